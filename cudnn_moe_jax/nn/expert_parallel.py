"""Expert-parallel MoE layer: experts sharded over a mesh axis, tokens exchanged with `jax.lax.all_to_all`.

Built on JAX's own distributed machinery: a `jax.sharding.Mesh`, `jax.shard_map` and the collectives it lowers to
(NCCL on GPUs, gloo on CPUs; several hosts through `jax.distributed.initialize`). Inside the `shard_map`, each
device of the expert axis (size D) owns L/D consecutive experts and T/S of the tokens (S = number of token shards:
the product of the `data_axes` sizes and D). Per device:

    router (local tokens)  ->  ep_dispatch: each (token, choice) copied into a fixed slot for the device that owns
    its expert, one all_to_all  ->  route/permute into aligned groups of the local experts  ->  nn.moe_mlp (the
    fused custom_vjp MLP; the gate weight travels with the row and is applied inside it, as in nn.moe_layer)  ->
    unpermute  ->  ep_combine: the reverse all_to_all and the sum of each token's k expert outputs  ->  the
    token-side terms of nn.block (FC2 bias, shared expert; their parameters replicated) on the local tokens.

JAX differentiates the collectives (the transpose of an all_to_all is the reverse all_to_all), so `jax.grad` of a
loss gives the same gradients as `nn.moe_layer` on the gathered tokens, up to summation order.

Capacity and overflow policy (`capacity_factor`)
------------------------------------------------
The exchange has static shapes: every source device sends every destination device a block of C row slots
(`ep_capacity`). With `capacity_factor=None` (the default) C is the largest number of assignments one device can
ever send another, `T/S * min(k, L/D)`, so nothing is ever dropped and the layer equals `nn.moe_layer` (at the
cost of buffers sized for the worst case; each row meets the same arithmetic, only sums over k > 2 choices and, with
data axes, the psum of bf16 weight-gradient partials round differently). With a factor f, `C = ceil(f * (T/S) * k / D)` (the mean load per
device pair under uniform routing, times f), capped at that maximum. Slots from one source to one destination are
filled in priority order: every token's first choice (in token order), then every second choice, and so on. An
assignment that finds its block full is *dropped*: it contributes zero to its token's output (the token's other
choices still count, and their gate weights are not renormalized) and receives no gradient. `aux["dropped"]`
counts the dropped assignments over the whole mesh.

The fused ops' primitive carries no varying-manual-axes (vma) types, so a `shard_map` around them needs
`check_vma=False` (as here); calling `nn.moe_mlp` or an op inside your own `shard_map` needs the same.

`jax.lax.ragged_all_to_all` (exact, no capacity) is not used: XLA:CPU does not implement it (jaxlib 0.10.2:
"HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"), so it could not be tested here.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from . import routing as _routing
from .block import SharedExpert, add_token_terms
from .layer import LayerSpec, expert_load, gating_of, prepare, shared_of, token_aux
from .moe import moe_mlp
from .router import RouterConfig


class Dispatch(NamedTuple):
    """One device's side of the exchange (inside `shard_map`). R = D * C received slots, A = T_loc * k."""

    x: jax.Array             # (R, H) rows received from every source device (block s = source s); empty slots 0
    local_expert: jax.Array  # (R,) int32 expert of each received row, local to this device; L/D for empty slots
    prob: jax.Array          # (R,) float32 gate weight of each received row; 0 for empty slots
    slot: jax.Array          # (T_loc, k) int32 send slot d*C + c of each (token, choice); R where dropped
    slot_token: jax.Array    # (R,) int32 source token of each send slot; T_loc for empty slots
    dropped: jax.Array       # () int32 assignments of this device's tokens dropped for capacity


def ep_capacity(tokens_per_shard: int, top_k: int, num_experts: int, num_devices: int,
                capacity_factor: Optional[float] = None) -> int:
    """Row slots C that each source device sends each destination device (static).

    `capacity_factor=None`: the no-drop maximum `tokens_per_shard * min(top_k, num_experts // num_devices)`
    (top-k choices are distinct experts, so one token sends at most that many copies to one device). Otherwise
    `ceil(capacity_factor * tokens_per_shard * top_k / num_devices)`, at least 1 and at most the maximum."""
    most = tokens_per_shard * min(top_k, num_experts // num_devices)
    if capacity_factor is None:
        return most
    if not (isinstance(capacity_factor, numbers.Real) and not isinstance(capacity_factor, bool)
            and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number > 0 (or None: no drops)")
    return max(1, min(most, math.ceil(capacity_factor * tokens_per_shard * top_k / num_devices)))


def ep_dispatch(x, experts, weights, *, axis_name: str, num_local_experts: int, capacity: int) -> Dispatch:
    """Send each (token, choice) to the device owning its expert (call inside `shard_map` over `axis_name`).

    x (T_loc, H) this device's tokens; experts (T_loc, k) int32 global expert ids (device d owns experts
    [d*Ll, (d+1)*Ll), Ll = `num_local_experts`); weights (T_loc, k) float32 gate weights. Priority for the C =
    `capacity` slots per destination: choice 0 of every token in token order, then choice 1, ... (module doc)."""
    num_devices = jax.lax.axis_size(axis_name)
    num_tokens, top_k = experts.shape
    slots = num_devices * capacity
    # Assignment a = j * T_loc + t (choice-major): every first choice outranks every second choice.
    flat_expert = experts.T.reshape(-1)
    flat_token = jnp.tile(jnp.arange(num_tokens, dtype=jnp.int32), top_k)
    dest = flat_expert // num_local_experts
    rank = _routing.rank_in_group(dest, num_devices)[0]
    kept = rank < capacity
    slot = jnp.where(kept, dest * capacity + rank, slots)
    filler = jnp.full((slots,), num_tokens * top_k, jnp.int32).at[slot].set(
        jnp.arange(num_tokens * top_k, dtype=jnp.int32), mode="drop")
    filled = filler < num_tokens * top_k
    src_token = jnp.where(filled, jnp.append(flat_token, num_tokens)[filler], num_tokens)
    slot_tk = slot.reshape(top_k, num_tokens).T
    # The send blocks are gathered, and so is the gradient (through slot_tk: a token's k slots; routing.gather_rows)
    send_x = _routing.gather_rows(x, src_token, slot_tk)
    send_prob = jnp.append(weights.T.reshape(-1).astype(jnp.float32), 0.0)[filler]
    send_expert = jnp.where(filled, jnp.append(flat_expert % num_local_experts, 0)[filler], num_local_experts)

    def exchange(a):  # block d of the sender goes to device d; block s of the receiver came from device s
        blocks = a.reshape(num_devices, capacity, *a.shape[1:])
        return jax.lax.all_to_all(blocks, axis_name, 0, 0).reshape(a.shape)

    return Dispatch(exchange(send_x), exchange(send_expert), exchange(send_prob), slot_tk, src_token,
                    jnp.sum(~kept).astype(jnp.int32))


def ep_combine(y, dispatch: Dispatch, *, axis_name: str):
    """Return the expert outputs y (R, H) (row i answers `dispatch.x[i]`, already gate-weighted) to their source
    devices and sum each token's k outputs: (T_loc, H) in y's dtype. Dropped assignments add zero."""
    num_devices = jax.lax.axis_size(axis_name)
    back = jax.lax.all_to_all(y.reshape(num_devices, -1, y.shape[-1]), axis_name, 0, 0).reshape(y.shape)
    # back is in send-slot order: each token's k slots added in fp32 (a dropped one adds zero), as moe_layer's
    # unpermute; the gradient is a gather through slot_token (routing.combine_rows)
    return _routing.combine_rows(back, dispatch.slot, dispatch.slot_token)


def local_expert_mlp(dispatch: Dispatch, w1, w2, b1=None, *, act: str = "swiglu",
                     glu_limit: Optional[float] = None):
    """The received rows through this device's experts: route into 64-row-aligned groups, `nn.moe_mlp`, back to the
    received-slot order. w1 (Ll, 2I or I, H), w2 (Ll, H, I), b1 (Ll, 2I or I) or None. Returns (R, H)."""
    num_local = w1.shape[0]
    rows = dispatch.x.shape[0]
    # Empty slots go to an extra last group that moe_mlp never computes (rows past the last group end are 0).
    plan = _routing.route(dispatch.local_expert[:, None], num_local + 1)
    x_perm, prob = _routing.permute(dispatch.x, dispatch.prob[:, None], plan)
    y_perm = moe_mlp(x_perm, w1, w2, prob, b1, plan.padded_offsets[:num_local], act, glu_limit)
    return _routing.unpermute(y_perm, plan, rows)


def _axis_tuple(data_axes) -> tuple:
    if data_axes is None:
        return ()
    return (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)


def _check_layout(mesh, expert_axis, data_axes, num_tokens, num_experts):
    """Mesh, axes and divisibility rules of the layer; returns (num_devices D, token shards S)."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    for axis in (expert_axis, *data_axes):
        if axis not in names:
            raise ValueError(f"mesh axis {axis!r} (expert_axis / data_axes) is not in the mesh axes {names}")
    if len(set((expert_axis, *data_axes))) != 1 + len(data_axes):
        raise ValueError(f"expert_axis={expert_axis!r} and data_axes={data_axes!r} must be distinct mesh axes")
    num_devices = mesh.shape[expert_axis]
    shards = num_devices * math.prod(mesh.shape[a] for a in data_axes)
    if num_experts % num_devices:
        raise ValueError(f"num_experts={num_experts} (w1.shape[0]) must be divisible by the {expert_axis!r} axis "
                         f"size {num_devices}: experts are sharded evenly")
    if num_tokens % shards:
        raise ValueError(f"the token count {num_tokens} (product of x.shape[:-1]) must be divisible by the "
                         f"number of token shards {shards} (axes {(*data_axes, expert_axis)})")
    return num_devices, shards


def _place(a, mesh, spec):
    """Put `a` in the layout shard_map expects: reshard on Explicit mesh axes, a sharding constraint on Auto ones
    (shard_map refuses a mismatched input on an Explicit mesh and would reshard silently on an Auto one)."""
    sharding = NamedSharding(mesh, spec)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    used = {n for entry in spec if entry is not None for n in ((entry,) if isinstance(entry, str) else entry)}
    explicit = jax.sharding.AxisType.Explicit
    if any(types[n] == explicit for n in used) or (not used and explicit in mesh.axis_types):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


_EXPERT_SHARDED = ("w1", "w2", "b1")          # along L over the expert axis
_TOKEN_SHARDED = ("experts", "weights")       # a precomputed gating: like x; every other parameter replicated


def moe_layer_ep(x, router_weight, w1, w2, b1=None, *, mesh: jax.sharding.Mesh, expert_axis: str = "expert",
                 data_axes: Sequence[str] | str = (), top_k: Optional[int] = None, act: str = "swiglu",
                 glu_limit: Optional[float] = None, capacity_factor: Optional[float] = None,
                 router_config: Optional[RouterConfig] = None, router_bias=None, gating=None, b2=None,
                 shared: Optional[SharedExpert] = None, weight_layout: str = "out_in", dtype=None):
    """Expert-parallel `nn.moe_layer`: the same math and arguments, experts sharded over `mesh` axis `expert_axis`.

    x (..., H) tokens, sharded over (`data_axes`..., `expert_axis`) along the flattened token dimension T (T
    divisible by the number of token shards S; a precomputed `gating` likewise); w1, w2, b1 sharded along L over
    `expert_axis` (L divisible by its size D); the router, router_bias, b2 and the shared expert replicated; inputs
    in another layout are resharded. `capacity_factor`: see the module doc (None: exact, no drops; a dropped
    assignment adds neither its expert's output nor its FC2 bias).
    Returns (y (..., H) in the compute dtype and x's layout, aux) with aux["expert_load"] (L,) int32 assignments
    per expert over all tokens (before drops), aux["dropped"] () int32 assignments dropped for capacity, and the
    per-token aux["experts"], aux["weights"] (and with a router aux["logits"], aux["scores"]) as `nn.moe_layer`.
    On a mesh with Explicit axes (`jax.make_mesh`'s default) call it under `jax.set_mesh(mesh)`, as JAX requires
    for differentiating through explicitly sharded arrays."""
    data_axes = _axis_tuple(data_axes)
    batch_shape = x.shape[:-1]
    x2d, params, spec = prepare(x, router_weight, w1, w2, b1, top_k=top_k, router_config=router_config,
                                router_bias=router_bias, gating=gating, b2=b2, shared=shared, act=act,
                                glu_limit=glu_limit, weight_layout=weight_layout, dtype=dtype)
    num_tokens, num_experts = x2d.shape[0], params["w1"].shape[0]
    num_devices, shards = _check_layout(mesh, expert_axis, data_axes, num_tokens, num_experts)
    capacity = ep_capacity(num_tokens // shards, spec.top_k, num_experts, num_devices, capacity_factor)
    layer = _sharded_layer(mesh, expert_axis, data_axes, spec, capacity, tuple(sorted(params)))
    y, per_token, load, dropped = layer(x2d, params)
    aux = {"expert_load": load, "dropped": dropped,
           **{k: v.reshape(*batch_shape, v.shape[-1]) for k, v in per_token.items()}}
    return y.reshape(*batch_shape, x.shape[-1]), aux


@functools.lru_cache(maxsize=64)
def _sharded_layer(mesh, expert_axis, data_axes, spec: LayerSpec, capacity, names):
    """The jitted shard_map of the layer for one static configuration (cached: an eager call compiles once
    instead of dispatching every op inside shard_map; under an outer jit it is inlined)."""
    token_axes = (*data_axes, expert_axis)
    x_spec = P(token_axes)
    specs = {n: P(expert_axis) if n in _EXPERT_SHARDED else x_spec if n in _TOKEN_SHARDED else P() for n in names}

    def body(x_loc, params):
        num_local = params["w1"].shape[0]
        num_experts = num_local * jax.lax.axis_size(expert_axis)
        gating = gating_of(x_loc, params, spec, num_experts)
        dispatch = ep_dispatch(x_loc, gating.experts, gating.weights, axis_name=expert_axis,
                               num_local_experts=num_local, capacity=capacity)
        y_recv = local_expert_mlp(dispatch, params["w1"], params["w2"], params.get("b1"), act=spec.act,
                                  glu_limit=spec.glu_limit)
        y_loc = ep_combine(y_recv, dispatch, axis_name=expert_axis)
        kept = jnp.where(dispatch.slot < dispatch.x.shape[0], gating.weights, 0.0)   # a dropped copy adds no b2
        y_loc = add_token_terms(y_loc, x_loc, gating.experts, kept, params.get("b2"), shared_of(params), spec.act,
                                spec.glu_limit)
        load = expert_load(gating.experts, num_experts)
        per_token = token_aux(gating, gating.experts.shape[:1])
        return y_loc, per_token, jax.lax.psum(load, token_axes), jax.lax.psum(dispatch.dropped, token_axes)

    per_token_names = ("experts", "weights") + (("logits", "scores") if spec.config is not None else ())
    out_specs = (x_spec, {k: x_spec for k in per_token_names}, P(), P())
    # check_vma=False: the fused ops' primitive does not propagate varying-manual-axes types (its abstract eval
    # returns plain avals), which the vma checker rejects inside custom_vjp. Without the checker shard_map's
    # transpose psums the cotangents of inputs replicated over an axis (the router), which is the right rule here.
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, specs), out_specs=out_specs, check_vma=False)

    def layer(x, params):
        return mapped(_place(x, mesh, x_spec), {n: _place(a, mesh, specs[n]) for n, a in params.items()})
    return jax.jit(layer)


def expert_parallel_shardings(mesh: jax.sharding.Mesh, expert_axis: str = "expert",
                              data_axes: Sequence[str] | str = ()) -> dict:
    """NamedShardings of `moe_layer_ep`'s arguments: {"x", "router_weight", "w1", "w2", "b1"} (x flattened to
    (T, H)); for `jax.device_put` / `jax.make_array_from_callback` of the parameters and tokens."""
    token_axes = (*_axis_tuple(data_axes), expert_axis)
    weights = NamedSharding(mesh, P(expert_axis))
    return {"x": NamedSharding(mesh, P(token_axes)), "router_weight": NamedSharding(mesh, P()), "w1": weights,
            "w2": weights, "b1": weights}
