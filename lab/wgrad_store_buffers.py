"""The wgrad's W store buffers: with few tokens per expert a wgrad tile runs two k-tiles and then stores 64 KB of W
in 8 steps, each waiting for the TMA store `epi_stages` steps back to have read its buffer. More buffers keep more
stores in flight; 8 stage the whole bf16 tile (the TMA engine drains it under the next tile's mainloop) at the price
of an A/B stage. RESULTS runs 166 (2 / 4 / 8 on every wgrad) and 167 (the library's choice against 2).

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_e --variants lab.wgrad_store_buffers:items
    LAB_WGRAD_EPI=2 python -m lab.wgrad_store_buffers --shape e128_a128     # bench_moe_ops' wgrad rows
    python -m lab.wgrad_store_buffers --shape e128_a128                     # the same, the library's schedule
"""

from __future__ import annotations

import os
import sys

from lab import harness

SHAPES = ("e128_a128", "small", "fc")
BUFFERS = (None, 2)   # None: the library's choice; 2: the schedule before run 166


def with_buffers(buffers):
    """A schedule change: every non-accumulating wgrad with `buffers` epilogue buffers (None: unchanged)."""
    if buffers is None:
        return None
    return harness.config_change(lambda p: p.op == "wgrad" and not p.accumulate, epi_stages=buffers)


def items() -> list:
    """The wgrad rows of bench_moe_ops (bf16 and block-scaled, the library's routes) on SHAPES with each of
    BUFFERS."""
    import lab.bench_dequant_first  # noqa: F401  (e128_a128)
    from benchmarks import bench_moe_ops

    return [harness.under_schedule(with_buffers(buffers), item)
            for buffers in BUFFERS for item in bench_moe_ops.bundle_items(SHAPES, "wgrad w")]


if __name__ == "__main__":
    import lab.bench_dequant_first  # noqa: F401
    from benchmarks import bench_moe_ops

    env = os.environ.get("LAB_WGRAD_EPI")
    change = with_buffers(int(env) if env else None)
    with harness.schedule_override(change):
        bench_moe_ops.main(sys.argv[1:] + ["--only", "wgrad w"])
