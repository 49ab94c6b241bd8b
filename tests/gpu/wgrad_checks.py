"""The exact-input check of the block-scaled wgrad GPU suite (tests/gpu/test_wgrad_gpu.py: run_bs_case), shared with
its CPU test (tests/test_wgrad_bs_checks.py).

"exact" inputs (lab/wgrad_cases.py: codes on a coarse grid, scales in {1, 2}) make every product and partial sum
exact in fp32, so W must equal the oracle's correctly rounded result bit for bit -- except where a scale byte is not
one of the drawn ones: SF bytes past the end of the segment buffer (segments of unaligned ends run off it,
docs/formats.md#segmented-layout) read 0x00, e8m0 2^-127. Their products lie below 2^-120: next to partial sums of
the drawn scales' products (multiples of 2^-6) they vanish, in fp32 as in float64, so which of them survive depends
on the summation order. Where the drawn-scale products of an element cancel exactly, the kernel (tokens in order,
the tiny ones last) keeps their sum (~1e-38), the oracle's float64 matmul may have absorbed them (0), and the GPU may
also flush subnormals (docs/numerics.md#subnormals). Such elements (|exact value| < TINY) must be tiny, not
bit-identical. (The first H200 run flagged exactly these: 5 / 1 / 1 elements of bs_mxfp8_c1 "unsanitized",
bs_mxfp8_tok_c2 "unsanitized" and bs_mxfp8_c1 at T = 1024; tests/test_wgrad_bs_checks.py.)
"""

from __future__ import annotations

import numpy as np

TINY = 2.0 ** -64   # below every nonzero sum of exact-grid products (>= 2^-6), above every sum of 2^-127-scaled ones


def exact_mismatches(got, want, pre) -> int:
    """Elements of W (`got`, as the kernel stored it) that break the exact-input rule against the oracle's rounded
    W (`want`) and float64 values (`pre`): bit-identical, or (|pre| < TINY) below TINY too."""
    got, want, pre = np.asarray(got), np.asarray(want), np.asarray(pre)
    bits = f"u{got.dtype.itemsize}"
    tiny = np.abs(pre) < TINY
    with np.errstate(invalid="ignore"):
        normal_bad = (got.view(bits) != want.view(bits)) & ~tiny
        tiny_bad = tiny & ~(np.abs(got.astype(np.float64)) < TINY)
    return int(np.sum(normal_bad | tiny_bad))
