"""Forward ops: grouped GEMM fused with the MoE epilogues (docs/ops.md).

Keyword names follow cuDNN's JAX contract. Every op validates its arguments here (nothing below re-validates),
builds a `GroupedGemmProblem`, binds the primitive and returns an `OpResult` in cuDNN key order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from .. import _primitive, activations
from .._problem import Epilogue, GroupedGemmProblem
from .._results import OpResult
from ..limits import FORWARD_D_DTYPES, FP4, OUT_DTYPES, QUANT_D_DTYPES
from . import _checks as ck

_SF_OUT_KEYS = ("sfd_row_tensor", "sfd_col_tensor", "sfd_tensor", "sfrht_tensor")


def finish(problem: GroupedGemmProblem, outputs: dict, sf_out_dtype: str) -> OpResult:
    """Give SF outputs their scale-factor dtype (they travel as uint8 bit patterns) and wrap the result."""
    for key in _SF_OUT_KEYS:
        if outputs.get(key) is not None:
            outputs[key] = jax.lax.bitcast_convert_type(outputs[key], jnp.dtype(sf_out_dtype))
    return OpResult(tuple(outputs), tuple(outputs.values()))


def output_quantization(d_dtype: str, norm_const_tensor, discrete_col_sfd: bool, compute_amax):
    """Decide SFD generation (FP8 / FP4 D), amax (default: bf16/fp16 D, as cuDNN's wrappers) and check
    norm_const."""
    generate_sfd = d_dtype in QUANT_D_DTYPES
    norm_const = None
    if generate_sfd:
        if norm_const_tensor is None:
            raise ValueError(f"norm_const_tensor is required for a quantized d_dtype ({d_dtype}): it is the global "
                             "encode scale of the SFD quantization (pass jnp.ones((1,), jnp.float32) for none)")
        norm_const = ck.scalar_f32(norm_const_tensor, "norm_const_tensor")
    elif discrete_col_sfd:
        raise ValueError("discrete_col_sfd=True only applies to FP8 outputs (it lays out SFD_col per expert)")
    if compute_amax is None:
        compute_amax = d_dtype in ("bfloat16", "float16")
    return generate_sfd, norm_const, bool(compute_amax)


def output_width(act: Optional[str], dims: dict) -> int:
    """N_out: the activation's output width of N (GLU: half; its N must pair 32-column gate/up blocks)."""
    if act is None:
        return dims["n"]
    entry = activations.get(act)
    if dims["n"] % entry.column_multiple:
        raise ValueError(f"{dims['b_arg']}: N={dims['n']} must be a multiple of {entry.column_multiple} for {act} "
                         "(32-column gate/up blocks)")
    return entry.output_width(dims["n"])


def activation_options(act: Optional[str], glu_limit, glu_alpha, tanh_clamp_scale) -> dict:
    """Validated activation options as Epilogue fields; an option the activation does not use is an error."""
    takes = activations.get(act).options if act is not None else ()
    for option, value in (("glu_limit", glu_limit), ("glu_alpha", glu_alpha), ("tanh_clamp_scale", tanh_clamp_scale)):
        if value is not None and option not in takes:
            users = tuple(a.name for a in activations.TABLE.values() if option in a.options)
            raise ValueError(f"{option} applies to act_func in {users}, not {act!r}")
    return dict(glu_limit=ck.positive_float(glu_limit, "glu_limit"),
                glu_alpha=ck.finite_float(glu_alpha, "glu_alpha"),
                tanh_clamp_scale=ck.positive_float(tanh_clamp_scale, "tanh_clamp_scale"))


def bind_forward(op: str, dims: dict, inputs: dict, epilogue: Epilogue, config, *, alpha_tensor, prob_tensor,
                 sf_out_dtype: str, majors=None, **extra_inputs) -> OpResult:
    """Problem from the operand dims + epilogue, gating inputs (alpha default ones, prob optional), bind, wrap."""
    problem = GroupedGemmProblem(op=op, m=dims["m"], n=dims["n"], k=dims["k"], num_groups=dims["num_groups"],
                                 ab_dtype=dims["ab_dtype"], a_dtype=dims["a_dtype"], sf_dtype=dims["sf_dtype"],
                                 sf_vec_size=dims["vec"], discrete_weights=dims["discrete"], epilogue=epilogue,
                                 m_aligned=dims["m_aligned"], a_rows=dims["a_rows"], **(majors or {}))
    inputs.update(alpha=ck.float_vector(alpha_tensor, dims["num_groups"], "alpha_tensor", default=1.0),
                  prob=ck.float_vector(prob_tensor, dims["m"], "prob_tensor"), **extra_inputs)
    return finish(problem, _primitive.bind(problem, inputs, config), sf_out_dtype)


def _forward(op: str, act: Optional[str], *, a_tensor, b_tensor, b_tensors, sfa_tensor, sfb_tensor,
             sfb_tensors, padded_offsets, alpha_tensor, prob_tensor, bias_tensor, norm_const_tensor, c_dtype,
             d_dtype, sf_vec_size, discrete_col_sfd, compute_amax, a_index, glu_limit=None, glu_alpha=None,
             tanh_clamp_scale=None, static_kwargs=None):
    static_kwargs = dict(static_kwargs or {})
    majors = ck.operand_majors(static_kwargs)
    m_aligned = ck.pop_m_aligned(static_kwargs)
    config = ck.check_static_kwargs(**static_kwargs)
    inputs, dims = ck.gemm_operands(a_tensor, b_tensor, b_tensors, sfa_tensor, sfb_tensor, sfb_tensors,
                                    padded_offsets, sf_vec_size, m_aligned, a_index=a_index)
    d_dtype = ck.out_dtype(d_dtype, "d_dtype", FORWARD_D_DTYPES)
    if d_dtype in QUANT_D_DTYPES:
        kind = "FP4" if d_dtype == FP4 else "FP8"
        ck.check_sf_alignment(m_aligned, f"an {kind} d_dtype ({d_dtype}: SFD_row, D_col, SFD_col)")
    if op != "quant":                      # srelu/glu always produce C (docs/ops.md): None is not "no C"
        c_dtype = ck.out_dtype(c_dtype, "c_dtype", OUT_DTYPES, "C is stored unscaled (bf16 / fp16 / fp32 / FP8): "
                               "an FP4 C would have no scale factors")
    n_out = output_width(act, dims)
    row_values = 32 if d_dtype == FP4 else 16          # 16-byte rows of D (FP4: two values a byte)
    if d_dtype in QUANT_D_DTYPES and n_out % row_values:
        raise ValueError(f"d_dtype {d_dtype}: N_out={n_out} must be a multiple of {row_values} (16-byte rows)")
    generate_sfd, norm_const, compute_amax = output_quantization(d_dtype, norm_const_tensor, discrete_col_sfd,
                                                                 compute_amax)
    bias, bias_dtype = ck.bias_array(bias_tensor, dims["num_groups"], dims["n"])
    epilogue = Epilogue(act=act, has_bias=bias is not None, bias_dtype=bias_dtype, has_prob=prob_tensor is not None,
                        c_dtype=c_dtype, d_dtype=d_dtype, compute_amax=compute_amax, generate_sfd=generate_sfd,
                        discrete_col_sfd=bool(discrete_col_sfd),
                        **activation_options(act, glu_limit, glu_alpha, tanh_clamp_scale))
    return bind_forward(op, dims, inputs, epilogue, config, alpha_tensor=alpha_tensor, prob_tensor=prob_tensor,
                        sf_out_dtype="float8_e8m0fnu", majors=majors, bias=bias, norm_const=norm_const)


def grouped_gemm_quant(a_tensor, b_tensor=None, sfa_tensor=None, sfb_tensor=None, padded_offsets=None,
                       alpha_tensor=None, prob_tensor=None, bias_tensor=None, norm_const_tensor=None, *,
                       b_tensors: Optional[Sequence] = None, sfb_tensors: Optional[Sequence] = None,
                       d_dtype="bfloat16", sf_vec_size: Optional[int] = None, discrete_col_sfd: bool = False,
                       compute_amax: Optional[bool] = None, a_index=None, **cudnn_static) -> OpResult:
    """Grouped GEMM + per-row gating + optional bias + output quantization (FC2 fprop / FC1 dgrad).

    a_tensor (m, K), or (T, K) with a_index (m,) int32 naming the row each GEMM row reads (outside [0, T): zeros;
    docs/ops.md#gathered-a-rows); b_tensor (L, N, K) or b_tensors [L x (N, K)]; padded_offsets (L,) int32 group
    ends; alpha (L,) f32 (default ones); prob (m,) (default ones); bias (L, N).
    D = prob * alpha * acc, or alpha * acc + prob * bias with a bias (docs/ops.md#grouped_gemm_quant).
    Returns d_tensor, d_col_tensor, amax_tensor, sfd_row_tensor, sfd_col_tensor.
    """
    return _forward("quant", None, a_tensor=a_tensor, b_tensor=b_tensor, b_tensors=b_tensors,
                    sfa_tensor=sfa_tensor, sfb_tensor=sfb_tensor, sfb_tensors=sfb_tensors,
                    padded_offsets=padded_offsets, alpha_tensor=alpha_tensor, prob_tensor=prob_tensor,
                    bias_tensor=bias_tensor, norm_const_tensor=norm_const_tensor, c_dtype=None, d_dtype=d_dtype,
                    sf_vec_size=sf_vec_size, discrete_col_sfd=discrete_col_sfd, compute_amax=compute_amax,
                    a_index=a_index, static_kwargs=cudnn_static)


def grouped_gemm_srelu(a_tensor, b_tensor=None, sfa_tensor=None, sfb_tensor=None, padded_offsets=None,
                       alpha_tensor=None, prob_tensor=None, bias_tensor=None, norm_const_tensor=None, *,
                       b_tensors=None, sfb_tensors=None, c_dtype="bfloat16", d_dtype="bfloat16",
                       sf_vec_size=None, discrete_col_sfd=False, compute_amax=None,
                       tanh_clamp_scale: Optional[float] = None, a_index=None, **cudnn_static) -> OpResult:
    """Grouped GEMM + squared ReLU (FC1 fprop): C = alpha*acc (+ bias), D = prob * relu(C)^2.

    With tanh_clamp_scale s: D = prob * (s * min(tanh(relu(C) / s), 1))^2.
    Returns c_tensor, d_tensor, d_col_tensor, amax_tensor, sfd_row_tensor, sfd_col_tensor.
    """
    return _forward("srelu", "srelu", a_tensor=a_tensor, b_tensor=b_tensor, b_tensors=b_tensors,
                    sfa_tensor=sfa_tensor, sfb_tensor=sfb_tensor, sfb_tensors=sfb_tensors,
                    padded_offsets=padded_offsets, alpha_tensor=alpha_tensor, prob_tensor=prob_tensor,
                    bias_tensor=bias_tensor, norm_const_tensor=norm_const_tensor, c_dtype=c_dtype,
                    d_dtype=d_dtype, sf_vec_size=sf_vec_size, discrete_col_sfd=discrete_col_sfd,
                    compute_amax=compute_amax, tanh_clamp_scale=tanh_clamp_scale, a_index=a_index,
                    static_kwargs=cudnn_static)


def grouped_gemm_glu(a_tensor, b_tensor=None, sfa_tensor=None, sfb_tensor=None, padded_offsets=None,
                     alpha_tensor=None, prob_tensor=None, bias_tensor=None, norm_const_tensor=None, *,
                     b_tensors=None, sfb_tensors=None, act_func: str = "swiglu", c_dtype="bfloat16",
                     d_dtype="bfloat16", sf_vec_size=None, discrete_col_sfd=False, compute_amax=None,
                     glu_limit: Optional[float] = None, glu_alpha: Optional[float] = None, a_index=None,
                     **cudnn_static) -> OpResult:
    """Grouped GEMM + SwiGLU/GeGLU (FC1 fprop). Even 32-column blocks of C are the gate, odd blocks the up half.

    C = alpha*acc (+ bias) (m, N); D = glu_alpha * prob * act(gate, up) (m, N/2).
    Returns c_tensor, d_tensor, d_col_tensor, amax_tensor, sfd_row_tensor, sfd_col_tensor.
    """
    ck.check_choice(act_func, activations.GLU_NAMES, "act_func")
    return _forward("glu", act_func, a_tensor=a_tensor, b_tensor=b_tensor, b_tensors=b_tensors,
                    sfa_tensor=sfa_tensor, sfb_tensor=sfb_tensor, sfb_tensors=sfb_tensors,
                    padded_offsets=padded_offsets, alpha_tensor=alpha_tensor, prob_tensor=prob_tensor,
                    bias_tensor=bias_tensor, norm_const_tensor=norm_const_tensor, c_dtype=c_dtype,
                    d_dtype=d_dtype, sf_vec_size=sf_vec_size, discrete_col_sfd=discrete_col_sfd,
                    compute_amax=compute_amax, glu_limit=glu_limit, glu_alpha=glu_alpha, a_index=a_index,
                    static_kwargs=cudnn_static)


def grouped_gemm_swiglu(a_tensor, b_tensor=None, sfa_tensor=None, sfb_tensor=None, padded_offsets=None,
                        alpha_tensor=None, prob_tensor=None, norm_const_tensor=None, *, c_dtype="bfloat16",
                        d_dtype="bfloat16", sf_vec_size=None, discrete_col_sfd=False, compute_amax=None,
                        **cudnn_static) -> OpResult:
    """Legacy contiguous SwiGLU (= grouped_gemm_glu with act_func="swiglu", dense weights, no bias)."""
    return grouped_gemm_glu(a_tensor, b_tensor, sfa_tensor, sfb_tensor, padded_offsets, alpha_tensor,
                            prob_tensor, None, norm_const_tensor, act_func="swiglu", c_dtype=c_dtype,
                            d_dtype=d_dtype, sf_vec_size=sf_vec_size, discrete_col_sfd=discrete_col_sfd,
                            compute_amax=compute_amax, **cudnn_static)
