"""Static description of one grouped-GEMM call: the compile key of every backend.

A `GroupedGemmProblem` is built once per call by the public ops (after validation) and carried through the
primitive as a parameter. It is frozen and hashable; it holds shapes and dtypes that are static under `jax.jit`
and the epilogue recipe. Runtime data (group sizes, `valid_m`) never appears here: one compiled kernel serves
every routing draw of the same shapes. The operands of a problem (shapes, dtypes, presence, order) are rules over it
in the operand table, `cudnn_moe_jax.operands`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import activations
from .limits import GROUP_ALIGN, M_ALIGNED_CHOICES

# Op names (the public op each problem comes from).
FORWARD_OPS = ("quant", "srelu", "glu", "glu_hadamard_quant")
DGRAD_OPS = ("dglu", "dsrelu")             # M-grouped backward: the FC2 dgrad fused with the activation derivative
BACKWARD_OPS = DGRAD_OPS + ("wgrad",)
OPS = FORWARD_OPS + BACKWARD_OPS
# The ops whose A rows may be gathered (`a_rows`, the public ops' `a_index`): the M-grouped ops but the Hadamard one.
GATHER_OPS = tuple(op for op in FORWARD_OPS if op != "glu_hadamard_quant") + DGRAD_OPS


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What happens to the fp32 accumulator tile before it is stored.

    act: None (quant: plain alpha*acc), a forward act_func of the activation table (activations.py: "srelu",
    "swiglu", ...) or a backward one ("dsrelu", "dswiglu", ...: the GEMM is the FC2 dgrad, C is the saved forward
    pre-activation read as an input). glu_limit / glu_alpha / tanh_clamp_scale: the activation's options (None:
    its default).
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

    m: GEMM rows (a multiple of m_aligned; the rows of A, or of `a_index` when A is gathered); n: columns of the
    GEMM output (rows of each expert weight); k: logical reduction length; num_groups: L. For wgrad, m/n are the
    weight-gradient rows/cols and k the token count.
    m_aligned: every group end is a multiple of it (cuDNN's keyword; 256 by default, 1 = padding-free groups;
    docs/offsets.md). wgrad's token offsets have no alignment rule: it stays 256 there.
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
    # A's storage dtype where it is not ab_dtype: bf16 A with block-scaled B (weight-only quantization; ab_dtype,
    # sf_dtype, sf_vec_size then describe B, and A has no scale factors). None: A is ab_dtype.
    a_dtype: Optional[str] = None
    # Memory order of the operands (a performance hint; the math is the same): "k" = K contiguous (the canonical
    # row-major A (m, K), B (L, N, K)); "m" / "n" = A's M / B's N contiguous. A kernel then asks XLA for that
    # layout, so a transposed activation or weight (`x.T`, `jnp.swapaxes(w, 1, 2)`) reaches it without a copy.
    a_major: str = "k"
    b_major: str = "k"
    m_aligned: int = GROUP_ALIGN
    # Gathered A: A is (a_rows, K) in memory and the input `a_index` (m,) int32 names the A row of each GEMM row
    # (outside [0, a_rows): a zero row). None: A is (m, K). wgrad: A is (m, a_rows) (token-major) and `a_index` (T,)
    # names A's token of each of the T tokens; b_rows / `b_index` likewise for B (n, b_rows) (wgrad only).
    a_rows: Optional[int] = None
    b_rows: Optional[int] = None
    # Block-scaled operands converted once, inside the kernel, into bf16 workspaces that the bf16 mainloop reads,
    # beside the GEMM (kernels/sm90/mainloop_staged.py): how the kernel runs, not what it computes.
    staged: bool = False

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}")
        if self.m_aligned not in M_ALIGNED_CHOICES:
            raise ValueError(f"m_aligned must be one of {M_ALIGNED_CHOICES}, got {self.m_aligned!r}")
        if self.a_major not in ("k", "m") or self.b_major not in ("k", "n"):
            raise ValueError(f"a_major must be 'k' or 'm' and b_major 'k' or 'n', got {self.a_major!r}, "
                             f"{self.b_major!r}")
        if self.a_rows is not None and self.op not in GATHER_OPS + ("wgrad",):
            raise ValueError(f"a_rows (gathered A rows) applies to the ops {GATHER_OPS + ('wgrad',)}, "
                             f"not {self.op!r}")
        if self.b_rows is not None and self.op != "wgrad":
            raise ValueError(f"b_rows (gathered B tokens) applies to wgrad only, not {self.op!r}")

    @property
    def block_scaled(self) -> bool:
        return self.sf_dtype is not None

    @property
    def n_out(self) -> int:
        """Width of D: the activation's output width of N (GLU: half); backward D_row is dC, as wide as C (the
        activation's input width of N)."""
        if self.op == "wgrad" or self.epilogue.act is None:
            return self.n
        act = activations.get(self.epilogue.act, "act")
        return act.input_width(self.n) if self.op in BACKWARD_OPS else act.output_width(self.n)
