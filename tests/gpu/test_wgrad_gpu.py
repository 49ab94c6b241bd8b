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

from cudnn_moe_jax import _runtime  # noqa: E402

import np_ops  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
import wgrad_cases as cases  # noqa: E402

pytestmark = pytest.mark.gpu


def _has_gpu():
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


if not _has_gpu():
    pytest.skip("no GPU", allow_module_level=True)
if not any(d.is_dir() for d in _runtime.bundle_dirs()):
    pytest.skip("no kernel bundle (tests/gpu/wgrad_cases.py says how to build one)", allow_module_level=True)

ULP = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 2 ** -24}


def _poison():
    x = jnp.full((64 << 20,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


@pytest.mark.parametrize("pattern", list(cases.PATTERNS))
@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_wgrad_kernel_matches_float64(case, pattern):
    x = cases.inputs(case, pattern, seed=zlib.crc32(f"{case[0]}/{pattern}".encode()) % 1000)
    fn = jax.jit(functools.partial(cases.call, case))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback to the reference would warn
        _poison()
        got = np.asarray(jax.block_until_ready(fn(x)).wgrad_tensor)
        _poison()
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
