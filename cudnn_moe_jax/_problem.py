"""Static description of one grouped-GEMM call: the compile key of every backend.

A `GroupedGemmProblem` is built once per call by the public ops (after validation) and carried through the
primitive as a parameter. It is frozen and hashable; it holds shapes and dtypes that are static under `jax.jit`
and the epilogue recipe. Runtime data (group sizes, `valid_m`) never appears here: one compiled kernel serves
every routing draw of the same shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import activations

# Expert groups along M are padded to this many rows (cuDNN's m_aligned / FIX_PAD_SIZE, docs/offsets.md): every
# group end is a multiple of it, so no 128/256-row tile, SF row block or 32-row column-quant block spans two groups.
# The one copy of this constant: kernels/scheduler.py and kernels/sm90/jax_bridge.py import it.
GROUP_ALIGN = 256

# Inputs whose shape involves m (the row count of A, dynamic in the kernels): name -> (axis, rows per index along
# that axis). a (m, K), prob (m,), sfa (1, m/128, Kb, 32, 4, 4), the backward ops' saved c (m, N_out); every other
# input is static. Outputs: `output_specs`.
M_AXES = {"a": (0, 1), "prob": (0, 1), "sfa": (1, 128), "c": (0, 1)}

# wgrad's dynamic extent is the token count T (= problem.k; its m is the static weight rows): a (m_w, T),
# b (n_w, T), packed FP4 (., T/2). Every T the public op accepts is a multiple of TOKEN_ALIGN (16-byte rows of
# 16-bit tokens; FP8 / FP4 need more), so one module compiled for T = TOKEN_ALIGN * t_blocks serves them all.
T_AXES = {"a": (1, 1), "b": (1, 1)}
TOKEN_ALIGN = 8


def dynamic_axes(problem) -> tuple[str, dict]:
    """("m" or "k": the problem field that is dynamic in its kernel module, {input name: (axis, extent per
    index)}): M_AXES for the M-grouped ops, T_AXES for wgrad (two tokens per byte for packed FP4)."""
    if problem.op == "wgrad":
        per = 2 if problem.ab_dtype == "float4_e2m1fn" else 1
        return "k", {name: (axis, per) for name, (axis, _) in T_AXES.items()}
    return "m", M_AXES

# Op names (the public op each problem comes from).
FORWARD_OPS = ("quant", "srelu", "glu", "glu_hadamard_quant")
BACKWARD_OPS = ("dglu", "dsrelu", "wgrad")
OPS = FORWARD_OPS + BACKWARD_OPS

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
HALF_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What happens to the fp32 accumulator tile before it is stored.

    act: None (quant: plain alpha*acc), "srelu", "swiglu", "geglu" (forward) or "dswiglu", "dgeglu", "dsrelu"
    (backward: the GEMM is the FC2 dgrad, C is the saved forward pre-activation read as an input).
    """

    act: Optional[str] = None
    has_bias: bool = False
    bias_dtype: Optional[str] = None
    has_prob: bool = True
    glu_limit: Optional[float] = None
    glu_alpha: Optional[float] = None
    tanh_clamp_scale: Optional[float] = None
    c_dtype: Optional[str] = None          # dtype of the C output (forward) or C input (backward); None: no C
    d_dtype: str = "bfloat16"              # dtype of D (forward) / D_row (backward)
    compute_amax: bool = False
    generate_sfd: bool = False             # FP8 D with SFD_row, D_col, SFD_col (norm_const input)
    discrete_col_sfd: bool = False
    dbias_dtype: Optional[str] = None      # backward: dbias output dtype (None: no dbias)
    # glu_hadamard_quant only
    rht: Optional[str] = None              # None | "rowwise" | "colwise"
    rht_dtype: Optional[str] = None
    has_hadamard: bool = False

    @property
    def is_glu(self) -> bool:
        return self.act is not None and activations.get(self.act, "act").glu


@dataclasses.dataclass(frozen=True)
class GroupedGemmProblem:
    """One grouped GEMM `acc[m, n] = sum_k A[m, k] * B[g(m), n, k]` plus its epilogue.

    m: rows of A (multiple of 256); n: columns of the GEMM output (rows of each expert weight); k: logical
    reduction length; num_groups: L. For wgrad, m/n are the weight-gradient rows/cols and k the token count.
    """

    op: str
    m: int
    n: int
    k: int
    num_groups: int
    ab_dtype: str
    sf_dtype: Optional[str] = None          # None for bf16/fp16 inputs
    sf_vec_size: Optional[int] = None
    discrete_weights: bool = False
    epilogue: Epilogue = Epilogue()
    # wgrad only
    wgrad_dtype: Optional[str] = None
    has_global_scales: bool = False
    accumulate: bool = False
    # Memory order of the operands (a performance hint; the math is the same): "k" = K contiguous (the canonical
    # row-major A (m, K), B (L, N, K)); "m" / "n" = A's M / B's N contiguous. A kernel then asks XLA for that
    # layout, so a transposed activation or weight (`x.T`, `jnp.swapaxes(w, 1, 2)`) reaches it without a copy.
    a_major: str = "k"
    b_major: str = "k"

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}")
        if self.a_major not in ("k", "m") or self.b_major not in ("k", "n"):
            raise ValueError(f"a_major must be 'k' or 'm' and b_major 'k' or 'n', got {self.a_major!r}, "
                             f"{self.b_major!r}")

    @property
    def block_scaled(self) -> bool:
        return self.sf_dtype is not None

    @property
    def n_out(self) -> int:
        """Width of D: half of N for the forward GLU ops, N otherwise (backward D_row is dC, as wide as C)."""
        if self.op in ("glu", "glu_hadamard_quant") and self.epilogue.is_glu:
            return self.n // 2
        if self.op == "dglu":
            return 2 * self.n
        return self.n


# ---------------------------------------------------------------------------------------------------------------
# Output names (cuDNN key order) and static output shapes: the abstract evaluation of the primitive.

OUTPUT_KEYS = {
    "quant": ("d_tensor", "d_col_tensor", "amax_tensor", "sfd_row_tensor", "sfd_col_tensor"),
    "srelu": ("c_tensor", "d_tensor", "d_col_tensor", "amax_tensor", "sfd_row_tensor", "sfd_col_tensor"),
    "glu": ("c_tensor", "d_tensor", "d_col_tensor", "amax_tensor", "sfd_row_tensor", "sfd_col_tensor"),
    "glu_hadamard_quant": ("c_tensor", "d_tensor", "sfd_tensor", "amax_tensor", "rht_tensor", "sfrht_tensor"),
    "dglu": ("d_row_tensor", "d_col_tensor", "dprob_tensor", "dbias_tensor", "amax_tensor", "sfd_row_tensor",
             "sfd_col_tensor"),
    "dsrelu": ("d_row_tensor", "d_col_tensor", "dprob_tensor", "dbias_tensor", "amax_tensor", "sfd_row_tensor",
               "sfd_col_tensor"),
    "wgrad": ("wgrad_tensor",),
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sf_shape(rows: int, cols: int, vec: int) -> tuple:
    """Physical MMA-tiled scale-factor shape of one (rows, cols) operand, L = 1 (docs/formats.md, scale-factor
    layout)."""
    return (1, cdiv(rows, 128), cdiv(cdiv(cols, vec), 4), 32, 4, 4)


def sf_segment_bytes(rows: int, tokens: int, vec: int) -> int:
    """Bytes of a per-expert segmented SF buffer (docs/formats.md#segmented-layout): equal to the contiguous
    buffer's size."""
    return cdiv(rows, 128) * 128 * cdiv(cdiv(tokens, vec), 4) * 4


def output_specs(p: GroupedGemmProblem) -> dict:
    """name -> (shape, dtype name) for every output the problem produces, in cuDNN key order (absent: None).

    The one table of output shapes: the primitive's abstract eval and the kernels' `cutlass_call` output shapes
    (kernels/sm90/jax_bridge.py) both read it. `p.m` may be a jax.export symbolic dimension."""
    e = p.epilogue
    m, n_out = p.m, p.n_out
    out = dict.fromkeys(OUTPUT_KEYS[p.op])
    if p.op == "wgrad":
        out["wgrad_tensor"] = ((p.num_groups, p.m, p.n), p.wgrad_dtype)
        return out
    amax_cols = 2 if p.op == "dglu" else 1
    if e.compute_amax:
        out["amax_tensor"] = ((p.num_groups, amax_cols), "float32")
    if p.op == "glu_hadamard_quant":
        out["c_tensor"] = ((m, p.n), e.c_dtype)

        def row_major(key, sf_key, dtype):
            # NVFP4: packed (m, N_out/2) bytes + e4m3 vec-16 scales; otherwise plain (m, N_out).
            if dtype == "float4_e2m1fn":
                out[key], out[sf_key] = ((m, n_out // 2), "uint8"), (sf_shape(m, n_out, 16), "uint8")
            else:
                out[key] = ((m, n_out), dtype)

        row_major("d_tensor", "sfd_tensor", e.d_dtype)
        if e.rht == "rowwise":
            row_major("rht_tensor", "sfrht_tensor", e.rht_dtype)
        elif e.rht == "colwise":
            out["rht_tensor"] = ((m * n_out // 2,), "uint8")
            out["sfrht_tensor"] = ((sf_segment_bytes(n_out, m, 16),), "uint8")
        return out
    main = "d_tensor" if p.op in FORWARD_OPS else "d_row_tensor"
    out[main] = ((m, n_out), e.d_dtype)
    if p.op in ("srelu", "glu") and e.c_dtype is not None:  # the public ops always ask for C; kernel variants may not
        out["c_tensor"] = ((m, p.n), e.c_dtype)
    if p.op in ("dglu", "dsrelu"):
        out["dprob_tensor"] = ((m,), "float32")
        if e.dbias_dtype is not None:
            out["dbias_tensor"] = ((p.num_groups, n_out), e.dbias_dtype)
    if e.generate_sfd:
        out["d_col_tensor"] = ((m, n_out), e.d_dtype)
        out["sfd_row_tensor"] = (sf_shape(m, n_out, 32), "uint8")
        if e.discrete_col_sfd:
            out["sfd_col_tensor"] = ((sf_segment_bytes(n_out, m, 32),), "uint8")
        else:
            out["sfd_col_tensor"] = (sf_shape(n_out, m, 32), "uint8")
    return out
