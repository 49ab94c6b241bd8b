"""GPU: the K-grouped weight-gradient kernel against the float64 oracle (tests/np_ops.py), every element, outputs
poisoned first, on unaligned / empty / unsanitized token offsets; repeated calls bit-identical.

Needs a Hopper GPU and a bundle with the cases' modules (tests/gpu/wgrad_cases.py); skipped otherwise.
"""

from __future__ import annotations

import functools
import warnings
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import harness  # noqa: E402
import np_ops  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
import wgrad_cases as cases  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("wgrad_cases")
ULP = harness.ULP


@pytest.mark.parametrize("pattern", list(cases.PATTERNS))
@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_wgrad_kernel_matches_float64(case, pattern):
    x = cases.inputs(case, pattern, seed=zlib.crc32(f"{case[0]}/{pattern}".encode()) % 1000)
    fn = jax.jit(functools.partial(cases.call, case))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback to the reference would warn
        harness.poison_allocator()
        got = np.asarray(jax.block_until_ready(fn(x)).wgrad_tensor)
        harness.poison_allocator()
        again = np.asarray(jax.block_until_ready(fn(x)).wgrad_tensor)
    np.testing.assert_array_equal(got.view(np.uint8), again.view(np.uint8), err_msg="two calls differ")
    a, b = (np.asarray(v.astype(jnp.float32)) for v in cases.operands(case, x))
    want = np_ops.grouped_gemm_wgrad(a, b, np.asarray(x["offsets"]), ab_dtype=case[1], wgrad_dtype=case[2])
    gv = got.astype(np.float32).astype(np.float64)
    assert np.all(np.isfinite(gv)), "non-finite output (poison left in W?)"
    pre, mag = want["_pre"]["wgrad"], want["_mag"]["wgrad"]
    bound = ULP[case[2]] * np.abs(pre) + 1e-5 * mag + 1e-30
    err = np.abs(gv - pre)
    assert np.all(err <= bound), f"worst {np.max(err / bound):.2f} x the bound"
    for e, (s, t) in enumerate(want["_groups"]):
        if t <= s:
            assert not gv[e].any(), f"expert {e} has no token: W[e] must be zero"
