"""The block-scaled rows of benchmarks/bench_moe_ops.py (forward, dglu and wgrad GEMMs of the fc step with MXFP8 /
NVFP4 / MXFP4 operands) timed twice in one process: every block-scaled call converted on chip, then every one
dequantized by XLA before the bf16 kernel (cudnn_moe_jax._dequant_first), whatever the library's rule
(`dequantize_first`) would pick -- the measurement behind that rule, for wgrad and dglu.

    python -m lab.bench_dequant_first [--only NAME_PART] [--shape fc]
    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.bench_dequant_first:bundle_items
"""

from __future__ import annotations

import argparse
import contextlib

from benchmarks import bench_moe_ops
from cudnn_moe_jax import _dequant_first

ROUTES = ("on-chip", "xla-dequant")


@contextlib.contextmanager
def route(name: str):
    """Every block-scaled call traced and lowered inside takes route `name` (ROUTES)."""
    rule = _dequant_first.dequantize_first
    _dequant_first.dequantize_first = lambda p: name == "xla-dequant" and p.block_scaled and p.a_dtype != "float16"
    try:
        yield
    finally:
        _dequant_first.dequantize_first = rule


def bundle_items(shape: str = "fc") -> list:
    """The block-scaled rows of bench_moe_ops lowered under both routes."""
    import jax

    items = []
    for name in ROUTES:
        for fn, avals in _rows(shape):
            def lower(fn=fn, avals=avals, name=name):
                with route(name):
                    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
            items.append(lower)
    return items


def wgrad_suite_items() -> list:
    """The block-scaled wgrad GPU suite's calls (lab.wgrad_cases.BS_CASES) lowered under the dequantize-first route
    (tests/gpu/test_wgrad_gpu.py runs them so)."""
    from cudnn_moe_jax import aot
    from lab import wgrad_cases

    def routed(item):
        def lower():
            with route("xla-dequant"):
                return item()
        return lower

    return [routed(i) for i in aot.lowering_items(wgrad_cases.BS_CASES, wgrad_cases.bs_inputs, wgrad_cases.bs_call)]


def _rows(shape: str):
    for name in bench_moe_ops.BS_WGRAD:
        fn, avals, _, _ = bench_moe_ops._bs_wgrad(shape, name)
        yield fn, avals
    for name in bench_moe_ops.BS_OPS:
        fn, _, _ = bench_moe_ops._bs_op(shape, name)
        yield fn, bench_moe_ops._bs_op_avals(shape, name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="fc")
    ap.add_argument("--only", default="", help="rows whose name contains this (default: every block-scaled row)")
    args = ap.parse_args(argv)
    names = [n for n in list(bench_moe_ops.BS_WGRAD) + list(bench_moe_ops.BS_OPS) if args.only in n]
    for name in ROUTES:
        print(f"== route {name}", flush=True)
        with route(name):
            for row in names:
                bench_moe_ops.main(["--shape", args.shape, "--only", row])


if __name__ == "__main__":
    main()
