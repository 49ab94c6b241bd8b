"""Pure-jnp reference of every op: the CPU backend and the twin of the test oracle (tests/np_ops.py).

Every function takes the op's *canonical* arrays (NOTES.md "Layer contracts") plus static keyword options and
returns a dict keyed by cuDNN's output names in cuDNN's order (absent outputs `None`). All math is fp32: operands
are dequantized exactly (decode * scale, docs/numerics.md), every matmul runs at `Precision.HIGHEST` (XLA would use
TF32 on a GPU otherwise) with fp32 accumulation, and outputs are rounded once (RNE; e8m0 scales RCEIL,
docs/formats.md#rounding).
The scale-factor layout and all quantization rules live in `formats`; this module never re-derives them.
On CUDA (no kernel for a call) the GEMMs are traced with 16-bit operands instead: `tensor_core_operands`.

Device offsets are sanitized (docs/offsets.md): `end_g = running_max(floor_a(clip(padded_offsets[g], 0, m)))` with
`a` the call's `m_aligned` (256 by default; every M-grouped op takes it as a keyword).
Rows outside every group produce zeros everywhere (SF bytes 0, dprob 0) and add nothing to amax/dbias; an empty
group's amax and dbias are 0 (docs/offsets.md#rows-outside-every-group).

Backward ops are the exact gradients of our forward ops (docs/ops.md, docs/activations.md). Forward/backward
activations are the table's jnp functions (`activations.TABLE[name].reference`): one definition each that returns
the value and, on request, its derivatives.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import jax
import jax.numpy as jnp

from . import activations
from .activations import GLU_BLOCK
from . import formats as F
from .limits import FLOAT_OUT_DTYPES, GROUP_ALIGN, QUANT_D_DTYPES, values_per_byte
from .offsets import group_starts, row_groups, sanitize_offsets, sanitize_token_offsets  # noqa: F401 (API)
from .offsets import search_sorted

HIGHEST = jax.lax.Precision.HIGHEST
F32 = jnp.float32
COL_VEC = 32          # D_col quantization block (32 rows, docs/formats.md#column-quantization)
NVFP4_VEC = 16        # Hadamard op: NVFP4 outputs, vec 16, e4m3 scales (docs/formats.md#nvfp4)


# ---------------------------------------------------------------------------------------------------------------
# Groups (the sanitizer and the row -> group map: cudnn_moe_jax.offsets)


def _per_row(values, gid):
    """Gather a per-group array (L, ...) to rows; rows outside every group read group L-1 (masked later)."""
    return values[jnp.minimum(gid, values.shape[0] - 1)]


def _group_max(x, gid, num_groups: int):
    """(L,) max over in-group rows of x (m,) >= 0; empty groups 0.0 (docs/offsets.md); NaN propagates."""
    mx = jax.ops.segment_max(x, gid, num_segments=num_groups + 1)[:num_groups]
    return jnp.where(jnp.isnan(mx), mx, jnp.maximum(mx, 0.0))


def _row_amax(x):
    """(m,) max |x| over each row of x (m, N), NaN propagating (XLA:CPU's reduce-max can drop a NaN)."""
    return jnp.where(jnp.isnan(x).any(axis=1), jnp.float32(jnp.nan), jnp.max(jnp.abs(x), axis=1))


def _group_sum(x, gid, num_groups: int):
    """(L, ...) fp32 sum over in-group rows of x (m, ...); rows outside every group are dropped."""
    return jax.ops.segment_sum(x, gid, num_segments=num_groups + 1)[:num_groups]


# ---------------------------------------------------------------------------------------------------------------
# Operands


def _is_block_scaled(dtype: str) -> bool:
    return dtype in (F.E4M3, F.E5M2, F.E2M1)


def _decode_scales(s, sf_dtype: str):
    return F.e8m0_decode(s) if sf_dtype == F.E8M0 else F.decode(s, sf_dtype)


def _dequant_rows(x, s_logical, *, ab_dtype: str, sf_dtype: str, vec: int):
    """Exact dequantization of a K-major operand: decode(x)[r, k] * val(s_logical[r, k // vec])."""
    vals = F.decode(x, ab_dtype)
    k = vals.shape[-1]
    s = _decode_scales(s_logical, sf_dtype)     # repeated by a broadcast: XLA fuses it (no gather)
    scale = jnp.broadcast_to(s[..., None], s.shape + (vec,)).reshape(s.shape[:-1] + (s.shape[-1] * vec,))
    return vals * scale[..., :k]


def dequantize_a(a, sfa, *, ab_dtype: str, sf_dtype: Optional[str], sf_vec_size: Optional[int]):
    """A (m, K) [FP4: uint8 (m, K//2)] + sfa (1, Rb, Kb, 32, 4, 4) -> (m, K) f32. Without sfa (bf16 / fp16 A, also
    bf16 A with block-scaled B: weight-only quantization) A is used as stored."""
    if sfa is None or not _is_block_scaled(ab_dtype):
        return jnp.asarray(a).astype(F32)
    m = a.shape[0]
    k = a.shape[1] * values_per_byte(ab_dtype)
    s = F.unpack_sf(sfa, m, F.cdiv(k, sf_vec_size))[0]
    return _dequant_rows(a, s, ab_dtype=ab_dtype, sf_dtype=sf_dtype, vec=sf_vec_size)


def gather_rows(a, a_index):
    """A gathered by `a_index` (docs/ops.md#gathered-a-rows): row r is a[a_index[r]], a zero row where the index is
    outside [0, T), T = a.shape[0] (masked explicitly: an index is never wrapped or clipped onto a real row)."""
    rows = a.shape[0]
    valid = (a_index >= 0) & (a_index < rows)
    return jnp.where(valid[:, None], a[jnp.clip(a_index, 0, rows - 1)], jnp.zeros((), a.dtype))


def dequantize_b(b, sfb, *, ab_dtype: str, sf_dtype: Optional[str], sf_vec_size: Optional[int]):
    """B (L, N, K) or a tuple of L (N, K) arrays (discrete weights) [+ sfb (L, ...) or tuple of (1, ...)]
    -> (L, N, K) f32."""
    if isinstance(b, (tuple, list)):
        sfbs = sfb if isinstance(sfb, (tuple, list)) else (None,) * len(b)
        return jnp.concatenate([dequantize_b(bi[None], si, ab_dtype=ab_dtype, sf_dtype=sf_dtype,
                                             sf_vec_size=sf_vec_size) for bi, si in zip(b, sfbs)], axis=0)
    if not _is_block_scaled(ab_dtype):
        return jnp.asarray(b).astype(F32)
    num_groups, n = b.shape[0], b.shape[1]
    k = b.shape[2] * values_per_byte(ab_dtype)
    s = F.unpack_sf(sfb, n, F.cdiv(k, sf_vec_size), num_groups)
    return _dequant_rows(b, s, ab_dtype=ab_dtype, sf_dtype=sf_dtype, vec=sf_vec_size)


def row_tile(m: int, num_groups: int, m_aligned: int) -> int:
    """Rows per step of `grouped_matmul`: 256 when groups are 256-aligned (steps never straddle a group end); else
    about one group's share (a power of two in [16, 256]): a step past its group's end is wasted work."""
    if m_aligned % GROUP_ALIGN == 0:
        return GROUP_ALIGN
    share = max(m // max(num_groups, 1), 1)
    return min(max(1 << (share.bit_length() - 1), 16), GROUP_ALIGN)


def grouped_matmul(a_op, b_op, ends, m_aligned: int = GROUP_ALIGN):
    """acc[r, n] = sum_k a[r, k] * b[g(r), n, k] (fp32 accumulation); rows outside every group are 0.

    Operands are f32 (dequantized, multiplied at HIGHEST) or 16-bit (see `tensor_core_operands`). A loop over row
    tiles, each a (R, K) x (K, N) matmul with its group's weight, does the useful work with O(N*K) extra memory.
    Each group's rows are cut into tiles from its first row, like the kernels' M tiles: sum_g ceil(|g| / R) steps,
    at most cdiv(m, R) + L - 1 (each group end adds at most one partial tile; none when the ends are multiples of
    R). A row is read back from the tile of its own group. (`lax.ragged_dot` lowers to an (L, m, K) masked operand
    on CPU and to L x the work on a GPU.)
    """
    m, k = a_op.shape
    num_groups, n = b_op.shape[0], b_op.shape[1]
    tile = row_tile(m, num_groups, m_aligned)
    aligned = m_aligned % tile == 0 and m % tile == 0
    starts = group_starts(ends)
    count = (ends - starts + tile - 1) // tile           # tiles of each group (0 for an empty one)
    tile_end = jnp.cumsum(count)
    first = tile_end - count
    steps = F.cdiv(m, tile) + (0 if aligned else num_groups - 1)
    step = jnp.arange(steps, dtype=jnp.int32)
    group = search_sorted(tile_end, step, side="right")   # L: an unused step
    used = group < num_groups
    gc = jnp.minimum(group, num_groups - 1)
    row0 = jnp.where(used, starts[gc] + (step - first[gc]) * tile, 0)

    def product(g, a_tile):
        w = jax.lax.dynamic_index_in_dim(b_op, jnp.minimum(g, num_groups - 1), keepdims=False)
        return jnp.dot(a_tile, w.T, precision=HIGHEST, preferred_element_type=F32)

    if aligned:   # every tile lies in one group (or past the last end): the tiles are A's rows in order
        out = jax.lax.map(lambda args: jnp.where(args[1] < num_groups, product(*args[::-1]), 0.0),
                          (a_op.reshape(steps, tile, k), row_groups(ends, m)[::tile]))
        return out.reshape(m, n)

    def one(args):
        r0, g, use = args
        rows = jnp.minimum(r0 + jnp.arange(tile, dtype=jnp.int32), m - 1)   # past m: any row, never read back
        return jax.lax.cond(use, lambda: product(g, jnp.take(a_op, rows, axis=0)),
                            lambda: jnp.zeros((tile, n), F32))

    tiles = jax.lax.map(one, (row0, group, used)).reshape(steps * tile, n)
    gid = row_groups(ends, m)
    r = jnp.arange(m, dtype=jnp.int32)
    g = jnp.minimum(gid, num_groups - 1)
    local = r - starts[g]
    out = jnp.take(tiles, (first[g] + local // tile) * tile + local % tile, axis=0)
    return jnp.where((gid < num_groups)[:, None], out, 0.0)


def token_tile(tokens: int, num_groups: int) -> int:
    """Tokens per step of the expert-wise contraction: about one expert's share (a power of two in [256, 2048]).
    Larger steps mean fewer read-modify-writes of the (m_w, n_w) fp32 accumulator, smaller ones less masked work
    in the steps that straddle expert boundaries (at most L - 1 of them)."""
    share = max(tokens // max(num_groups, 1), 1)
    return min(max(1 << (share.bit_length() - 1), 256), 2048)


def expert_token_matmul(a_op, b_op, ends):
    """W[e] = a[:, T_e] @ b[:, T_e]^T (L, m_w, n_w) f32 for token ranges T_e = [start_e, end_e) (any alignment).

    A scan over (token tile, expert) pairs sorted by expert: a tile that straddles expert boundaries is visited
    once per expert it holds, with the other experts' tokens masked out. There are at most
    cdiv(T, tile) + L - 1 such pairs (each boundary adds one), so the work is the useful work plus at most
    L - 1 tiles, not L x the whole product.
    """
    m_w, tokens = a_op.shape
    n_w = b_op.shape[0]
    num_groups = ends.shape[0]
    step_tokens = token_tile(tokens, num_groups)
    n_tiles = F.cdiv(tokens, step_tokens)
    pad = n_tiles * step_tokens - tokens
    a_op = jnp.pad(a_op, ((0, 0), (0, pad)))
    b_op = jnp.pad(b_op, ((0, 0), (0, pad)))
    starts = group_starts(ends)
    first = starts // step_tokens
    count = jnp.where(ends > starts, (ends + step_tokens - 1) // step_tokens - first, 0)
    cum = jnp.cumsum(count)                                 # inclusive: pairs of experts 0..e
    pair = jnp.arange(n_tiles + num_groups - 1, dtype=jnp.int32)
    expert = search_sorted(cum, pair, side="right")   # L for unused pairs
    used = expert < num_groups
    expert = jnp.minimum(expert, num_groups - 1)
    tile = jnp.where(used, first[expert] + pair - (cum[expert] - count[expert]), 0)

    def step(acc, item):
        e, t, use = item
        a_t = jax.lax.dynamic_slice_in_dim(a_op, t * step_tokens, step_tokens, axis=1)
        b_t = jax.lax.dynamic_slice_in_dim(b_op, t * step_tokens, step_tokens, axis=1)
        token = t * step_tokens + jnp.arange(step_tokens, dtype=jnp.int32)
        keep = use & (token >= starts[e]) & (token < ends[e])
        # both operands: another expert's NaN / inf must not reach W[e] through a product with a masked zero
        a_t = jnp.where(keep[None, :], a_t, jnp.zeros((), a_t.dtype))
        b_t = jnp.where(keep[None, :], b_t, jnp.zeros((), b_t.dtype))
        w = jnp.dot(a_t, b_t.T, precision=HIGHEST, preferred_element_type=F32)
        return jax.lax.dynamic_update_index_in_dim(acc, acc[e] + w, e, axis=0), None

    acc, _ = jax.lax.scan(step, jnp.zeros((num_groups, m_w, n_w), F32), (expert, tile, used))
    return acc


# Set while the CUDA fallback lowering traces the reference (`tensor_core_operands`).
_tensor_core_operands = False


@contextlib.contextmanager
def tensor_core_operands():
    """Trace the GEMMs with 16-bit operands and fp32 accumulation (for XLA on a GPU).

    bf16/fp16 data stays as stored and block-scaled data is dequantized to bf16, which is exact: an FP8 or FP4 code
    times an e8m0/e4m3 scale has at most 8 significant bits and bf16 has fp32's exponent range (only magnitudes
    below 2^-126, which every backend flushes or ignores, can differ). The products and the fp32 sums are those
    of the f32 path, but XLA runs them on the tensor cores instead of fp32 SIMT GEMMs (~50x slower on an H200).
    """
    global _tensor_core_operands
    previous, _tensor_core_operands = _tensor_core_operands, True
    try:
        yield
    finally:
        _tensor_core_operands = previous


def _mma_operand(x, dequantized_f32, ab_dtype: str):
    """The GEMM operand: 16-bit under `tensor_core_operands`, else the dequantized f32 array."""
    if not _tensor_core_operands:
        return dequantized_f32()
    if _is_block_scaled(ab_dtype):
        return dequantized_f32().astype(jnp.bfloat16)
    if isinstance(x, (tuple, list)):
        return jnp.stack([jnp.asarray(xi) for xi in x])
    return jnp.asarray(x)


def _gemm(a, b, sfa, sfb, ends, *, ab_dtype, sf_dtype, sf_vec_size, m_aligned):
    kw = dict(ab_dtype=ab_dtype, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size)
    b_op = _mma_operand(b, lambda: dequantize_b(b, sfb, **kw), ab_dtype)
    if _tensor_core_operands and _is_block_scaled(ab_dtype) and jnp.asarray(a).dtype == jnp.float16:
        # an fp16 A beside a dequantized (bf16) B: the exact sum of two bf16 parts, one product each
        hi, lo = split_f16(a)
        return grouped_matmul(hi, b_op, ends, m_aligned) + grouped_matmul(lo, b_op, ends, m_aligned)
    a_op = _mma_operand(a, lambda: dequantize_a(a, sfa, **kw), ab_dtype)
    return grouped_matmul(a_op, b_op, ends, m_aligned)


def split_f16(a):
    """fp16 a -> bf16 (hi, lo) with hi + lo = a exactly (hi: a rounded to bf16; lo: the rest, at most 4
    significant bits); an infinite value's lo is 0 (inf - inf would be NaN)."""
    f = jnp.asarray(a).astype(F32)
    hi = f.astype(jnp.bfloat16)
    lo = jnp.where(jnp.isinf(f), 0.0, f - hi.astype(F32)).astype(jnp.bfloat16)
    return hi, lo


def _prep(padded_offsets, m: int, m_aligned: int):
    ends = sanitize_offsets(padded_offsets, m, m_aligned)
    gid = row_groups(ends, m)
    return ends, gid, gid < ends.shape[0]


def _f32(x):
    return None if x is None else jnp.asarray(x).astype(F32)


def _prob_rows(prob, m: int):
    """(m, 1) f32 router weights; None (legacy SwiGLU's optional prob) means 1."""
    return jnp.ones((m, 1), F32) if prob is None else _f32(prob).reshape(m)[:, None]


def _norm_const(norm_const, what: str = "norm_const"):
    if norm_const is None:
        raise ValueError(f"{what} is required for quantized (FP8/NVFP4) outputs")
    return jnp.asarray(norm_const).astype(F32).reshape(-1)[0]


# ---------------------------------------------------------------------------------------------------------------
# Output stage


def cast(x, dtype: str):
    """fp32 -> storage dtype, RNE; FP8 saturating (satfinite, docs/formats.md#rounding). FP8 results are jnp
    float8 arrays."""
    if dtype in FLOAT_OUT_DTYPES:
        return x.astype(dtype)
    if dtype == F.E4M3:
        return F.e4m3_encode(x)
    if dtype == F.E5M2:
        return F.e5m2_encode(x)
    raise ValueError(f"unsupported output dtype {dtype!r}")


def store_d(dfp, ends, *, d_dtype: str, norm_const=None, discrete_col_sfd: bool = False):
    """D (and for FP8 / FP4 D: D_col, SFD_row, SFD_col) from the fp32 D (m, N_out), already zero outside groups.

    SFD_row: row quantization (docs/formats.md#row-quantization), e8m0 vec 32, physical (1, Rb, Kb, 32, 4, 4).
    D_col/SFD_col: column quantization, 32-row blocks; SFD_col is the MMA-tiled layout of D^T or, with
    `discrete_col_sfd`, the per-group segments (docs/formats.md#segmented-layout) of the sanitized
    group ends. FP4 (MXFP4) D is packed (m, N_out/2), its D_col transposed (N_out, m/2), tokens packed
    (docs/formats.md#fp4-d-outputs). Zero data quantizes to code 0 with SF byte 0, so rows outside every group stay
    zero.
    """
    out = dict(d=None, d_col=None, sfd_row=None, sfd_col=None)
    if d_dtype not in QUANT_D_DTYPES:
        out["d"] = cast(dfp, d_dtype)
        return out
    nc = _norm_const(norm_const)
    codes, s_row = F.quantize_rows(dfp, d_dtype, F.E8M0, COL_VEC, nc)
    codes_col, s_col = F.quantize_cols(dfp, d_dtype, nc)
    out["d"], out["d_col"] = codes, codes_col
    out["sfd_row"] = F.pack_sf(s_row[None])
    out["sfd_col"] = (F.pack_sf_segments(s_col, ends, COL_VEC) if discrete_col_sfd else F.pack_sf(s_col[None]))
    return out


def _fwd_outputs(c, dfp, ends, gid, *, c_dtype, d_dtype, norm_const, compute_amax, discrete_col_sfd):
    """Shared tail of quant/srelu/glu: mask rows outside groups, amax of fp32 D, C/D/SFD outputs."""
    num_groups = ends.shape[0]
    valid = (gid < num_groups)[:, None]
    dfp = jnp.where(valid, dfp, 0.0)
    d = store_d(dfp, ends, d_dtype=d_dtype, norm_const=norm_const, discrete_col_sfd=discrete_col_sfd)
    out = {}
    if c_dtype is not None:
        out["c_tensor"] = cast(jnp.where(valid, c, 0.0), c_dtype)
    out["d_tensor"] = d["d"]
    out["d_col_tensor"] = d["d_col"]
    out["amax_tensor"] = (_group_max(_row_amax(dfp), gid, num_groups)[:, None]
                          if compute_amax else None)
    out["sfd_row_tensor"] = d["sfd_row"]
    out["sfd_col_tensor"] = d["sfd_col"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# GLU layout


def glu_split(x):
    """(m, N) interleaved in 32-col blocks -> gate (m, N/2) from even blocks, up (m, N/2) from odd blocks
    (docs/activations.md#glu-layout)."""
    m, n = x.shape
    x = x.reshape(m, n // (2 * GLU_BLOCK), 2, GLU_BLOCK)
    return x[:, :, 0, :].reshape(m, n // 2), x[:, :, 1, :].reshape(m, n // 2)


def glu_interleave(gate, up):
    """Inverse of `glu_split`."""
    m, h = gate.shape
    g = gate.reshape(m, h // GLU_BLOCK, 1, GLU_BLOCK)
    u = up.reshape(m, h // GLU_BLOCK, 1, GLU_BLOCK)
    return jnp.concatenate([g, u], axis=2).reshape(m, 2 * h)


# ---------------------------------------------------------------------------------------------------------------
# Forward ops


def grouped_gemm_quant(a, b, sfa, sfb, padded_offsets, alpha, prob, bias=None, norm_const=None, *,
                       ab_dtype: str, sf_dtype: Optional[str] = None, sf_vec_size: Optional[int] = None,
                       d_dtype: str, compute_amax: bool = False, discrete_col_sfd: bool = False,
                       m_aligned: int = GROUP_ALIGN):
    """D = prob*alpha*acc, or with bias D = alpha*acc + prob*bias (docs/ops.md#grouped_gemm_quant). D (m, N);
    FP8 D adds D_col and SFD."""
    m = a.shape[0]
    ends, gid, _ = _prep(padded_offsets, m, m_aligned)
    acc = _gemm(a, b, sfa, sfb, ends, ab_dtype=ab_dtype, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size,
                m_aligned=m_aligned)
    alpha_r = _per_row(_f32(alpha), gid)[:, None]
    prob_r = _prob_rows(prob, m)
    if bias is None:
        dfp = prob_r * (alpha_r * acc)
    else:
        dfp = alpha_r * acc + prob_r * _per_row(_f32(bias), gid)
    return _fwd_outputs(None, dfp, ends, gid, c_dtype=None, d_dtype=d_dtype, norm_const=norm_const,
                        compute_amax=compute_amax, discrete_col_sfd=discrete_col_sfd)


def _c_fp32(a, b, sfa, sfb, padded_offsets, alpha, bias, *, ab_dtype, sf_dtype, sf_vec_size, m_aligned):
    """C = alpha*acc (+ bias): the pre-activation of srelu/glu/hadamard (docs/ops.md)."""
    m = a.shape[0]
    ends, gid, _ = _prep(padded_offsets, m, m_aligned)
    acc = _gemm(a, b, sfa, sfb, ends, ab_dtype=ab_dtype, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size,
                m_aligned=m_aligned)
    c = _per_row(_f32(alpha), gid)[:, None] * acc
    if bias is not None:
        c = c + _per_row(_f32(bias), gid)
    return c, ends, gid


def _activation(c, prob, *, act, **options):
    """D = prob * act(C) (GLU: of the gate/up blocks of C) times the entry's output scale, if any."""
    entry = activations.get(act)
    x = glu_split(c) if entry.glu else (c,)
    dfp = _prob_rows(prob, c.shape[0]) * entry.reference(*x, **entry.constants(options))
    scale = entry.output_scale(options)
    if scale is not None:
        dfp = dfp * jnp.float32(scale)
    return dfp


def grouped_gemm_srelu(a, b, sfa, sfb, padded_offsets, alpha, prob, bias=None, norm_const=None, *,
                       ab_dtype: str, sf_dtype: Optional[str] = None, sf_vec_size: Optional[int] = None,
                       c_dtype: str = "bfloat16", d_dtype: str, tanh_clamp_scale: Optional[float] = None,
                       compute_amax: bool = False, discrete_col_sfd: bool = False, m_aligned: int = GROUP_ALIGN):
    """C = alpha*acc (+ bias), D = prob * relu(C)^2 (or the tanh-clamped form) (docs/ops.md#grouped_gemm_srelu).
    C, D (m, N)."""
    c, ends, gid = _c_fp32(a, b, sfa, sfb, padded_offsets, alpha, bias, ab_dtype=ab_dtype, sf_dtype=sf_dtype,
                           sf_vec_size=sf_vec_size, m_aligned=m_aligned)
    dfp = _activation(c, prob, act="srelu", tanh_clamp_scale=tanh_clamp_scale)
    return _fwd_outputs(c, dfp, ends, gid, c_dtype=c_dtype, d_dtype=d_dtype, norm_const=norm_const,
                        compute_amax=compute_amax, discrete_col_sfd=discrete_col_sfd)


def grouped_gemm_glu(a, b, sfa, sfb, padded_offsets, alpha, prob, bias=None, norm_const=None, *,
                     ab_dtype: str, sf_dtype: Optional[str] = None, sf_vec_size: Optional[int] = None,
                     act_func: str = "swiglu", c_dtype: str = "bfloat16", d_dtype: str,
                     glu_limit: Optional[float] = None, glu_alpha: Optional[float] = None,
                     compute_amax: bool = False, discrete_col_sfd: bool = False, m_aligned: int = GROUP_ALIGN):
    """C = alpha*acc (+ bias) (m, N) stored pre-clamp; D = scale * prob * act(gate, up) (m, N/2), scale = glu_alpha
    for swiglu / geglu (docs/ops.md#grouped_gemm_glu, docs/activations.md)."""
    c, ends, gid = _c_fp32(a, b, sfa, sfb, padded_offsets, alpha, bias, ab_dtype=ab_dtype, sf_dtype=sf_dtype,
                           sf_vec_size=sf_vec_size, m_aligned=m_aligned)
    dfp = _activation(c, prob, act=act_func, glu_limit=glu_limit, glu_alpha=glu_alpha)
    return _fwd_outputs(c, dfp, ends, gid, c_dtype=c_dtype, d_dtype=d_dtype, norm_const=norm_const,
                        compute_amax=compute_amax, discrete_col_sfd=discrete_col_sfd)


def grouped_gemm_swiglu(*args, **kwargs):
    """Legacy alias: grouped_gemm_glu with act_func='swiglu'."""
    return grouped_gemm_glu(*args, act_func="swiglu", **kwargs)


def hadamard16(dtype=F32):
    """Orthonormal Sylvester Hadamard H16/4, H[i][o] = (-1)^popcount(i & o) / 4
    (docs/ops.md#grouped_gemm_glu_hadamard_quant)."""
    i = jnp.arange(16, dtype=jnp.int32)
    x = i[:, None] & i[None, :]
    parity = jnp.zeros_like(x)
    for bit in range(4):
        parity = parity ^ ((x >> bit) & 1)
    return (1.0 - 2.0 * parity.astype(F32)).astype(dtype) * 0.25


def _rht_rows(x, p):
    """Per 16-column block of x (R, C): out_block = x_block @ P^T (fp32, HIGHEST)."""
    r, c = x.shape
    y = jnp.einsum("rbi,oi->rbo", x.reshape(r, c // 16, 16), p, precision=HIGHEST, preferred_element_type=F32)
    return y.reshape(r, c)


def _nvfp4(x, norm_const):
    """NVFP4 quantization (docs/formats.md#nvfp4): codes uint8 (R, C/2) packed, e4m3 SF logical (R, C/16)."""
    codes, s = F.quantize_rows(x, F.E2M1, F.E4M3, NVFP4_VEC, norm_const)
    return codes, s


def pack_token_segments(packed, ends):
    """(R, T/2) packed FP4 rows -> flat R*T/2 bytes, per-group transposed segments
    (docs/ops.md#grouped_gemm_glu_hadamard_quant).

    Segment g is `packed[:, start_g/2 : end_g/2]` flattened row-major (tokens contiguous), starting at byte
    R*start_g/2. Bytes past the last group are 0. Group bounds are even (NVFP4 outputs need m_aligned % 128 == 0).
    """
    rows, half_t = packed.shape
    num_groups = ends.shape[0]
    starts = group_starts(ends)
    p = jnp.arange(rows * half_t, dtype=jnp.int32)
    seg_end = ends * rows // 2
    g = search_sorted(seg_end, p, side="right")
    gc = jnp.minimum(g, num_groups - 1)
    local = p - starts[gc] * rows // 2
    width = jnp.maximum((ends[gc] - starts[gc]) // 2, 1)
    n = jnp.clip(local // width, 0, rows - 1)
    col = jnp.clip(starts[gc] // 2 + local % width, 0, half_t - 1)
    return jnp.where(g < num_groups, packed[n, col], jnp.uint8(0))


def grouped_gemm_glu_hadamard_quant(a, b, sfa, sfb, padded_offsets, alpha, prob, bias=None, norm_const=None,
                                    rht_norm_const=None, hadamard=None, *, ab_dtype: str,
                                    sf_dtype: Optional[str] = None, sf_vec_size: Optional[int] = None,
                                    act_func: str = "swiglu", c_dtype: str = "bfloat16", d_dtype: str = "bfloat16",
                                    rht: Optional[str] = None, rht_dtype: Optional[str] = None,
                                    glu_limit: Optional[float] = None, glu_alpha: Optional[float] = None,
                                    tanh_clamp_scale: Optional[float] = None, compute_amax: bool = False,
                                    m_aligned: int = GROUP_ALIGN):
    """docs/ops.md#grouped_gemm_glu_hadamard_quant. D = activation output: bf16 (m, N_out), or NVFP4 uint8
    (m, N_out/2) + e4m3 `sfd_tensor`.

    RHT = 16-wide transform (P = `hadamard` or H16/4, out = blk @ P^T) of bf16(D):
      rowwise: per 16-column block -> bf16 (m, N_out) or NVFP4 (m, N_out/2) + sfrht (1, Rb, Kb, 32, 4, 4);
      colwise: per 16-token block of each column -> NVFP4 in per-group transposed segments (flat m*N_out/2
               bytes) + sfrht flat per-group segments (docs/formats.md#segmented-layout, vec 16).
    amax: per-group max |D| of the fp32 activation output.
    """
    c, ends, gid = _c_fp32(a, b, sfa, sfb, padded_offsets, alpha, bias, ab_dtype=ab_dtype, sf_dtype=sf_dtype,
                           sf_vec_size=sf_vec_size, m_aligned=m_aligned)
    num_groups = ends.shape[0]
    valid = (gid < num_groups)[:, None]
    dfp = jnp.where(valid, _activation(c, prob, act=act_func, glu_limit=glu_limit, glu_alpha=glu_alpha,
                                       tanh_clamp_scale=tanh_clamp_scale), 0.0)
    out = dict(c_tensor=cast(jnp.where(valid, c, 0.0), c_dtype), d_tensor=None, sfd_tensor=None,
               amax_tensor=None, rht_tensor=None, sfrht_tensor=None)
    if d_dtype == F.E2M1:
        codes, s = _nvfp4(dfp, _norm_const(norm_const))
        out["d_tensor"], out["sfd_tensor"] = codes, F.pack_sf(s[None])
    else:
        out["d_tensor"] = cast(dfp, d_dtype)
    if compute_amax:
        out["amax_tensor"] = _group_max(_row_amax(dfp), gid, num_groups)[:, None]
    if rht is None:
        return out
    p = hadamard16() if hadamard is None else _f32(hadamard)
    d_bf16 = dfp.astype(jnp.bfloat16).astype(F32)
    if rht == "rowwise":
        y = _rht_rows(d_bf16, p)
        if rht_dtype == F.E2M1:
            codes, s = _nvfp4(y, _norm_const(rht_norm_const, "rht_norm_const"))
            out["rht_tensor"], out["sfrht_tensor"] = codes, F.pack_sf(s[None])
        else:
            out["rht_tensor"] = cast(y, rht_dtype or "bfloat16")
    elif rht == "colwise":
        y = _rht_rows(d_bf16.T, p)                         # (N_out, m): 16-token blocks never straddle groups
        codes, s = _nvfp4(y, _norm_const(rht_norm_const, "rht_norm_const"))
        out["rht_tensor"] = pack_token_segments(codes, ends)
        out["sfrht_tensor"] = F.pack_sf_segments(s, ends, NVFP4_VEC)
    else:
        raise ValueError(f"rht {rht!r}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Backward ops (exact gradients of the forward ops above; docs/ops.md)


def _load_c(c, c_dtype):
    """Saved C in its storage dtype (bf16/fp16/f32/fp8, or fp8 bit patterns as uint8 with c_dtype) -> f32."""
    c = jnp.asarray(c)
    if c.dtype == jnp.uint8 and c_dtype is not None:
        return F.decode(c, c_dtype)
    return c.astype(F32)


def _bwd_prologue(a, b, c, sfa, sfb, padded_offsets, alpha, beta, prob, *, ab_dtype, sf_dtype, sf_vec_size,
                  c_dtype, m_aligned):
    """dD = alpha*acc (acc = dY @ W2^T per group), x = beta*C (the forward pre-activation), prob per row."""
    m = a.shape[0]
    ends, gid, valid = _prep(padded_offsets, m, m_aligned)
    acc = _gemm(a, b, sfa, sfb, ends, ab_dtype=ab_dtype, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size,
                m_aligned=m_aligned)
    dd = _per_row(_f32(alpha), gid)[:, None] * acc
    x = _per_row(_f32(beta), gid)[:, None] * _load_c(c, c_dtype)
    return dd, x, _prob_rows(prob, m), ends, gid, valid


def _bwd_outputs(dc, dprob, amax_cols, ends, gid, valid, *, d_dtype, norm_const, dbias_dtype, compute_amax,
                 discrete_col_sfd):
    num_groups = ends.shape[0]
    dc = jnp.where(valid[:, None], dc, 0.0)
    d = store_d(dc, ends, d_dtype=d_dtype, norm_const=norm_const, discrete_col_sfd=discrete_col_sfd)
    amax = None
    if compute_amax:
        amax = jnp.stack([_group_max(_row_amax(v), gid, num_groups) for v in amax_cols], axis=1)
    return dict(d_row_tensor=d["d"], d_col_tensor=d["d_col"],
                dprob_tensor=jnp.where(valid, dprob, 0.0),
                dbias_tensor=None if dbias_dtype is None else _group_sum(dc, gid, num_groups).astype(dbias_dtype),
                amax_tensor=amax, sfd_row_tensor=d["sfd_row"], sfd_col_tensor=d["sfd_col"])


def grouped_gemm_dglu(a, b, c, sfa, sfb, padded_offsets, alpha, beta, prob, norm_const=None, *, ab_dtype: str,
                      sf_dtype: Optional[str] = None, sf_vec_size: Optional[int] = None,
                      c_dtype: Optional[str] = None, act_func: str = "dswiglu", glu_limit: Optional[float] = None,
                      glu_alpha: Optional[float] = None, d_dtype: str, dbias_dtype: Optional[str] = None,
                      compute_amax: bool = False, discrete_col_sfd: bool = False, m_aligned: int = GROUP_ALIGN):
    """GLU backward (docs/ops.md#grouped_gemm_dglu). a = dY (m, H), b = W2^T (L, I, H), c = saved C (m, 2I) with
    dequant scale beta.

    dD = alpha*acc (m, I); gate/up = beta*C; dC (m, 2I) interleaved like C = dD*prob*scale*d act (zero
    where clamped; scale as in the forward); dprob = sum_n dD*scale*act; dbias = per-group column sums of dC;
    amax (L, 2) = (max|d_gate|, max|d_up|).
    """
    entry = activations.get(act_func)
    options = dict(glu_limit=glu_limit, glu_alpha=glu_alpha)
    dd, x, prob_r, ends, gid, valid = _bwd_prologue(a, b, c, sfa, sfb, padded_offsets, alpha, beta, prob,
                                                    ab_dtype=ab_dtype, sf_dtype=sf_dtype,
                                                    sf_vec_size=sf_vec_size, c_dtype=c_dtype, m_aligned=m_aligned)
    value, d_gate, d_up = entry.reference(*glu_split(x), **entry.constants(options), grad=True)
    scale = entry.output_scale(options)
    if scale is not None:
        dd = dd * jnp.float32(scale)
    g_scale = dd * prob_r
    d_gate, d_up = g_scale * d_gate, g_scale * d_up
    dprob = jnp.sum(dd * value, axis=1)
    return _bwd_outputs(glu_interleave(d_gate, d_up), dprob, (d_gate, d_up), ends, gid, valid, d_dtype=d_dtype,
                        norm_const=norm_const, dbias_dtype=dbias_dtype, compute_amax=compute_amax,
                        discrete_col_sfd=discrete_col_sfd)


def grouped_gemm_dswiglu(*args, **kwargs):
    """Legacy alias: grouped_gemm_dglu with act_func='dswiglu'."""
    return grouped_gemm_dglu(*args, act_func="dswiglu", **kwargs)


def grouped_gemm_dsrelu(a, b, c, sfa, sfb, padded_offsets, alpha, beta, prob, norm_const=None, *, ab_dtype: str,
                        sf_dtype: Optional[str] = None, sf_vec_size: Optional[int] = None,
                        c_dtype: Optional[str] = None, tanh_clamp_scale: Optional[float] = None, d_dtype: str,
                        dbias_dtype: Optional[str] = None, compute_amax: bool = False,
                        discrete_col_sfd: bool = False, m_aligned: int = GROUP_ALIGN):
    """sReLU backward (docs/ops.md#grouped_gemm_dsrelu, mirrors dglu). a = dY (m, H), b = W2^T (L, I, H), c = saved
    pre-activation (m, I).

    x = beta*C; dC = dD*prob*d/dx srelu(x); dprob = sum_n dD*srelu(x); dbias = per-group column sums of dC.
    """
    dd, x, prob_r, ends, gid, valid = _bwd_prologue(a, b, c, sfa, sfb, padded_offsets, alpha, beta, prob,
                                                    ab_dtype=ab_dtype, sf_dtype=sf_dtype,
                                                    sf_vec_size=sf_vec_size, c_dtype=c_dtype, m_aligned=m_aligned)
    entry = activations.get("dsrelu")
    value, dvalue = entry.reference(x, **entry.constants(dict(tanh_clamp_scale=tanh_clamp_scale)), grad=True)
    dc = dd * prob_r * dvalue
    dprob = jnp.sum(dd * value, axis=1)
    return _bwd_outputs(dc, dprob, (dc,), ends, gid, valid, d_dtype=d_dtype, norm_const=norm_const,
                        dbias_dtype=dbias_dtype, compute_amax=compute_amax, discrete_col_sfd=discrete_col_sfd)


def dequantize_tokens(x, sf, ends, *, ab_dtype: str, sf_dtype: Optional[str], sf_vec_size: Optional[int],
                      token_major: bool = False):
    """A wgrad token operand (rows, T) [FP4: uint8 (rows, T//2)] + its flat per-expert SF segments (sanitized token
    `ends`) -> (rows, T) f32; a bf16 / fp16 operand as stored. `token_major`: the operand is stored (T, rows) (the
    same values; XLA's gather of the scales then runs along its memory order, `formats.segment_token_scales`)."""
    if not _is_block_scaled(ab_dtype):
        return jnp.asarray(x).astype(F32)
    tokens = x.shape[1] * values_per_byte(ab_dtype)
    s = F.segment_token_scales(sf, x.shape[0], ends, tokens, sf_vec_size, token_major=token_major)
    return F.decode(x, ab_dtype) * _decode_scales(s, sf_dtype)


def grouped_gemm_wgrad(a, b, offsets, sfa=None, sfb=None, global_scale_a=None, global_scale_b=None,
                       wgrad_tensor=None, *, ab_dtype: str, sf_dtype: Optional[str] = None,
                       sf_vec_size: Optional[int] = None, wgrad_dtype: str = "bfloat16"):
    """W[e] = gsa[e]*gsb[e] * A[:, T_e] @ B[:, T_e]^T (L, m_w, n_w) (docs/ops.md#grouped_gemm_wgrad).

    a (m_w, T), b (n_w, T) token-contiguous (FP4: uint8 (., T/2)); sfa/sfb flat per-expert SF segments
    (docs/formats.md#segmented-layout: token t of expert e is scaled by local block (t - start_e) // vec of its
    segment); token ends sanitized as running_max(clip(offsets, 0, T)); `wgrad_tensor` given: out = cast(W_in + W)
    (fp32 add).
    """
    tokens = a.shape[1] * values_per_byte(ab_dtype)
    ends = sanitize_token_offsets(offsets, tokens)
    num_groups = ends.shape[0]
    kw = dict(ab_dtype=ab_dtype, sf_dtype=sf_dtype, sf_vec_size=sf_vec_size)
    w = expert_token_matmul(_mma_operand(a, lambda: dequantize_tokens(a, sfa, ends, **kw), ab_dtype),
                            _mma_operand(b, lambda: dequantize_tokens(b, sfb, ends, **kw), ab_dtype), ends)
    if global_scale_a is not None or global_scale_b is not None:
        gs = jnp.ones((num_groups,), F32)
        if global_scale_a is not None:
            gs = gs * _f32(global_scale_a).reshape(num_groups)
        if global_scale_b is not None:
            gs = gs * _f32(global_scale_b).reshape(num_groups)
        w = gs[:, None, None] * w
    if wgrad_tensor is not None:
        w = _f32(wgrad_tensor) + w
    return dict(wgrad_tensor=w.astype(wgrad_dtype))
