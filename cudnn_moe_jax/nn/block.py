"""The expert block around the routed experts: compute dtype, the gate-weighted FC2 bias and shared experts.

For token t with chosen experts e_j and gate weights w_j (j < k), the layers compute

    y_t = sum_j w_j * (W2[e_j] act(W1[e_j] x_t + b1[e_j]) + b2[e_j])          routed experts (+ FC2 bias, GPT-OSS)
        + s_t * W2s act(W1s x_t + b1s)                                        shared expert (DeepSeek / Qwen)

with s_t = sigmoid(x_t . g) for a gated shared expert (Qwen2-MoE's shared_expert_gate) and 1 otherwise.

The routed sum runs on the permuted rows (`nn.moe_mlp`). The FC2 bias term is the (T, L) gate matrix
(w_j at column e_j) times b2 (L, H): a small GEMM on the token side whose gradient is a GEMM too (no scatter of
H-wide rows), independent of the permuted layout. The shared expert is `nn.moe_mlp` with one group over every
token (its gate value is the fused `prob`, so the gate's gradient is the op's dprob). Both are added to the routed
output in fp32 and rounded once to the compute dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .moe import moe_mlp
from .router import matmul_f32_acc
from .routing import permuted_rows
from .weights import COMPUTE_DTYPES, to_fused_layout


class SharedExpert(NamedTuple):
    """A dense MLP on every token beside the routed experts (DeepSeek-V3 / Qwen2-MoE shared experts; several
    shared experts are one MLP of their summed width). Same activation and `weight_layout` as the routed experts,
    without the expert axis: w1 (2Is, H) gate/up interleaved, or a pair (w_gate, w_up) of (Is, H) ("in_out":
    (H, 2Is) / (H, Is)); w2 (H, Is) ("in_out": (Is, H)); b1 (2Is,) or a pair or None; gate (H,) or None: the
    output scaled by sigmoid(x . gate) per token."""

    w1: object
    w2: jax.Array
    b1: object = None
    gate: Optional[jax.Array] = None


def compute_dtype(x, dtype) -> str:
    """The layer's compute dtype: `dtype`, else x's. bfloat16 / float16 run the fused kernels, float32 the jnp
    reference path (debugging)."""
    name = jnp.dtype(dtype if dtype is not None else x.dtype).name
    if name not in COMPUTE_DTYPES:
        arg = "dtype" if dtype is not None else "x"
        raise TypeError(f"{arg}: compute dtype {name} is not supported: bfloat16 or float16 (fused kernels) or "
                        f"float32 (jnp reference path); cast with x.astype(jnp.bfloat16) or pass dtype=")
    return name


def _expand(w):
    """One expert's weight or (gate, up) pair -> with a leading expert axis of 1."""
    if isinstance(w, (tuple, list)):
        return tuple(jnp.asarray(p)[None] for p in w)
    return None if w is None else jnp.asarray(w)[None]


def shared_fused_layout(shared: SharedExpert, weight_layout: str, act: str, hidden: int):
    """SharedExpert -> (w1 (1, N1, H), w2 (1, H, Is), b1 (1, N1) or None, gate (H,) or None) in the fused layout."""
    if not isinstance(shared, SharedExpert):
        raise TypeError(f"shared must be a cudnn_moe_jax.nn.SharedExpert, got {type(shared).__name__}")
    w1, w2, b1 = to_fused_layout(_expand(shared.w1), _expand(shared.w2), _expand(shared.b1), weight_layout, act,
                                 prefix="shared.")
    if shared.gate is not None and tuple(shared.gate.shape) != (hidden,):
        raise ValueError(f"shared.gate must have shape (H,) = ({hidden},); got {tuple(shared.gate.shape)}")
    return w1, w2, b1, shared.gate


def _precision(dtype: str):
    return "highest" if dtype == "float32" else None   # a float32 debug run: no TF32 / bf16 passes on a GPU


def fc2_bias_term(experts, weights, b2, dtype: str):
    """(T, H) float32 sum_j weights[t, j] * b2[experts[t, j]]: the gate matrix (T, L) times b2 (L, H)."""
    gates = jnp.sum(jax.nn.one_hot(experts, b2.shape[0], dtype=jnp.float32) * weights[..., None], axis=1)
    return matmul_f32_acc(gates, b2, dtype, _precision(dtype))


def shared_expert_output(x, w1, w2, b1, gate, act: str, glu_limit):
    """The shared MLP on tokens x (T, H) in the compute dtype: one expert group over every token, starting at row 0
    and ending at T (m_aligned 1; padded to a multiple of 8 rows, the wgrad ops' token count; padding rows have
    prob 0). Returns (T, H) in x's dtype."""
    tokens = x.shape[0]
    rows = permuted_rows(tokens, 1, 1, m_aligned=1)
    if gate is None:
        prob = jnp.ones((tokens,), jnp.float32)
    else:
        prob = jax.nn.sigmoid(matmul_f32_acc(x, gate[:, None], x.dtype.name, _precision(x.dtype.name))[:, 0])
    x_rows = jnp.pad(x, ((0, rows - tokens), (0, 0)))
    prob = jnp.pad(prob, (0, rows - tokens))
    y = moe_mlp(x_rows, w1, w2, prob, b1, jnp.full((1,), tokens, jnp.int32), act, glu_limit, m_aligned=1)
    return y[:tokens]


def add_token_terms(y, x, experts, weights, b2, shared, act: str, glu_limit):
    """y (T, H) routed output in the compute dtype, plus the FC2 bias term and the shared expert (either None),
    summed in fp32 and rounded once. `shared` = shared_fused_layout's tuple."""
    if b2 is None and shared is None:
        return y
    total = y.astype(jnp.float32)
    if b2 is not None:
        total = total + fc2_bias_term(experts, weights, b2, y.dtype.name)
    if shared is not None:
        total = total + shared_expert_output(x, *shared, act, glu_limit).astype(jnp.float32)
    return total.astype(y.dtype)
