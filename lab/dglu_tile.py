"""The block-scaled dglu on 128 x 128 tiles: with 128 x 256 tiles its dequantizing stages (NVFP4 46.6 KB) leave 3 A/B
stages beside C's load ring and dC's buffers (64 KB), where fc2's forward gets 4; 128-column tiles halve the stage
(NVFP4: 6 fit, MXFP8: 4) at the price of converting A once per 128 columns instead of 256.

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_g --variants lab.dglu_tile:items
    LAB_DGLU_TILE_N=128 python -m lab.dglu_tile --shape small      # bench_moe_ops' dglu rows, then fc2 quant's
    python -m lab.dglu_tile --shape small                          # the same, the library's schedule
"""

from __future__ import annotations

import os
import sys

from lab import harness

SHAPES = ("small", "e128_a128")


def with_tile_n(tile_n):
    """A schedule change: block-scaled dglu / dsrelu on `tile_n`-column tiles (None: unchanged)."""
    if tile_n is None:
        return None
    return harness.config_change(lambda p: p.op in ("dglu", "dsrelu") and p.block_scaled, tile_n=tile_n)


def items() -> list:
    """bench_moe_ops' dglu and fc2 quant rows on SHAPES, with the library's tiles and with 128 columns."""
    import lab.bench_dequant_first  # noqa: F401  (e128_a128)
    from benchmarks import bench_moe_ops

    return [harness.under_schedule(with_tile_n(tile_n), item) for tile_n in (None, 128)
            for only in ("dglu", "fc2 quant") for item in bench_moe_ops.bundle_items(SHAPES, only)]


if __name__ == "__main__":
    import lab.bench_dequant_first  # noqa: F401
    from benchmarks import bench_moe_ops

    env = os.environ.get("LAB_DGLU_TILE_N")
    change = with_tile_n(int(env) if env else None)
    with harness.schedule_override(change):
        bench_moe_ops.main(sys.argv[1:] + ["--only", "dglu"])
        bench_moe_ops.main(sys.argv[1:] + ["--only", "fc2 quant"])
