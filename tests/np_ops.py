"""Independent float64 numpy oracle of every op (docs/ops.md, docs/activations.md; offsets rule docs/offsets.md).

Written from the documented semantics, not from cudnn_moe_jax.reference: explicit Python loops over the groups
derived from the raw offsets, float64 GEMMs per expert, explicit derivative formulas for the backward activations,
and the per-expert segment layouts built by concatenating per-group MMA-tiled blocks (not through a segment helper).
Element formats, block quantization and the scale-factor byte layout come from tests/np_formats.py (also independent).

Each op has the signature and output keys of its `reference` twin. Every result also carries `"_pre"`: the
float64 values fed to each rounding step; `"_mag"`: for each of them a first-order *condition magnitude* (the
same computation on absolute values: sum |a||b| for a GEMM, |f'| times the input magnitude through an
activation), which bounds the fp32 rounding noise of any implementation as (a few) 2^-24 * mag; and
`"_groups"`: the sanitized [(start, end)] list.

The GPU tests (tests/gpu) use the same oracle through `np_forward_oracle` / `np_forward_from_acc`: the float64
C, D and amax of a forward problem described by its manifest dict, from the operands or from an accumulator.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import ml_dtypes
import numpy as np

from np_formats import (E2M1, E4M3, E5M2, E8M0, np_cdiv, np_decode, np_dequantize, np_e8m0_decode,
                        np_fp8_encode, np_pack_sf, np_quantize_cols, np_quantize_rows, np_unpack_sf)

FP8 = (E4M3, E5M2)
QUANT_D = FP8 + (E2M1,)         # D dtypes quantized with SFD_row / D_col / SFD_col (FP4: MXFP4)
FLOAT_OUT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
BLOCK_SCALED = (E4M3, E5M2, E2M1)


# ---------------------------------------------------------------------------------------------------------------
# groups


def np_sanitized_ends(offsets, m, align=256) -> np.ndarray:
    """Group ends from raw (possibly invalid) offsets, the NOTES.md device rule: clip to [0, m], floor to `align`,
    running max."""
    ends = np.clip(np.asarray(offsets, np.int64).reshape(-1), 0, m) // align * align
    return np.maximum.accumulate(ends)


def np_groups(offsets, m, align=256):
    """[(start, end)] per group: start_0 = 0, start_g = end_{g-1} of the sanitized ends."""
    ends = np_sanitized_ends(offsets, m, align).tolist()
    return list(zip([0] + ends[:-1], ends))


def np_group_of_rows(offsets, m, align=256) -> np.ndarray:
    """(m,) group index of every row, L for rows past the last sanitized end (outside every group)."""
    return np.searchsorted(np_sanitized_ends(offsets, m, align), np.arange(m), side="right")


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def _prob(prob, m):
    return np.ones(m) if prob is None else _f64(prob).reshape(m)


def _scalar(x, what):
    if x is None:
        raise ValueError(f"{what} required")
    return float(np.asarray(x, np.float32).reshape(-1)[0])


# ---------------------------------------------------------------------------------------------------------------
# operands


def np_operand(x, sf, rows_axis_groups, ab_dtype, sf_dtype, vec):
    """Dequantize one K-major operand in float64. x (R, K) or (L, R, K) [fp4 packed K/2]; sf physical."""
    if ab_dtype not in BLOCK_SCALED or sf is None:   # bf16 / fp16, or bf16 A beside block-scaled B
        return np.asarray(x).astype(np.float64)
    x = np.asarray(x)
    batched = x.ndim == 3
    xs = x if batched else x[None]
    k = xs.shape[2] * (2 if ab_dtype == E2M1 else 1)
    s = np_unpack_sf(sf, xs.shape[1], np_cdiv(k, vec), xs.shape[0])
    # np_dequantize rounds (and flushes) to fp32, as formats.dequantize; the GEMMs of the oracle are float64: a
    # float32 product here ran the block-scaled GEMMs in fp32 (BLAS order), off the exact sum by up to ~K 2^-24
    # sum|a b| -- under cancellation far beyond the value itself (mxfp4_srelu_tanh_k224: an oracle C of -384.4
    # where the exact value is -56.2)
    out = np.stack([np_dequantize(xs[l], s[l], ab_dtype, sf_dtype, vec) for l in range(xs.shape[0])])
    out = out.astype(np.float64)
    return out if batched else out[0]


def _weights(b, sfb, ab_dtype, sf_dtype, vec):
    if isinstance(b, (tuple, list)):
        sfbs = sfb if isinstance(sfb, (tuple, list)) else [None] * len(b)
        return np.stack([np_operand(bi, si, 1, ab_dtype, sf_dtype, vec) for bi, si in zip(b, sfbs)])
    return np_operand(b, sfb, None, ab_dtype, sf_dtype, vec)


def _accumulate(a, b, sfa, sfb, groups, ab_dtype, sf_dtype, vec):
    """(acc, sum |a||b|) (m, N) float64: each group's rows times its expert's weight; rows outside groups 0."""
    a64 = np_operand(a, sfa, None, ab_dtype, sf_dtype, vec)
    b64 = _weights(b, sfb, ab_dtype, sf_dtype, vec)
    acc = np.zeros((a64.shape[0], b64.shape[1]))
    mag = np.zeros_like(acc)
    for g, (s, e) in enumerate(groups):
        if e > s:
            acc[s:e] = a64[s:e] @ b64[g].T
            mag[s:e] = np.abs(a64[s:e]) @ np.abs(b64[g]).T
    return acc, mag


# ---------------------------------------------------------------------------------------------------------------
# output rounding (also called by the tests on perturbed inputs)


def np_round_float(x, dtype):
    return np.asarray(x, np.float64).astype(np.float32).astype(FLOAT_OUT[dtype])


def np_cast(x, dtype):
    """Plain output cast: bf16/fp16/fp32 RNE; fp8 RNE-satfinite."""
    if dtype in FP8:
        return np_fp8_encode(np.asarray(x, np.float64).astype(np.float32), dtype)
    return np_round_float(x, dtype)


def np_segments_sf(s, groups, vec):
    """Per-group MMA-tiled blocks SF(R, T_g) concatenated at byte rup(R,128)*start_g/vec (docs/formats.md,
    segmented layout), built group by group."""
    rows, nblk = s.shape
    rows_pad = np_cdiv(rows, 128) * 128
    buf = np.zeros(rows_pad * np_cdiv(nblk, 4) * 4, np.uint8)
    for st, en in groups:
        if en > st:
            blk = np_pack_sf(s[:, st // vec: en // vec])
            base = rows_pad * st // vec
            buf[base: base + blk.size] = blk
    return buf


def _phys(s):
    """Logical (R, nkb) uint8 -> physical (1, Rb, Kb, 32, 4, 4) via the oracle's flat packer."""
    rows, nkb = s.shape
    return np_pack_sf(s).reshape(1, np_cdiv(rows, 128), np_cdiv(nkb, 4), 32, 4, 4)


def np_quant_d_outputs(dfp, groups, d_dtype, norm_const, discrete_col_sfd):
    """Row / column quantization (docs/formats.md#quantization): D, D_col (fp8, or packed e2m1: D (m, N/2), D_col
    transposed (N, m/2)), SFD_row (physical), SFD_col (physical or flat segments) from float64 D; e8m0, vec 32."""
    d, s_row = np_quantize_rows(dfp, d_dtype, E8M0, 32, norm_const)
    d_col, s_col = np_quantize_cols(dfp, d_dtype, norm_const)
    sfd_col = np_segments_sf(s_col, groups, 32) if discrete_col_sfd else _phys(s_col)
    return dict(d=d, d_col=d_col, sfd_row=_phys(s_row), sfd_col=sfd_col)


def np_nvfp4(x, norm_const):
    """NVFP4 (docs/formats.md#nvfp4): (packed e2m1 codes (R, C/2), e4m3 SF logical (R, C/16))."""
    return np_quantize_rows(x, E2M1, E4M3, 16, norm_const)


def _d_outputs(dfp, groups, d_dtype, norm_const, discrete_col_sfd):
    if d_dtype in QUANT_D:
        o = np_quant_d_outputs(dfp, groups, d_dtype, _scalar(norm_const, "norm_const"), discrete_col_sfd)
        return o["d"], o["d_col"], o["sfd_row"], o["sfd_col"]
    return np_round_float(dfp, d_dtype), None, None, None


def _amax(x, groups):
    """(L, 1): per-group max |x| over the group's rows; empty group 0.0 (docs/ops.md#amax)."""
    return np.array([[np.abs(x[s:e]).max() if e > s else 0.0] for s, e in groups], np.float32)


def _forward_result(c, dfp, groups, c_dtype, d_dtype, norm_const, compute_amax, discrete_col_sfd, mag):
    d, d_col, sfd_row, sfd_col = _d_outputs(dfp, groups, d_dtype, norm_const, discrete_col_sfd)
    out = {}
    if c_dtype is not None:
        out["c_tensor"] = np_cast(c, c_dtype)
    out.update(d_tensor=d, d_col_tensor=d_col, amax_tensor=_amax(dfp, groups) if compute_amax else None,
               sfd_row_tensor=sfd_row, sfd_col_tensor=sfd_col)
    out["_pre"] = dict(c=c, d=dfp)
    out["_mag"] = mag
    out["_groups"] = groups
    return out


# ---------------------------------------------------------------------------------------------------------------
# activations (float64, written out per 32-column block pair; keyed by the names of cudnn_moe_jax.activations)


def np_sigmoid(x, xp=np):
    """1 / (1 + e^-x) without cancellation in either tail (xp=jax.numpy: the same formula, differentiable)."""
    e_pos, e_neg = xp.exp(-xp.where(x >= 0, x, 0.0)), xp.exp(xp.where(x < 0, x, 0.0))
    return xp.where(x >= 0, 1.0 / (1.0 + e_pos), e_neg / (1.0 + e_neg))


class NpGlu(NamedTuple):
    """act(gate, up) = (u' + offset) * g' * sigmoid(k * g'), g' = clip(gate, glo, ghi), u' = clip(up, ulo, uhi)
    (bounds = (glo, ghi, ulo, uhi)); the op multiplies D by `scale`."""
    k: float
    offset: float
    bounds: tuple
    scale: float


def _np_swiglu(glu_limit=None, glu_alpha=None):
    lim = math.inf if glu_limit is None else glu_limit
    return NpGlu(1.0, 0.0, (-lim, lim, -lim, lim), 1.0 if glu_alpha is None else glu_alpha)


def _np_geglu(glu_limit=None, glu_alpha=None):
    """cuDNN's GeGLU: gate <= 7 and up in [-7, 7] unless glu_limit L clamps both to [-L, L]."""
    bounds = (-math.inf, 7.0, -7.0, 7.0) if glu_limit is None else (-glu_limit, glu_limit, -glu_limit, glu_limit)
    return NpGlu(1.702, 1.0, bounds, 1.0 if glu_alpha is None else glu_alpha)


def _np_gpt_oss_swiglu(glu_limit=None, glu_alpha=None):
    """GPT-OSS: sigmoid(alpha * gate) with alpha = glu_alpha (1.702), gate <= limit (from above only), up in
    [-limit, limit], limit = glu_limit (7); D is not scaled."""
    alpha = 1.702 if glu_alpha is None else glu_alpha
    lim = 7.0 if glu_limit is None else glu_limit
    return NpGlu(alpha, 1.0, (-math.inf, lim, -lim, lim), 1.0)


NP_GLU = {"swiglu": _np_swiglu, "geglu": _np_geglu, "gpt_oss_swiglu": _np_gpt_oss_swiglu}


def np_glu(act, **options) -> NpGlu:
    """The oracle's GLU of a forward or backward ("d" + name) act_func with its options (glu_limit, glu_alpha);
    ValueError for any other name."""
    name = act[1:] if act not in NP_GLU and act.startswith("d") else act
    if name not in NP_GLU:
        raise ValueError(f"the oracle knows no GLU activation {act!r} (only {tuple(NP_GLU)})")
    return NP_GLU[name](**options)


def np_glu_pairs(x):
    """Yield (j, gate cols, up cols) of the 32-col pairing: block 2j is the gate, block 2j+1 the up half."""
    for j in range(x.shape[1] // 64):
        yield j, slice(64 * j, 64 * j + 32), slice(64 * j + 32, 64 * j + 64)


def _clipped(p: NpGlu, gate, up, xp=np):
    glo, ghi, ulo, uhi = p.bounds
    return xp.minimum(xp.maximum(gate, glo), ghi), xp.minimum(xp.maximum(up, ulo), uhi)


def np_glu_value(gate, up, act, options, sigmoid=np_sigmoid, xp=np):
    """act(gate, up), without the op's scale. xp=jax.numpy: the same formula for jax.grad (tests that
    differentiate a plain layer; `sigmoid` is then ignored)."""
    p = np_glu(act, **options)
    g, u = _clipped(p, gate, up, xp)
    sg = sigmoid(p.k * g) if xp is np else np_sigmoid(p.k * g, xp)
    return (u + p.offset) * g * sg


def np_glu_derivatives(gate, up, act, options):
    """(d act/d gate, d act/d up) in float64; zero where the clamp is active (bounds inclusive: at a bound the
    derivative of the unclamped function)."""
    p = np_glu(act, **options)
    glo, ghi, ulo, uhi = p.bounds
    g, u = _clipped(p, gate, up)
    sg = np_sigmoid(p.k * g)
    dg = (u + p.offset) * (sg + p.k * g * sg * (1.0 - sg))      # d/dg [(u + offset) g s(k g)]
    du = g * sg
    return np.where((gate >= glo) & (gate <= ghi), dg, 0.0), np.where((up >= ulo) & (up <= uhi), du, 0.0)


def np_glu_derivative_mags(gate, up, act, options):
    """Sums of |terms| of the two derivatives (their fp32 evaluation noise scale; no cancellation)."""
    p = np_glu(act, **options)
    g, u = _clipped(p, gate, up)
    lin = np.abs(u + p.offset) + abs(p.offset)
    sg = np_sigmoid(p.k * g)
    return lin * (sg + abs(p.k) * np.abs(g) * sg * (1.0 - sg)), np.abs(g) * sg


def np_srelu_value(x, s):
    r = np.where(x > 0, x, 0.0)
    if s is None:
        return r ** 2
    return (s * np.minimum(np.tanh(r / s), 1.0)) ** 2


def np_srelu_derivative(x, s):
    """d/dx relu(x)^2 = 2x (x > 0); tanh-clamped: d/dx (s tanh(x/s))^2 = 2 s t (1 - t^2), t = tanh(x/s)."""
    if s is None:
        return np.where(x > 0, 2.0 * x, 0.0)
    t = np.tanh(np.where(x > 0, x, 0.0) / s)
    return np.where(x > 0, 2.0 * s * t * (1.0 - t * t), 0.0)


def _srelu_forward(c, c_mag, prob, s):
    """(D, mag) of D = prob * srelu(C)."""
    d = prob[:, None] * np_srelu_value(c, s)
    return d, np.abs(prob[:, None] * np_srelu_derivative(c, s)) * c_mag + np.abs(d)


NP_POINTWISE = {"srelu": (np_srelu_value, np_srelu_derivative)}
NP_ACTIVATIONS = (*NP_GLU, *NP_POINTWISE)         # every name the oracle knows (the table's, tests check)


def _glu_d(c, prob, act, options, sigmoid=np_sigmoid):
    """D = scale * prob * act(gate, up) per 32-column pair."""
    d = np.zeros((c.shape[0], c.shape[1] // 2))
    for j, gs, us in np_glu_pairs(c):
        d[:, 32 * j: 32 * j + 32] = prob[:, None] * np_glu_value(c[:, gs], c[:, us], act, options, sigmoid)
    return d * np_glu(act, **options).scale


def _glu_forward(c, c_mag, prob, act, options):
    """(D, mag) of D = scale * prob * act(gate, up) per 32-column pair."""
    d = _glu_d(c, prob, act, options)
    mag = np.zeros_like(d)
    for j, gs, us in np_glu_pairs(c):
        dg, du = np_glu_derivative_mags(c[:, gs], c[:, us], act, options)
        mag[:, 32 * j: 32 * j + 32] = np.abs(prob[:, None]) * (dg * c_mag[:, gs] + du * c_mag[:, us])
    return d, abs(np_glu(act, **options).scale) * mag + np.abs(d)


# ---------------------------------------------------------------------------------------------------------------
# forward ops


def _c_from_acc(acc, groups, alpha, bias):
    """C = alpha * acc (+ bias) per group; rows outside every group 0."""
    alpha, bias = _f64(alpha), _f64(bias)
    c = np.zeros_like(acc)
    for g, (s, e) in enumerate(groups):
        c[s:e] = alpha[g] * acc[s:e] + (0.0 if bias is None else bias[g][None, :])
    return c


def _c(a, b, sfa, sfb, padded_offsets, alpha, bias, ab_dtype, sf_dtype, sf_vec_size, m_aligned):
    m = np.asarray(a).shape[0]
    groups = np_groups(padded_offsets, m, m_aligned)
    acc, acc_mag = _accumulate(a, b, sfa, sfb, groups, ab_dtype, sf_dtype, sf_vec_size)
    alpha, bias = _f64(alpha), _f64(bias)
    mag = np.zeros_like(acc)
    for g, (s, e) in enumerate(groups):
        mag[s:e] = abs(alpha[g]) * acc_mag[s:e] + (0.0 if bias is None else np.abs(bias[g])[None, :])
    return _c_from_acc(acc, groups, alpha, bias), _mask_rows(mag, groups), groups


def _mask_rows(x, groups):
    out = np.zeros_like(x)
    for s, e in groups:
        out[s:e] = x[s:e]
    return out


def _quant_d(acc, groups, p, alpha, bias):
    """D of the quant op (A7): prob * alpha * acc, or alpha * acc + prob * bias with a bias; rows outside 0."""
    alpha, bias = _f64(alpha), _f64(bias)
    dfp = np.zeros_like(acc)
    for g, (s, e) in enumerate(groups):
        if bias is None:
            dfp[s:e] = p[s:e, None] * alpha[g] * acc[s:e]
        else:
            dfp[s:e] = alpha[g] * acc[s:e] + p[s:e, None] * bias[g][None, :]
    return dfp


def grouped_gemm_quant(a, b, sfa, sfb, padded_offsets, alpha, prob, bias=None, norm_const=None, *, ab_dtype,
                       sf_dtype=None, sf_vec_size=None, d_dtype, compute_amax=False, discrete_col_sfd=False,
                       m_aligned=256):
    m = np.asarray(a).shape[0]
    groups = np_groups(padded_offsets, m, m_aligned)
    acc, acc_mag = _accumulate(a, b, sfa, sfb, groups, ab_dtype, sf_dtype, sf_vec_size)
    p, alpha, bias = _prob(prob, m), _f64(alpha), _f64(bias)
    dfp, mag = _quant_d(acc, groups, p, alpha, bias), np.zeros_like(acc)
    for g, (s, e) in enumerate(groups):
        if bias is None:
            mag[s:e] = np.abs(p[s:e, None] * alpha[g]) * acc_mag[s:e]
        else:
            mag[s:e] = abs(alpha[g]) * acc_mag[s:e] + np.abs(p[s:e, None] * bias[g][None, :])
    return _forward_result(None, dfp, groups, None, d_dtype, norm_const, compute_amax, discrete_col_sfd,
                           dict(d=mag))


def grouped_gemm_srelu(a, b, sfa, sfb, padded_offsets, alpha, prob, bias=None, norm_const=None, *, ab_dtype,
                       sf_dtype=None, sf_vec_size=None, c_dtype="bfloat16", d_dtype, tanh_clamp_scale=None,
                       compute_amax=False, discrete_col_sfd=False, m_aligned=256):
    c, c_mag, groups = _c(a, b, sfa, sfb, padded_offsets, alpha, bias, ab_dtype, sf_dtype, sf_vec_size, m_aligned)
    dfp, d_mag = _srelu_forward(c, c_mag, _prob(prob, c.shape[0]), tanh_clamp_scale)
    return _forward_result(c, _mask_rows(dfp, groups), groups, c_dtype, d_dtype, norm_const, compute_amax,
                           discrete_col_sfd, dict(c=c_mag, d=d_mag))


def grouped_gemm_glu(a, b, sfa, sfb, padded_offsets, alpha, prob, bias=None, norm_const=None, *, ab_dtype,
                     sf_dtype=None, sf_vec_size=None, act_func="swiglu", c_dtype="bfloat16", d_dtype,
                     glu_limit=None, glu_alpha=None, compute_amax=False, discrete_col_sfd=False, m_aligned=256):
    c, c_mag, groups = _c(a, b, sfa, sfb, padded_offsets, alpha, bias, ab_dtype, sf_dtype, sf_vec_size, m_aligned)
    dfp, d_mag = _glu_forward(c, c_mag, _prob(prob, c.shape[0]), act_func,
                              dict(glu_limit=glu_limit, glu_alpha=glu_alpha))
    return _forward_result(c, _mask_rows(dfp, groups), groups, c_dtype, d_dtype, norm_const, compute_amax,
                           discrete_col_sfd, dict(c=c_mag, d=d_mag))


def np_forward_from_acc(p: dict, acc, offsets, alpha, prob, bias, sigmoid=np_sigmoid) -> dict:
    """float64 {"c", "d", "amax"} of the forward problem `p` (a GroupedGemmProblem as a dict, e.g. a GPU manifest
    entry; quant / srelu / glu) from its accumulator acc (m, N): the GPU tests' oracle. Rows outside every
    (sanitized) group are 0; c is None for quant; amax (L, 1) per group (0 for an empty one). `sigmoid` replaces
    the activation's sigmoid (a GPU test models the kernel's flush of tiny values with it)."""
    epi = p["epilogue"]
    m = acc.shape[0]
    groups = np_groups(offsets, m, p.get("m_aligned", 256))
    pr = _prob(prob, m)
    if p["op"] == "quant":
        c, d = None, _quant_d(acc, groups, pr, alpha, bias)
    else:
        c = _c_from_acc(acc, groups, alpha, bias)
        if p["op"] == "srelu":
            d = pr[:, None] * np_srelu_value(c, epi.get("tanh_clamp_scale"))
        else:
            d = _glu_d(c, pr, epi["act"], dict(glu_limit=epi.get("glu_limit"), glu_alpha=epi.get("glu_alpha")),
                       sigmoid)
        d = _mask_rows(d, groups)
    amax = np.array([[np.abs(d[s:e]).max() if e > s else 0.0] for s, e in groups])
    return {"c": c, "d": d, "amax": amax}


def np_forward_oracle(p: dict, a, b, offsets, alpha, prob, bias) -> dict:
    """np_forward_from_acc on a (m, K) times each group's expert b[g] (N, K) (bf16 / fp16 / float64 values)."""
    groups = np_groups(offsets, np.asarray(a).shape[0], p.get("m_aligned", 256))
    acc, _ = _accumulate(a, b, None, None, groups, None, None, None)
    return np_forward_from_acc(p, acc, offsets, alpha, prob, bias)


def np_hadamard16():
    """Sylvester H16 / 4: H[i][o] = (-1)^popcount(i & o) / 4."""
    return np.array([[(-1.0) ** bin(i & o).count("1") for o in range(16)] for i in range(16)]) / 4.0


def np_rht_rowwise(x, p):
    """Each 16-column block of every row: out = blk @ P^T."""
    out = np.zeros_like(x)
    for j in range(x.shape[1] // 16):
        out[:, 16 * j: 16 * j + 16] = x[:, 16 * j: 16 * j + 16] @ p.T
    return out


def np_rht_colwise(x, groups, p):
    """Per group, per column, each 16-token block: out = v @ P^T. Returns (N_out, m) (rows = D columns)."""
    xt = x.T.copy()
    out = np.zeros_like(xt)
    for s, e in groups:
        for t in range(s, e, 16):
            out[:, t: t + 16] = xt[:, t: t + 16] @ p.T
    return out


def np_rht_colwise_outputs(y_t, groups, rht_norm_const):
    """Colwise NVFP4 (docs/ops.md#grouped_gemm_glu_hadamard_quant): data segment g = packed (N_out, T_g) at byte
    N_out*start/2; SF segments vec 16."""
    n_out, m = y_t.shape
    data = np.zeros(n_out * m // 2, np.uint8)
    codes, s = np_nvfp4(y_t, rht_norm_const)
    for st, en in groups:
        if en > st:
            seg = codes[:, st // 2: en // 2]
            data[n_out * st // 2: n_out * en // 2] = seg.reshape(-1)
    return data, np_segments_sf(s, groups, 16)


def grouped_gemm_glu_hadamard_quant(a, b, sfa, sfb, padded_offsets, alpha, prob, bias=None, norm_const=None,
                                    rht_norm_const=None, hadamard=None, *, ab_dtype, sf_dtype=None,
                                    sf_vec_size=None, act_func="swiglu", c_dtype="bfloat16", d_dtype="bfloat16",
                                    rht=None, rht_dtype=None, glu_limit=None, glu_alpha=None,
                                    tanh_clamp_scale=None, compute_amax=False, d_bf16=None, m_aligned=256):
    """`d_bf16` (test hook): use this bf16-rounded D as the transform input instead of the oracle's own."""
    c, c_mag, groups = _c(a, b, sfa, sfb, padded_offsets, alpha, bias, ab_dtype, sf_dtype, sf_vec_size, m_aligned)
    p_row = _prob(prob, c.shape[0])
    if act_func in NP_POINTWISE:
        dfp, d_mag = _srelu_forward(c, c_mag, p_row, tanh_clamp_scale)
    else:
        dfp, d_mag = _glu_forward(c, c_mag, p_row, act_func, dict(glu_limit=glu_limit, glu_alpha=glu_alpha))
    dfp = _mask_rows(dfp, groups)
    mag = dict(c=c_mag, d=d_mag)
    out = dict(c_tensor=np_cast(c, c_dtype), d_tensor=None, sfd_tensor=None, amax_tensor=None, rht_tensor=None,
               sfrht_tensor=None)
    if d_dtype == E2M1:
        codes, s = np_nvfp4(dfp, _scalar(norm_const, "norm_const"))
        out["d_tensor"], out["sfd_tensor"] = codes, _phys(s)
    else:
        out["d_tensor"] = np_round_float(dfp, d_dtype)
    if compute_amax:
        out["amax_tensor"] = _amax(dfp, groups)
    pre = dict(c=c, d=dfp)
    if rht is not None:
        p = np_hadamard16() if hadamard is None else _f64(hadamard)
        xb = (np_round_float(dfp, "bfloat16") if d_bf16 is None else np.asarray(d_bf16)).astype(np.float64)
        if rht == "rowwise":
            y = np_rht_rowwise(xb, p)
            if rht_dtype == E2M1:
                codes, s = np_nvfp4(y, _scalar(rht_norm_const, "rht_norm_const"))
                out["rht_tensor"], out["sfrht_tensor"] = codes, _phys(s)
            else:
                out["rht_tensor"] = np_round_float(y, rht_dtype or "bfloat16")
        else:
            y = np_rht_colwise(xb, groups, p)
            out["rht_tensor"], out["sfrht_tensor"] = np_rht_colwise_outputs(
                y, groups, _scalar(rht_norm_const, "rht_norm_const"))
        pre["rht"] = y
        mag["rht"] = (np_rht_rowwise(np.abs(xb), np.abs(p)) if rht == "rowwise" else
                      np_rht_colwise(np.abs(xb), groups, np.abs(p)))
    out["_pre"] = pre
    out["_mag"] = mag
    out["_groups"] = groups
    return out


# ---------------------------------------------------------------------------------------------------------------
# backward ops


def _backward_common(a, b, c, sfa, sfb, padded_offsets, alpha, beta, ab_dtype, sf_dtype, sf_vec_size, c_dtype,
                     m_aligned):
    m = np.asarray(a).shape[0]
    groups = np_groups(padded_offsets, m, m_aligned)
    acc, acc_mag = _accumulate(a, b, sfa, sfb, groups, ab_dtype, sf_dtype, sf_vec_size)
    c = np.asarray(c)
    c64 = np_decode(c, c_dtype).astype(np.float64) if (c.dtype == np.uint8 and c_dtype) else c.astype(np.float64)
    alpha, beta = _f64(alpha), _f64(beta)
    dd, dd_mag, x = np.zeros_like(acc), np.zeros_like(acc), np.zeros_like(c64)
    for g, (s, e) in enumerate(groups):
        dd[s:e] = alpha[g] * acc[s:e]
        dd_mag[s:e] = abs(alpha[g]) * acc_mag[s:e]
        x[s:e] = beta[g] * c64[s:e]
    return dd, dd_mag, x, groups


def _backward_result(dc, dprob, amax_parts, groups, d_dtype, norm_const, dbias_dtype, compute_amax,
                     discrete_col_sfd, dc_mag, dprob_mag):
    dc = _mask_rows(dc, groups)
    dc_mag = _mask_rows(dc_mag + np.abs(dc), groups)
    d, d_col, sfd_row, sfd_col = _d_outputs(dc, groups, d_dtype, norm_const, discrete_col_sfd)
    dbias = None
    if dbias_dtype is not None:
        dbias = np.stack([dc[s:e].sum(axis=0) if e > s else np.zeros(dc.shape[1]) for s, e in groups])
        dbias = np_round_float(dbias, dbias_dtype)
    amax = None
    if compute_amax:
        amax = np.concatenate([_amax(p, groups) for p in amax_parts], axis=1)
    dprob_out = np.zeros(dc.shape[0])
    for s, e in groups:
        dprob_out[s:e] = dprob[s:e]
    return dict(d_row_tensor=d, d_col_tensor=d_col, dprob_tensor=dprob_out.astype(np.float32), dbias_tensor=dbias,
                amax_tensor=amax, sfd_row_tensor=sfd_row, sfd_col_tensor=sfd_col,
                _pre=dict(d=dc, dprob=dprob_out, dbias=None if dbias_dtype is None else
                          np.stack([dc[s:e].sum(axis=0) if e > s else np.zeros(dc.shape[1]) for s, e in groups])),
                _mag=dict(d=dc_mag, dprob=_mask_rows(dprob_mag, groups),
                          dbias=np.stack([dc_mag[s:e].sum(axis=0) if e > s else np.zeros(dc.shape[1])
                                          for s, e in groups])),
                _groups=groups)


def grouped_gemm_dglu(a, b, c, sfa, sfb, padded_offsets, alpha, beta, prob, norm_const=None, *, ab_dtype,
                      sf_dtype=None, sf_vec_size=None, c_dtype=None, act_func="dswiglu", glu_limit=None,
                      glu_alpha=None, d_dtype, dbias_dtype=None, compute_amax=False, discrete_col_sfd=False,
                      m_aligned=256):
    options = dict(glu_limit=glu_limit, glu_alpha=glu_alpha)
    ga = np_glu(act_func, **options).scale
    dd, dd_mag, x, groups = _backward_common(a, b, c, sfa, sfb, padded_offsets, alpha, beta, ab_dtype, sf_dtype,
                                             sf_vec_size, c_dtype, m_aligned)
    p = _prob(prob, x.shape[0])[:, None]
    dc, dc_mag = np.zeros_like(x), np.zeros_like(x)
    dprob, dprob_mag = np.zeros(x.shape[0]), np.zeros(x.shape[0])
    d_gate_all, d_up_all = np.zeros_like(dd), np.zeros_like(dd)
    for j, gs, us in np_glu_pairs(x):
        gate, up, ddj = x[:, gs], x[:, us], dd[:, 32 * j: 32 * j + 32]
        dg, du = np_glu_derivatives(gate, up, act_func, options)
        dc[:, gs] = ddj * p * ga * dg
        dc[:, us] = ddj * p * ga * du
        d_gate_all[:, 32 * j: 32 * j + 32] = dc[:, gs]
        d_up_all[:, 32 * j: 32 * j + 32] = dc[:, us]
        value = np_glu_value(gate, up, act_func, options)
        dprob += (ddj * ga * value).sum(axis=1)
        magj = dd_mag[:, 32 * j: 32 * j + 32] * abs(ga)
        dg_mag, du_mag = np_glu_derivative_mags(gate, up, act_func, options)
        dc_mag[:, gs] = magj * np.abs(p) * dg_mag
        dc_mag[:, us] = magj * np.abs(p) * du_mag
        dprob_mag += (magj * np.abs(value)).sum(axis=1)
    return _backward_result(dc, dprob, (d_gate_all, d_up_all), groups, d_dtype, norm_const, dbias_dtype,
                            compute_amax, discrete_col_sfd, dc_mag, dprob_mag)


def grouped_gemm_dsrelu(a, b, c, sfa, sfb, padded_offsets, alpha, beta, prob, norm_const=None, *, ab_dtype,
                        sf_dtype=None, sf_vec_size=None, c_dtype=None, tanh_clamp_scale=None, d_dtype,
                        dbias_dtype=None, compute_amax=False, discrete_col_sfd=False, m_aligned=256):
    dd, dd_mag, x, groups = _backward_common(a, b, c, sfa, sfb, padded_offsets, alpha, beta, ab_dtype, sf_dtype,
                                             sf_vec_size, c_dtype, m_aligned)
    p = _prob(prob, x.shape[0])[:, None]
    deriv, value = np_srelu_derivative(x, tanh_clamp_scale), np_srelu_value(x, tanh_clamp_scale)
    dc = dd * p * deriv
    dprob = (dd * value).sum(axis=1)
    return _backward_result(dc, dprob, (dc,), groups, d_dtype, norm_const, dbias_dtype, compute_amax,
                            discrete_col_sfd, dd_mag * np.abs(p * deriv), (dd_mag * value).sum(axis=1))


def _segment_operand(x, flat, groups, ab_dtype, sf_dtype, vec):
    """Token-contiguous (R, T) operand with per-expert SF segments: each segment read as its own MMA-tiled block
    SF(R, T_g), its blocks starting at the expert's first token; bytes past the buffer read 0."""
    vals = np_decode(x, ab_dtype).astype(np.float64) if ab_dtype in BLOCK_SCALED else np.asarray(x, np.float64)
    if ab_dtype not in BLOCK_SCALED:
        return vals
    rows = vals.shape[0]
    rows_pad = np_cdiv(rows, 128) * 128
    flat = np.asarray(flat).view(np.uint8).reshape(-1)
    out = np.zeros_like(vals)
    for st, en in groups:
        if en <= st:
            continue
        nblk = np_cdiv(en - st, vec)
        base = rows_pad * st // vec
        size = rows_pad * np_cdiv(nblk, 4) * 4
        seg = np.zeros(size, np.uint8)
        part = flat[base: base + size]
        seg[:part.size] = part
        s = np_unpack_sf(seg, rows, nblk)[0]
        sv = np_e8m0_decode(s) if sf_dtype == E8M0 else s.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        out[:, st:en] = vals[:, st:en] * np.repeat(sv.astype(np.float64), vec, axis=1)[:, : en - st]
    return out


def grouped_gemm_wgrad(a, b, offsets, sfa=None, sfb=None, global_scale_a=None, global_scale_b=None,
                       wgrad_tensor=None, *, ab_dtype, sf_dtype=None, sf_vec_size=None, wgrad_dtype="bfloat16"):
    a = np.asarray(a)
    tokens = a.shape[1] * (2 if ab_dtype == E2M1 else 1)
    groups = np_groups(offsets, tokens, align=1)
    a64 = _segment_operand(a, sfa, groups, ab_dtype, sf_dtype, sf_vec_size)
    b64 = _segment_operand(np.asarray(b), sfb, groups, ab_dtype, sf_dtype, sf_vec_size)
    w = np.zeros((len(groups), a64.shape[0], b64.shape[0]))
    mag = np.zeros_like(w)
    for e, (s, t) in enumerate(groups):
        scale = 1.0
        if global_scale_a is not None:
            scale *= float(np.asarray(global_scale_a, np.float64).reshape(-1)[e])
        if global_scale_b is not None:
            scale *= float(np.asarray(global_scale_b, np.float64).reshape(-1)[e])
        w[e] = scale * (a64[:, s:t] @ b64[:, s:t].T)
        mag[e] = abs(scale) * (np.abs(a64[:, s:t]) @ np.abs(b64[:, s:t]).T)
    if wgrad_tensor is not None:
        w = w + np.asarray(wgrad_tensor).astype(np.float64)
        mag = mag + np.abs(np.asarray(wgrad_tensor).astype(np.float64))
    return dict(wgrad_tensor=np_round_float(w, wgrad_dtype), _pre=dict(wgrad=w), _mag=dict(wgrad=mag),
                _groups=groups)
