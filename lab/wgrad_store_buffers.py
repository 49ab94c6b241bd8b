"""The wgrad's W store buffers: with few tokens per expert a wgrad tile runs two k-tiles and then stores 64 KB of W
in 8 steps, each waiting for the TMA store `epi_stages` steps back to have read its buffer. More buffers keep more
stores in flight; 8 stage the whole bf16 tile (the TMA engine drains it under the next tile's mainloop) at the price
of an A/B stage. RESULTS runs 166 (2 / 4 / 8 on every wgrad), 167 (the library's choice against 2) and 170 (the
layer's gathered wgrads: `--layer`, the whole `nn.moe_layer` step with its gathered wgrads on 2 buffers and on the
library's choice, alternated in one process).

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_e --variants lab.wgrad_store_buffers:items
    LAB_WGRAD_EPI=2 python -m lab.wgrad_store_buffers --shape e128_a128     # bench_moe_ops' wgrad rows
    python -m lab.wgrad_store_buffers --shape e128_a128                     # the same, the library's schedule
    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_l --variants lab.wgrad_store_buffers:layer_items
    python -m lab.wgrad_store_buffers --layer [--configs 64e,128e]
"""

from __future__ import annotations

import os
import sys

from lab import harness

SHAPES = ("e128_a128", "small", "fc")
BUFFERS = (None, 2)   # None: the library's choice; 2: the schedule before run 166


def with_buffers(buffers, applies=lambda problem: True):
    """A schedule change: every non-accumulating wgrad (where `applies`) with `buffers` epilogue buffers (None:
    unchanged)."""
    if buffers is None:
        return None
    return harness.config_change(lambda p: p.op == "wgrad" and not p.accumulate and applies(p), epi_stages=buffers)


def items() -> list:
    """The wgrad rows of bench_moe_ops (bf16 and block-scaled, the library's routes) on SHAPES with each of
    BUFFERS."""
    import lab.bench_dequant_first  # noqa: F401  (e128_a128)
    from benchmarks import bench_moe_ops

    return [harness.under_schedule(with_buffers(buffers), item)
            for buffers in BUFFERS for item in bench_moe_ops.bundle_items(SHAPES, "wgrad w")]


LAYER_CONFIGS = ("64e", "128e", "8e")


def gathered_on_two():
    """The schedule before run 170: the gathered (row-mapped) wgrads with 2 W buffers."""
    return with_buffers(2, lambda p: p.a_rows is not None or p.b_rows is not None)


def layer_items() -> list:
    """bench_moe_layer's own step (`nn.moe_layer`, default alignment) on LAYER_CONFIGS, under both schedules."""
    from benchmarks import bench_moe_layer

    return [harness.under_schedule(change, item) for change in (None, gathered_on_two())
            for item in bench_moe_layer.bundle_items(LAYER_CONFIGS, aligns=())]


def layer_main(configs) -> None:
    """The layer's step, the library's schedule vs gathered wgrads on 2 buffers, alternated in one process."""
    harness.layer_step_ab(configs, {"library": None, "gathered_2": gathered_on_two()})


if __name__ == "__main__" and "--layer" in sys.argv:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", action="store_true")
    ap.add_argument("--configs", default=",".join(LAYER_CONFIGS))
    layer_main(ap.parse_args().configs.split(","))
elif __name__ == "__main__":
    import lab.bench_dequant_first  # noqa: F401
    from benchmarks import bench_moe_ops

    env = os.environ.get("LAB_WGRAD_EPI")
    change = with_buffers(int(env) if env else None)
    with harness.schedule_override(change):
        bench_moe_ops.main(sys.argv[1:] + ["--only", "wgrad w"])
