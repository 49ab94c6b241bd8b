"""cudnn_moe_jax.reference vs the independent float64 oracle (tests/np_ops.py), every op and every output.

Tolerances (docs/numerics.md). The oracle gives, with every float64 pre-rounding value x, its condition magnitude `mag`
(sum |a||b| through the same epilogue, first order); the reference's fp32 noise is bounded by
NOISE = 2^-20 * mag + 2^-15 * |x|: the first term covers the fp32 GEMM/epilogue arithmetic (measured max
2^-24.7 * mag for C), the second the relative error of XLA's fp32 exp/tanh (measured up to 2^-15.7 * |x| deep in
the sigmoid tail, where values are tiny and harmless).
  * bf16 / fp16 / fp32 outputs: |ref - x| <= 1 ulp(x) of the output dtype (final RNE rounding + a possible flip
    of it) + NOISE (+ the dtype's smallest subnormal);
  * quantized data (fp8 / NVFP4 codes, compared as decoded values so -0 == +0) and scale-factor bytes: exact,
    except elements whose float64 value lies within NOISE of a rounding boundary. Those are found by re-running
    the oracle's quantizer on the values shrunk and grown in magnitude by NOISE: an output element (code or SF
    byte) that differs between the two is a near-tie and is excluded; the excluded fraction must stay tiny.
Operands use random data codes and random scale-factor bytes (never all-equal scales), random SF padding bytes,
alpha of both signs, prob in (0.2, 1), and group patterns with empty experts, one giant expert, everything in the
last expert, m > valid_m, and invalid offsets (which must follow the sanitized-offsets rule of docs/offsets.md).
The reference runs eagerly (op-by-op compile caches are shared between cases), plus one jit run per op. The
harness (operands, the reference run beside the oracle, the comparisons) is tests/reference_checks.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import np_ops as O
import numpy as np
import pytest
from np_formats import E2M1, E4M3, E5M2, np_cdiv
from reference_checks import (FORMATS, M, L, GROUPS, NORM_CONST, _rng, _scale_bytes, make_operand, make_gemm, to_jnp,
                               check_float, check_quantized, check_d_outputs, check_c, check_fwd_amax, call_ref,
                               with_jit, run_both, check_keys, make_dgrad, check_backward)

from cudnn_moe_jax import reference as R


# ---------------------------------------------------------------------------------------------------------------
# forward ops

QUANT_CASES = [
    # fmt, d_dtype, bias, groups, discrete_col_sfd, discrete_weights
    ("bf16", "bfloat16", "bfloat16", "balanced", False, False),
    ("fp16", "float16", None, "empty", False, False),
    ("mxfp8_e4m3", E4M3, None, "balanced", False, False),
    ("mxfp8_e4m3", E4M3, "float32", "empty", True, False),
    ("mxfp8_e5m2", E5M2, None, "short", True, False),
    ("mxfp8_e4m3", "bfloat16", "float16", "giant", False, True),
    ("mxfp4", "float32", None, "giant", False, False),
    ("nvfp4", "bfloat16", "bfloat16", "last", False, False),
    ("nvfp4_e8m0", "float16", None, "balanced", False, False),
    ("mxfp8_e4m3", E4M3, None, "nonmono", True, True),
    ("mxfp8_e4m3", E4M3, None, "over", True, False),
    ("mxfp8_e5m2", E5M2, "bfloat16", "negative", False, False),
    ("mxfp8_e4m3", E4M3, None, "unaligned", True, False),
    ("bf16", E2M1, None, "empty", True, False),
    ("nvfp4", E2M1, "float32", "balanced", False, False),
]


@pytest.mark.parametrize("fmt,d_dtype,bias,groups,dcs,discrete,jit", with_jit(QUANT_CASES, 3, 10, 13))
def test_quant(fmt, d_dtype, bias, groups, dcs, discrete, jit):
    x, kw = make_gemm(fmt, M, 96, 128, groups, bias, discrete)
    nc = np.array([NORM_CONST], np.float32)
    ref, ora = run_both("grouped_gemm_quant", jit, dict(x, norm_const=nc), kw, d_dtype=d_dtype, compute_amax=True,
                        discrete_col_sfd=dcs)
    check_d_outputs(ref, ora, d_key="d_tensor", d_dtype=d_dtype, norm_const=NORM_CONST, discrete_col_sfd=dcs)
    check_fwd_amax(ref, ora)


SRELU_CASES = [
    # fmt, c_dtype, d_dtype, bias, tanh_clamp_scale, groups, dcs, discrete
    ("bf16", "bfloat16", "bfloat16", None, None, "balanced", False, False),
    ("mxfp8_e4m3", E4M3, E4M3, None, 2.0, "empty", True, False),
    ("mxfp8_e5m2", "float32", E5M2, "bfloat16", None, "giant", False, False),
    ("mxfp4", "float32", "float32", "float32", None, "last", False, False),
    ("nvfp4", "float16", "bfloat16", None, 1.5, "short", False, False),
    ("mxfp8_e4m3", "bfloat16", E4M3, None, None, "nonmono", True, True),
    ("fp16", "float16", "float16", "float16", 3.0, "negative", False, True),
    ("mxfp8_e4m3", "bfloat16", E2M1, None, None, "short", True, False),
]


@pytest.mark.parametrize("fmt,c_dtype,d_dtype,bias,tanh,groups,dcs,discrete,jit", with_jit(SRELU_CASES, 1))
def test_srelu(fmt, c_dtype, d_dtype, bias, tanh, groups, dcs, discrete, jit):
    x, kw = make_gemm(fmt, M, 96, 128, groups, bias, discrete)
    nc = np.array([NORM_CONST], np.float32)
    ref, ora = run_both("grouped_gemm_srelu", jit, dict(x, norm_const=nc), kw, c_dtype=c_dtype, d_dtype=d_dtype,
                        tanh_clamp_scale=tanh, compute_amax=True, discrete_col_sfd=dcs)
    check_c(ref, ora, c_dtype)
    check_d_outputs(ref, ora, d_key="d_tensor", d_dtype=d_dtype, norm_const=NORM_CONST, discrete_col_sfd=dcs)
    check_fwd_amax(ref, ora)


GLU_CASES = [
    # fmt, act, c_dtype, d_dtype, bias, glu_limit, glu_alpha, groups, dcs, discrete
    ("bf16", "swiglu", "bfloat16", "bfloat16", None, None, None, "balanced", False, False),
    ("bf16", "geglu", "float32", "float32", "bfloat16", None, None, "empty", False, False),
    ("fp16", "geglu", "float16", "float16", None, 1.5, 0.8, "giant", False, False),
    ("mxfp8_e4m3", "swiglu", "bfloat16", E4M3, None, None, None, "balanced", False, False),
    ("mxfp8_e4m3", "geglu", E4M3, E4M3, "float32", None, 1.3, "empty", True, False),
    ("mxfp8_e5m2", "swiglu", E5M2, E5M2, None, 2.0, None, "last", True, False),
    ("mxfp8_e5m2", "geglu", "bfloat16", "bfloat16", None, 1.0, None, "short", False, True),
    ("mxfp4", "swiglu", "float16", "float32", "float16", None, None, "giant", False, False),
    ("mxfp4", "geglu", "bfloat16", "bfloat16", None, None, None, "balanced", False, True),
    ("nvfp4", "swiglu", "bfloat16", "bfloat16", "bfloat16", 1.2, 1.7, "last", False, False),
    ("nvfp4", "geglu", "float16", "float16", None, None, None, "over", False, False),
    ("nvfp4_e8m0", "swiglu", "bfloat16", "float32", None, None, None, "unaligned", False, False),
    ("mxfp8_e4m3", "swiglu", "float32", E4M3, "bfloat16", None, None, "nonmono", True, True),
    ("mxfp8_e4m3", "geglu", "bfloat16", E4M3, None, 3.0, None, "negative", True, False),
    ("bf16", "gpt_oss_swiglu", "bfloat16", "bfloat16", "float32", None, None, "empty", False, False),
    ("mxfp8_e4m3", "gpt_oss_swiglu", E4M3, E4M3, None, 1.5, 1.2, "balanced", True, False),
    ("bf16", "swiglu", "bfloat16", E2M1, None, None, None, "nonmono", False, False),
    ("mxfp4", "geglu", "float32", E2M1, "bfloat16", None, 1.3, "empty", True, False),
]


@pytest.mark.parametrize("fmt,act,c_dtype,d_dtype,bias,limit,galpha,groups,dcs,discrete,jit", with_jit(GLU_CASES, 4))
def test_glu(fmt, act, c_dtype, d_dtype, bias, limit, galpha, groups, dcs, discrete, jit):
    x, kw = make_gemm(fmt, M, 96, 256, groups, bias, discrete)
    nc = np.array([NORM_CONST], np.float32)
    ref, ora = run_both("grouped_gemm_glu", jit, dict(x, norm_const=nc), kw, act_func=act, c_dtype=c_dtype,
                        d_dtype=d_dtype, glu_limit=limit, glu_alpha=galpha, compute_amax=True, discrete_col_sfd=dcs)
    check_c(ref, ora, c_dtype)
    check_d_outputs(ref, ora, d_key="d_tensor", d_dtype=d_dtype, norm_const=NORM_CONST, discrete_col_sfd=dcs)
    check_fwd_amax(ref, ora)


HADAMARD_CASES = [
    # fmt, act, d_dtype, rht, rht_dtype, user_hadamard, bias, glu options, groups
    ("nvfp4", "swiglu", "bfloat16", None, None, False, None, {}, "balanced"),
    ("nvfp4", "geglu", E2M1, "rowwise", "bfloat16", False, "bfloat16", {}, "empty"),
    ("mxfp4", "swiglu", E2M1, "rowwise", E2M1, False, None, dict(glu_limit=1.5, glu_alpha=0.7), "giant"),
    ("nvfp4_e8m0", "srelu", "bfloat16", "colwise", E2M1, False, None, dict(tanh_clamp_scale=2.0), "short"),
    ("nvfp4", "swiglu", E2M1, "colwise", E2M1, True, "float32", {}, "empty"),
    ("nvfp4", "geglu", "bfloat16", "colwise", E2M1, False, None, {}, "nonmono"),
    ("nvfp4", "srelu", E2M1, "rowwise", E2M1, True, None, {}, "last"),
    ("nvfp4", "gpt_oss_swiglu", "bfloat16", "rowwise", "bfloat16", False, None, dict(glu_limit=1.5), "balanced"),
]


@pytest.mark.parametrize("fmt,act,d_dtype,rht,rht_dtype,user_h,bias,opts,groups,jit", with_jit(HADAMARD_CASES, 4))
def test_glu_hadamard_quant(fmt, act, d_dtype, rht, rht_dtype, user_h, bias, opts, groups, jit):
    n = 128 if act == "srelu" else 256
    x, kw = make_gemm(fmt, M, 96, n, groups, bias)
    x["norm_const"] = np.array([NORM_CONST], np.float32)
    x["rht_norm_const"] = np.array([0.61], np.float32)
    if user_h:
        x["hadamard"] = _rng("h", fmt).uniform(-0.5, 0.5, (16, 16)).astype(ml_dtypes.bfloat16)
    static = dict(act_func=act, c_dtype="bfloat16", d_dtype=d_dtype, rht=rht, rht_dtype=rht_dtype,
                  compute_amax=True, **opts)
    ref = call_ref("grouped_gemm_glu_hadamard_quant", x, jit, **kw, **static)
    # The transform input is bf16(D): take the reference's own bf16 D (its rounding is checked below) so that the
    # transform + quantization are compared without bf16 near-ties of the input.
    d_bf16 = ref["d_tensor"] if d_dtype == "bfloat16" else call_ref(
        "grouped_gemm_glu_hadamard_quant", x, jit, **kw, **dict(static, d_dtype="bfloat16", rht=None))["d_tensor"]
    ora = O.grouped_gemm_glu_hadamard_quant(**x, **kw, **static, d_bf16=np.asarray(d_bf16))
    check_keys(ref, ora, jit)
    check_c(ref, ora, "bfloat16")
    check_fwd_amax(ref, ora)
    if d_dtype == E2M1:
        def nvfp4_d(v):
            codes, s = O.np_nvfp4(v, NORM_CONST)
            return dict(d=codes, sfd=O._phys(s))
        check_quantized({"d_tensor": ("d", "fp4"), "sfd_tensor": ("sfd", "bytes")}, ref, ora["_pre"]["d"],
                        ora["_mag"]["d"], nvfp4_d)
    else:
        check_float("d_tensor", ref["d_tensor"], ora["_pre"]["d"], "bfloat16", ora["_mag"]["d"])
        assert ref["sfd_tensor"] is None
    if rht is None:
        assert ref["rht_tensor"] is None and ref["sfrht_tensor"] is None
        return
    y, y_mag = ora["_pre"]["rht"], ora["_mag"]["rht"]
    if rht == "rowwise" and rht_dtype == "bfloat16":
        check_float("rht_tensor", ref["rht_tensor"], y, "bfloat16", y_mag)
        assert ref["sfrht_tensor"] is None
    elif rht == "rowwise":
        def nvfp4_r(v):
            codes, s = O.np_nvfp4(v, 0.61)
            return dict(r=codes, s=O._phys(s))
        check_quantized({"rht_tensor": ("r", "fp4"), "sfrht_tensor": ("s", "bytes")}, ref, y, y_mag, nvfp4_r)
    else:
        groups_ = ora["_groups"]

        def colwise(v):
            data, sf = O.np_rht_colwise_outputs(v, groups_, 0.61)
            return dict(r=data, s=sf)
        check_quantized({"rht_tensor": ("r", "fp4"), "sfrht_tensor": ("s", "bytes")}, ref, y, y_mag, colwise)


# ---------------------------------------------------------------------------------------------------------------
# backward ops


DGLU_CASES = [
    # fmt, act, c_dtype, d_dtype, dbias, glu_limit, glu_alpha, groups, dcs, discrete
    ("bf16", "dswiglu", "bfloat16", "bfloat16", "bfloat16", None, None, "balanced", False, False),
    ("fp16", "dgeglu", "float32", "float32", "float32", None, None, "empty", False, False),
    ("mxfp8_e4m3", "dswiglu", E4M3, E4M3, "bfloat16", None, None, "balanced", False, False),
    ("mxfp8_e4m3", "dgeglu", "bfloat16", E4M3, None, None, 1.3, "giant", True, False),
    ("mxfp8_e5m2", "dswiglu", E5M2, E5M2, "float32", 2.5, 0.9, "short", True, True),
    ("mxfp4", "dgeglu", "float16", "bfloat16", "bfloat16", 4.0, None, "last", False, False),
    ("nvfp4", "dswiglu", "bfloat16", "float32", "float32", None, None, "nonmono", False, False),
    ("nvfp4_e8m0", "dgeglu", "float32", "float16", None, None, None, "negative", False, True),
    ("mxfp8_e4m3", "dswiglu", "float32", E4M3, "float32", 1.0, None, "unaligned", True, False),
    ("bf16", "dgpt_oss_swiglu", "bfloat16", "bfloat16", "float32", None, None, "empty", False, False),
    ("mxfp8_e5m2", "dgpt_oss_swiglu", E4M3, E4M3, None, 2.0, 0.8, "short", True, False),
]


@pytest.mark.parametrize("fmt,act,c_dtype,d_dtype,dbias,limit,galpha,groups,dcs,discrete,jit", with_jit(DGLU_CASES, 3))
def test_dglu(fmt, act, c_dtype, d_dtype, dbias, limit, galpha, groups, dcs, discrete, jit):
    x, kw = make_dgrad(fmt, 256, 128, 96, groups, discrete, c_dtype)
    x["norm_const"] = np.array([NORM_CONST], np.float32)
    ref, ora = run_both("grouped_gemm_dglu", jit, x, kw, act_func=act, glu_limit=limit, glu_alpha=galpha,
                        d_dtype=d_dtype, dbias_dtype=dbias, compute_amax=True, discrete_col_sfd=dcs)
    assert ref["amax_tensor"].shape == (L, 2)
    check_backward(ref, ora, d_dtype=d_dtype, dbias_dtype=dbias, dcs=dcs)


DSRELU_CASES = [
    # fmt, c_dtype, d_dtype, dbias, tanh_clamp_scale, groups, dcs, discrete
    ("bf16", "bfloat16", "bfloat16", "bfloat16", None, "balanced", False, False),
    ("mxfp8_e4m3", E4M3, E4M3, "float32", 2.0, "empty", True, False),
    ("mxfp8_e5m2", "bfloat16", E5M2, None, None, "giant", False, True),
    ("mxfp4", "float32", "float32", "bfloat16", 3.0, "short", False, False),
    ("nvfp4", "float16", "bfloat16", "float32", None, "over", False, False),
    ("fp16", "float32", "float16", None, 1.5, "last", False, False),
]


@pytest.mark.parametrize("fmt,c_dtype,d_dtype,dbias,tanh,groups,dcs,discrete,jit", with_jit(DSRELU_CASES, 1))
def test_dsrelu(fmt, c_dtype, d_dtype, dbias, tanh, groups, dcs, discrete, jit):
    x, kw = make_dgrad(fmt, 128, 128, 96, groups, discrete, c_dtype)
    x["norm_const"] = np.array([NORM_CONST], np.float32)
    ref, ora = run_both("grouped_gemm_dsrelu", jit, x, kw, tanh_clamp_scale=tanh, d_dtype=d_dtype, dbias_dtype=dbias,
                        compute_amax=True, discrete_col_sfd=dcs)
    assert ref["amax_tensor"].shape == (L, 1)
    check_backward(ref, ora, d_dtype=d_dtype, dbias_dtype=dbias, dcs=dcs)


WGRAD_CASES = [
    # fmt, token offsets (T = 768), global scales, accumulate, wgrad_dtype
    ("bf16", [128, 384, 384, 768], False, False, "bfloat16"),
    ("fp16", [0, 256, 640, 768], False, True, "float32"),
    ("mxfp8_e4m3", [128, 384, 384, 768], False, False, "bfloat16"),
    ("mxfp8_e5m2", [256, 256, 256, 768], False, True, "float16"),
    ("mxfp4", [384, 512, 768, 768], True, False, "float32"),
    ("nvfp4", [128, 256, 512, 640], True, True, "bfloat16"),
    ("nvfp4_e8m0", [640, 128, 9999, 768], False, False, "float32"),      # non-monotone, > T
    ("mxfp8_e4m3", [-128, 256, 128, 512], True, False, "float32"),       # negative, non-monotone
]


@pytest.mark.parametrize("fmt,offsets,gs,acc,wdtype,jit", with_jit(WGRAD_CASES, 5))
def test_wgrad(fmt, offsets, gs, acc, wdtype, jit):
    rng = _rng("wgrad", fmt, offsets)
    ab, sf, vec = FORMATS[fmt]
    tokens, mw, nw = 768, 96, 128
    x = dict(offsets=np.asarray(offsets, np.int32))
    groups = O.np_groups(offsets, tokens, align=1)
    for name, rows in (("a", mw), ("b", nw)):
        data, phys = make_operand(rng, (rows, tokens), fmt)
        x[name] = data
        if sf is not None:
            s = O.np_unpack_sf(phys, rows, np_cdiv(tokens, vec))[0]
            x["sf" + name] = O.np_segments_sf(s, groups, vec)
    if gs:
        x["global_scale_a"] = rng.uniform(0.5, 2, L).astype(np.float32)
        x["global_scale_b"] = rng.uniform(0.5, 2, L).astype(np.float32)
    if acc:
        x["wgrad_tensor"] = rng.uniform(-50, 50, (L, mw, nw)).astype(np.float32).astype(O.FLOAT_OUT[wdtype])
    ref, ora = run_both("grouped_gemm_wgrad", jit, x, dict(ab_dtype=ab, sf_dtype=sf, sf_vec_size=vec),
                        wgrad_dtype=wdtype)
    check_float("wgrad_tensor", ref["wgrad_tensor"], ora["_pre"]["wgrad"], wdtype, ora["_mag"]["wgrad"])
    if not acc:                                     # empty experts: exactly zero
        assert all(not np.asarray(ref["wgrad_tensor"][g], np.float32).any()
                   for g, (s, e) in enumerate(groups) if e == s)


@pytest.mark.parametrize("fmt,offsets", [
    ("mxfp8_e4m3", [40, 300, 333, 333, 760]),       # starts inside SF blocks; the last segment runs off the buffer
    ("nvfp4", [8, 72, 500, 700, 768]),
    ("mxfp4", [0, 17, 400, 401, 768]),
])
def test_wgrad_unaligned_segments(fmt, offsets):
    """Expert starts that are not multiples of vec: token t of expert e reads local block (t - start_e) // vec of its
    own segment (SF(R, T_e), blocks from the expert's first token); bytes past the buffer read 0. The SF buffers
    are random finite bytes, so every byte a segment reads is pinned."""
    rng = _rng("wgrad_unaligned", fmt, offsets)
    ab, sf, vec = FORMATS[fmt]
    tokens, mw, nw = 768, 96, 136
    x = dict(offsets=np.asarray(offsets, np.int32))
    for name, rows in (("a", mw), ("b", nw)):
        x[name] = make_operand(rng, (rows, tokens), fmt)[0]
        size = np_cdiv(rows, 128) * 128 * np_cdiv(np_cdiv(tokens, vec), 4) * 4
        x["sf" + name] = _scale_bytes(rng, (size,), sf)
    x["global_scale_a"] = rng.uniform(0.5, 2, len(offsets)).astype(np.float32)
    x["global_scale_b"] = rng.uniform(0.5, 2, len(offsets)).astype(np.float32)
    ref, ora = run_both("grouped_gemm_wgrad", False, x, dict(ab_dtype=ab, sf_dtype=sf, sf_vec_size=vec),
                        wgrad_dtype="float32")
    check_float("wgrad_tensor", ref["wgrad_tensor"], ora["_pre"]["wgrad"], "float32", ora["_mag"]["wgrad"])


# ---------------------------------------------------------------------------------------------------------------
# backward == autodiff of a plain-jnp forward formula (f32, no bf16 rounding anywhere)


def _jnp_glu_forward(x, prob, act, limit, galpha):
    """prob * scale * act(gate, up): the oracle's formula in jnp (tests/np_ops.py), differentiated by JAX."""
    m, n = x.shape
    blocks = x.reshape(m, n // 64, 2, 32)
    gate, up = blocks[:, :, 0].reshape(m, -1), blocks[:, :, 1].reshape(m, -1)
    options = dict(glu_limit=limit, glu_alpha=galpha)
    return prob[:, None] * O.np_glu_value(gate, up, act, options, xp=jnp) * O.np_glu(act, **options).scale


def _jnp_srelu_forward(x, prob, s):
    r = jnp.maximum(x, 0.0)
    y = r * r if s is None else (s * jnp.minimum(jnp.tanh(r / s), 1.0)) ** 2
    return prob[:, None] * y


@pytest.mark.parametrize("op,act,limit,galpha,tanh", [
    ("dglu", "swiglu", None, None, None), ("dglu", "geglu", None, 1.3, None), ("dglu", "swiglu", 2.0, 0.7, None),
    ("dglu", "geglu", 1.5, None, None), ("dsrelu", "srelu", None, None, None), ("dsrelu", "srelu", None, None, 2.0),
    ("dglu", "gpt_oss_swiglu", None, None, None), ("dglu", "gpt_oss_swiglu", 2.0, 1.1, None)])
def test_backward_is_autodiff_of_forward(op, act, limit, galpha, tanh):
    n_c = 256 if op == "dglu" else 128
    x, kw = make_dgrad("bf16", n_c, n_c // 2 if op == "dglu" else n_c, 96, "empty", False, "float32", seed=3)
    groups = O.np_groups(x["padded_offsets"], M)
    gid = np.full(M, L)
    for g, (s, e) in enumerate(groups):
        gid[s:e] = g
    valid = jnp.asarray(gid < L)
    beta_rows = jnp.asarray(np.append(x["beta"], 0.0)[gid], jnp.float32)
    xpre = beta_rows[:, None] * jnp.asarray(x["c"])
    # dD = alpha * dY @ W2^T per group (float64, then f32)
    a64, b64 = np.asarray(x["a"], np.float64), np.asarray(x["b"], np.float64)
    dd = np.zeros((M, b64.shape[1]))
    for g, (s, e) in enumerate(groups):
        dd[s:e] = x["alpha"][g] * a64[s:e] @ b64[g].T
    dd = jnp.asarray(dd, jnp.float32)

    def loss(xp, prob, bias):
        xb = xp + jnp.concatenate([bias, jnp.zeros((1, bias.shape[1]))])[gid]
        d = (_jnp_glu_forward(xb, prob, act, limit, galpha) if op == "dglu" else _jnp_srelu_forward(xb, prob, tanh))
        return jnp.sum(jnp.where(valid[:, None], dd * d, 0.0))

    gx, gp, gb = jax.grad(loss, argnums=(0, 1, 2))(xpre, jnp.asarray(x["prob"]), jnp.zeros((L, n_c), jnp.float32))
    opts = dict(act_func="d" + act, glu_limit=limit, glu_alpha=galpha) if op == "dglu" else dict(
        tanh_clamp_scale=tanh)
    ref = getattr(R, "grouped_gemm_" + op)(**to_jnp(x), **kw, d_dtype="float32", dbias_dtype="float32",
                                           compute_amax=False, **opts)
    for name, got, want in (("d_row", ref["d_row_tensor"], gx), ("dprob", ref["dprob_tensor"], gp),
                            ("dbias", ref["dbias_tensor"], gb)):
        want = np.asarray(want, np.float64)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-6 * np.abs(want).max(),
                                   err_msg=name)
    assert np.abs(np.asarray(gx)).max() > 0 and not np.asarray(ref["d_row_tensor"])[~np.asarray(valid)].any()


# ---------------------------------------------------------------------------------------------------------------
# shared pieces (every op also runs under jax.jit above: the `jit` cases)


@pytest.mark.parametrize("offsets", list(GROUPS.values()) + [[1023, 1024, 0, 2000], [-1, -1, -1, -1]])
def test_sanitize_offsets(offsets):
    ends = np.asarray(R.sanitize_offsets(jnp.asarray(offsets, jnp.int32), M))
    want = [e for _, e in O.np_groups(offsets, M)]
    assert ends.tolist() == want
    gid = np.asarray(R.row_groups(jnp.asarray(ends), M))
    for g, (s, e) in enumerate(O.np_groups(offsets, M)):
        assert (gid[s:e] == g).all()
    assert (gid[want[-1]:] == L).all()
