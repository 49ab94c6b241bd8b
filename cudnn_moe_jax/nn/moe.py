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
from .routing import M_ALIGNED, Routing, combine_rows, gather_rows, sum_rows, take_rows
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


def _forward(a, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned, a_index=None):
    """(y_perm, (C, h)): FC1 on the permuted rows, a (m, H) or, with `a_index`, x's rows through the row map."""
    dtype = a.dtype
    # float32 master weights (and any bias) -> the compute dtype (else no-op), as a Flax Dense with param_dtype
    w1, w2, b1 = w1.astype(dtype), w2.astype(dtype), None if b1 is None else b1.astype(dtype)
    entry = activations.TABLE[act]
    fc1 = _FC1_OPS[entry.forward_op](a, w1, padded_offsets=padded_offsets, prob_tensor=prob, bias_tensor=b1,
                                     c_dtype=dtype, d_dtype=dtype, compute_amax=False, m_aligned=m_aligned,
                                     a_index=a_index, **_selection(entry, entry.name, glu_limit))
    fc2 = ops.grouped_gemm_quant(fc1.d_tensor, w2, padded_offsets=padded_offsets, d_dtype=dtype,
                                 compute_amax=False, m_aligned=m_aligned)
    return fc2.d_tensor, (fc1.c_tensor, fc1.d_tensor)


def _backward(a, w1, w2, prob, b1, padded_offsets, c, h, dy, act, glu_limit, m_aligned, a_index=None,
              dy_index=None):
    """(dx_perm, dW1, dW2, dprob, db1) from dY: the permuted rows (m, H), or with `dy_index` dY's tokens read
    through the row map; `a` / `a_index`: FC1's A as the forward read it."""
    dtype = a.dtype
    dy = dy.astype(dtype)
    w1_c, w2_c = w1.astype(dtype), w2.astype(dtype)   # w1 / w2 as given: their dtype is the wgrad's
    # FC2 dgrad fused with the activation derivative: dC, dprob, db1.
    common = dict(padded_offsets=padded_offsets, prob_tensor=prob, d_dtype=dtype, compute_amax=False,
                  generate_dbias=b1 is not None, dbias_dtype="float32" if b1 is not None else None,
                  m_aligned=m_aligned)
    entry = activations.TABLE[act]
    bwd = _DACT_OPS[entry.backward_op](dy, _swap_last(w2_c), c, b_major="n", a_index=dy_index, **common,
                                       **_selection(entry, entry.derivative, glu_limit))
    dc = bwd.d_row_tensor
    # FC1 dgrad: dx = dC W1[e] (quant op with B = W1 seen as (L, H, 2I)).
    dx = ops.grouped_gemm_quant(dc, _swap_last(w1_c), padded_offsets=padded_offsets, d_dtype=dtype, b_major="n",
                                compute_amax=False, m_aligned=m_aligned).d_tensor
    # Weight gradients: tokens are the rows of the permuted layout; the group ends are the token offsets.
    # token-major operands (a_major="m", b_major="n"): the kernel reads dy, h, dC, x as they are, no transpose
    majors = dict(a_major="m", b_major="n")
    dw2 = ops.grouped_gemm_wgrad(dy.T, h.T, padded_offsets, wgrad_dtype=w2.dtype, a_index=dy_index,
                                 **majors).wgrad_tensor
    dw1 = ops.grouped_gemm_wgrad(dc.T, a.T, padded_offsets, wgrad_dtype=w1.dtype, b_index=a_index,
                                 **majors).wgrad_tensor
    db1 = None if b1 is None else bwd.dbias_tensor.astype(b1.dtype)
    return dx, dw1, dw2, bwd.dprob_tensor, db1


def _moe_mlp_fwd(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned):
    y, (c, h) = _forward(x_perm, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned)
    return y, (x_perm, w1, w2, prob, b1, padded_offsets, c, h)


def _moe_mlp_bwd(act, glu_limit, m_aligned, residuals, dy):
    x_perm, w1, w2, prob, b1, padded_offsets, c, h = residuals
    # padded_offsets is integer routing data: no cotangent.
    return _backward(x_perm, w1, w2, prob, b1, padded_offsets, c, h, dy, act, glu_limit, m_aligned) + (None,)


_fused_mlp.defvjp(_moe_mlp_fwd, _moe_mlp_bwd)


# The expert MLP on tokens: the kernels read the permuted rows through the routing's row map (the ops' `a_index`,
# `b_index`), so dY (and, with `gather_x`, x) is never copied into the permuted layout, and the combine / dx are the
# routing's gather-sums inside the same custom_vjp. Bit-identical to moe_mlp between routing.permute and
# routing.unpermute: the gathered kernels compute exactly what they compute on the gathered rows.
@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _fused_routed_mlp(x, w1, w2, prob, b1, padded_offsets, row_token, dest_row, act, glu_limit, m_aligned, gather_x):
    return _routed_fwd(x, w1, w2, prob, b1, padded_offsets, row_token, dest_row, act, glu_limit, m_aligned,
                       gather_x)[0]


def _routed_fwd(x, w1, w2, prob, b1, padded_offsets, row_token, dest_row, act, glu_limit, m_aligned, gather_x):
    # FC1's A: x through the row map, or its permuted copy (then also dW1's B)
    a, a_index = (x, row_token) if gather_x else (take_rows(x, row_token), None)
    y_perm, (c, h) = _forward(a, w1, w2, prob, b1, padded_offsets, act, glu_limit, m_aligned, a_index)
    return sum_rows(y_perm, dest_row), (a, w1, w2, prob, b1, padded_offsets, row_token, dest_row, c, h)


def _routed_bwd(act, glu_limit, m_aligned, gather_x, residuals, dy):
    a, w1, w2, prob, b1, padded_offsets, row_token, dest_row, c, h = residuals
    dx_perm, dw1, dw2, dprob, db1 = _backward(a, w1, w2, prob, b1, padded_offsets, c, h, dy, act, glu_limit,
                                              m_aligned, row_token if gather_x else None, row_token)
    # the routing maps are integer data: no cotangent
    return sum_rows(dx_perm, dest_row), dw1, dw2, dprob, db1, None, None, None


_fused_routed_mlp.defvjp(_routed_fwd, _routed_bwd)


# x is read through the row map (FC1's a_index, dW1's b_index) up to this many routed rows per expert; above, the
# layer copies x_perm once (XLA) for FC1 and dW1: a gathered dW1 B costs more than the copy there (8 experts x 2048
# rows: the layer 6.59 vs 6.42 ms; 256 and 32 rows per expert gain; RESULTS run 98). dY is always read through it.
GATHER_X_ROWS_PER_EXPERT = 1024


def routed_mlp(x, w1, w2, prob, b1, routing: Routing, act: str = "swiglu", glu_limit: Optional[float] = None,
               m_aligned: int = M_ALIGNED):
    """The expert MLP on tokens, as nn.moe_layer runs it: `unpermute(moe_mlp(permute(x)))` with the permutation
    read by the kernels (no permuted copy of x or dY). x (T, H) bf16 / fp16 (the compute dtype); prob (m,) f32 per
    permuted row (`routing.permuted_prob`); `routing` from `routing.route(..., m_aligned)`. Returns y (T, H): each
    token's k expert outputs summed in fp32 (choice order), rounded once. float32 x: moe_mlp's reference path."""
    _check_options(act, glu_limit)
    if x.dtype == jnp.float32:
        x_perm = gather_rows(x, routing.row_token, routing.dest_row)
        y_perm = moe_mlp(x_perm, w1, w2, prob, b1, routing.padded_offsets, act, glu_limit, m_aligned)
        return combine_rows(y_perm, routing.dest_row, routing.row_token)
    check_expert_mlp(x, w1, w2, b1, act)
    num_tokens, top_k = routing.dest_row.shape
    gather_x = num_tokens * top_k <= GATHER_X_ROWS_PER_EXPERT * w1.shape[0]
    return _fused_routed_mlp(x, w1, w2, prob, b1, routing.padded_offsets, routing.row_token, routing.dest_row, act,
                             glu_limit, m_aligned, gather_x)


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
