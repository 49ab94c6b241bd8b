"""Router losses and the balancing-bias update, on the routing internals the layers return in `aux`.

All three are pure jnp functions of aux["scores"], aux["logits"], aux["experts"], aux["expert_load"]: the layer's
own router pass, no second one.

- `load_balancing_loss` (Switch Transformer eq. 4; Mixtral; DeepSeek-V3's sequence-wise balance loss):
  L * sum_i f_i * P_i, f_i = the fraction of the T*k assignments that chose expert i, P_i = the mean over tokens of
  s_t,i / sum_j s_t,j (the scores normalized per token; softmax scores already are). 1.0 when routing and scores
  are uniform. Hugging Face's Mixtral `load_balancing_loss_func` counts f per choice (its f sums to k): it is k
  times this value.
- `router_z_loss` (ST-MoE eq. 5): mean over tokens of logsumexp(logits_t)^2.
- `balancing_bias_update` (DeepSeek-V3's auxiliary-loss-free balancing): b_i + rate * sign(mean load - load_i).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _token_weights(shape, mask):
    if mask is None:
        return jnp.ones(shape, jnp.float32)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have the tokens' shape {tuple(shape)}, got {tuple(mask.shape)}")
    return mask.astype(jnp.float32)


def load_balancing_loss(scores, experts, *, per_sequence: bool = False, mask=None):
    """L * sum_i f_i P_i (module doc) from scores (..., L) and the chosen experts (..., k) (aux["scores"],
    aux["experts"]).

    per_sequence=False: f and P over every token (the batch-wise loss). True: over each sequence -- the
    second-to-last axis of scores, e.g. (batch, seq, L) -- then averaged over the sequences (DeepSeek-V3's
    sequence-wise loss, before its factor alpha). mask (...,) (tokens' shape), optional: 1 for tokens that count,
    0 for padding. The gradient flows through P (the scores); f is a count."""
    if scores.ndim < 2 or experts.shape[:-1] != scores.shape[:-1]:
        raise ValueError(f"scores (..., L) {tuple(scores.shape)} and experts (..., k) {tuple(experts.shape)} must "
                         f"share the tokens' shape")
    if per_sequence and scores.ndim < 3:
        raise ValueError(f"per_sequence=True needs scores (..., seq, L), got {tuple(scores.shape)}")
    num_experts, top_k = scores.shape[-1], experts.shape[-1]
    w = _token_weights(scores.shape[:-1], mask)
    s = scores.astype(jnp.float32)
    s = s / jnp.sum(s, axis=-1, keepdims=True)
    counts = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=-2)      # (..., L)
    axes = (-2,) if per_sequence else tuple(range(-scores.ndim, -1))
    tokens = jnp.maximum(jnp.sum(w, axis=tuple(a + 1 for a in axes)), 1.0)[..., None]        # (..., 1)
    f = jnp.sum(counts * w[..., None], axis=axes) / (tokens * top_k)
    p = jnp.sum(s * w[..., None], axis=axes) / tokens
    return jnp.mean(num_experts * jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


def router_z_loss(logits, mask=None):
    """mean_t logsumexp(logits_t)^2 over the tokens (aux["logits"] (..., L)); mask as in `load_balancing_loss`."""
    w = _token_weights(logits.shape[:-1], mask)
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(w * z * z) / jnp.maximum(jnp.sum(w), 1.0)


def balancing_bias_update(router_bias, expert_load, rate: float = 1e-3):
    """The new selection bias of auxiliary-loss-free balancing (DeepSeek-V3, gamma = `rate`): raised by `rate` for
    an expert that received fewer assignments than the mean, lowered for one that received more (aux["expert_load"]
    (L,), global under expert parallelism). Pure: returns the new bias in router_bias's dtype."""
    load = expert_load.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(load) - load)
    return (router_bias.astype(jnp.float32) + step).astype(router_bias.dtype)
