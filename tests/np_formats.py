"""Independent numpy / ml_dtypes oracle for the block-scaled formats (docs/formats.md).

Written from the spec, not from cudnn_moe_jax.formats (which it must never import), so that tests of formats.py
and of every op output can compare against it. Element rounding is done on float64 values (exact images of the
fp32 operands) with explicit per-format rules; the arithmetic the spec fixes in fp32 (pv = (amax*rcp)*norm_const,
scale = min(norm_const * 1/val(s), FLT_MAX), x*scale) is done in numpy float32, so results are bit-exact.

Conventions shared with formats.py: scale factors are uint8 codes; fp8 data are ml_dtypes arrays; fp4 data are
packed uint8 (..., K//2), low nibble = even element; NaN -> fp8 code 0x7F, e2m1 code 0x7; -0 -> e2m1 0x8.
Quantizers flush fp32 subnormals (data, pv after each multiply, the scale) to signed zero, as formats.py documents;
the element codecs (np_e8m0_encode, np_fp8_encode, np_e2m1_encode) are exact.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3, E5M2, E2M1, E8M0 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu"
Q_MAX = {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}
FLT_MAX = np.float32(np.finfo(np.float32).max)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_ML = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}


def _f64(x):
    """fp32 values as exact float64 (signalling-NaN patterns quietly become NaN)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(x, np.float32).astype(np.float64)


def np_flush(x):
    """fp32 subnormals -> signed zero: the flush points formats.py documents (XLA:CPU flushes in hardware)."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.float32(2.0 ** -126), np.copysign(np.float32(0), x), x).astype(np.float32)


def _scale_from_e8m0(codes, nc):
    """min(nc * 2^(127-e), FLT_MAX): float64 product is exact, one rounding to fp32, flushed; NaN for 0xFF."""
    e = np.asarray(codes, np.uint8).astype(np.float64)
    with np.errstate(all="ignore"):
        v = (np.float64(nc) * np.exp2(127.0 - e)).astype(np.float32)
    v = np.minimum(np_flush(v), FLT_MAX)
    return np.where(e == 255, np.float32(np.nan), v).astype(np.float32)


def np_cdiv(a, b):
    return -(-a // b)


def np_rcp_limit(d_dtype):
    return np.float32(1.0) / np.float32(Q_MAX[d_dtype]) if d_dtype in Q_MAX else np.float32(1.0)


# ---------------------------------------------------------------------------------------------------------------------
# element codecs
# ---------------------------------------------------------------------------------------------------------------------

def _e8m0_one(v):
    """RCEIL of one float64 value (an exact fp32 image): smallest 2^e >= v, saturated to [2^-127, 2^127]."""
    if math.isnan(v):
        return 255
    if v <= 2.0 ** -127:
        return 0
    if math.isinf(v):
        return 254
    m, e = math.frexp(v)            # v = m * 2^e, 0.5 <= m < 1
    ceil_log2 = e - 1 if m == 0.5 else e
    return min(ceil_log2 + 127, 254)


def np_e8m0_encode(x):
    x = _f64(x)
    return np.array([_e8m0_one(v) for v in x.ravel()], np.uint8).reshape(x.shape)


def np_e8m0_decode(codes):
    c = np.asarray(codes, np.uint8).astype(np.float64)
    out = np.where(c == 255, np.nan, np.exp2(c - 127.0))
    return out.astype(np.float32)      # 2^-127 is an exact fp32 subnormal


def np_fp8_encode(x, fmt):
    """fp32 -> fp8 (ml_dtypes array): ml_dtypes RNE cast from float64 after explicit saturation; NaN -> 0x7F."""
    v = _f64(x)
    q = Q_MAX[fmt]
    sat = np.clip(v, -q, q)                           # |v| > q rounds to >= q anyway: saturate first
    bits = sat.astype(_ML[fmt]).view(np.uint8).copy()
    bits[np.isnan(v)] = 0x7F
    return bits.view(_ML[fmt])


def np_e4m3_encode(x):
    return np_fp8_encode(x, E4M3)


def np_e2m1_encode(x):
    """Nearest value of the e2m1 table, ties to the even code (mantissa bit 0), saturate at 6, sign bit 0x8."""
    v = _f64(x)
    a = np.minimum(np.abs(v), 6.0)
    dist = np.abs(a[..., None] - E2M1_VALUES)
    best = dist.min(axis=-1, keepdims=True)
    cand = dist == best                                # one or two (tie) candidates
    even = cand & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1)).astype(np.uint8)
    code = idx | (np.signbit(v).astype(np.uint8) << 3)
    return np.where(np.isnan(v), np.uint8(7), code).astype(np.uint8)


def np_e2m1_decode(codes):
    c = np.asarray(codes, np.uint8)
    mag = E2M1_VALUES[c & 7]
    return np.where(c & 8, -mag, mag).astype(np.float32)


def np_pack_fp4(codes):
    c = np.asarray(codes, np.uint8)
    return ((c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)).astype(np.uint8)


def np_unpack_fp4(packed):
    p = np.asarray(packed, np.uint8)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def np_decode(data, dtype):
    """storage -> float32 (fp4: packed uint8 (..., K//2) -> (..., K); fp8 may be uint8 bits)."""
    if dtype == E2M1:
        return np_e2m1_decode(np_unpack_fp4(data))
    if dtype == E8M0:
        return np_e8m0_decode(np.asarray(data).view(np.uint8))
    if dtype in _ML:
        return np.asarray(data).view(np.uint8).view(_ML[dtype]).astype(np.float32)
    return np.asarray(data).astype(np.float32)


def np_sf_decode(s, sf_dtype):
    """scale-factor codes -> float32 values (e8m0: 2^(e-127), 0xFF NaN; e4m3: fp8 value)."""
    s = np.asarray(s).view(np.uint8)
    return np_e8m0_decode(s) if sf_dtype == E8M0 else s.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------------
# block quantization
# ---------------------------------------------------------------------------------------------------------------------

def np_quantize_rows(x, d_dtype, sf_dtype=E8M0, vec=32, norm_const=None):
    """Row quantization (docs/formats.md#row-quantization; e4m3 scales: #nvfp4) on x (R, C): returns
    (codes, s uint8 (R, cdiv(C, vec))).

    codes: ml_dtypes fp8 (R, C) or packed uint8 (R, C//2) for e2m1. scale = min(nc * (1/val(s)), FLT_MAX) with
    1/0 = inf (e4m3 scale 0 -> scale FLT_MAX).
    """
    x = np_flush(x)
    R, C = x.shape
    nkb = np_cdiv(C, vec)
    nc = np.float32(1.0 if norm_const is None else np.asarray(norm_const, np.float32).reshape(()))
    s = np.zeros((R, nkb), np.uint8)
    y = np.zeros_like(x)
    with np.errstate(all="ignore"):
        for j in range(nkb):
            blk = x[:, j * vec:(j + 1) * vec]
            amax = np.abs(blk).max(axis=1)                       # NaN propagates
            pv = np_flush(amax * np_rcp_limit(d_dtype))
            if norm_const is not None:
                pv = np_flush(pv * nc)
            if sf_dtype == E8M0:
                code = np_e8m0_encode(pv)
                scale = _scale_from_e8m0(code, nc)
            else:
                code = np_e4m3_encode(pv).view(np.uint8)
                val = np_sf_decode(code, sf_dtype).astype(np.float64)
                recip = (1.0 / val).astype(np.float32)          # float64 1/v is exact or far from fp32 midpoints
                scale = np.minimum(np_flush(nc * recip), FLT_MAX)
            s[:, j] = code
            y[:, j * vec:(j + 1) * vec] = blk * scale[:, None]
    return _np_encode(y, d_dtype), s


def _np_encode(y, d_dtype):
    if d_dtype == E2M1:
        return np_pack_fp4(np_e2m1_encode(y))
    return np_fp8_encode(y, d_dtype)


def np_quantize_cols(x, d_dtype, norm_const=None):
    """Column quantization (docs/formats.md#column-quantization): 32-row blocks per column, e8m0,
    scale = val(s) == 0 ? 0 : min(nc / val(s), FLT_MAX).

    Returns (codes, s uint8 (C, cdiv(R, 32))): fp8 codes (R, C); e2m1 codes of the transpose, two consecutive rows
    a byte (docs/formats.md#fp4-d-outputs): byte [c, j] = row 2j (low nibble) and row 2j + 1 of column c.
    """
    x = np.asarray(x, np.float32)
    R, C = x.shape
    nc = np.float32(1.0 if norm_const is None else np.asarray(norm_const, np.float32).reshape(()))
    s = np.zeros((C, np_cdiv(R, 32)), np.uint8)
    with np.errstate(all="ignore"):
        for i in range(s.shape[1]):
            amax = np.abs(x[32 * i:32 * i + 32, :]).max(axis=0)
            pv = (amax * np_rcp_limit(d_dtype)).astype(np.float32)
            if norm_const is not None:
                pv = (pv * nc).astype(np.float32)
            s[:, i] = np_e8m0_encode(pv)
    y = _np_col_scaled(x, s, norm_const)
    if d_dtype == E2M1:
        nib = np_e2m1_encode(y)                                     # (R, C) nibbles
        return ((nib[0::2, :] & 0xF) | ((nib[1::2, :] & 0xF) << 4)).T.astype(np.uint8).copy(), s
    return _np_encode(y, d_dtype), s


def _np_col_scaled(x, s, norm_const):
    """x * scale with the column rule's scale = val(s) == 0 ? 0 : min(nc / val(s), FLT_MAX); e8m0 val is never 0, and
    nc / 2^(e-127) = nc * 2^(127-e) exactly (then rounded once, flushed)."""
    nc = np.float32(1.0 if norm_const is None else np.asarray(norm_const, np.float32).reshape(()))
    scale = _scale_from_e8m0(s, nc)                                 # (C, nb)
    with np.errstate(all="ignore"):
        per_elem = np.repeat(scale, 32, axis=1)[:, :x.shape[0]].T
        return (np_flush(x) * per_elem).astype(np.float32)


def np_dequantize(codes, s, data_dtype, sf_dtype, vec):
    """val(codes) * val(s) (exact in float64), rounded to fp32 and flushed like formats.dequantize."""
    vals = np_decode(codes, data_dtype).astype(np.float64)
    sv = np_sf_decode(s, sf_dtype).astype(np.float64)
    return np_flush(vals * np.repeat(sv, vec, axis=-1)[..., :vals.shape[-1]])


# ---------------------------------------------------------------------------------------------------------------------
# scale-factor layout (docs/formats.md byte-offset formula applied element by element; no reshape tricks)
# ---------------------------------------------------------------------------------------------------------------------

def np_sf_offset(r, kb, l, rows, n_kblocks):
    Rb, Kb = np_cdiv(rows, 128), np_cdiv(n_kblocks, 4)
    return (l * (Rb * Kb * 512) + (r // 128) * (Kb * 512) + (kb // 4) * 512
            + (r % 32) * 16 + ((r // 32) % 4) * 4 + (kb % 4))


def np_pack_sf(s):
    """(L, R, nkb) or (R, nkb) uint8 -> flat uint8 of L*Rb*Kb*512 bytes, zero padding (reshape to
    (L, cdiv(R, 128), cdiv(nkb, 4), 32, 4, 4) for the 6-D physical array)."""
    s = np.asarray(s).view(np.uint8)
    if s.ndim == 2:
        s = s[None]
    L, R, nkb = s.shape
    buf = np.zeros(L * np_cdiv(R, 128) * np_cdiv(nkb, 4) * 512, np.uint8)
    l, r, kb = np.meshgrid(np.arange(L), np.arange(R), np.arange(nkb), indexing="ij")
    off = np_sf_offset(r, kb, l, R, nkb)
    assert len(np.unique(off)) == off.size                     # the layout is injective
    buf[off] = s[l, r, kb]
    return buf


def np_unpack_sf(buf, rows, n_kblocks, num_groups=1):
    buf = np.asarray(buf).view(np.uint8).reshape(-1)
    l, r, kb = np.meshgrid(np.arange(num_groups), np.arange(rows), np.arange(n_kblocks), indexing="ij")
    return buf[np_sf_offset(r, kb, l, rows, n_kblocks)]


def np_segment_bounds(ends):
    ends = np.asarray(ends, np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    return starts, ends


def np_pack_sf_segments(s, ends, vec):
    """Segmented layout (docs/formats.md#segmented-layout): segment g = SF(R, T_g) at byte rup(R,128)*start_g//vec,
    local block j <- s[:, start_g//vec + j].

    Sequential writes in group order with the spec's per-segment offset formula. Meant for valid ends (non-
    decreasing, in [0, T]); with overlapping segments later groups overwrite earlier ones.
    """
    s = np.asarray(s).view(np.uint8)
    R, NT = s.shape
    buf = np.zeros(np_cdiv(R, 128) * 128 * np_cdiv(NT, 4) * 4, np.uint8)
    for r, col, off in _np_segment_places(R, ends, vec):
        buf[off] = s[r, col]
    return buf


def np_unpack_sf_segments(flat, rows, ends, total_tokens, vec):
    flat = np.asarray(flat).view(np.uint8).reshape(-1)
    out = np.zeros((rows, np_cdiv(total_tokens, vec)), np.uint8)
    for r, col, off in _np_segment_places(rows, ends, vec):
        out[r, col] = flat[off]
    return out


def _np_segment_places(rows, ends, vec):
    """Per non-empty group: (row, logical k-block column, byte offset) grids of its segment."""
    Rp = np_cdiv(rows, 128) * 128
    starts, ends = np_segment_bounds(ends)
    for g in range(len(ends)):
        nb = np_cdiv(int(ends[g] - starts[g]), vec)
        if nb == 0:
            continue
        Kb_g = np_cdiv(nb, 4)
        base = Rp * int(starts[g]) // vec
        r, j = np.meshgrid(np.arange(rows), np.arange(nb), indexing="ij")
        off = (base + (r // 128) * Kb_g * 512 + (j // 4) * 512
               + (r % 32) * 16 + ((r // 32) % 4) * 4 + j % 4)
        yield r, int(starts[g]) // vec + j, off


# ---------------------------------------------------------------------------------------------------------------------
# convenience
# ---------------------------------------------------------------------------------------------------------------------

def np_to_block_scaled(x, data_dtype, sf_dtype=E8M0, vec=32):
    """x (R, K) or (L, N, K) -> (codes, flat sf bytes) with norm_const 1."""
    x = np.asarray(x, np.float32)
    xs = x[None] if x.ndim == 2 else x
    pairs = [np_quantize_rows(xi, data_dtype, sf_dtype, vec) for xi in xs]
    codes = np.stack([c for c, _ in pairs])
    s = np.stack([s for _, s in pairs])
    return (codes[0] if x.ndim == 2 else codes), np_pack_sf(s)
