"""Neural-network building blocks on top of the fused ops: routing, the custom_vjp MoE MLP, layer wrappers."""

from .moe import moe_layer, moe_mlp
from .routing import Routing, permute, permuted_rows, route, top_k_gating, unpermute

__all__ = ["moe_mlp", "moe_layer", "Routing", "route", "permute", "unpermute", "permuted_rows", "top_k_gating"]
