"""Flax (NNX) and Equinox wrappers of `moe_layer`: parameters + a __call__(x) -> y, nothing else.

Imported lazily (`cudnn_moe_jax.nn.FlaxMoE`, `cudnn_moe_jax.nn.EquinoxMoE`) so neither framework is a dependency.
With `mesh=` the layer is expert-parallel (`nn.moe_layer_ep`): the parameters are created sharded (experts over
`expert_axis`, the router replicated) and `expert_axis`, `data_axes`, `capacity_factor` are passed through.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from .. import activations
from .expert_parallel import expert_parallel_shardings, moe_layer_ep
from .moe import moe_layer


def _init_weights(key, num_experts, hidden, intermediate, act, dtype, bias):
    """Router (H, L) f32, W1 (L, 2I or I, H), W2 (L, H, I), optional b1, scaled by 1/sqrt(fan_in)."""
    k_router, k_w1, k_w2 = jax.random.split(key, 3)
    fc1_out = 2 * intermediate if activations.get(act, "act").glu else intermediate
    router = jax.random.normal(k_router, (hidden, num_experts), jnp.float32) / hidden ** 0.5
    w1 = (jax.random.normal(k_w1, (num_experts, fc1_out, hidden)) / hidden ** 0.5).astype(dtype)
    w2 = (jax.random.normal(k_w2, (num_experts, hidden, intermediate)) / intermediate ** 0.5).astype(dtype)
    b1 = jnp.zeros((num_experts, fc1_out), dtype) if bias else None
    return router, w1, w2, b1


def _place_weights(weights, mesh, expert_axis, data_axes):
    """(router, w1, w2, b1) on the expert-parallel layout of `mesh` (unchanged without a mesh)."""
    if mesh is None:
        return weights
    shardings = expert_parallel_shardings(mesh, expert_axis, data_axes)
    return tuple(None if w is None else jax.device_put(w, shardings[name])
                 for name, w in zip(("router_weight", "w1", "w2", "b1"), weights))


class _Parallel(NamedTuple):
    """The module's expert-parallel options (hashable: a static field of either framework)."""

    mesh: Optional[jax.sharding.Mesh]
    expert_axis: str
    data_axes: tuple
    capacity_factor: Optional[float]


def _parallel(mesh, expert_axis, data_axes, capacity_factor) -> _Parallel:
    data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    return _Parallel(mesh, expert_axis, data_axes, capacity_factor)


def _call(x, router, w1, w2, b1, options, parallel: _Parallel):
    """moe_layer, or moe_layer_ep when the module has a mesh; returns y only."""
    if parallel.mesh is None:
        return moe_layer(x, router, w1, w2, b1, **options)[0]
    return moe_layer_ep(x, router, w1, w2, b1, **options, **parallel._asdict())[0]


@functools.cache  # one class per process: `nn.X is nn.X`, isinstance and pytree treedefs agree
def _flax_module():
    from flax import nnx

    class FlaxMoE(nnx.Module):
        """Routed MoE FFN (flax.nnx): y = moe_layer(x, router, w1, w2, b1); with `mesh`, moe_layer_ep."""

        def __init__(self, hidden: int, intermediate: int, num_experts: int, *, rngs: "nnx.Rngs", top_k: int = 2,
                     act: str = "swiglu", bias: bool = False, dtype=jnp.bfloat16,
                     glu_limit: Optional[float] = None, mesh: Optional[jax.sharding.Mesh] = None,
                     expert_axis: str = "expert", data_axes: Sequence[str] = (),
                     capacity_factor: Optional[float] = None):
            weights = _init_weights(rngs.params(), num_experts, hidden, intermediate, act, dtype, bias)
            router, w1, w2, b1 = _place_weights(weights, mesh, expert_axis, data_axes)
            self.router, self.w1, self.w2 = nnx.Param(router), nnx.Param(w1), nnx.Param(w2)
            self.b1 = nnx.Param(b1) if bias else None
            self.top_k, self.act, self.glu_limit = top_k, act, glu_limit
            self.parallel = _parallel(mesh, expert_axis, data_axes, capacity_factor)

        def __call__(self, x):
            """x (..., H) bf16/fp16 tokens -> y with x's shape (see `cudnn_moe_jax.nn.moe_layer`)."""
            b1 = None if self.b1 is None else self.b1[...]
            options = dict(top_k=self.top_k, act=self.act, glu_limit=self.glu_limit)
            return _call(x, self.router[...], self.w1[...], self.w2[...], b1, options, self.parallel)

    return _public_name(FlaxMoE)


@functools.cache
def _equinox_module():
    import equinox as eqx

    class EquinoxMoE(eqx.Module):
        """Routed MoE FFN (equinox): y = moe_layer(x, router, w1, w2, b1); with `mesh`, moe_layer_ep."""

        router: jax.Array
        w1: jax.Array
        w2: jax.Array
        b1: Optional[jax.Array]
        top_k: int = eqx.field(static=True)
        act: str = eqx.field(static=True)
        glu_limit: Optional[float] = eqx.field(static=True)
        parallel: _Parallel = eqx.field(static=True)

        def __init__(self, hidden: int, intermediate: int, num_experts: int, *, key, top_k: int = 2,
                     act: str = "swiglu", bias: bool = False, dtype=jnp.bfloat16,
                     glu_limit: Optional[float] = None, mesh: Optional[jax.sharding.Mesh] = None,
                     expert_axis: str = "expert", data_axes: Sequence[str] = (),
                     capacity_factor: Optional[float] = None):
            weights = _init_weights(key, num_experts, hidden, intermediate, act, dtype, bias)
            self.router, self.w1, self.w2, self.b1 = _place_weights(weights, mesh, expert_axis, data_axes)
            self.top_k, self.act, self.glu_limit = top_k, act, glu_limit
            self.parallel = _parallel(mesh, expert_axis, data_axes, capacity_factor)

        def __call__(self, x):
            """x (..., H) bf16/fp16 tokens -> y with x's shape (see `cudnn_moe_jax.nn.moe_layer`)."""
            options = dict(top_k=self.top_k, act=self.act, glu_limit=self.glu_limit)
            return _call(x, self.router, self.w1, self.w2, self.b1, options, self.parallel)

    return _public_name(EquinoxMoE)


def _public_name(cls):
    """Name a class built inside a factory after where users find it: reprs read `EquinoxMoE(...)`, not
    `_equinox_module.<locals>.EquinoxMoE(...)`, and pickle finds it as cudnn_moe_jax.nn.<name>."""
    cls.__qualname__ = cls.__name__
    cls.__module__ = "cudnn_moe_jax.nn"
    return cls
