"""Neural-network building blocks on top of the fused ops (docs/nn.md): the router (`RouterConfig`, `apply_router`),
the permutation (`route`, `permute`, `unpermute`), the custom_vjp expert MLP (`moe_mlp`), the layers (`moe_layer`,
`moe_layer_ep`), the router losses and the Flax / Equinox modules.

`FlaxMoE` (flax.nnx) and `EquinoxMoE` are created on first access, so neither framework is a dependency.
"""

from .block import SharedExpert
from .expert_parallel import (Dispatch, ep_capacity, ep_combine, ep_dispatch, expert_parallel_shardings,
                              local_expert_mlp, moe_layer_ep)
from .layer import moe_layer
from .losses import balancing_bias_update, load_balancing_loss, router_z_loss
from .moe import moe_mlp
from .router import Gating, RouterConfig, apply_router, gate, top_k_gating
from .routing import Routing, permute, permuted_rows, route, unpermute
from .weights import deinterleave_glu_weights, interleave_glu_weights, to_fused_layout

__all__ = ["moe_mlp", "moe_layer", "RouterConfig", "Gating", "apply_router", "gate", "top_k_gating",
           "SharedExpert", "load_balancing_loss", "router_z_loss", "balancing_bias_update", "Routing", "route",
           "permute", "unpermute", "permuted_rows", "interleave_glu_weights", "deinterleave_glu_weights",
           "to_fused_layout", "moe_layer_ep", "ep_capacity", "ep_dispatch", "ep_combine", "local_expert_mlp",
           "Dispatch", "expert_parallel_shardings", "FlaxMoE", "EquinoxMoE"]


def __getattr__(name):
    import importlib

    modules = importlib.import_module(".modules", __name__)
    if name == "FlaxMoE":
        return modules._flax_module()
    if name == "EquinoxMoE":
        return modules._equinox_module()
    raise AttributeError(name)
