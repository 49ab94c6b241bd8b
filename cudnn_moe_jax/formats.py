"""Block-scaled number formats, quantization rules and the MMA-tiled scale-factor layout.

This module is the only home of (documented in ``docs/formats.md``):
  * the element codecs (e8m0 RCEIL, e4m3 / e5m2 / e2m1 RNE-satfinite; #element-formats, #rounding),
  * the block quantization rules: rows, columns and NVFP4 with e4m3 scale factors (#quantization),
  * the scale-factor byte layout (the 512-byte 128x4 atoms, #scale-factor-layout) and the per-expert segment
    layout (#segmented-layout),
  * the block-scaled format names -- "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4", "nvfp4_e8m0" -- and what each fixes
    (data dtype, scale dtype, vec; `BLOCK_FORMATS`, #block-scaled-inputs).

Everything is pure jnp and jit-able on any backend; dtype names and block sizes are static Python values.
Scale factors are handled as **uint8 bit patterns** (e8m0 code = biased exponent, e4m3 code = fp8 bits); inputs
typed ``float8_e8m0fnu`` / ``float8_e4m3fn`` are bit-cast, never value-converted.

Facts that shaped the implementation (measured with jax/jaxlib 0.10.2 on CPU):
  * XLA's f32 -> float8_e4m3fn / float8_e5m2 ``convert`` is single-rounding RNE (agrees with ml_dtypes on every f32
    pattern we tried, ties and subnormal results included) but it does NOT saturate: |x| beyond the largest finite
    value after rounding gives NaN (e4m3) or inf (e5m2). It is also a backend detail we cannot see from here, so the
    encoders below round bitwise themselves and only use ``convert`` on values already on the fp8 grid (exact on
    every backend, even one that converts through f16).
  * XLA's f32 -> float8_e8m0fnu ``convert`` rounds to nearest and maps 0 and inf to 0xFF (NaN); the spec needs
    RCEIL with 0 -> 0x00 and inf -> 0xFE, hence the bit rule of ``e8m0_encode``.
  * XLA:CPU flushes fp32 subnormals (FTZ and DAZ: ``x * 2`` of 1e-40 is 0, ``1e-40 > 0`` is False); XLA:GPU does not
    by default. So that every backend quantizes alike, the quantizers flush explicitly, by bits, at fixed points
    (input data, pv after each multiply, the scale): values below 2^-126 count as 0 there. This only touches the
    regime the spec says to ignore: amax below ~1e-35, and blocks containing +-inf (s = 0xFE, scale
    norm_const * 2^-127 is subnormal for norm_const < 2 and flushes to 0 -- as the kernel's flushing reciprocal
    does -- so the inf element encodes NaN and the rest 0). The element codecs themselves are exact (integer bit
    rules, immune to FTZ).
  * XLA's elementwise ``max``/``min``/``clamp`` propagate NaN, but XLA:CPU's vectorised reduce-max does NOT
    reliably (a (200, 7, 32) -> (200, 7) max returned 7.0 for a block [7, 0, 0, NaN, ...]); amax propagates NaN
    explicitly.

Decisions where the spec leaves room:
  * NaN -> e4m3 / e5m2 code 0x7F (positive canonical NaN, sign dropped).
  * e2m1 has no NaN: NaN -> code 0x7 (+6). A NaN block always has a NaN scale factor (e8m0 0xFF, e4m3 0x7F), so
    the dequantized block is NaN whatever the code. -0 and negative values that round to 0 keep the sign (0x8).
  * e8m0 code 0x00 decodes to 2^-127 exactly; its reciprocal is 2^127 (correctly rounded, finite). The Blackwell
    kernel's approximate reciprocal flushes it to 0 (scale FLT_MAX); that only differs for non-zero blocks with
    pv <= 2^-127, which the spec says to ignore.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from .limits import FP8_DTYPES, SF_DTYPES, values_per_byte
from .offsets import search_sorted

E4M3, E5M2, E2M1, E8M0 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu"
BF16, F16, F32 = "bfloat16", "float16", "float32"

# e5m2 outputs use the documented q_max 57344 (cuDNN's code uses 128); docs/formats.md#quantization.
Q_MAX = {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}
FLT_MAX = float(np.finfo(np.float32).max)

# (mantissa bits, exponent of the smallest normal, largest finite) of each data format: enough to round to its grid.
_GRID = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0), E2M1: (1, 0, 6.0)}
_JNP_DTYPE = {E4M3: jnp.float8_e4m3fn, E5M2: jnp.float8_e5m2, E8M0: jnp.float8_e8m0fnu,
              BF16: jnp.bfloat16, F16: jnp.float16, F32: jnp.float32}
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# What each dtype argument accepts: storage formats that decode to fp32, block-quantized data, scale factors.
_DECODABLE = (E4M3, E5M2, E2M1, E8M0, BF16, F16, F32)
_BLOCK_DATA = FP8_DTYPES + (E2M1,)
_SF = SF_DTYPES

# Correctly rounded fp32 reciprocals of the 256 e4m3 codes (IEEE fp32 division done once here, so that no backend's
# division mode can change a scale); 1/0 = inf so that min(norm_const * inf, FLT_MAX) gives the spec's FLT_MAX.
with np.errstate(divide="ignore"):
    _E4M3_RECIP = np.float32(1.0) / np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def exact_in_float16(ab_dtype: str, sf_dtype) -> bool:
    """Whether every code of block-scaled data times its block scale is an fp16 value exactly (then an fp16 A pairs
    with the dequantized B in fp16, as a bf16 A does in bf16): e2m1 (<= 2 significant bits, 0.5 .. 6) times an e4m3
    scale (<= 4 bits, 2^-9 .. 448; NaN stays NaN) has <= 5 bits within 2^-10 .. 2688, fp16 normal from 2^-14 to
    65504. An e8m0 scale (2^-127 .. 2^127) or FP8 data with one leaves fp16's range."""
    return ab_dtype == E2M1 and sf_dtype == E4M3


def cdiv(a, b):
    """ceil(a / b) for a >= 0, b > 0. Written -(-a // b): exact for a jax.export symbolic dimension too (the SF
    shapes of a module compiled for the symbolic m, e.g. cdiv(256*m_blocks, 128) = 2*m_blocks)."""
    return -(-a // b)


def rcp_limit(d_dtype) -> float:
    """float32(1 / q_max) for the low-precision data formats, 1.0 for bf16/fp16/fp32 (docs/formats.md#quantization)."""
    d_dtype = dtype_name(d_dtype, "rcp_limit: d_dtype")
    if d_dtype in Q_MAX:
        return float(np.float32(1.0) / np.float32(Q_MAX[d_dtype]))
    return 1.0


_DTYPE_ALIASES = {"bf16": BF16, "fp16": F16, "fp32": F32, "e4m3": E4M3, "e5m2": E5M2, "e8m0": E8M0, "fp4": E2M1,
                  "nvfp4": E2M1, "e2m1": E2M1}


def dtype_name(dtype, arg: str) -> str:
    """The canonical name ('float8_e4m3fn', 'bfloat16', ...) of any dtype spelling: a name or short alias ('e4m3',
    'bf16'), a jnp / numpy / ml_dtypes dtype, or a scalar type such as jnp.float8_e4m3fn.

    The one normaliser of dtype arguments, used by this module and by the public ops (`arg` names the argument in
    the error), so both accept the same spellings.
    """
    if dtype is None:
        raise TypeError(f"{arg}: a dtype is required")
    if isinstance(dtype, str):
        dtype = _DTYPE_ALIASES.get(dtype, dtype)
    try:
        return jnp.dtype(dtype).name
    except TypeError as exc:
        raise TypeError(f"{arg}: {dtype!r} is not a dtype (pass a name such as 'float8_e4m3fn' or a dtype such as "
                        "jnp.float8_e4m3fn)") from exc


def _dtype_choice(fn: str, arg: str, value, allowed) -> str:
    """dtype_name(value) if it is one of `allowed`, else a ValueError naming the function and the argument."""
    name = dtype_name(value, f"{fn}: {arg}")
    if name not in allowed:
        raise ValueError(f"{fn}: {arg}={value!r} ({name}) is not supported: expected one of {sorted(allowed)}")
    return name


# --------------------------------------------------------------------------------------------------------------------
# Bit helpers
# --------------------------------------------------------------------------------------------------------------------

def _f32_bits(x):
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def _bits_f32(b):
    return lax.bitcast_convert_type(jnp.asarray(b).astype(jnp.uint32), jnp.float32)


def _flush(x):
    """fp32 subnormals -> signed zero, decided on the bits (same result with or without hardware FTZ/DAZ)."""
    b = _f32_bits(x)
    return _bits_f32(jnp.where((b & 0x7F800000) == 0, b & jnp.uint32(0x80000000), b))


def _pow2(k):
    """2.0**k as fp32 for int32 k in [-126, 127], built from the exponent field (exact, no transcendental)."""
    return _bits_f32((k + 127).astype(jnp.uint32) << 23)


def as_u8(x):
    """View 1-byte scale factors / fp8 data (any float8 dtype or uint8) as uint8 bit patterns."""
    x = jnp.asarray(x)
    if x.dtype == jnp.uint8:
        return x
    if x.dtype.itemsize != 1:
        raise TypeError(f"expected a 1-byte dtype (uint8 or float8), got {x.dtype}")
    return lax.bitcast_convert_type(x, jnp.uint8)


# --------------------------------------------------------------------------------------------------------------------
# Element codecs (docs/formats.md#element-formats, #rounding)
# --------------------------------------------------------------------------------------------------------------------

def e8m0_encode(x_f32):
    """fp32 -> e8m0 code (uint8), round toward +inf ("RCEIL"), the closed form of docs/formats.md#rounding.

    x <= 2^-127 (incl. +-0 and every negative value) -> 0x00; NaN -> 0xFF; otherwise min(E + (M != 0), 254),
    E/M = exponent/mantissa fields (subnormals in (2^-127, 2^-126) -> 0x01, +inf and huge values -> 0xFE).
    Integer compares on the bits: immune to any flush-to-zero of fp32 subnormals.
    """
    b = _f32_bits(x_f32)
    e, m = (b >> 23) & 0xFF, b & 0x7FFFFF
    code = jnp.minimum(e + (m != 0).astype(jnp.uint32), 254)
    tiny = ((b >> 31) == 1) | (b <= 0x00400000)          # negative, or 0 <= x <= 2^-127 (bits of 2^-127: 0x00400000)
    nan = (e == 255) & (m != 0)
    return jnp.where(nan, 255, jnp.where(tiny, 0, code)).astype(jnp.uint8)


def e8m0_decode(u8):
    """e8m0 code -> fp32 2^(e-127); 0x00 -> 2^-127 (an exact fp32 subnormal), 0xFF -> NaN."""
    e = as_u8(u8).astype(jnp.uint32)
    b = jnp.where(e == 0, 0x00400000, jnp.where(e == 255, 0x7FC00000, e << 23))
    return _bits_f32(b)


def _mul_exp2(v, k):
    """v * 2^k for int32 k in [-127, 127], exact whenever the result is a normal fp32 number; subnormal results
    flush to signed zero. 2^-127 itself is an fp32 subnormal (a flushing backend reads it as 0), so k = -127 is
    applied as 2^-126 then 0.5."""
    hi = _pow2(jnp.maximum(k, -126))
    lo = jnp.where(k < -126, jnp.float32(0.5), jnp.float32(1.0))
    return _flush((v * hi) * lo)


def _round_to_grid(x_f32, fmt):
    """RNE-satfinite rounding of fp32 to the value grid of `fmt`, returned as fp32 (on the grid; NaN kept).

    Clamp first: rounding is monotone and +-q_max is on the grid, so clamp-then-round == round-then-saturate.
    Then with e = max(floor(log2|x|), emin) the grid spacing around x is 2^(e - mbits); scaling by its inverse,
    rounding half-to-even to an integer and scaling back are all exact (powers of two, no over/underflow), so the
    only rounding is the single RNE that the spec asks for -- the same for normal and subnormal results.
    """
    mbits, emin, qmax = _GRID[fmt]
    x = jnp.clip(jnp.asarray(x_f32, jnp.float32), -qmax, qmax)
    e = ((_f32_bits(x) >> 23) & 0xFF).astype(jnp.int32) - 127       # -127 for 0 / f32 subnormals, 128 for NaN
    e = jnp.clip(e, emin, 64)
    return jnp.round(x * _pow2(mbits - e)) * _pow2(e - mbits)        # jnp.round = round-half-to-even


def _fp8_encode(x_f32, fmt):
    y = _round_to_grid(x_f32, fmt)
    # y is exactly representable, so convert cannot round (whatever path a backend takes); canonicalise NaN.
    bits = as_u8(y.astype(_JNP_DTYPE[fmt]))
    bits = jnp.where(jnp.isnan(y), jnp.uint8(0x7F), bits)
    return lax.bitcast_convert_type(bits, _JNP_DTYPE[fmt])


def e4m3_encode(x_f32):
    """fp32 -> float8_e4m3fn, RNE, saturating to +-448; NaN -> 0x7F."""
    return _fp8_encode(x_f32, E4M3)


def e5m2_encode(x_f32):
    """fp32 -> float8_e5m2, RNE, saturating to +-57344 (inf too); NaN -> 0x7F."""
    return _fp8_encode(x_f32, E5M2)


def e2m1_encode(x_f32):
    """fp32 -> e2m1 nibble codes (uint8 0..15): RNE to {0,.5,1,1.5,2,3,4,6}, saturate at 6, sign bit 0x8.

    -0 and negatives rounding to zero -> 0x8 (sign kept, as a bit-level converter does); NaN -> 0x7 (+6).
    """
    x = jnp.asarray(x_f32, jnp.float32)
    y = jnp.abs(_round_to_grid(x, E2M1))
    mag = sum((y >= v).astype(jnp.uint8) for v in _E2M1_VALUES[1:])   # index of y in the value table
    sign = ((_f32_bits(x) >> 31).astype(jnp.uint8)) << 3
    return jnp.where(jnp.isnan(x), jnp.uint8(0x7), sign | mag).astype(jnp.uint8)


def _e2m1_bits_f32(nib):
    """e2m1 codes (uint32 0..15) -> fp32, placed straight into fp32 bits (integer work XLA fuses into its consumer;
    a table gather runs at a quarter of memory speed on the GPU, RESULTS run 84): s e e m is +-2^(e-1) (1 + m/2),
    or +-m/2 for e = 0."""
    e, m = (nib >> 1) & 3, nib & 1
    mag = jnp.where(e == 0, m * jnp.uint32(0x3F000000), ((e + 126) << 23) | (m << 22))
    return _bits_f32(mag | ((nib & 8) << 28))


def e2m1_decode(codes_u8):
    """e2m1 nibble codes (uint8, high nibble ignored) -> fp32 values."""
    return _e2m1_bits_f32(jnp.asarray(codes_u8).astype(jnp.uint32) & 0xF)


def pack_fp4(codes):
    """(..., K) nibble codes -> (..., K//2) uint8: element 2j in the low nibble, 2j+1 in the high nibble
    (docs/formats.md#fp4-packing)."""
    codes = jnp.asarray(codes).astype(jnp.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dimension {codes.shape[-1]} must be even")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed):
    """(..., K//2) uint8 -> (..., K) nibble codes (inverse of pack_fp4)."""
    packed = as_u8(packed)
    lo, hi = packed & 0xF, packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def decode(data, data_dtype):
    """Storage array -> fp32 values. fp8 data may be typed or uint8 bits; fp4 is packed uint8 (..., K//2) -> (..., K)."""
    data_dtype = _dtype_choice("decode", "data_dtype", data_dtype, _DECODABLE)
    if data_dtype == E2M1:   # each byte read twice by a broadcast, not unpacked into a stacked copy
        packed = as_u8(data)
        shape = packed.shape[:-1] + (2 * packed.shape[-1],)
        pairs = jnp.broadcast_to(packed[..., None], packed.shape + (2,)).reshape(shape).astype(jnp.uint32)
        high = lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1) & 1
        return _e2m1_bits_f32((pairs >> (high << 2)) & 0xF)
    if data_dtype == E8M0:
        return e8m0_decode(data)
    if data_dtype in (E4M3, E5M2):
        data = lax.bitcast_convert_type(as_u8(data), _JNP_DTYPE[data_dtype])
    return jnp.asarray(data).astype(jnp.float32)        # widening to fp32 is exact


# --------------------------------------------------------------------------------------------------------------------
# Scale-factor layout (docs/formats.md#scale-factor-layout)
# --------------------------------------------------------------------------------------------------------------------

SF_ATOM_ROWS = 128    # rows of one scale-factor atom
SF_ATOM_KBLOCKS = 4   # k-blocks of one atom
SF_ATOM_BYTES = 512   # = SF_ATOM_ROWS * SF_ATOM_KBLOCKS


def sf_physical_shape(rows, k, vec, num_groups=1) -> tuple:
    """C-contiguous physical shape (L, Rb, Kb, 32, 4, 4) of the scale factors of a (rows, k) operand. `rows` and
    `k` may be jax.export symbolic dimensions."""
    return (num_groups, cdiv(rows, SF_ATOM_ROWS), cdiv(cdiv(k, vec), SF_ATOM_KBLOCKS), 32, 4, 4)


def sf_segment_bytes(rows, tokens, vec) -> int:
    """Bytes of a per-expert segment SF buffer over `tokens` tokens (docs/formats.md#segmented-layout): the size of
    the contiguous layout of (rows, tokens), rup(rows, 128) * rup(cdiv(tokens, vec), 4)."""
    return cdiv(rows, SF_ATOM_ROWS) * SF_ATOM_ROWS * cdiv(cdiv(tokens, vec), SF_ATOM_KBLOCKS) * SF_ATOM_KBLOCKS


# The two helpers below are the layout's formula. They use shifts and masks only, so the same function serves
# Python ints, numpy / jnp integer arrays and the kernels' device integers (for the non-negative coordinates they
# take, `>>` / `&` are `//` / `%`, without the sign fix-ups a device floor division costs).
def sf_atom_start(row_block, kb_atom, kb_atoms):
    """Byte offset of the atom (128-row block `row_block`, k-block quad `kb_atom`) in a layout `kb_atoms` quads
    wide (atoms are row-block major)."""
    return (row_block * kb_atoms + kb_atom) * SF_ATOM_BYTES


def sf_atom_byte(r0, r1, kb0):
    """Byte of row r = 32 * r1 + r0 (r0 < 32, r1 < 4) of a 128-row block and k-block kb0 (< 4) of a quad inside
    their atom: the 32 x 4 x 4 interleave, 16 bytes per r0."""
    return r0 * 16 + r1 * 4 + kb0


def sf_row_byte(r, kb):
    """Byte of row r and k-block kb inside their atom (only r % 128 and kb % 4 count): `sf_atom_byte` of the row
    split r0 = r % 32, r1 = (r // 32) % 4."""
    return sf_atom_byte(r & 31, (r >> 5) & 3, kb & 3)


def sf_atom_coords(w):
    """Inverse of `sf_row_byte`: (row in the 128-row block, k-block in the quad) of byte `w` (< 512) of an atom."""
    return (w >> 4) + ((w >> 2) & 3) * 32, w & 3


def sf_offset(r, kb, l, rows, n_kblocks):
    """Byte offset of logical S[l, r, kb] (docs/formats.md#scale-factor-layout); Python ints, numpy or jnp integer
    arrays."""
    rb_n, kb_n = cdiv(rows, SF_ATOM_ROWS), cdiv(n_kblocks, SF_ATOM_KBLOCKS)
    return l * (rb_n * kb_n * SF_ATOM_BYTES) + sf_atom_start(r >> 7, kb >> 2, kb_n) + sf_row_byte(r, kb)


# Axis order that turns (L, Rb, r1=4, r0=32, Kb, kb0=4) into memory order (L, Rb, Kb, r0, r1, kb0); it is its own
# inverse (swaps axes 2 and 4). r = rb*128 + r1*32 + r0: r1 is the slow half of the row index but the fast one in
# memory -- the 32x4 interleave that lets one 16-byte load per row feed the MMA.
_SF_PERM = (0, 1, 4, 3, 2, 5)


def pack_sf(s):
    """Logical scales (L, R, nkb) or (R, nkb) [-> L = 1] -> physical uint8 (L, Rb, Kb, 32, 4, 4), padding 0x00."""
    s = as_u8(s)
    if s.ndim == 2:
        s = s[None]
    num_groups, rows, nkb = s.shape
    rb_n, kb_n = cdiv(rows, 128), cdiv(nkb, 4)
    s = jnp.pad(s, ((0, 0), (0, rb_n * 128 - rows), (0, kb_n * 4 - nkb)))
    return s.reshape(num_groups, rb_n, 4, 32, kb_n, 4).transpose(_SF_PERM)


def unpack_sf(buf, rows, n_kblocks, num_groups=1):
    """Physical scales (6-D or flat 1-D, uint8 or a float8 dtype) -> logical uint8 (L, rows, n_kblocks)."""
    rb_n, kb_n = cdiv(rows, 128), cdiv(n_kblocks, 4)
    buf = as_u8(buf)
    if buf.size != num_groups * rb_n * kb_n * SF_ATOM_BYTES:
        raise ValueError(f"unpack_sf: buffer has {buf.size} bytes, expected "
                         f"{num_groups * rb_n * kb_n * SF_ATOM_BYTES} for rows={rows}, n_kblocks={n_kblocks}, "
                         f"num_groups={num_groups}")
    s = buf.reshape(num_groups, rb_n, kb_n, 32, 4, 4).transpose(_SF_PERM)
    return s.reshape(num_groups, rb_n * 128, kb_n * 4)[:, :rows, :n_kblocks]


# --------------------------------------------------------------------------------------------------------------------
# Per-expert segment layout (docs/formats.md#segmented-layout: discrete_col_sfd, wgrad operands, colwise SFRHT)
# --------------------------------------------------------------------------------------------------------------------

def _segments(ends, max_token, rows, vec):
    """Sanitize token ends (device data) and derive per-segment geometry, all int32 (L,).

    Returns starts, ends, nkb (k-blocks of the segment), kb_n (4-block atoms), base (first byte).
    """
    ends = lax.cummax(jnp.clip(jnp.asarray(ends).astype(jnp.int32), 0, max_token), axis=0)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    nkb = cdiv(ends - starts, vec)
    kb_n = cdiv(nkb, 4)
    # base = rup(rows,128) * start // vec, split so that no int32 intermediate exceeds the buffer size.
    rows_pad = cdiv(rows, 128) * 128
    base = (rows_pad // vec) * starts + ((rows_pad % vec) * starts) // vec
    return starts, ends, nkb, kb_n, base


def pack_sf_segments(s, ends, vec):
    """Logical scales (R, cdiv(T, vec)) over all T tokens -> flat uint8 per-expert segment layout
    (docs/formats.md#segmented-layout).

    Segment g (tokens [start_g, end_g)) is the MMA-tiled layout of SF(R, T_g) (L = 1) starting at byte
    rup(R,128) * start_g // vec; its local k-block j holds s[:, start_g // vec + j]. Total bytes
    rup(R,128) * rup(cdiv(T,vec), 4). `ends` is device data: it is sanitized (clip to [0, T'], running max; the
    identity for valid ends) and the buffer is built by a gather, so no value can index out of bounds.
    Valid layouts (every start a multiple of vec, every non-last T_g a multiple of 4*vec -- always true for
    multiples of 256) have disjoint segments. Otherwise segments overlap; then, deterministically, byte p belongs to
    the last non-empty segment whose base is <= p (zero where that segment has padding). Bytes past the last
    segment are 0.
    """
    s = as_u8(s)
    rows, n_tok_blocks = s.shape
    rb_n = cdiv(rows, SF_ATOM_ROWS)
    total = sf_segment_bytes(rows, n_tok_blocks * vec, vec)
    starts, _, nkb, kb_n, base = _segments(ends, n_tok_blocks * vec, rows, vec)
    n_groups = base.shape[0]

    p = jnp.arange(total, dtype=jnp.int32)
    g_last = search_sorted(base, p, side="right") - 1     # base[0] == 0, so >= 0
    last_nonempty = lax.cummax(jnp.where(nkb > 0, jnp.arange(n_groups, dtype=jnp.int32), -1), axis=0)
    owner = last_nonempty[g_last]
    g = jnp.maximum(owner, 0)
    q = p - base[g]                                      # byte offset inside the owner's SF(R, T_g) block
    atom_row = jnp.maximum(kb_n[g], 1) * SF_ATOM_BYTES   # bytes per 128-row block of the segment
    rb, ka, w = q // atom_row, (q % atom_row) // SF_ATOM_BYTES, q % SF_ATOM_BYTES
    r_in, kb0 = sf_atom_coords(w)
    r, j = rb * SF_ATOM_ROWS + r_in, ka * SF_ATOM_KBLOCKS + kb0
    valid = (owner >= 0) & (rb < rb_n) & (r < rows) & (j < nkb[g])
    col = starts[g] // vec + j
    val = s[jnp.clip(r, 0, rows - 1), jnp.clip(col, 0, n_tok_blocks - 1)]
    return jnp.where(valid, val, jnp.uint8(0))


def unpack_sf_segments(flat, rows, ends, total_tokens, vec):
    """Inverse of pack_sf_segments: flat bytes -> logical uint8 (rows, cdiv(T, vec)); blocks in no segment -> 0.

    Global k-block t belongs to the segment containing its first token t*vec and is its local block
    t - start_g // vec.
    """
    flat = as_u8(flat).reshape(-1)
    n_tok_blocks = cdiv(total_tokens, vec)
    starts, ends, nkb, kb_n, base = _segments(ends, total_tokens, rows, vec)
    n_groups = ends.shape[0]
    t = jnp.arange(n_tok_blocks, dtype=jnp.int32)
    g_raw = search_sorted(ends, t * vec, side="right")   # first g with end_g > token
    g = jnp.minimum(g_raw, n_groups - 1)
    j = t - starts[g] // vec
    valid = (g_raw < n_groups) & (j >= 0) & (j < nkb[g])
    r = jnp.arange(rows, dtype=jnp.int32)[:, None]
    off = base[g] + sf_atom_start(r >> 7, j >> 2, kb_n[g]) + sf_row_byte(r, j)
    val = flat[jnp.clip(off, 0, flat.shape[0] - 1)]
    return jnp.where(valid[None, :], val, jnp.uint8(0))


def segment_token_scales(flat, rows, ends, total_tokens, vec, token_major=False):
    """The scale byte of every (row, token) as a reader of per-expert segments takes it (wgrad's sfa / sfb,
    docs/formats.md#segmented-layout): token t of expert g reads local k-block (t - start_g) // vec of segment g
    -- the blocks of SF(R, T_g) start at the expert's first token. (rows, T) uint8; tokens in no expert and bytes
    past the buffer (segments of unaligned ends can run off its end) read 0.

    `token_major` (same values): the consumer runs over rows fastest (a token-major operand), so the per-block
    bytes are gathered as (blocks, rows) and a token's scales are one contiguous row of them; the default
    orientation (rows, blocks) suits a token-contiguous consumer. On the GPU the wrong one costs the
    dequantize-first route up to 2.3x (RESULTS run 92).

    For starts that are multiples of vec this is `unpack_sf_segments` repeated over each block's tokens."""
    flat = as_u8(flat).reshape(-1)
    starts, ends, nkb, kb_n, base = _segments(ends, total_tokens, rows, vec)
    n_groups = ends.shape[0]
    # every (segment, local block) once: block b of the list is local block b - first[g] of segment g
    first = jnp.cumsum(nkb) - nkb
    b = jnp.arange(cdiv(total_tokens, vec) + n_groups, dtype=jnp.int32)       # >= sum(nkb)
    bg = jnp.minimum(search_sorted(first + nkb, b, side="right"), n_groups - 1)
    j, r = b - first[bg], jnp.arange(rows, dtype=jnp.int32)
    j, bg, r = (j[:, None], bg[:, None], r[None, :]) if token_major else (j, bg, r[:, None])
    off = base[bg] + sf_atom_start(r >> 7, j >> 2, kb_n[bg]) + sf_row_byte(r, j)     # (rows, blocks) / transposed
    blocks = jnp.where((j < nkb[bg]) & (off < flat.shape[0]), flat[jnp.clip(off, 0, flat.shape[0] - 1)],
                       jnp.uint8(0))
    t = jnp.arange(total_tokens, dtype=jnp.int32)
    g_raw = search_sorted(ends, t, side="right")        # first g with end_g > t
    g = jnp.minimum(g_raw, n_groups - 1)
    block = jnp.clip(first[g] + (t - starts[g]) // vec, 0, b.shape[0] - 1)
    if token_major:
        return jnp.where((g_raw < n_groups)[:, None], blocks[block], jnp.uint8(0)).T
    return jnp.where((g_raw < n_groups)[None, :], blocks[:, block], jnp.uint8(0))


# --------------------------------------------------------------------------------------------------------------------
# Block quantization (docs/formats.md#quantization: rows, columns, NVFP4)
# --------------------------------------------------------------------------------------------------------------------

def _encode(y, d_dtype):
    """fp32 (already scaled) -> storage: fp8 arrays, or packed uint8 (..., C//2) for e2m1."""
    if d_dtype == E4M3:
        return e4m3_encode(y)
    if d_dtype == E5M2:
        return e5m2_encode(y)
    return pack_fp4(e2m1_encode(y))


def _scaled_rows(x, d_dtype, sf_dtype, vec, norm_const):
    """Shared core of the row and column rules: returns (x * scale (..., R, C) fp32, s codes (..., R, nkb) uint8).

    pv = (amax * rcp_limit) * norm_const in this fp32 order (the kernel's, docs/formats.md#row-quantization);
    scale = min(norm_const * 1/val(s), FLT_MAX) with the correctly rounded reciprocal (1/0 = inf: scale FLT_MAX);
    NaN propagates through max, multiply and min. Subnormal intermediates flush to zero (module docstring).
    """
    x = _flush(jnp.asarray(x, jnp.float32))
    cols = x.shape[-1]
    nkb = cdiv(cols, vec)
    # Zero padding leaves amax unchanged (|x| >= 0), so a partial last block is the max over its existing columns.
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nkb * vec - cols)])
    blocks = jnp.abs(xp.reshape(*x.shape[:-1], nkb, vec))
    # NaN must win (docs/formats.md#special-values). XLA:CPU's vectorised reduce-max drops NaN depending on its
    # position (measured), so propagate it explicitly instead of trusting the reduction.
    amax = jnp.where(jnp.isnan(blocks).any(axis=-1), jnp.float32(jnp.nan), jnp.max(blocks, axis=-1))
    pv = _flush(amax * jnp.float32(rcp_limit(d_dtype)))
    nc = None if norm_const is None else jnp.asarray(norm_const, jnp.float32).reshape(())
    if nc is not None:
        pv = _flush(pv * nc)
    if sf_dtype == E8M0:
        # nc * (1/val(s)) = nc * 2^(127-e): applied as an exact power-of-two product (no division, no subnormal
        # operand), so it is the correctly rounded spec value on every backend.
        s = e8m0_encode(pv)
        e = s.astype(jnp.int32)
        scale = _mul_exp2(jnp.float32(1.0) if nc is None else nc, 127 - e)
        scale = jnp.where(e == 255, jnp.float32(jnp.nan), scale)
    else:
        s = as_u8(e4m3_encode(pv))
        recip = jnp.asarray(_E4M3_RECIP)[s.astype(jnp.int32)]   # normal fp32 numbers, or inf for a zero scale
        scale = recip if nc is None else _flush(nc * recip)
    scale = jnp.minimum(scale, jnp.float32(FLT_MAX))
    y = x * jnp.repeat(scale, vec, axis=-1)[..., :cols]
    return y, s


def quantize_rows(x_f32, d_dtype, sf_dtype=E8M0, vec=32, norm_const=None):
    """Row quantization (docs/formats.md#row-quantization, #nvfp4) of x (R, C) (leading batch dims allowed) in
    blocks of `vec` columns.

    Returns (codes, s): codes float8 (R, C) or packed uint8 (R, C//2) for e2m1; s uint8 codes (R, cdiv(C, vec)).
    norm_const None means 1.0 (standard MX / NVFP4 input quantization). Dequantize: val(codes)*val(s)/norm_const.
    """
    d_dtype = _dtype_choice("quantize_rows", "d_dtype", d_dtype, _BLOCK_DATA)
    sf_dtype = _dtype_choice("quantize_rows", "sf_dtype", sf_dtype, _SF)
    if d_dtype == E2M1 and jnp.shape(x_f32)[-1] % 2:
        raise ValueError("quantize_rows: e2m1 data needs an even number of columns (two values per byte)")
    y, s = _scaled_rows(x_f32, d_dtype, sf_dtype, vec, norm_const)
    return _encode(y, d_dtype), s


def quantize_cols(x_f32, d_dtype, norm_const=None):
    """Column quantization (docs/formats.md#column-quantization) of x (R, C): blocks of 32 consecutive rows per
    column, always e8m0.

    Returns (codes, s uint8 (C, cdiv(R, 32))): FP8 codes (R, C), x's shape; e2m1 codes transposed and packed
    along the rows, (C, R//2) -- two consecutive rows (tokens) a byte, the token-contiguous operand wgrad reads
    (docs/formats.md#fp4-d-outputs). The spec's scale = (val(s) == 0) ? 0 : min(norm_const / val(s), FLT_MAX)
    equals the row rule's norm_const * (1/val(s)) here: val(s) is a power of two (never 0 for e8m0), so both are
    the correctly rounded norm_const * 2^(127-e). So the result is the row quantization of x^T.
    """
    d_dtype = _dtype_choice("quantize_cols", "d_dtype", d_dtype, _BLOCK_DATA)
    x = jnp.asarray(x_f32, jnp.float32)
    if d_dtype == E2M1 and x.shape[-2] % 2:
        raise ValueError("quantize_cols: e2m1 data needs an even number of rows (two tokens a byte)")
    y_t, s = _scaled_rows(jnp.swapaxes(x, -1, -2), d_dtype, E8M0, 32, norm_const)
    if d_dtype == E2M1:
        return _encode(y_t, d_dtype), s
    return _encode(jnp.swapaxes(y_t, -1, -2), d_dtype), s


def dequantize(codes, s_logical, data_dtype, sf_dtype, vec):
    """val(codes) * val(s) in fp32: codes (R, C) (e2m1 packed (R, C//2)), s (R, cdiv(C, vec)) -> (R, C).

    Does not divide by norm_const. Exact whenever the result is a normal fp32 number (e8m0 0x00 = 2^-127 is applied
    as an exact power-of-two product, never as a subnormal operand); results below 2^-126 flush to 0.
    """
    sf_dtype = _dtype_choice("dequantize", "sf_dtype", sf_dtype, _SF)
    vals = decode(codes, _dtype_choice("dequantize", "data_dtype", data_dtype, _DECODABLE))
    rep = lambda a: jnp.repeat(a, vec, axis=-1)[..., :vals.shape[-1]]
    if sf_dtype == E4M3:
        return _flush(vals * rep(decode(s_logical, E4M3)))      # e4m3 scale values are normal fp32 numbers
    e = as_u8(s_logical).astype(jnp.int32)
    sv_exp = rep(e)
    return jnp.where(sv_exp == 255, jnp.float32(jnp.nan), _mul_exp2(vals, sv_exp - 127))


# --------------------------------------------------------------------------------------------------------------------
# Convenience for users: operands in the physical form the ops take
# --------------------------------------------------------------------------------------------------------------------

# The block-scaled input formats by name: (data dtype, scale-factor dtype, vec). A name fixes all three, so a buffer
# quantized as "nvfp4" can never carry MXFP4 scales (docs/formats.md#block-scaled-inputs; the ops accept exactly
# these combinations, ops/_checks.resolve_block_format).
BLOCK_FORMATS = {
    "mxfp8": (E4M3, E8M0, 32),
    "mxfp8_e5m2": (E5M2, E8M0, 32),
    "mxfp4": (E2M1, E8M0, 32),
    "nvfp4": (E2M1, E4M3, 16),
    "nvfp4_e8m0": (E2M1, E8M0, 16),
}


def _describe(name: str) -> str:
    data, sf, vec = BLOCK_FORMATS[name]
    return f"{name!r} ({data} data, {sf} scales, vec {vec})"


def block_format(fmt, sf_dtype=None, vec=None, fn: str = "block_format") -> tuple:
    """(data dtype, sf dtype, vec) of a format name (`BLOCK_FORMATS`: 'mxfp8', 'mxfp8_e5m2', 'mxfp4', 'nvfp4',
    'nvfp4_e8m0'), or of a data dtype plus whatever `sf_dtype` / `vec` are given, when exactly one format fits.

    A format name fixes all three: an sf_dtype or vec that contradicts it is an error. A bare data dtype must leave
    no choice: float8_e4m3fn alone is MXFP8, but float4_e2m1fn alone could be MXFP4, NVFP4 or NVFP4-e8m0.
    """
    if sf_dtype is not None:
        sf_dtype = _dtype_choice(fn, "sf_dtype", sf_dtype, _SF)
    if isinstance(fmt, str) and fmt.lower() in BLOCK_FORMATS:
        name = fmt.lower()
        data, sf, v = BLOCK_FORMATS[name]
        if sf_dtype not in (None, sf) or vec not in (None, v):
            raise ValueError(f"{fn}: format {_describe(name)} is fixed by its name; sf_dtype={sf_dtype!r}, "
                             f"vec={vec!r} contradict it: leave them out, or name another format "
                             f"({', '.join(BLOCK_FORMATS)})")
        return data, sf, v
    try:
        data = dtype_name(fmt, f"{fn}: data_dtype")
    except TypeError:
        data = None
    if data not in _BLOCK_DATA:
        raise ValueError(f"{fn}: data_dtype={fmt!r} is neither a block-scaled format ({', '.join(BLOCK_FORMATS)}) "
                         f"nor one of their data dtypes ({', '.join(_BLOCK_DATA)})")
    fits = [n for n, (d, sf, v) in BLOCK_FORMATS.items()
            if d == data and sf_dtype in (None, sf) and vec in (None, v)]
    if not fits:
        raise ValueError(f"{fn}: {data} with sf_dtype={sf_dtype!r}, vec={vec!r} is not a block-scaled format; "
                         f"the formats are {', '.join(map(_describe, BLOCK_FORMATS))}")
    if len(fits) > 1:
        raise ValueError(f"{fn}: {data} with sf_dtype={sf_dtype!r}, vec={vec!r} could be "
                         f"{' or '.join(map(_describe, fits))}: name the format")
    return BLOCK_FORMATS[fits[0]]


def to_block_scaled(x, data_dtype, sf_dtype=None, vec=None):
    """x (R, K) -> (codes, sf (1, Rb, Kb, 32, 4, 4)); x (L, N, K) -> (codes, sf (L, Rb, Kb, 32, 4, 4)).

    `data_dtype` is a format name -- "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4" (e4m3 scales, vec 16) or
    "nvfp4_e8m0" -- which fixes the data dtype, scale dtype and vec (`BLOCK_FORMATS`), or a data dtype in any
    spelling the ops accept ('float8_e4m3fn', 'e4m3', jnp.float8_e4m3fn, ...) with `sf_dtype` / `vec` as needed to
    leave one format (`block_format`). Standard MX / NVFP4 input quantization (norm_const 1). codes are float8
    (FP8) or packed uint8 (FP4, (..., K//2)); sf is uint8 e8m0 bit patterns for e8m0 scales (the ops read uint8
    scales as e8m0, docs/formats.md) and a float8_e4m3fn array for e4m3, so neither can be misread. Runs jitted
    (the format static), so a new shape costs one compile, not seconds of eager dispatch.
    """
    fmt = block_format(data_dtype, sf_dtype, vec, "to_block_scaled")
    x = jnp.asarray(x, jnp.float32)
    if x.ndim not in (2, 3):
        raise ValueError(f"to_block_scaled: x must be (R, K) or (L, N, K), got shape {x.shape}")
    if fmt[0] == E2M1 and x.shape[-1] % 2:
        raise ValueError(f"to_block_scaled: FP4 data needs an even K (two values per byte), got K={x.shape[-1]}")
    return _to_block_scaled(x, *fmt)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _to_block_scaled(x, data_dtype, sf_dtype, vec):
    codes, s = quantize_rows(x, data_dtype, sf_dtype, vec)
    sf = pack_sf(s)
    return codes, (lax.bitcast_convert_type(sf, jnp.float8_e4m3fn) if sf_dtype == E4M3 else sf)


def from_block_scaled(codes, sf_physical, data_dtype, sf_dtype=None, vec=None):
    """Inverse of to_block_scaled: fp32 with the leading shape of codes and the logical K (no division by an op's
    norm_const). Also reads an op's block-scaled outputs back: FP8 D with its SFD_row ("mxfp8" / "mxfp8_e5m2"),
    NVFP4 D with its sfd ("nvfp4", then divide by the op's norm_const).

    The format is resolved as in `to_block_scaled`; with a data dtype and no sf_dtype, the scale dtype is the one
    the buffer records (float8_e4m3fn, or e8m0 for float8_e8m0fnu / uint8). The buffers must agree with the format:
    the codes' dtype, the scales' dtype and the scale buffer's size for (rows, K, vec).
    """
    codes, sf_physical = jnp.asarray(codes), jnp.asarray(sf_physical)
    recorded = E8M0 if sf_physical.dtype == jnp.uint8 else sf_physical.dtype.name  # uint8 holds e8m0 bits
    if recorded not in _SF:
        raise TypeError(f"from_block_scaled: sf_physical has dtype {recorded}, not a scale-factor dtype "
                        "(float8_e8m0fnu, float8_e4m3fn or uint8 e8m0 bits)")
    if sf_dtype is None and not (isinstance(data_dtype, str) and data_dtype.lower() in BLOCK_FORMATS):
        sf_dtype = recorded
    data, sf, vec = block_format(data_dtype, sf_dtype, vec, "from_block_scaled")
    if recorded != sf:
        raise ValueError(f"from_block_scaled: the format has {sf} scales but sf_physical holds {recorded} "
                         "(uint8 buffers hold e8m0 bits)")
    want_codes = "uint8" if data == E2M1 else data
    if codes.dtype.name != want_codes:
        raise TypeError(f"from_block_scaled: {data} codes are stored as {want_codes}, got {codes.dtype.name}")
    if codes.ndim not in (2, 3):
        raise ValueError(f"from_block_scaled: codes must be (R, K) or (L, N, K), got shape {codes.shape}")
    k = codes.shape[-1] * values_per_byte(data)
    num_groups = codes.shape[0] if codes.ndim == 3 else 1
    want = sf_physical_shape(codes.shape[-2], k, vec, num_groups)
    size = sf_physical.size
    if size != int(np.prod(want)):
        other = [n for n, f in BLOCK_FORMATS.items() if f[:2] == (data, sf) and f[2] != vec
                 and int(np.prod(sf_physical_shape(codes.shape[-2], k, f[2], num_groups))) == size]
        hint = f" -- the size of vec {BLOCK_FORMATS[other[0]][2]} scales ({other[0]!r}?)" if other else ""
        raise ValueError(f"from_block_scaled: sf_physical has {size} bytes{hint}; codes {tuple(codes.shape)} at "
                         f"vec {vec} need the shape {want}")
    return _from_block_scaled(codes, sf_physical, data, sf, vec)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _from_block_scaled(codes, sf_physical, data_dtype, sf_dtype, vec):
    k = codes.shape[-1] * values_per_byte(data_dtype)
    s = unpack_sf(sf_physical, codes.shape[-2], cdiv(k, vec), codes.shape[0] if codes.ndim == 3 else 1)
    return dequantize(codes, s if codes.ndim == 3 else s[0], data_dtype, sf_dtype, vec)
