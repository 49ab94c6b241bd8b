"""Explicit fused backward ops (docs/ops.md): exact gradients of the forward ops.

dglu / dsrelu: the FC2 dgrad GEMM (A = dY (m, H), B = FC2 weight transposed to (L, I, H)) fused with the
activation derivative evaluated on the saved forward pre-activation C. wgrad: per-expert A[:, T_e] B[:, T_e]^T.
"""

from __future__ import annotations

from typing import Optional

from .. import _primitive, activations
from .._problem import Epilogue, GroupedGemmProblem
from .._results import OpResult
from ..formats import sf_segment_bytes
from ..limits import DBIAS_DTYPES, FLOAT_OUT_DTYPES, FP8_DTYPES, HALF_DTYPES, MAX_GROUPS, OUT_DTYPES
from . import _checks as ck
from .forward import finish, output_quantization


def _dact(op, act, *, a_tensor, b_tensor, b_tensors, c_tensor, sfa_tensor, sfb_tensor, sfb_tensors,
          padded_offsets, alpha_tensor, beta_tensor, prob_tensor, norm_const_tensor, d_dtype, sf_vec_size,
          discrete_col_sfd, compute_amax, generate_dbias, dbias_dtype, a_index=None, glu_limit=None,
          glu_alpha=None, tanh_clamp_scale=None, static_kwargs=None, drop_keys=()):
    static_kwargs = dict(static_kwargs or {})
    majors = ck.operand_majors(static_kwargs)
    m_aligned = ck.pop_m_aligned(static_kwargs)
    config = ck.check_static_kwargs(**static_kwargs)
    inputs, dims = ck.gemm_operands(a_tensor, b_tensor, b_tensors, sfa_tensor, sfb_tensor, sfb_tensors,
                                    padded_offsets, sf_vec_size, m_aligned, a_index=a_index)
    m, n, num_groups = dims["m"], dims["n"], dims["num_groups"]
    entry = activations.get(act)
    c_width = entry.input_width(n)
    if c_width % entry.column_multiple:
        raise ValueError(f"{dims['b_arg']}: N={n} (= I, the GLU output width) must be a multiple of "
                         f"{entry.output_width(entry.column_multiple)}")
    c = ck.squeeze_unit(ck.array(c_tensor, "c_tensor"), 2, "c_tensor", f"({m}, {c_width})")
    if tuple(c.shape) != (m, c_width):
        raise ValueError(f"c_tensor (the saved forward pre-activation) must have shape ({m}, {c_width}), got "
                         f"{tuple(c.shape)}")
    c_dtype = ck.out_dtype(c.dtype.name, "c_tensor dtype", OUT_DTYPES, "the saved C is never FP4 (the forward "
                           "ops store C as bf16 / fp16 / fp32 / FP8)")
    d_dtype = ck.out_dtype(d_dtype, "d_dtype", OUT_DTYPES, "cuDNN's dglu / dsrelu write D_row as FP8 (with SFD) or "
                           "bf16 / fp16 / fp32 only (docs/ops.md#grouped_gemm_dglu)")
    if d_dtype in FP8_DTYPES:
        ck.check_sf_alignment(m_aligned, f"an FP8 d_dtype ({d_dtype}: SFD_row, D_col, SFD_col)")
    if d_dtype in FP8_DTYPES and c_width % 16:
        raise ValueError(f"d_dtype {d_dtype}: output width {c_width} must be a multiple of 16")
    generate_sfd, norm_const, compute_amax = output_quantization(d_dtype, norm_const_tensor, discrete_col_sfd,
                                                                 compute_amax)
    if generate_dbias:
        dbias_dtype = ck.out_dtype(dbias_dtype or "bfloat16", "dbias_dtype", DBIAS_DTYPES)
    elif dbias_dtype is not None:
        raise ValueError("dbias_dtype needs generate_dbias=True")
    epilogue = Epilogue(act=act, has_prob=prob_tensor is not None,
                        glu_limit=ck.positive_float(glu_limit, "glu_limit"),
                        glu_alpha=ck.finite_float(glu_alpha, "glu_alpha"),
                        tanh_clamp_scale=ck.positive_float(tanh_clamp_scale, "tanh_clamp_scale"),
                        c_dtype=c_dtype, d_dtype=d_dtype, compute_amax=compute_amax, generate_sfd=generate_sfd,
                        discrete_col_sfd=bool(discrete_col_sfd), dbias_dtype=dbias_dtype if generate_dbias else None)
    problem = GroupedGemmProblem(op=op, m=m, n=n, k=dims["k"], num_groups=num_groups, ab_dtype=dims["ab_dtype"],
                                 a_dtype=dims["a_dtype"], sf_dtype=dims["sf_dtype"], sf_vec_size=dims["vec"],
                                 discrete_weights=dims["discrete"], epilogue=epilogue, m_aligned=m_aligned,
                                 a_rows=dims["a_rows"], **majors)
    inputs.update(c=c, alpha=ck.float_vector(alpha_tensor, num_groups, "alpha_tensor", default=1.0),
                  beta=ck.float_vector(beta_tensor, num_groups, "beta_tensor", default=1.0),
                  prob=ck.float_vector(prob_tensor, m, "prob_tensor"), norm_const=norm_const)
    result = finish(problem, _primitive.bind(problem, inputs, config), "float8_e8m0fnu")
    if drop_keys:
        result = type(result)(*zip(*[(k, v) for k, v in result.items() if k not in drop_keys]))
    return result


def grouped_gemm_dglu(a_tensor, b_tensor=None, c_tensor=None, sfa_tensor=None, sfb_tensor=None,
                      padded_offsets=None, alpha_tensor=None, beta_tensor=None, prob_tensor=None,
                      norm_const_tensor=None, *, b_tensors=None, sfb_tensors=None, act_func: str = "dswiglu",
                      d_dtype="bfloat16", sf_vec_size=None, discrete_col_sfd=False, compute_amax=None,
                      generate_dbias: bool = False, dbias_dtype=None, glu_limit: Optional[float] = None,
                      glu_alpha: Optional[float] = None, a_index=None, **cudnn_static) -> OpResult:
    """FC2 dgrad fused with the GLU derivative.

    a_tensor = dY (m, H) (or (T, H) gathered by a_index (m,) int32, as the forward ops); b_tensor = FC2 weight as
    (L, I, H); c_tensor = forward C (m, 2I) (gate/up interleaved in 32-column blocks), dequantized per group by
    beta (default ones). dD = alpha * acc;
    D_row = dC (m, 2I); dprob (m,) = sum_n dD * glu_alpha * act(gate, up); dbias (L, 2I) = per-group sums of dC;
    amax (L, 2) = max |d_gate|, max |d_up|. Use the same act/glu_limit/glu_alpha as the forward op.
    Returns d_row_tensor, d_col_tensor, dprob_tensor, dbias_tensor, amax_tensor, sfd_row_tensor, sfd_col_tensor.
    """
    ck.check_choice(act_func, activations.GLU_DERIVATIVES, "act_func")
    return _dact("dglu", act_func, a_tensor=a_tensor, b_tensor=b_tensor, b_tensors=b_tensors, c_tensor=c_tensor,
                 sfa_tensor=sfa_tensor, sfb_tensor=sfb_tensor, sfb_tensors=sfb_tensors,
                 padded_offsets=padded_offsets, alpha_tensor=alpha_tensor, beta_tensor=beta_tensor,
                 prob_tensor=prob_tensor, norm_const_tensor=norm_const_tensor, d_dtype=d_dtype,
                 sf_vec_size=sf_vec_size, discrete_col_sfd=discrete_col_sfd, compute_amax=compute_amax,
                 generate_dbias=generate_dbias, dbias_dtype=dbias_dtype, a_index=a_index, glu_limit=glu_limit,
                 glu_alpha=glu_alpha, static_kwargs=cudnn_static)


def grouped_gemm_dswiglu(a_tensor, b_tensor=None, c_tensor=None, sfa_tensor=None, sfb_tensor=None,
                         padded_offsets=None, alpha_tensor=None, beta_tensor=None, prob_tensor=None,
                         norm_const_tensor=None, *, d_dtype="bfloat16", sf_vec_size=None, discrete_col_sfd=False,
                         compute_amax=None, **cudnn_static) -> OpResult:
    """Legacy dSwiGLU (= grouped_gemm_dglu with act_func="dswiglu", no dbias).

    Returns d_row_tensor, d_col_tensor, dprob_tensor, amax_tensor, sfd_row_tensor, sfd_col_tensor.
    """
    return _dact("dglu", "dswiglu", a_tensor=a_tensor, b_tensor=b_tensor, b_tensors=None, c_tensor=c_tensor,
                 sfa_tensor=sfa_tensor, sfb_tensor=sfb_tensor, sfb_tensors=None, padded_offsets=padded_offsets,
                 alpha_tensor=alpha_tensor, beta_tensor=beta_tensor, prob_tensor=prob_tensor,
                 norm_const_tensor=norm_const_tensor, d_dtype=d_dtype, sf_vec_size=sf_vec_size,
                 discrete_col_sfd=discrete_col_sfd, compute_amax=compute_amax, generate_dbias=False,
                 dbias_dtype=None, static_kwargs=cudnn_static, drop_keys=("dbias_tensor",))


def grouped_gemm_dsrelu(a_tensor, b_tensor=None, c_tensor=None, sfa_tensor=None, sfb_tensor=None,
                        padded_offsets=None, alpha_tensor=None, beta_tensor=None, prob_tensor=None,
                        norm_const_tensor=None, *, b_tensors=None, sfb_tensors=None, d_dtype="bfloat16",
                        sf_vec_size=None, discrete_col_sfd=False, compute_amax=None, generate_dbias: bool = False,
                        dbias_dtype=None, tanh_clamp_scale: Optional[float] = None, a_index=None,
                        **cudnn_static) -> OpResult:
    """FC2 dgrad fused with the squared-ReLU derivative (mirrors dglu, docs/ops.md#grouped_gemm_dsrelu).

    a_tensor = dY (m, H) (or (T, H) gathered by a_index, as dglu); b_tensor = FC2 weight as (L, I, H); c_tensor =
    forward pre-activation (m, I) (x = beta*C).
    dC = alpha*acc * prob * d/dx relu(x)^2 (or its tanh-clamped form); dprob = sum_n dD * relu(x)^2.
    Returns d_row_tensor, d_col_tensor, dprob_tensor, dbias_tensor, amax_tensor, sfd_row_tensor, sfd_col_tensor.
    """
    return _dact("dsrelu", "dsrelu", a_tensor=a_tensor, b_tensor=b_tensor, b_tensors=b_tensors,
                 c_tensor=c_tensor, sfa_tensor=sfa_tensor, sfb_tensor=sfb_tensor, sfb_tensors=sfb_tensors,
                 padded_offsets=padded_offsets, alpha_tensor=alpha_tensor, beta_tensor=beta_tensor,
                 prob_tensor=prob_tensor, norm_const_tensor=norm_const_tensor, d_dtype=d_dtype,
                 sf_vec_size=sf_vec_size, discrete_col_sfd=discrete_col_sfd, compute_amax=compute_amax,
                 generate_dbias=generate_dbias, dbias_dtype=dbias_dtype, a_index=a_index,
                 tanh_clamp_scale=tanh_clamp_scale, static_kwargs=cudnn_static)


def grouped_gemm_wgrad(a_tensor, b_tensor, offsets_tensor, sfa_tensor=None, sfb_tensor=None,
                       global_scale_a=None, global_scale_b=None, wgrad_tensor=None, *,
                       accumulate_on_output: bool = False, wgrad_dtype=None, sf_vec_size=None, a_index=None,
                       b_index=None, **cudnn_static) -> OpResult:
    """Per-expert weight gradient: W[e] = gsa[e] * gsb[e] * A[:, T_e] @ B[:, T_e]^T.

    a_tensor (m, T) and b_tensor (n, T), tokens contiguous; offsets_tensor (L,) cumulative token ends (no 256
    rule; empty experts legal); sfa/sfb: per-expert segment SF buffers (flat, docs/formats.md#segmented-layout),
    their segments tile exactly when every |T_e| is a multiple of 4 * sf_vec_size. With accumulate_on_output the
    result is wgrad_tensor + W (added in fp32, rounded once). Returns wgrad_tensor (L, m, n).
    a_index / b_index (T,) int32 (docs/ops.md#gathered-a-rows): token t of A / B is token a_index[t] / b_index[t]
    of a_tensor (m, T_a) / b_tensor (n, T_b) (a zero token outside [0, T_a)); T is then the index's length. The
    gathered operand is 16-bit and token-major (a_major="m" / b_major="n": passed as x.T of a row-major (T_a, m)).
    """
    majors = ck.operand_majors(cudnn_static, a_major_allowed=True)
    ck.pop_m_aligned(cudnn_static)   # accepted for symmetry: token offsets have no alignment rule
    output_mode = cudnn_static.pop("output_mode", "dense")
    if output_mode == "discrete":
        raise NotImplementedError(
            "grouped_gemm_wgrad(output_mode='discrete') (cuDNN's per-expert wgrad_ptrs) is not implemented: a JAX "
            "output is always a new buffer, so per-expert outputs differ from the dense (L, m, n) result only when "
            "accumulating into existing per-expert buffers, which needs per-expert TMA store descriptors and L "
            "aliased outputs in the wgrad epilogue (the discrete-weights descriptor table serves loads of B); "
            "use the dense output (W[e] is expert e's gradient)")
    if output_mode != "dense":
        raise ValueError(f"output_mode must be 'dense' or 'discrete', got {output_mode!r}")
    config = ck.check_static_kwargs(**cudnn_static)
    a = ck.squeeze_unit(ck.array(a_tensor, "a_tensor"), 2, "a_tensor", "(m, T)")
    b = ck.squeeze_unit(ck.array(b_tensor, "b_tensor"), 2, "b_tensor", "(n, T)")
    ab_dtype = ck.operand_dtype(a, "a_tensor")
    if ck.operand_dtype(b, "b_tensor") != ab_dtype:
        raise TypeError(f"a_tensor ({ab_dtype}) and b_tensor ({b.dtype.name}) must have the same dtype")
    tokens, rows = _wgrad_tokens(a, b, ab_dtype, a_index, b_index, majors)
    m, n = a.shape[0], b.shape[0]
    offsets = ck.array(offsets_tensor, "offsets_tensor")
    num_groups = offsets.shape[0] if offsets.ndim else 0
    if not 1 <= num_groups <= MAX_GROUPS:
        raise ValueError(f"offsets_tensor must have shape (L,) with 1 <= L <= {MAX_GROUPS}")
    offsets = ck.offsets_vector(offsets, num_groups, tokens, "offsets_tensor", 1,
                                f"the cumulative token end of each expert: non-decreasing in [0, T={tokens}]")
    sf_dtype, vec = ck.resolve_block_format(ab_dtype, sfa_tensor, sfb_tensor, sf_vec_size)
    sfa = sfb = None
    if sf_dtype is not None:
        sfa = ck.sf_bytes(sfa_tensor, (sf_segment_bytes(m, tokens, vec),), "sfa_tensor", ck.SF_HINT_SEGMENTS)
        sfb = ck.sf_bytes(sfb_tensor, (sf_segment_bytes(n, tokens, vec),), "sfb_tensor", ck.SF_HINT_SEGMENTS)
    nvfp4 = sf_dtype == "float8_e4m3fn"
    if nvfp4 and (global_scale_a is None or global_scale_b is None):
        raise ValueError("global_scale_a and global_scale_b are required for NVFP4 (e4m3-scaled) wgrad")
    if (global_scale_a is None) != (global_scale_b is None):
        raise ValueError("pass both global_scale_a and global_scale_b, or neither")
    if accumulate_on_output:
        if wgrad_tensor is None:
            raise ValueError("accumulate_on_output=True needs wgrad_tensor (the gradient to add to)")
        existing = ck.array(wgrad_tensor, "wgrad_tensor")
        if tuple(existing.shape) != (num_groups, m, n):
            raise ValueError(f"wgrad_tensor must have shape ({num_groups}, {m}, {n}), got {tuple(existing.shape)}")
        # The accumulated result keeps wgrad_tensor's dtype.
        existing_dtype = ck.out_dtype(existing.dtype.name, "wgrad_tensor dtype", FLOAT_OUT_DTYPES)
        if wgrad_dtype is not None and ck.dtype_name(wgrad_dtype, "wgrad_dtype") != existing_dtype:
            raise ValueError(f"wgrad_dtype={wgrad_dtype!r} differs from wgrad_tensor's dtype {existing_dtype}: the "
                             "accumulated gradient keeps wgrad_tensor's dtype")
        wgrad_dtype = existing_dtype
    elif wgrad_tensor is not None:
        raise ValueError("wgrad_tensor is only read with accumulate_on_output=True")
    else:
        wgrad_dtype = ck.out_dtype(wgrad_dtype or "bfloat16", "wgrad_dtype", FLOAT_OUT_DTYPES)
    problem = GroupedGemmProblem(op="wgrad", m=m, n=n, k=tokens, num_groups=num_groups, ab_dtype=ab_dtype,
                                 sf_dtype=sf_dtype, sf_vec_size=vec, wgrad_dtype=wgrad_dtype,
                                 has_global_scales=global_scale_a is not None, accumulate=bool(accumulate_on_output),
                                 **majors, **rows)
    inputs = {"a": a, "b": b, "padded_offsets": offsets, "sfa": sfa, "sfb": sfb, "a_index": a_index,
              "b_index": b_index,
              "global_scale_a": ck.float_vector(global_scale_a, num_groups, "global_scale_a"),
              "global_scale_b": ck.float_vector(global_scale_b, num_groups, "global_scale_b"),
              "wgrad": wgrad_tensor if accumulate_on_output else None}
    out = _primitive.bind(problem, inputs, config)
    return OpResult(tuple(out), tuple(out.values()))



def _wgrad_tokens(a, b, ab_dtype, a_index, b_index, majors):
    """(T, {"a_rows" / "b_rows": T_a / T_b of a gathered operand}) of a wgrad call, its indices checked: each
    (T,) int32 of one length, the gathered operand plain 16-bit and token-major (the kernel reads a token's row);
    an operand not gathered has T tokens itself."""
    operands = {"a": (a, a_index, "m"), "b": (b, b_index, "n")}
    tokens, rows = {}, {}
    for name, (x, index, token_major) in operands.items():
        if index is None:
            tokens[f"{name}_tensor"] = ck.logical_k(x, ab_dtype)
            continue
        major = majors[f"{name}_major"]
        if ab_dtype not in HALF_DTYPES or major != token_major:
            raise ValueError(f"{name}_index (gathered {name.upper()} tokens) needs a bf16 / fp16 {name}_tensor "
                             f"stored token-major ({name}_major={token_major!r}: pass a row-major (T, rows) array as "
                             f"x.T); got {ab_dtype} with {name}_major={major!r}")
        tokens[f"{name}_index"] = ck.gather_index(index, x.shape[1], f"{name}_index", f"{name}_tensor",
                                                  "token").shape[0]
        rows[f"{name}_rows"] = x.shape[1]
    (first, t), (second, u) = tokens.items()
    if u != t:
        if not rows:
            raise ValueError(f"b_tensor: token count {u} does not match a_tensor's {t}")
        if len(rows) == 2:
            raise ValueError(f"a_index and b_index must have one length (the token count T), got {t} and {u}")
        tensor, index = (first, second) if first.endswith("_tensor") else (second, first)
        raise ValueError(f"{tensor}: token count {tokens[tensor]} does not match the token count {tokens[index]} "
                         f"of {index}")
    ck.check_k_alignment(t, ab_dtype, next((k for k in tokens if k.endswith("_index")), "a_tensor"))
    return t, rows
