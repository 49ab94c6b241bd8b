"""The block-scaled rows of benchmarks/bench_moe_ops.py (forward, dglu and wgrad GEMMs of the fc step with MXFP8 /
NVFP4 / MXFP4 operands) timed per route in one process: every block-scaled call converted on chip, then every one
dequantized by XLA before the bf16 kernel (cudnn_moe_jax._dequant_first), then every row staged in the kernel
(kernels/sm90/mainloop_staged.py, mainloop_staged_wgrad.py; token-major wgrad operands go XLA's way), whatever the
library's rule (`dequantize_first`) would pick -- the measurement behind that rule, for wgrad and dglu, and the
backward ops beside the forward ones.

    python -m lab.bench_dequant_first [--only NAME_PART] [--shape fc] [--routes on-chip,xla-dequant,staged]
    python -m lab.bench_dequant_first --shape e128_a128 --routes public   # bench_moe_ops' every row, the library's
                                                                          # routes (also on the shapes added here)
    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.bench_dequant_first:bundle_items
    (the on-chip wgrad kernel alone on `small` and `e128`: lab.bench_dequant_first:onchip_wgrad_items)

TOKEN_SWEEP adds step shapes with fewer tokens per expert (the same m = 16384) to bench_moe_step's table: the fc
step's at 1024 / 512 (for the wgrad rule) and the memory-bound 128 experts x 128 rows
(`--shape e128`; modules: `token_sweep_items`, `shape_items`).
"""

from __future__ import annotations

import argparse

from benchmarks import bench_moe_ops, bench_moe_step
from lab import harness

TOKEN_SWEEP = {"fc_t1024": ([1024] * 16, 7168, 2048), "fc_t512": ([512] * 32, 7168, 2048),
               "e128": ([128] * 128, 4096, 1024),     # issue 19's memory-bound shape (128 experts x 128 rows)
               "e128_t64": ([64] * 128, 4096, 1024),  # below the wgrad's dequantize-first threshold (on chip)
               "e128_t64u": ([56, 72] * 64, 4096, 1024)}  # the same, experts off 16-token boundaries (general path)
bench_moe_step.SHAPES.update(TOKEN_SWEEP)
# issue 19's memory-bound shape as it is (128 rows per expert, no padding: m_aligned 128); `e128` pads each to 256
bench_moe_step.SHAPES["e128_a128"] = ([128] * 128, 4096, 1024)
bench_moe_step.ALIGN["e128_a128"] = 128
ROUTES = (*harness.BLOCK_SCALED_ROUTES, "staged")


def bundle_items(shape: str = "fc", only: str = "") -> list:
    """The block-scaled rows of bench_moe_ops (names containing `only`) lowered under every route."""
    return [harness.on_route(route, _lowering(fn, avals))
            for route in ROUTES for fn, avals in _rows(shape, only, route)]


def _lowering(fn, avals):
    """A bundle item: `fn` lowered for CUDA on `avals`."""
    import jax

    return lambda: jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))


def token_sweep_items() -> list:
    """The wgrad rows (block-scaled under both routes, and bf16) on the TOKEN_SWEEP shapes and on bench_moe_step's
    `small` (256 tokens per expert)."""
    return [i for shape in (*TOKEN_SWEEP, "small")
            for i in bundle_items(shape, "wgrad w") + bench_moe_ops.bundle_items((shape,), "wgrad w")]


def onchip_wgrad_items() -> list:
    """The block-scaled wgrad rows on chip (the K-grouped dequantizing mainloop, mainloop_dequant_wgrad.py) on
    `small` (256 tokens per expert), `e128` (128) and `e128_t64` / `e128_t64u` (64 on average, the second with
    experts off 16-token boundaries; there also XLA's route, which the public op does not take below 128 tokens):
    `--only "wgrad w" --routes on-chip[,xla-dequant]`."""
    return [harness.on_route(route, _lowering(fn, avals))
            for shape, routes in (("small", ("on-chip",)), ("e128", ("on-chip",)),
                                  ("e128_t64", ("on-chip", "xla-dequant")), ("e128_t64u", ("on-chip", "xla-dequant")))
            for route in routes for fn, avals in _rows(shape, "wgrad w", route)]


def shape_items() -> list:
    """Every row, every route and bf16, on `small` (64 x 256), `e128` (128 x 128 in 256-row segments) and
    `e128_a128` (unpadded): the backward ops beside the forward ones on the shapes with few rows per expert."""
    return [i for shape in ("small", "e128", "e128_a128")
            for i in bundle_items(shape) + bench_moe_ops.bundle_items((shape,))]


def _row_names(only: str, route: str) -> list:
    """The rows named with `only` (every route runs every row; the staged route takes XLA's way where the kernel
    stages no such problem: token-major wgrad operands)."""
    return [n for n in list(bench_moe_ops.BS_WGRAD) + list(bench_moe_ops.BS_OPS) if only in n]


def _rows(shape: str, only: str = "", route: str = "on-chip"):
    for name in _row_names(only, route):
        if name in bench_moe_ops.BS_WGRAD:
            fn, avals, _, _ = bench_moe_ops._bs_wgrad(shape, name)
            yield fn, avals
        else:
            fn, _, _ = bench_moe_ops._bs_op(shape, name)
            yield fn, bench_moe_ops._bs_op_avals(shape, name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="fc")
    ap.add_argument("--only", default="", help="rows whose name contains this (default: every block-scaled row)")
    ap.add_argument("--routes", default=",".join(ROUTES), help='comma-separated, or "public" (the library\'s own)')
    args = ap.parse_args(argv)
    if args.routes == "public":   # every row of bench_moe_ops (bf16, forward and backward) as the library routes it
        bench_moe_ops.main(["--shape", args.shape, "--only", args.only])
        return
    for name in args.routes.split(","):
        print(f"== route {name}", flush=True)
        with harness.block_scaled_route(name):
            for row in _row_names(args.only, name):
                bench_moe_ops.main(["--shape", args.shape, "--only", row])


if __name__ == "__main__":
    main()
