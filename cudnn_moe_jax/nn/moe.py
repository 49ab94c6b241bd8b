"""MoE feed-forward built only from the fused forward and explicit backward ops, wired with `jax.custom_vjp`.

Per expert e (rows of its group in the permuted layout), with W1 (L, 2I, H) gate/up interleaved in 32-row blocks
(or (L, I, H) for srelu) and W2 (L, H, I):
    C = x W1[e]^T (+ b1[e]);  h = prob * act(C);  y = h W2[e]^T
Forward: grouped_gemm_glu / grouped_gemm_srelu (FC1), grouped_gemm_quant (FC2).
Backward: grouped_gemm_dglu / grouped_gemm_dsrelu (FC2 dgrad + activation derivative, dprob, db1),
grouped_gemm_quant (FC1 dgrad), grouped_gemm_wgrad x2.

x_perm's dtype is the compute dtype. Weights may be float32 master weights: cast to it inside the custom_vjp, so
the wgrad ops write their fp32 accumulators as float32 gradients (a cast outside would round them to bf16 first).
A float32 x_perm runs the same math on the reference functions in jnp instead (the ops take 16-bit A/B only).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from .. import activations, ops, reference
from .routing import M_ALIGNED
from .weights import check_expert_mlp, check_permuted


def _swap_last(w):
    """(L, N, K) -> (L, K, N): the other operand orientation of an expert weight. Passed with b_major="n", the
    kernel reads the weight's own buffer (XLA turns the transpose into a layout change, no copy)."""
    return jnp.swapaxes(w, 1, 2)


# The fused ops of each activation's problem ops (activations.TABLE[act].forward_op / backward_op).
_FC1_OPS = {"glu": ops.grouped_gemm_glu, "srelu": ops.grouped_gemm_srelu}
_DACT_OPS = {"dglu": ops.grouped_gemm_dglu, "dsrelu": ops.grouped_gemm_dsrelu}
_REFERENCE_FC1_OPS = {"glu": reference.grouped_gemm_glu, "srelu": reference.grouped_gemm_srelu}


def _selection(entry, act_func, glu_limit):
    """The op keywords naming the activation: the GLU ops are shared and take act_func (and glu_limit); srelu's
    ops are their activation."""
    return dict(act_func=act_func, glu_limit=glu_limit) if entry.glu else {}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _fused_mlp(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned):
    """moe_mlp on the fused ops (bf16 / fp16 x_perm; w1 / w2 in its dtype or float32, cast here)."""
    y, _ = _forward(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned)
    return y


def _forward(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned):
    dtype = x_perm.dtype
    # float32 master weights (and any bias) -> the compute dtype (else no-op), as a Flax Dense with param_dtype
    w1, w2, b1 = w1.astype(dtype), w2.astype(dtype), None if b1 is None else b1.astype(dtype)
    entry = activations.TABLE[act]
    fc1 = _FC1_OPS[entry.forward_op](x_perm, w1, padded_offsets=padded_offsets, prob_tensor=prob, bias_tensor=b1,
                                     c_dtype=dtype, d_dtype=dtype, compute_amax=False, m_aligned=m_aligned,
                                     **_selection(entry, entry.name, glu_limit))
    fc2 = ops.grouped_gemm_quant(fc1.d_tensor, w2, padded_offsets=padded_offsets, d_dtype=dtype,
                                 compute_amax=False, m_aligned=m_aligned)
    return fc2.d_tensor, (fc1.c_tensor, fc1.d_tensor)


def _moe_mlp_fwd(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned):
    y, (c, h) = _forward(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned)
    return y, (x_perm, w1, w2, prob, b1, padded_offsets, c, h)


def _moe_mlp_bwd(act, glu_limit, m_aligned, residuals, dy):
    x_perm, w1, w2, prob, b1, padded_offsets, c, h = residuals   # w1 / w2 as given: their dtype is the wgrad's
    dtype = x_perm.dtype
    dy = dy.astype(dtype)
    w1_c, w2_c = w1.astype(dtype), w2.astype(dtype)
    # FC2 dgrad fused with the activation derivative: dC, dprob, db1.
    common = dict(padded_offsets=padded_offsets, prob_tensor=prob, d_dtype=dtype, compute_amax=False,
                  generate_dbias=b1 is not None, dbias_dtype="float32" if b1 is not None else None,
                  m_aligned=m_aligned)
    entry = activations.TABLE[act]
    bwd = _DACT_OPS[entry.backward_op](dy, _swap_last(w2_c), c, b_major="n", **common,
                                       **_selection(entry, entry.derivative, glu_limit))
    dc = bwd.d_row_tensor
    # FC1 dgrad: dx = dC W1[e] (quant op with B = W1 seen as (L, H, 2I)).
    dx = ops.grouped_gemm_quant(dc, _swap_last(w1_c), padded_offsets=padded_offsets, d_dtype=dtype, b_major="n",
                                compute_amax=False, m_aligned=m_aligned).d_tensor
    # Weight gradients: tokens are the rows of the permuted layout; the group ends are the token offsets.
    # token-major operands (a_major="m", b_major="n"): the kernel reads dy, h, dC, x as they are, no transpose
    majors = dict(a_major="m", b_major="n")
    dw2 = ops.grouped_gemm_wgrad(dy.T, h.T, padded_offsets, wgrad_dtype=w2.dtype, **majors).wgrad_tensor
    dw1 = ops.grouped_gemm_wgrad(dc.T, x_perm.T, padded_offsets, wgrad_dtype=w1.dtype, **majors).wgrad_tensor
    db1 = None if b1 is None else bwd.dbias_tensor.astype(b1.dtype)
    # padded_offsets is integer routing data: no cotangent.
    return dx, dw1, dw2, bwd.dprob_tensor, db1, None


_fused_mlp.defvjp(_moe_mlp_fwd, _moe_mlp_bwd)


def _check_options(act, glu_limit):
    if act not in activations.TABLE:
        raise ValueError(f"act={act!r} is not supported: allowed {tuple(activations.TABLE)}")
    if glu_limit is not None and "glu_limit" not in activations.TABLE[act].options:
        raise ValueError(f"glu_limit applies to act in {activations.GLU_NAMES}, not {act!r}")


def _reference_mlp(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned):
    """The float32 expert MLP: the reference backend's functions for the same two ops on float32 operands
    (`reference` is the library's definition of the ops' math), differentiated by JAX. For debugging: exact fp32
    products and sums, no kernel, and JAX's scan-based gradients are slow at scale."""
    f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    ones = jnp.ones((w1.shape[0],), jnp.float32)
    common = dict(ab_dtype="float32", d_dtype="float32", m_aligned=m_aligned)
    entry = activations.TABLE[act]
    h = _REFERENCE_FC1_OPS[entry.forward_op](f32(x_perm), f32(w1), None, None, padded_offsets, ones, prob, f32(b1),
                                             c_dtype="float32", **common, **_selection(entry, entry.name, glu_limit))
    return reference.grouped_gemm_quant(h["d_tensor"], f32(w2), None, None, padded_offsets, ones, None,
                                        **common)["d_tensor"]


def moe_mlp(x_perm, w1, w2, prob, b1, padded_offsets, act: str = "swiglu", glu_limit: Optional[float] = None,
            m_aligned: int = M_ALIGNED):
    """Expert MLP on permuted rows. x_perm (m, H); w1 (L, 2I or I, H); w2 (L, H, I); prob (m,) f32;
    b1 (L, 2I or I) or None; padded_offsets (L,) int32 (static-shaped, device values), multiples of `m_aligned`
    (static; default `routing.M_ALIGNED`, 1: any group ends; m a multiple of it and of 8). Returns y_perm (m, H) in
    x_perm's dtype, which is the compute dtype:

    - bfloat16 / float16: the fused ops (custom_vjp). w1 / w2 in x_perm's dtype, or float32 master weights: cast
      inside, and their gradients come back float32 straight from the wgrad GEMM's fp32 accumulators.
    - float32: the same math on the reference functions in jnp, differentiated by JAX (for debugging)."""
    _check_options(act, glu_limit)
    check_permuted(x_perm, prob, padded_offsets, check_expert_mlp(x_perm, w1, w2, b1, act, "x_perm")[0], m_aligned)
    if x_perm.dtype == jnp.float32:
        return _reference_mlp(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned)
    return _fused_mlp(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned)
