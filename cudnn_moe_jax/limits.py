"""Limits, alignments and dtype sets of the grouped-GEMM problem: one name each, read by the ops' checks, the
operand table, the reference and the kernels' support predicate. Pure Python (nothing imported).

What a backend *implements* is narrower than what the ops accept (the kernels' `config.supports` says which of these
combinations it covers); the sets below are the public contract (docs/ops.md, docs/formats.md).
"""

from __future__ import annotations

# Expert groups along M are padded to this many rows by default (cuDNN's m_aligned / FIX_PAD_SIZE, docs/offsets.md):
# every group end is a multiple of it, so no 128/256-row tile, SF row block or 32-row column-quant block spans two
# groups. It is cuDNN's only value and the ops' default.
GROUP_ALIGN = 256

# The `m_aligned` values the M-grouped ops accept: group ends (and m) are multiples of it. Below 128 the kernels
# clip their M tiles at group ends (docs/offsets.md#group-alignment); 1 is padding-free.
M_ALIGNED_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# The smallest m_aligned of a call with scale-factor operands along M: block-scaled A (128-row SFA atoms) and FP8 /
# FP4 outputs (SFD in 128-row atoms, D_col / SFD_col in 32-row blocks, per-expert SF segments in whole atoms).
SF_GROUP_ALIGN = 128

# Every token count T wgrad accepts is a multiple of this (16-byte rows of 16-bit tokens; FP8 / FP4 need more), so
# one module compiled for T = TOKEN_ALIGN * t_blocks serves them all.
TOKEN_ALIGN = 8


def values_per_byte(dtype: str) -> int:
    """Values one byte of a stored operand holds along its contiguous axis: 2 for packed FP4, else 1."""
    return 2 if dtype == FP4 else 1


def k_align(ab_dtype: str) -> int:
    """What K (wgrad: T) must be a multiple of for 16-byte operand rows: 8 for 16-bit data, 16 for FP8, 32 for
    packed FP4 (docs/ops.md#errors); a wgrad module is compiled for T = k_align * t_blocks."""
    return {FP4: 32, "float8_e4m3fn": 16, "float8_e5m2": 16}.get(ab_dtype, TOKEN_ALIGN)


# Experts (L) per call.
MAX_GROUPS = 1024

FP4 = "float4_e2m1fn"                                   # packed two values a byte (uint8 storage)
HALF_DTYPES = ("bfloat16", "float16")                   # A/B without scale factors
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")           # MXFP8 A/B; FP8 C; FP8 D (with SFD_row, D_col, SFD_col)
SF_DTYPES = ("float8_e8m0fnu", "float8_e4m3fn")         # scale factors (e4m3: NVFP4 only)
FLOAT_OUT_DTYPES = ("bfloat16", "float16", "float32")   # bias, wgrad's W, plain (unquantized) outputs
OUT_DTYPES = FLOAT_OUT_DTYPES + FP8_DTYPES              # C and D of the forward ops, C (input) and D_row of dgrad
QUANT_D_DTYPES = FP8_DTYPES + (FP4,)                    # D of quant / srelu / glu with SFD_row, D_col, SFD_col
FORWARD_D_DTYPES = OUT_DTYPES + (FP4,)                  # D of quant / srelu / glu (FP4: MXFP4, docs/formats.md)
DBIAS_DTYPES = ("bfloat16", "float32")
