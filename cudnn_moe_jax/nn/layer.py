"""`moe_layer`: the routed MoE FFN on tokens, and the argument handling it shares with `moe_layer_ep`.

    x (..., H) -> flatten to (T, H), cast to the compute dtype
    router (nn.router: RouterConfig) or a precomputed gating=(experts, weights)
    -> route into 64-row-aligned expert groups -> nn.moe.routed_mlp: the fused ops read the tokens through the
       routing's row map (no permuted copy of x or dY; float32: the jnp reference on permuted rows)
    -> each token's k outputs (gate-weighted in FC1's epilogue) summed in fp32
    (+ gate-weighted FC2 bias, + shared expert: nn.block) -> y (..., H) in the compute dtype, aux
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from . import block
from . import moe as _moe
from . import routing as _routing
from .router import Gating, RouterConfig, check_router_args, resolve_config
from .router import apply_router
from .weights import check_expert_mlp, to_fused_layout


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """The static part of one layer call (hashable: the EP layer caches its jitted shard_map on it)."""

    config: Optional[RouterConfig]   # None with a precomputed gating
    act: str
    glu_limit: Optional[float]
    dtype: str                       # compute dtype
    top_k: int


def prepare(x, router_weight, w1, w2, b1, *, top_k, router_config, router_bias, gating, b2, shared, act,
            glu_limit, weight_layout, dtype):
    """Check every argument (errors name the user's arguments) and bring them to the fused form.

    Returns (x2d (T, H) in the compute dtype, params {name: array} of the present ones among router_weight,
    router_bias, w1, w2, b1 (fused layout, their own dtype), b2, shared_w1, shared_w2, shared_b1, shared_gate,
    experts, weights (a precomputed gating, flattened to (T, k)), LayerSpec)."""
    _moe._check_options(act, glu_limit)
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., H) (tokens x hidden), got {tuple(x.shape)}")
    dtype = block.compute_dtype(x, dtype)
    hidden = x.shape[-1]
    x2d = jnp.reshape(x, (-1, hidden)).astype(dtype)
    w1, w2, b1 = to_fused_layout(w1, w2, b1, weight_layout, act)
    num_experts = check_expert_mlp(x2d, w1, w2, b1, act)[0]
    config = None if gating is not None else resolve_config(router_config, top_k)
    if gating is not None and (router_config is not None or top_k is not None):
        raise ValueError("gating=(experts, weights) replaces the router: pass no router_config / top_k")
    check_router_args(router_weight, router_bias, gating, config, hidden, num_experts)
    params = {"router_weight": router_weight, "router_bias": router_bias, "w1": w1, "w2": w2, "b1": b1}
    if gating is not None:
        experts, weights = gating
        if experts.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"gating: experts / weights {tuple(experts.shape)} must be x's token shape "
                             f"{tuple(x.shape[:-1])} + (k,)")
        k = experts.shape[-1]
        params["experts"] = jnp.reshape(experts, (-1, k)).astype(jnp.int32)
        params["weights"] = jnp.reshape(weights, (-1, k)).astype(jnp.float32)
    if b2 is not None:
        if tuple(b2.shape) != (num_experts, hidden):
            raise ValueError(f"b2 (the FC2 bias) must have shape (L, H) = ({num_experts}, {hidden}); got "
                             f"{tuple(b2.shape)}")
        params["b2"] = b2
    if shared is not None:
        s_w1, s_w2, s_b1, s_gate = block.shared_fused_layout(shared, weight_layout, act, hidden)
        try:
            check_expert_mlp(x2d, s_w1, s_w2, s_b1, act)
        except (ValueError, TypeError) as err:
            raise type(err)(f"shared expert (shapes with a leading expert axis of 1): {err}") from None
        params.update(shared_w1=s_w1, shared_w2=s_w2, shared_b1=s_b1, shared_gate=s_gate)
    params = {k: v for k, v in params.items() if v is not None}
    spec = LayerSpec(config, act, glu_limit, dtype, config.top_k if config is not None else gating[0].shape[-1])
    return x2d, params, spec


def gating_of(x2d, params: dict, spec: LayerSpec, num_experts: int) -> Gating:
    """The router's decision for tokens x2d, or the precomputed one (expert ids outside [0, L) get weight 0)."""
    if spec.config is None:
        experts, weights = params["experts"], params["weights"]
        valid = (experts >= 0) & (experts < num_experts)
        return Gating(jnp.where(valid, experts, 0), jnp.where(valid, weights, 0.0))
    return apply_router(x2d, params["router_weight"], spec.config, params.get("router_bias"), spec.dtype)


def shared_of(params: dict):
    """The shared expert's fused weights from `params`, or None."""
    if "shared_w1" not in params:
        return None
    return tuple(params.get(k) for k in ("shared_w1", "shared_w2", "shared_b1", "shared_gate"))


def expert_load(experts, num_experts: int):
    """(L,) int32 assignments per expert."""
    return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(1)


def token_aux(gating: Gating, batch_shape) -> dict:
    """The per-token routing internals with x's leading shape: experts, weights (and logits, scores)."""
    out = {"experts": gating.experts, "weights": gating.weights}
    if gating.logits is not None:
        out.update(logits=gating.logits, scores=gating.scores)
    return {k: jnp.reshape(v, tuple(batch_shape) + v.shape[-1:]) for k, v in out.items()}


def moe_layer(x, router_weight, w1, w2, b1=None, *, top_k: Optional[int] = None, act: str = "swiglu",
              glu_limit: Optional[float] = None, router_config: Optional[RouterConfig] = None, router_bias=None,
              gating=None, b2=None, shared: Optional[block.SharedExpert] = None, weight_layout: str = "out_in",
              dtype=None, m_aligned: int = _routing.M_ALIGNED):
    """A full MoE FFN on tokens x (..., H), e.g. (T, H) or (batch, seq, H) (docs/nn.md has every rule).

    Router: router_weight (H, L) with `router_config` (`nn.RouterConfig`: softmax / sigmoid, top-k first or not,
    renormalization, scaling, group-limited top-k, the use of `router_bias` (L,)); `top_k=k` is short for
    `RouterConfig(top_k=k)`; the default is a softmax top-2 router with renormalized weights. Or
    `gating=(experts, weights)` (..., k), precomputed, with router_weight=None.
    Experts: w1 (L, 2I, H) gate/up interleaved in 32-row blocks, or a pair (w_gate, w_up) of (L, I, H) halves
    ((L, I, H) for srelu); w2 (L, H, I); b1 (L, 2I or I), a pair, or None; `weight_layout="in_out"` takes
    (L, H, 2I) / (L, I, H) instead. b2 (L, H): FC2 bias, weighted by the gate. `shared`: an `nn.SharedExpert`.
    Precision: `dtype` (default x's) is the compute dtype: bf16 / fp16 run the fused kernels, weights in it or
    float32 (master weights, cast inside, float32 gradients); float32 runs the jnp reference path.
    `m_aligned`: the permuted rows' group alignment (static): 64 by default (measured fastest), 1 padding-free (the
    least memory), 256 cuDNN's layout.

    Returns (y with x's shape in the compute dtype, aux): aux["expert_load"] (L,) int32 assignments per expert,
    aux["padded_offsets"] (L,) group ends of the permuted rows, aux["experts"] / aux["weights"] (..., k), and
    with a router aux["logits"] / aux["scores"] (..., L) float32 (for `nn.load_balancing_loss`,
    `nn.router_z_loss`, `nn.balancing_bias_update`)."""
    batch_shape = x.shape[:-1]
    x2d, params, spec = prepare(x, router_weight, w1, w2, b1, top_k=top_k, router_config=router_config,
                                router_bias=router_bias, gating=gating, b2=b2, shared=shared, act=act,
                                glu_limit=glu_limit, weight_layout=weight_layout, dtype=dtype)
    num_experts = params["w1"].shape[0]
    gating = gating_of(x2d, params, spec, num_experts)
    plan = _routing.route(gating.experts, num_experts, m_aligned)
    prob = _routing.permuted_prob(gating.weights, plan)
    y = _moe.routed_mlp(x2d, params["w1"], params["w2"], prob, params.get("b1"), plan, act, glu_limit, m_aligned)
    y = block.add_token_terms(y, x2d, gating.experts, gating.weights, params.get("b2"), shared_of(params), act,
                              glu_limit)
    # padding-free groups: a group's rows are its assignments (no scatter-add of T*k ones for the load)
    load = (jnp.diff(plan.padded_offsets, prepend=0) if m_aligned == 1
            else expert_load(gating.experts, num_experts))
    aux = {"padded_offsets": plan.padded_offsets, "expert_load": load,
           **token_aux(gating, batch_shape)}
    return jnp.reshape(y, batch_shape + (x.shape[-1],)), aux
