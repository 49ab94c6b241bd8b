"""The operand table: every tensor of every op, one row each, and everything derived from it.

A row (`Operand`) describes one tensor of an op kind, as rules over the `GroupedGemmProblem`:
  name     inputs: the name the primitive binds (`input_names`) and the kernel launcher unpacks; outputs: cuDNN's
           key (`OpResult` field)
  kind     how a kernel launcher declares it (kernels/sm90/jax_bridge.py turns a kind into a TensorSpec):
           "rows" (m, cols) row-major, m dynamic; "weights" B (L, N, K), presented to the kernel as (N, K, L);
           "cols_by_m" (cols, m / 2) packed FP4 with m along the rows' bytes (an FP4 D_col, tokens contiguous);
           "sf_rows" / "sf_cols" / "sf_segments" scale-factor buffers whose row blocks follow m; "m_vector" (m,);
           "tiles_by_m" (n_parts, m) per-N-tile row partials; "row_tiles" (`m_tiles`, cols) per-M-tile column
           partials; "tokens" wgrad's A (m_w, T) / B (n_w, T), T dynamic; "gathered_rows" a gathered A
           (a_rows, K) (problem.a_rows: its rows are picked by the "a_index" m_vector), a_rows dynamic, any value;
           "gathered_tokens" wgrad's gathered token-major A (m_w, a_rows) / B (n_w, b_rows) ("a_index" / "b_index");
           "staged_tokens" / "token_chunks" the staged wgrad's workspaces (rows, padded T) / (flag words,), T
           dynamic; "static": its shape involves neither
  shape    (dims) of the problem; `m` (wgrad: the token count `k`) and `a_rows` may be jax.export symbolic
           dimensions
  dtype    dtype name ("uint8": packed FP4 data and scale-factor bytes)
  present  whether the problem has it; an absent operand is neither bound nor passed to a launcher
  dynamic  inputs whose shape follows the problem's dynamic extent (m; wgrad: T): (axis, extent per index), or
           (axis, size of the axis as a function of the extent) (wgrad's SF segments: rup(cdiv(T, vec), 4) columns);
           a rule may give None (a gathered A follows a_rows instead, the second dynamic extent: `gathered_axes`)
  split    discrete weights: one array per expert, bound as `name:0`, `name:1`, ..., of this shape
  ops      the ops of the table that have the row at all (None: every op of the table)
  launch   outputs: the launcher's name for it
  partial  outputs the launch writes as per-tile partial sums instead, for the lowering to reduce in a fixed order
           (deterministic without float atomics): `Partial(name, kind, shape(problem, config), reduce)`
  alias    outputs the launch writes into an input's buffer (`input_output_aliases`)

Workspaces (`WORKSPACES`) are launch-only outputs that stand for no op output: scratch the launch writes and reads
itself (the discrete-weights TMA descriptor table, the staged operands' bf16 copies and flags), passed after the
op's outputs and dropped by `finish`; whether one is present may follow the kernel config (`Workspace.present`).

The tables (`TABLES`, one per op) are the one statement of the operand contract; the binding order of the public
ops, the output avals, the dynamic axes, the launcher's operands and TensorSpecs and its unpacking are read from
here. Adding an operand is adding its row. No cutlass import: the kernels' pure-Python modules read it too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Union

from .formats import SF_ATOM_ROWS, cdiv, exact_in_float16, sf_physical_shape, sf_segment_bytes
from .limits import FP4, values_per_byte

Rule = Callable[[Any], Any]

# Rows per partial of a "row_tiles" output: the kernels' M tile (Config.tile_m).
ROW_TILE = 128


def m_tiles(p):
    """Partials of a "row_tiles" output: the kernels' M tiles, each group's rows cut into ROW_TILE-row tiles from
    its first row (kernels/scheduler.py). m / 128 when the group ends are multiples of 128; else at most
    cdiv(m, 128) + L - 1 (each group end adds at most one partial tile), rounded up to + L."""
    return cdiv(p.m, ROW_TILE) + (p.num_groups if p.m_aligned % ROW_TILE else 0)


# Scale-factor block of the FP8 D outputs (SFD_row / SFD_col, e8m0) and of the NVFP4 outputs (e4m3).
MX_VEC, NVFP4_VEC = 32, 16


def _always(p) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Partial:
    """A launch-only output standing for an op output: the kernel writes per-tile partial sums, `reduce(problem,
    parts, named launch inputs)` gives the op's output."""

    name: str
    kind: str
    shape: Callable[[Any, Any], tuple]   # (problem, kernel config)
    reduce: Callable[[Any, Any, dict], Any]
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class Operand:
    """One row of the table (the fields: this module's docstring)."""

    name: str
    kind: Union[str, Rule]
    shape: Rule
    dtype: Union[str, Rule]
    present: Rule = _always
    dynamic: Union[None, tuple, Rule] = None
    split: Optional[Rule] = None
    ops: Optional[tuple] = None
    launch: Optional[str] = None
    partial: Optional[Partial] = None
    alias: Optional[str] = None


class Bound(NamedTuple):
    """One operand of one problem: its rules evaluated."""

    name: str
    kind: str
    shape: Optional[tuple]   # None: a partial's shape without a kernel config
    dtype: str


def _eval(rule, p):
    return rule(p) if callable(rule) else rule


# ------------------------------------------------------------------------------------------------ rules

def _storage(dtype: Optional[str]) -> Optional[str]:
    return "uint8" if dtype == FP4 else dtype


def _per_byte(p, dtype=None) -> int:
    """Logical elements per byte of the A/B storage along K (T for wgrad): packed FP4 holds two."""
    return values_per_byte(dtype or p.ab_dtype)


def _a_dtype(p) -> str:
    """A's storage dtype: ab_dtype, or the bf16 A of weight-only quantization (block-scaled B)."""
    return p.a_dtype or p.ab_dtype


def _a_scaled(p) -> bool:
    return p.block_scaled and p.a_dtype is None


def _packed_out(rows, cols, dtype):
    """An output of `dtype`: NVFP4 is packed two values a byte along its columns."""
    return (rows, cols // 2) if dtype == FP4 else (rows, cols)


def _block_scaled(p) -> bool:
    return p.block_scaled


def _has_prob(p) -> bool:
    return p.epilogue.has_prob


def _quant_d(p) -> bool:
    """FP8 or FP4 D with SFD_row, D_col, SFD_col."""
    return p.epilogue.generate_sfd


def _d_col_shape(p):
    """D_col: D's shape (FP8), or FP4 transposed and packed along the tokens, (N_out, m / 2): wgrad's
    token-contiguous operand (docs/formats.md#fp4-d-outputs)."""
    if p.epilogue.d_dtype == FP4:
        return (p.n_out, p.m // 2)
    return (p.m, p.n_out)


def _norm_const(p) -> bool:
    """The D quantization's global encode scale: FP8 D (SFD), or NVFP4 D of the Hadamard op."""
    return p.epilogue.generate_sfd or (p.op == "glu_hadamard_quant" and p.epilogue.d_dtype == FP4)


def _sfd_col_shape(p):
    if p.epilogue.discrete_col_sfd:
        return (sf_segment_bytes(p.n_out, p.m, MX_VEC),)
    return sf_physical_shape(p.n_out, p.m, MX_VEC)


def dgrad_n_parts(p, config) -> int:
    """CTA tiles along N of a dgrad launch (the rows of its dprob partials), cluster padding included."""
    return cdiv(cdiv(p.n, config.tile_n), config.cluster_n) * config.cluster_n


def _sum_tiles(p, parts, inputs):
    """dprob: the per-N-tile row partials (n_parts, m) summed in tile order."""
    out = parts[0]
    for j in range(1, parts.shape[0]):
        out = out + parts[j]
    return out


def _group_sums(p, parts, inputs):
    """dbias: per-group sums of the per-M-tile column partials (m_tiles, N_out): for each group a reduction over
    the tiles of its partials, the other tiles' selected out (fp32, XLA's fixed reduction order; no atomics).
    Tile i belongs to group #{g : tile_end_g <= i}, tile_end_g = sum_{j <= g} ceil(|j| / 128) (the kernels'
    tiles, from each group's first row); partials past the last tile (zero tiles, or never written) are dropped.
    Selected, never multiplied by a 0/1 weight: a one-hot (L, m_tiles) x (m_tiles, N_out) product turned one
    group's NaN / inf partial into NaN in every group's dbias (0 * NaN), where the reference keeps it in its own."""
    import jax.numpy as jnp

    from .offsets import group_starts, sanitize_offsets, search_sorted

    ends = sanitize_offsets(inputs["padded_offsets"], p.m, p.m_aligned)
    tile_end = jnp.cumsum((ends - group_starts(ends) + ROW_TILE - 1) // ROW_TILE)
    group = search_sorted(tile_end, jnp.arange(parts.shape[0], dtype=tile_end.dtype), side="right")
    member = group[None, :, None] == jnp.arange(p.num_groups, dtype=group.dtype)[:, None, None]   # (L, tiles, 1)
    dbias = jnp.sum(jnp.where(member, parts[None].astype(jnp.float32), 0.0), axis=1)   # fused: no (L, tiles, N)
    return dbias.astype(p.epilogue.dbias_dtype)


# ------------------------------------------------------------------------------------------------ the rows

def _gathered(p) -> bool:
    return p.a_rows is not None


# Operands of every M-grouped GEMM (forward and dgrad): A (m, K) (gathered: (a_rows, K), and a_index (m,) names the
# A row of each GEMM row), B (L, N, K) or L x (N, K), their scale factors (block-scaled A/B), the group ends.
_GEMM_INPUTS = (
    Operand("a", lambda p: "gathered_rows" if _gathered(p) else "rows",
            lambda p: (p.a_rows if _gathered(p) else p.m, p.k // _per_byte(p, _a_dtype(p))),
            lambda p: _storage(_a_dtype(p)), dynamic=lambda p: None if _gathered(p) else (0, 1)),
    Operand("b", "weights", lambda p: (p.num_groups, p.n, p.k // _per_byte(p)), lambda p: _storage(p.ab_dtype),
            split=lambda p: (p.n, p.k // _per_byte(p))),
    Operand("sfa", "sf_rows", lambda p: sf_physical_shape(p.m, p.k, p.sf_vec_size), "uint8", _a_scaled,
            dynamic=(1, SF_ATOM_ROWS)),
    Operand("sfb", "static", lambda p: sf_physical_shape(p.n, p.k, p.sf_vec_size, p.num_groups), "uint8",
            _block_scaled, split=lambda p: sf_physical_shape(p.n, p.k, p.sf_vec_size)),
    Operand("padded_offsets", "static", lambda p: (p.num_groups,), "int32"),
    Operand("a_index", "m_vector", lambda p: (p.m,), "int32", present=_gathered, dynamic=(0, 1)),
)
_ALPHA = Operand("alpha", "static", lambda p: (p.num_groups,), "float32")
_PROB = Operand("prob", "m_vector", lambda p: (p.m,), "float32", _has_prob, dynamic=(0, 1))
_NORM_CONST = Operand("norm_const", "static", lambda p: (1,), "float32", _norm_const)

FORWARD_INPUTS = _GEMM_INPUTS + (
    _ALPHA,
    _PROB,
    Operand("bias", "static", lambda p: (p.num_groups, p.n), lambda p: p.epilogue.bias_dtype,
            lambda p: p.epilogue.has_bias),
    _NORM_CONST,
    Operand("rht_norm_const", "static", lambda p: (1,), "float32", lambda p: p.epilogue.rht_dtype == FP4,
            ops=("glu_hadamard_quant",)),
    Operand("hadamard", "static", lambda p: (16, 16), "float32", lambda p: p.epilogue.has_hadamard,
            ops=("glu_hadamard_quant",)),
)

# Backward (dgrad) ops: the saved forward pre-activation C is read; beta dequantizes it per group.
DGRAD_INPUTS = _GEMM_INPUTS + (
    Operand("c", "rows", lambda p: (p.m, p.n_out), lambda p: p.epilogue.c_dtype, dynamic=(0, 1)),
    _ALPHA,
    Operand("beta", "static", lambda p: (p.num_groups,), "float32"),
    _PROB,
    _NORM_CONST,
)

# wgrad: per-expert A[:, T_e] B[:, T_e]^T over the token count T = problem.k (dynamic); problem.m / n are W's rows /
# columns. padded_offsets holds the token ends (no 256 rule for wgrad).
def _token_operand(name: str, rows: str, gathered: str):
    """wgrad's A (m_w, T) / B (n_w, T); gathered (problem.a_rows / b_rows): (m_w / n_w, a_rows / b_rows), its tokens
    picked by the "a_index" / "b_index" vector, not dynamic in T (its own token count is the second extent)."""
    def src(p):
        return getattr(p, gathered)

    return Operand(name, lambda p: "gathered_tokens" if src(p) is not None else "tokens",
                   lambda p: (getattr(p, rows), (p.k if src(p) is None else src(p)) // _per_byte(p)),
                   lambda p: _storage(p.ab_dtype), dynamic=lambda p: (1, _per_byte(p)) if src(p) is None else None)


WGRAD_INPUTS = (
    _token_operand("a", "m", "a_rows"),
    _token_operand("b", "n", "b_rows"),
    Operand("padded_offsets", "static", lambda p: (p.num_groups,), "int32"),
    Operand("a_index", "m_vector", lambda p: (p.k,), "int32", _gathered, dynamic=(0, 1)),
    Operand("b_index", "m_vector", lambda p: (p.k,), "int32", lambda p: p.b_rows is not None, dynamic=(0, 1)),
    Operand("sfa", "sf_segments", lambda p: (sf_segment_bytes(p.m, p.k, p.sf_vec_size),), "uint8", _block_scaled,
            dynamic=lambda p: (0, lambda t: sf_segment_bytes(p.m, t, p.sf_vec_size))),
    Operand("sfb", "sf_segments", lambda p: (sf_segment_bytes(p.n, p.k, p.sf_vec_size),), "uint8", _block_scaled,
            dynamic=lambda p: (0, lambda t: sf_segment_bytes(p.n, t, p.sf_vec_size))),
    Operand("global_scale_a", "static", lambda p: (p.num_groups,), "float32", lambda p: p.has_global_scales),
    Operand("global_scale_b", "static", lambda p: (p.num_groups,), "float32", lambda p: p.has_global_scales),
    Operand("wgrad", "static", lambda p: (p.num_groups, p.m, p.n), lambda p: p.wgrad_dtype, lambda p: p.accumulate),
)

# C of the forward activation ops (the pre-activation; quant has none). The public ops always ask for it; kernel
# variants may leave it out (c_dtype None).
_C_OUT = Operand("c_tensor", "rows", lambda p: (p.m, p.n), lambda p: p.epilogue.c_dtype,
                 lambda p: p.epilogue.c_dtype is not None, ops=("srelu", "glu", "glu_hadamard_quant"), launch="c")
_D_COL = Operand("d_col_tensor", lambda p: "cols_by_m" if p.epilogue.d_dtype == FP4 else "rows", _d_col_shape,
                 lambda p: _storage(p.epilogue.d_dtype), _quant_d, launch="d_col")
_AMAX = Operand("amax_tensor", "static", lambda p: (p.num_groups, 2 if p.op == "dglu" else 1), "float32",
                lambda p: p.epilogue.compute_amax, launch="amax")
_SFD_ROW = Operand("sfd_row_tensor", "sf_rows", lambda p: sf_physical_shape(p.m, p.n_out, MX_VEC), "uint8", _quant_d,
                   launch="sfd_row")
_SFD_COL = Operand("sfd_col_tensor", lambda p: "sf_segments" if p.epilogue.discrete_col_sfd else "sf_cols",
                   _sfd_col_shape, "uint8", _quant_d, launch="sfd_col")

FORWARD_OUTPUTS = (
    _C_OUT,
    Operand("d_tensor", "rows", lambda p: _packed_out(p.m, p.n_out, p.epilogue.d_dtype),
            lambda p: _storage(p.epilogue.d_dtype), launch="d"),
    _D_COL,
    _AMAX,
    _SFD_ROW,
    _SFD_COL,
)


def _rht_present(p) -> bool:
    return p.epilogue.rht is not None


def _rht_shape(p):
    if p.epilogue.rht == "colwise":   # per-expert transposed NVFP4 segments, flat
        return (p.m * p.n_out // 2,)
    return _packed_out(p.m, p.n_out, p.epilogue.rht_dtype)


def _sfrht_shape(p):
    if p.epilogue.rht == "colwise":
        return (sf_segment_bytes(p.n_out, p.m, NVFP4_VEC),)
    return sf_physical_shape(p.m, p.n_out, NVFP4_VEC)


# glu_hadamard_quant: D is bf16 or NVFP4 (packed, with e4m3 vec-16 scales sfd), plus an optional 16-wide Hadamard
# output, rowwise (bf16 or NVFP4) or colwise (NVFP4 segments). No kernel launches it yet: its kinds say how one would.
HADAMARD_OUTPUTS = (
    _C_OUT,
    Operand("d_tensor", "rows", lambda p: _packed_out(p.m, p.n_out, p.epilogue.d_dtype),
            lambda p: _storage(p.epilogue.d_dtype), launch="d"),
    Operand("sfd_tensor", "sf_rows", lambda p: sf_physical_shape(p.m, p.n_out, NVFP4_VEC), "uint8",
            lambda p: p.epilogue.d_dtype == FP4, launch="sfd"),
    _AMAX,
    Operand("rht_tensor", lambda p: "sf_segments" if p.epilogue.rht == "colwise" else "rows", _rht_shape,
            lambda p: _storage(p.epilogue.rht_dtype), _rht_present, launch="rht"),
    Operand("sfrht_tensor", lambda p: "sf_segments" if p.epilogue.rht == "colwise" else "sf_rows", _sfrht_shape,
            "uint8", lambda p: p.epilogue.rht == "colwise" or p.epilogue.rht_dtype == FP4, launch="sfrht"),
)

DGRAD_OUTPUTS = (
    Operand("d_row_tensor", "rows", lambda p: (p.m, p.n_out), lambda p: p.epilogue.d_dtype, launch="d"),
    _D_COL,
    Operand("dprob_tensor", "m_vector", lambda p: (p.m,), "float32",
            partial=Partial("dprob_parts", "tiles_by_m", lambda p, cfg: (dgrad_n_parts(p, cfg), p.m), _sum_tiles)),
    Operand("dbias_tensor", "static", lambda p: (p.num_groups, p.n_out), lambda p: p.epilogue.dbias_dtype,
            lambda p: p.epilogue.dbias_dtype is not None,
            partial=Partial("dbias_parts", "row_tiles", lambda p, cfg: (m_tiles(p), p.n_out), _group_sums)),
    _AMAX,
    _SFD_ROW,
    _SFD_COL,
)

# With accumulate_on_output the launch writes W into the input "wgrad"'s buffer (it reads each tile's old values).
WGRAD_OUTPUTS = (
    Operand("wgrad_tensor", "static", lambda p: (p.num_groups, p.m, p.n), lambda p: p.wgrad_dtype, launch="wgrad",
            alias="wgrad"),
)

TABLES = {
    "quant": (FORWARD_INPUTS, FORWARD_OUTPUTS),
    "srelu": (FORWARD_INPUTS, FORWARD_OUTPUTS),
    "glu": (FORWARD_INPUTS, FORWARD_OUTPUTS),
    "glu_hadamard_quant": (FORWARD_INPUTS, HADAMARD_OUTPUTS),
    "dglu": (DGRAD_INPUTS, DGRAD_OUTPUTS),
    "dsrelu": (DGRAD_INPUTS, DGRAD_OUTPUTS),
    "wgrad": (WGRAD_INPUTS, WGRAD_OUTPUTS),
}


# Launch-only scratch (no op output): the discrete-weights descriptor table of the M-grouped kernels -- one 128-byte
# TMA descriptor per expert and per weight operand (B; block-scaled: SFB), then the experts' base addresses (8 bytes
# each) (kernels/sm90/experts.py; XLA buffers are 256-byte aligned, so every descriptor is 128-byte aligned).
TMA_DESCRIPTOR_BYTES = 128


def expert_descriptor_operands(p) -> int:
    """Weight operands read through per-expert descriptors: B, and SFB when block-scaled."""
    return 2 if p.block_scaled else 1


def _descriptor_table_bytes(p):
    return (expert_descriptor_operands(p) * p.num_groups * (TMA_DESCRIPTOR_BYTES + 8),)


# Staged problems (kernels/sm90/mainloop_staged.py): the bf16 copies of the block-scaled operands the kernel writes
# and reads back, and the ready flags of their 512-wide K chunks -- A's per 128-row tile in an (m, 1) column (at
# most m / 128 * cdiv(K, 512) <= m of them), B's per expert and 128-row block after a header word (the job counter).
# The staged wgrad (kernels/sm90/mainloop_staged_wgrad.py) converts A (m_w, T) and B (n_w, T) into token ranges
# padded to STAGED_TOKEN_TILE per expert ((rows, T + STAGED_TOKEN_TILE * L) bounds them), one flag per 128-row
# block of A, then of B, and 512-token chunk, after the header: the job counter, the GEMM's frontier (word
# STAGED_FRONTIER: the furthest chunk its producers have reached), then from STAGED_TILES_READ one word per expert
# (its CTA tiles that have read their operands: their slabs may leave L2 unwritten).
STAGED_CHUNK_K = 512
STAGED_HEADER_WORDS = 1
STAGED_FRONTIER, STAGED_TILES_READ = 1, 2
STAGED_WGRAD_HEADER_WORDS = STAGED_TILES_READ     # + one word per expert
STAGED_TOKEN_TILE = 64


def half_dtype(p) -> str:
    """The 16-bit type block-scaled operands are converted to (staged here, or by XLA first: _dequant_first): fp16
    beside an fp16 A (where `has_exact_half`), else bf16."""
    return "float16" if p.a_dtype == "float16" else "bfloat16"


def has_exact_half(p) -> bool:
    """Whether `half_dtype` holds both operands of a block-scaled problem exactly: bf16 does (block-scaled or bf16
    A), fp16 only where it holds the dequantized B (`formats.exact_in_float16`)."""
    return p.a_dtype != "float16" or exact_in_float16(p.ab_dtype, p.sf_dtype)


def staged_tokens(p):
    """The staged wgrad's padded token extent: every expert's tokens from a STAGED_TOKEN_TILE boundary."""
    return p.k + STAGED_TOKEN_TILE * p.num_groups


def staged_b_flag_words(p):
    if p.op == "wgrad":
        return (STAGED_WGRAD_HEADER_WORDS + p.num_groups + (cdiv(p.m, 128) + cdiv(p.n, 128))
                * cdiv(staged_tokens(p), STAGED_CHUNK_K),)
    return (STAGED_HEADER_WORDS + p.num_groups * cdiv(p.n, 128) * cdiv(p.k, STAGED_CHUNK_K),)


def _staged_b_shape(p):
    return (p.n, staged_tokens(p)) if p.op == "wgrad" else (p.num_groups, p.n, p.k)


# A staged block-scaled A in the kernel's registers up to this N (fc step TFLOP/s, registers vs A in a workspace:
# NVFP4 / MXFP4 N 2048 (dglu) 745 / 755 vs 656 / 658, N 4096 (fc1) 801 / 817 vs 741 / 744, N 7168 (fc2) 745 / 751 vs
# 749 / 762 (RESULTS run 118); MXFP8 N 2048 690 vs 647 (run 118), N 4096 738 vs 720, N 7168 705 vs 725 (run 119))
STAGED_A_REGISTERS_MAX_N = 4096


def staged_a_in_registers(p) -> bool:
    """Whether a staged problem leaves its block-scaled A to the consumers' registers (converted once per N tile
    into the RS wgmma's operand, B staged in the on-chip K slot order, which permutes within 64-wide stages: K % 64
    == 0) instead of converting it once into a bf16 workspace: per N tile the registers cost one conversion of A
    and save reading a bf16 A stage, the workspace writes A once for all N tiles, so the registers win up to an N
    (`STAGED_A_REGISTERS_MAX_N`; the kernels' default, `Config.dequant_a` "registers" / "workspace" overrides it)."""
    return (p.staged and p.op != "wgrad" and p.a_dtype is None and p.k % 64 == 0
            and p.n <= STAGED_A_REGISTERS_MAX_N)


def _stages_a(p, config=None) -> bool:
    if not (p.staged and p.a_dtype is None):
        return False
    if p.op == "wgrad":
        return True
    return config.dequant_a == "workspace" if config is not None else not staged_a_in_registers(p)


def _wgrad_kind(wgrad: str, other: str) -> Rule:
    """A workspace's kind: `wgrad`'s for the staged wgrad (its shape follows T), else `other`."""
    return lambda p: wgrad if p.op == "wgrad" else other


class Workspace(NamedTuple):
    """A launch-only output that stands for no op output; `present(problem, kernel config or None)`."""

    name: str
    kind: Union[str, Rule]
    shape: Rule
    dtype: Union[str, Rule]
    present: Callable[[Any, Any], bool]

    @property
    def launch(self) -> str:
        return self.name


WORKSPACES = (
    Workspace("expert_descriptors", "static", _descriptor_table_bytes, "uint8",
              lambda p, config=None: p.discrete_weights and p.op != "wgrad"),
    Workspace("staged_a", _wgrad_kind("staged_tokens", "rows"),
              lambda p: (p.m, staged_tokens(p) if p.op == "wgrad" else p.k), "bfloat16", _stages_a),
    Workspace("staged_a_flags", "rows", lambda p: (p.m, 1), "int32",
              lambda p, config=None: p.op != "wgrad" and _stages_a(p, config)),
    Workspace("staged_b", _wgrad_kind("staged_tokens", "static"), _staged_b_shape, half_dtype,
              lambda p, config=None: p.staged),
    Workspace("staged_b_flags", _wgrad_kind("token_chunks", "static"), staged_b_flag_words, "int32",
              lambda p, config=None: p.staged),
)


# ------------------------------------------------------------------------------------------------ derived

def rows(op: str) -> tuple[tuple, tuple]:
    """(input rows, output rows) of `op`, in order."""
    ins, outs = TABLES[op]
    return tuple(r for r in ins if r.ops is None or op in r.ops), tuple(r for r in outs if r.ops is None or op in r.ops)


def input_order(op: str) -> tuple:
    """Every input name `op` can bind, in binding order (present or not)."""
    return tuple(r.name for r in rows(op)[0])


def output_keys(op: str) -> tuple:
    """cuDNN's output keys of `op`, in order: the fields of its OpResult."""
    return tuple(r.name for r in rows(op)[1])


def launch_names() -> frozenset:
    """Every name a launcher may be handed, over all ops."""
    names = set()
    for ins, outs in TABLES.values():
        names.update(r.name for r in ins)
        names.update(r.partial.name if r.partial else r.launch for r in outs)
    names.update(r.launch for r in WORKSPACES)
    return frozenset(names)


def inputs(problem) -> list[Bound]:
    """The problem's present inputs in binding (= launcher) order; discrete weights one per expert (`name:i`)."""
    out = []
    for r in rows(problem.op)[0]:
        if not r.present(problem):
            continue
        kind, dtype = _eval(r.kind, problem), _eval(r.dtype, problem)
        if r.split is not None and problem.discrete_weights:
            out += [Bound(f"{r.name}:{i}", kind, tuple(r.split(problem)), dtype) for i in range(problem.num_groups)]
        else:
            out.append(Bound(r.name, kind, tuple(r.shape(problem)), dtype))
    return out


def input_names(problem) -> tuple:
    return tuple(b.name for b in inputs(problem))


def input_specs(problem) -> dict:
    """{name: (shape, dtype name)} of the present inputs, in binding order."""
    return {b.name: (b.shape, b.dtype) for b in inputs(problem)}


def check_input_names(problem, names) -> None:
    """The contract between a binding and the launchers, which take operands by position: `names` must be the
    problem's present inputs in table order. ValueError naming both lists otherwise."""
    want = input_names(problem)
    if tuple(names) != want:
        raise ValueError(f"{problem.op} operands bound as {list(names)}, but the operand table "
                         f"(cudnn_moe_jax/operands.py) orders this problem's present operands {list(want)}")


def output_specs(problem) -> dict:
    """{cuDNN key: (shape, dtype name), or None when absent} in key order: the primitive's abstract evaluation."""
    return {r.name: ((tuple(r.shape(problem)), _eval(r.dtype, problem)) if r.present(problem) else None)
            for r in rows(problem.op)[1]}


def launch_outputs(problem, config=None) -> list[Bound]:
    """What the launch writes, in launcher order: the present outputs, each partial-summed one as its partial
    (whose shape needs the kernel `config`; None: shape None), then the present workspaces."""
    out = []
    for r in rows(problem.op)[1]:
        if not r.present(problem):
            continue
        if r.partial is not None:
            part = r.partial
            out.append(Bound(part.name, part.kind, None if config is None else tuple(part.shape(problem, config)),
                             part.dtype))
        else:
            out.append(Bound(r.launch, _eval(r.kind, problem), tuple(r.shape(problem)), _eval(r.dtype, problem)))
    out += [Bound(r.launch, _eval(r.kind, problem), tuple(r.shape(problem)), _eval(r.dtype, problem))
            for r in WORKSPACES if r.present(problem, config)]
    return out


def input_output_aliases(problem) -> dict:
    """{input index: output index} over the present launch operands: outputs written into an input's buffer."""
    in_index = {b.name: i for i, b in enumerate(inputs(problem))}
    present = [r for r in rows(problem.op)[1] if r.present(problem)]
    return {in_index[r.alias]: j for j, r in enumerate(present) if r.alias in in_index}


def finish(problem) -> Optional[Callable]:
    """None when the launch writes exactly the op's outputs, else `finish(launch outputs, {input name: array})`
    -> the op's outputs (the partial sums reduced, the workspaces dropped, the rest passed through)."""
    present = [r for r in rows(problem.op)[1] if r.present(problem)]
    if not any(r.partial for r in present) and not any(r.present(problem) for r in WORKSPACES):
        return None

    def reduce(launch_outs, named_inputs):
        # zip stops at the op's outputs: the workspaces come after them
        return [r.partial.reduce(problem, x, named_inputs) if r.partial else x for r, x in zip(present, launch_outs)]

    return reduce


def axis_extent(per, extent):
    """The size of a dynamic axis (`dynamic_axes`' `per`: extent per index, or a function of the extent) at the
    problem's extent (concrete or a jax.export symbolic dimension)."""
    return per(extent) if callable(per) else extent // per


def with_axis_size(aval, axis: int, size):
    """`aval` (a ShapeDtypeStruct) with its axis `axis` of `size` (a dynamic extent: a module's symbolic one)."""
    import jax

    return jax.ShapeDtypeStruct(aval.shape[:axis] + (size,) + aval.shape[axis + 1:], aval.dtype)


def dynamic_axes(problem) -> tuple[str, dict]:
    """("m" or "k": the problem field that is dynamic in a kernel module, {present input name: (axis, extent per
    index)}): the row count m of the M-grouped ops, the token count (k) of wgrad."""
    field = "k" if problem.op == "wgrad" else "m"
    axes = {r.name: _eval(r.dynamic, problem) for r in rows(problem.op)[0] if r.present(problem)}
    return field, {name: tuple(rule) for name, rule in axes.items() if rule is not None}


def gathered_axes(problem) -> dict:
    """{present input name: (axis, problem field)} of the axes that follow a gathered operand's own row / token
    count, a module's further dynamic extents (none without a gather): axis 0 of a gathered A ("gathered_rows",
    a_rows); wgrad's gathered A / B ("gathered_tokens"), axis 1, a_rows / b_rows."""
    out = {}
    for b in inputs(problem):
        if b.kind == "gathered_rows":
            out[b.name] = (0, "a_rows")
        elif b.kind == "gathered_tokens":
            out[b.name] = (1, f"{b.name}_rows")
    return out
