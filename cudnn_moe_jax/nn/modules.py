"""Flax (NNX) and Equinox wrappers of `moe_layer`: parameters + a __call__(x) -> y (or (y, aux)), nothing else.

Imported lazily (`cudnn_moe_jax.nn.FlaxMoE`, `cudnn_moe_jax.nn.EquinoxMoE`) so neither framework is a dependency.
With `mesh=` the layer is expert-parallel (`nn.moe_layer_ep`): the parameters are created sharded (experts over
`expert_axis`, everything else replicated) and `expert_axis`, `data_axes`, `capacity_factor` are passed through.

Parameters (fused layout, docs/nn.md): router (H, L); router_bias (L,) when `router_config.bias` is set ("logits":
a trained parameter; "selection": the balancing bias, not a Flax `nnx.Param` but an `nnx.Variable` of its own type
`BalancingBias`, updated with `nn.balancing_bias_update`); w1 (L, 2I or I, H); w2 (L, H, I); b1 (L, 2I or I) with
`bias=True`; b2 (L, H) with `fc2_bias=True`; shared_w1 (2Is or Is, H), shared_w2 (H, Is), shared_b1 with
`shared_intermediate=Is` (and `bias=True`), shared_gate (H,) with `shared_gate=True`.

Precision: `dtype` is the compute dtype (bfloat16 default; float32 runs the jnp reference path). `param_dtype`
is the parameters' dtype; None keeps the expert weights in `dtype` and the router in float32. float32 parameters
with a 16-bit `dtype` are master weights: cast inside the layer, float32 gradients.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import activations
from .block import SharedExpert
from .expert_parallel import _EXPERT_SHARDED, moe_layer_ep
from .layer import moe_layer
from .router import RouterConfig, resolve_config


def _init_params(key, hidden, intermediate, num_experts, *, act, dtype, param_dtype, bias, router_config,
                 fc2_bias, shared_intermediate, shared_gate) -> dict:
    """Every parameter of the module, {name: array}: weights ~ N(0, 1/fan_in), biases 0."""
    glu = activations.get(act, "act").glu
    expert_dtype = jnp.dtype(param_dtype or dtype)
    router_dtype = jnp.dtype(param_dtype or jnp.float32)
    keys = iter(jax.random.split(key, 6))
    normal = lambda shape, fan_in, dt: (jax.random.normal(next(keys), shape) / fan_in ** 0.5).astype(dt)  # noqa
    zeros = lambda shape, dt: jnp.zeros(shape, dt)  # noqa: E731
    fc1 = 2 * intermediate if glu else intermediate
    out = {"router": normal((hidden, num_experts), hidden, router_dtype),
           "w1": normal((num_experts, fc1, hidden), hidden, expert_dtype),
           "w2": normal((num_experts, hidden, intermediate), intermediate, expert_dtype)}
    if router_config.bias is not None:
        out["router_bias"] = zeros((num_experts,), router_dtype)
    if bias:
        out["b1"] = zeros((num_experts, fc1), expert_dtype)
    if fc2_bias:
        out["b2"] = zeros((num_experts, hidden), expert_dtype)
    if shared_intermediate:
        s_fc1 = 2 * shared_intermediate if glu else shared_intermediate
        out["shared_w1"] = normal((s_fc1, hidden), hidden, expert_dtype)
        out["shared_w2"] = normal((hidden, shared_intermediate), shared_intermediate, expert_dtype)
        if bias:
            out["shared_b1"] = zeros((s_fc1,), expert_dtype)
        if shared_gate:
            out["shared_gate"] = normal((hidden,), hidden, expert_dtype)
    elif shared_gate:
        raise ValueError("shared_gate=True needs a shared expert (shared_intermediate > 0)")
    return out


def _place_params(params: dict, mesh, expert_axis) -> dict:
    """The parameters on the expert-parallel layout of `mesh` (unchanged without a mesh)."""
    if mesh is None:
        return params
    return {n: jax.device_put(a, NamedSharding(mesh, P(expert_axis) if n in _EXPERT_SHARDED else P()))
            for n, a in params.items()}


class _Options(NamedTuple):
    """The module's static layer options (hashable: a static field of either framework)."""

    act: str
    glu_limit: Optional[float]
    router_config: RouterConfig
    dtype: str
    mesh: Optional[jax.sharding.Mesh]
    expert_axis: str
    data_axes: tuple
    capacity_factor: Optional[float]


def _options(act, glu_limit, router_config, top_k, dtype, mesh, expert_axis, data_axes, capacity_factor):
    data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    return _Options(act, glu_limit, resolve_config(router_config, top_k), jnp.dtype(dtype).name, mesh, expert_axis,
                    data_axes, capacity_factor)


def _call(x, params: dict, options: _Options, return_aux: bool):
    """moe_layer, or moe_layer_ep when the module has a mesh, on the module's parameters {name: array}."""
    shared = None
    if "shared_w1" in params:
        shared = SharedExpert(params["shared_w1"], params["shared_w2"], params.get("shared_b1"),
                              params.get("shared_gate"))
    kwargs = dict(act=options.act, glu_limit=options.glu_limit, router_config=options.router_config,
                  router_bias=params.get("router_bias"), b2=params.get("b2"), shared=shared, dtype=options.dtype)
    args = (x, params["router"], params["w1"], params["w2"], params.get("b1"))
    if options.mesh is None:
        y, aux = moe_layer(*args, **kwargs)
    else:
        y, aux = moe_layer_ep(*args, **kwargs, mesh=options.mesh, expert_axis=options.expert_axis,
                              data_axes=options.data_axes, capacity_factor=options.capacity_factor)
    return (y, aux) if return_aux else y


_CALL_DOC = """x (..., H) tokens -> y with x's shape in the compute dtype (see `cudnn_moe_jax.nn.moe_layer`);
            with return_aux=True, (y, aux): the routing internals (logits, scores, experts, weights,
            expert_load) for the router losses and the balancing-bias update, from this same router pass."""


@functools.cache  # one class per process: `nn.X is nn.X`, isinstance and pytree treedefs agree
def _flax_module():
    from flax import nnx

    class BalancingBias(nnx.Variable):
        """The selection-only router bias of auxiliary-loss-free balancing: state, not a trained parameter."""

    class FlaxMoE(nnx.Module):
        """Routed MoE FFN (flax.nnx): y = moe_layer(x, ...); with `mesh`, moe_layer_ep (module doc)."""

        def __init__(self, hidden: int, intermediate: int, num_experts: int, *, rngs: "nnx.Rngs",
                     top_k: Optional[int] = None, act: str = "swiglu", bias: bool = False, dtype=jnp.bfloat16,
                     param_dtype=None, glu_limit: Optional[float] = None,
                     router_config: Optional[RouterConfig] = None, fc2_bias: bool = False,
                     shared_intermediate: int = 0, shared_gate: bool = False,
                     mesh: Optional[jax.sharding.Mesh] = None, expert_axis: str = "expert",
                     data_axes: Sequence[str] = (), capacity_factor: Optional[float] = None):
            self.options = _options(act, glu_limit, router_config, top_k, dtype, mesh, expert_axis, data_axes,
                                    capacity_factor)
            params = _init_params(rngs.params(), hidden, intermediate, num_experts, act=act, dtype=dtype,
                                  param_dtype=param_dtype, bias=bias, router_config=self.options.router_config,
                                  fc2_bias=fc2_bias, shared_intermediate=shared_intermediate,
                                  shared_gate=shared_gate)
            self.param_names = tuple(params)
            selection = self.options.router_config.bias == "selection"
            for name, value in _place_params(params, mesh, expert_axis).items():
                kind = BalancingBias if name == "router_bias" and selection else nnx.Param
                setattr(self, name, kind(value))

        def __call__(self, x, *, return_aux: bool = False):
            params = {name: getattr(self, name)[...] for name in self.param_names}
            return _call(x, params, self.options, return_aux)

    FlaxMoE.__call__.__doc__ = _CALL_DOC
    FlaxMoE.BalancingBias = BalancingBias
    return _public_name(FlaxMoE)


_PARAM_NAMES = ("router", "router_bias", "w1", "w2", "b1", "b2", "shared_w1", "shared_w2", "shared_b1",
                "shared_gate")


@functools.cache
def _equinox_module():
    import equinox as eqx

    class EquinoxMoE(eqx.Module):
        """Routed MoE FFN (equinox): y = moe_layer(x, ...); with `mesh`, moe_layer_ep (module doc). The
        "selection" router_bias gets a zero gradient: keep it out of the optimizer (or weight decay moves it)."""

        router: jax.Array
        w1: jax.Array
        w2: jax.Array
        router_bias: Optional[jax.Array]
        b1: Optional[jax.Array]
        b2: Optional[jax.Array]
        shared_w1: Optional[jax.Array]
        shared_w2: Optional[jax.Array]
        shared_b1: Optional[jax.Array]
        shared_gate: Optional[jax.Array]
        options: _Options = eqx.field(static=True)

        def __init__(self, hidden: int, intermediate: int, num_experts: int, *, key, top_k: Optional[int] = None,
                     act: str = "swiglu", bias: bool = False, dtype=jnp.bfloat16, param_dtype=None,
                     glu_limit: Optional[float] = None, router_config: Optional[RouterConfig] = None,
                     fc2_bias: bool = False, shared_intermediate: int = 0, shared_gate: bool = False,
                     mesh: Optional[jax.sharding.Mesh] = None, expert_axis: str = "expert",
                     data_axes: Sequence[str] = (), capacity_factor: Optional[float] = None):
            self.options = _options(act, glu_limit, router_config, top_k, dtype, mesh, expert_axis, data_axes,
                                    capacity_factor)
            params = _init_params(key, hidden, intermediate, num_experts, act=act, dtype=dtype,
                                  param_dtype=param_dtype, bias=bias, router_config=self.options.router_config,
                                  fc2_bias=fc2_bias, shared_intermediate=shared_intermediate,
                                  shared_gate=shared_gate)
            params = _place_params(params, mesh, expert_axis)
            for name in _PARAM_NAMES:
                setattr(self, name, params.get(name))

        def __call__(self, x, *, return_aux: bool = False):
            params = {name: getattr(self, name) for name in _PARAM_NAMES if getattr(self, name) is not None}
            return _call(x, params, self.options, return_aux)

    EquinoxMoE.__call__.__doc__ = _CALL_DOC
    return _public_name(EquinoxMoE)


def _public_name(cls):
    """Name a class built inside a factory after where users find it: reprs read `EquinoxMoE(...)`, not
    `_equinox_module.<locals>.EquinoxMoE(...)`, and pickle finds it as cudnn_moe_jax.nn.<name>."""
    cls.__qualname__ = cls.__name__
    cls.__module__ = "cudnn_moe_jax.nn"
    return cls
