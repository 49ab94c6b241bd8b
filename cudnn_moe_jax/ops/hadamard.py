"""`grouped_gemm_glu_hadamard_quant`: FC1 + activation + NVFP4 output + 16-wide Hadamard (RHT) output.

Semantics: docs/ops.md#grouped_gemm_glu_hadamard_quant, NVFP4 quantization docs/formats.md#nvfp4.
"""

from __future__ import annotations

from typing import Optional

from .. import activations
from .._problem import Epilogue
from .._results import OpResult
from ..limits import FLOAT_OUT_DTYPES, FP4
from . import _checks as ck
from .forward import activation_options, bind_forward, output_width


def grouped_gemm_glu_hadamard_quant(a_tensor, b_tensor=None, sfa_tensor=None, sfb_tensor=None,
                                    padded_offsets=None, alpha_tensor=None, prob_tensor=None, bias_tensor=None,
                                    norm_const_tensor=None, rht_norm_const_tensor=None, hadamard_tensor=None, *,
                                    b_tensors=None, sfb_tensors=None, act_func: str = "swiglu",
                                    c_dtype="bfloat16", d_dtype="bfloat16", rht_mode: Optional[str] = None,
                                    rht_dtype=None, sf_vec_size=None, compute_amax=None,
                                    glu_limit: Optional[float] = None, glu_alpha: Optional[float] = None,
                                    tanh_clamp_scale: Optional[float] = None, **cudnn_static) -> OpResult:
    """FC1 grouped GEMM + act (swiglu | geglu | srelu) with bf16 or NVFP4 D and an optional Hadamard output.

    D = activation output: bf16 `(m, N_out)` or NVFP4 packed `(m, N_out/2)` uint8 + e4m3 `sfd_tensor` (vec 16,
    encode scale `norm_const_tensor`). `rht_mode`: None, "rowwise" (bf16 or NVFP4, H applied per 16 columns) or
    "colwise" (NVFP4, per 16 tokens, per-expert transposed segments; scale `rht_norm_const_tensor`). The
    transform is the orthonormal Sylvester H16/4 on bf16-rounded D; `hadamard_tensor` (16, 16) replaces it
    (out = block @ P^T). Returns c_tensor, d_tensor, sfd_tensor, amax_tensor, rht_tensor, sfrht_tensor.
    """
    cudnn_static = dict(cudnn_static)
    m_aligned = ck.pop_m_aligned(cudnn_static)
    config = ck.check_static_kwargs(**cudnn_static)
    ck.check_choice(act_func, tuple(activations.TABLE), "act_func")
    inputs, dims = ck.gemm_operands(a_tensor, b_tensor, b_tensors, sfa_tensor, sfb_tensor, sfb_tensors,
                                    padded_offsets, sf_vec_size, m_aligned)
    act_options = activation_options(act_func, glu_limit, glu_alpha, tanh_clamp_scale)
    n_out = output_width(act_func, dims)
    if n_out % 16:
        raise ValueError(f"N_out={n_out} must be a multiple of 16 (16-wide Hadamard blocks)")
    c_dtype = ck.out_dtype(c_dtype, "c_dtype", FLOAT_OUT_DTYPES)
    d_dtype = ck.out_dtype(d_dtype, "d_dtype", ("bfloat16", FP4))
    ck.check_choice(rht_mode, (None, "rowwise", "colwise"), "rht_mode")
    if rht_mode is None:
        if rht_dtype is not None or rht_norm_const_tensor is not None or hadamard_tensor is not None:
            raise ValueError("rht_dtype / rht_norm_const_tensor / hadamard_tensor need rht_mode='rowwise' or "
                             "'colwise'")
    else:
        rht_dtype = ck.out_dtype(rht_dtype or (FP4 if rht_mode == "colwise" else "bfloat16"), "rht_dtype",
                                 ("bfloat16", FP4))
        if rht_mode == "colwise" and rht_dtype != FP4:
            raise ValueError("rht_dtype: the colwise Hadamard output is NVFP4 only (float4_e2m1fn)")
    fp4_out = d_dtype == FP4 or rht_dtype == FP4
    if fp4_out:
        ck.check_sf_alignment(m_aligned, "an NVFP4 output (d_dtype or rht_dtype float4_e2m1fn)")
    if fp4_out and n_out % 128:
        raise ValueError(f"NVFP4 outputs need N_out % 128 == 0, got N_out={n_out}")
    norm_const = rht_norm_const = None
    if d_dtype == FP4:
        if norm_const_tensor is None:
            raise ValueError("norm_const_tensor is required for an NVFP4 d_dtype (global encode scale; pass "
                             "jnp.ones((1,), jnp.float32) for none)")
        norm_const = ck.scalar_f32(norm_const_tensor, "norm_const_tensor")
    if rht_dtype == FP4:
        if rht_norm_const_tensor is None:
            raise ValueError("rht_norm_const_tensor is required for an NVFP4 Hadamard output (global encode scale; "
                             "pass jnp.ones((1,), jnp.float32) for none)")
        rht_norm_const = ck.scalar_f32(rht_norm_const_tensor, "rht_norm_const_tensor")
    hadamard = None
    if hadamard_tensor is not None:
        hadamard = ck.array(hadamard_tensor, "hadamard_tensor")
        if tuple(hadamard.shape) != (16, 16):
            raise ValueError(f"hadamard_tensor must be (16, 16), got {tuple(hadamard.shape)}")
        hadamard = hadamard.astype("float32")
    if compute_amax is None:
        compute_amax = d_dtype == "bfloat16"
    bias, bias_dtype = ck.bias_array(bias_tensor, dims["num_groups"], dims["n"])
    epilogue = Epilogue(act=act_func, has_bias=bias is not None, bias_dtype=bias_dtype,
                        has_prob=prob_tensor is not None, c_dtype=c_dtype, d_dtype=d_dtype,
                        compute_amax=bool(compute_amax), rht=rht_mode, rht_dtype=rht_dtype,
                        has_hadamard=hadamard is not None, **act_options)
    return bind_forward("glu_hadamard_quant", dims, inputs, epilogue, config, alpha_tensor=alpha_tensor,
                        prob_tensor=prob_tensor, sf_out_dtype="float8_e4m3fn", bias=bias, norm_const=norm_const,
                        rht_norm_const=rht_norm_const, hadamard=hadamard)
