"""GPU check of `lab.bench_memory_bound` schedule variants: every output of each variant byte-identical to the
default kernel's on the shape (N(0, 1) data quantized to the format; the variants change where and when operands
are converted, never the products or the order of the sums, so the bytes must agree).

    CUDNN_MOE_JAX_BUNDLE=DIR python -m lab.variant_check e128_fc1 nvfp4,mxfp8 tn128,tn128_cb16
"""

from __future__ import annotations

import sys


def main(shape: str, formats: str, variants: str) -> int:
    import jax
    import numpy as np

    from . import bench_kernels as bk
    from . import bench_memory_bound as mb
    from .forward_cases import kernel_fn
    from .harness import kernels_only
    from .profile_one import kernel_args

    bad = 0
    for fmt in formats.split(","):
        p = bk.format_problem(shape, fmt)
        args = kernel_args(p)
        with kernels_only():
            want = jax.block_until_ready(kernel_fn(p, None)(*args))
            for label in variants.split(","):
                got = jax.block_until_ready(kernel_fn(p, mb._config(label, p))(*args))
                differ = [key for key, w in want.items() if w is not None and not np.array_equal(
                    np.asarray(got[key]).view(np.uint8), np.asarray(w).view(np.uint8))]
                bad += bool(differ)
                verdict = f"DIFFERENT {differ}" if differ else "byte-identical"
                print(f"{shape} {fmt} {label}: {verdict}", flush=True)
    return bad


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
