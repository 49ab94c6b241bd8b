"""GPU: the fused backward epilogues (dglu: dswiglu / dgeglu, dsrelu) against the float64 oracle (tests/np_ops.py),
every output element, outputs poisoned first; repeated calls bit-identical (the reductions use no float atomics).

FP8 D_row: D_row / D_col codes and the SFD_row / SFD_col bytes by the block-quantization checks of
tests/gpu/test_mxfp8_gpu.py (`check_fp8_outputs`): every e8m0 byte is RCEIL of amax * rcp_limit * norm_const of the
float64 block unless a power of two lies within the block's error interval (then its neighbour is accepted too),
every code is the RNE-satfinite code of ref * scale (the kernel's own scale byte) up to the same rule, the packed
layouts byte for byte (padding, rows outside every group, bytes past the last segment: 0x00). The error interval
is the non-rounding part of the 16-bit bound below (fp32 accumulation and epilogue math).

Needs a Hopper GPU and a bundle with the cases' modules (tests/gpu/dgrad_cases.py); skipped otherwise.
"""

from __future__ import annotations

import functools
import zlib
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import harness  # noqa: E402
import dgrad_cases as cases  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
import np_ops  # noqa: E402
from test_mxfp8_gpu import check_fp8_outputs  # noqa: E402  (its NORM_CONST is dgrad_cases.NORM_CONST)

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("dgrad_cases")
ULP, SUBNORMAL_STEP = harness.ULP, harness.SUBNORMAL_STEP


def _run(case, x):
    fn = jax.jit(functools.partial(cases.call, case))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback to the reference would warn
        harness.poison_allocator()
        out = jax.block_until_ready(fn(x))
        harness.poison_allocator()
        again = jax.block_until_ready(fn(x))
    return out, again


def _oracle(case, x):
    _, op, act, options, ab, c_dtype = case
    options = dict(options)
    no_prob = options.pop("no_prob", False)
    h = {k: np.asarray(v.astype(jnp.float32)) if v.dtype != jnp.int32 else np.asarray(v) for k, v in x.items()}
    d_dtype = options.pop("d_dtype", "bfloat16")
    kw = dict(ab_dtype=ab, d_dtype=d_dtype, c_dtype=c_dtype, dbias_dtype=options.pop("dbias_dtype", None),
              # the ops' default: amax for a 16-bit D
              compute_amax=options.pop("compute_amax", d_dtype in ("bfloat16", "float16")))
    options.pop("generate_dbias", None)
    fn = np_ops.grouped_gemm_dglu if op == "dglu" else np_ops.grouped_gemm_dsrelu
    if op == "dglu":
        kw["act_func"] = act
    if d_dtype in cases.FP8:
        kw["norm_const"] = h["norm_const"]
    return fn(h["a"], h["b"], h["c"], None, None, h["offsets"], h["alpha"], h["beta"],
              None if no_prob else h["prob"], **kw, **options)


def _f32(v):
    return np.asarray(v.astype(jnp.float32))


FP8_KEYS = {"d_row_tensor": "d", "d_col_tensor": "d_col", "sfd_row_tensor": "sfd_row", "sfd_col_tensor": "sfd_col"}


def _check_fp8(case, x, got, want):
    """D_row, D_col, SFD_row, SFD_col of an FP8-D case (see the module docstring)."""
    options = case[3]
    p = {"num_groups": cases.L, "epilogue": {"d_dtype": options["d_dtype"],
                                             "discrete_col_sfd": options.get("discrete_col_sfd", False)}}
    outs = {FP8_KEYS[k]: np.asarray(got[k]) for k in FP8_KEYS}
    outs["sfd_row"], outs["sfd_col"] = (outs[k].view(np.uint8) for k in ("sfd_row", "sfd_col"))
    pre, mag = want["_pre"]["d"], want["_mag"]["d"]
    err = 1e-5 * mag + 2.0 ** -20 * np.abs(pre) + 1e-30
    m = pre.shape[0]
    errs = check_fp8_outputs(p, outs, {"d": pre}, err, np.asarray(x["offsets"]), m)
    assert not errs, "\n".join(errs)


@pytest.mark.parametrize("pattern", list(cases.PATTERNS))
@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_dgrad_kernel_matches_float64(case, pattern):
    x = cases.inputs(case, pattern, seed=zlib.crc32(f"{case[0]}/{pattern}".encode()) % 1000)
    got, again = _run(case, x)
    want = _oracle(case, x)
    groups = want["_groups"]
    valid = groups[-1][1]
    fp8 = case[3].get("d_dtype") in cases.FP8
    for key, g in got.items():
        if g is None:
            continue
        if fp8 and key in FP8_KEYS:
            np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(again[key]).view(np.uint8),
                                          err_msg=f"{key}: two calls differ")
            continue
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(again[key]).view(np.uint8),
                                      err_msg=f"{key}: two calls differ")
        gv = _f32(g)
        assert np.all(np.isfinite(gv)), f"{key}: non-finite (poison left in an output?)"
        if key == "amax_tensor":
            np.testing.assert_allclose(gv, np.asarray(want[key], np.float32), rtol=2 ** -7, err_msg=key)
            continue
        name = {"d_row_tensor": "d", "dprob_tensor": "dprob", "dbias_tensor": "dbias"}[key]
        pre, mag = want["_pre"][name], want["_mag"][name]
        out_dtype = str(g.dtype)
        # one rounding to the output dtype + fp32 accumulation error (K = H terms, bounded by the magnitude sum)
        bound = ULP[out_dtype] * np.abs(pre) + 1e-5 * mag + SUBNORMAL_STEP[out_dtype]
        err = np.abs(gv.astype(np.float64) - pre)
        assert np.all(err <= bound), f"{key}: worst {np.max(err / bound):.2f} x the bound"
        if key in ("d_row_tensor", "dprob_tensor"):
            assert not np.any(gv[valid:]), f"{key}: rows past valid_m must be zero"
    if fp8:
        assert all(got[k] is not None for k in FP8_KEYS)
        _check_fp8(case, x, got, want)
