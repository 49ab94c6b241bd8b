"""Flax (NNX) and Equinox wrappers of `moe_layer`: parameters + a __call__(x) -> y, nothing else.

Imported lazily (`cudnn_moe_jax.nn.FlaxMoE`, `cudnn_moe_jax.nn.EquinoxMoE`) so neither framework is a dependency.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from .moe import moe_layer


def _init_weights(key, num_experts, hidden, intermediate, act, dtype, bias):
    """Router (H, L) f32, W1 (L, 2I or I, H), W2 (L, H, I), optional b1, scaled by 1/sqrt(fan_in)."""
    k_router, k_w1, k_w2 = jax.random.split(key, 3)
    fc1_out = intermediate if act == "srelu" else 2 * intermediate
    router = jax.random.normal(k_router, (hidden, num_experts), jnp.float32) / hidden ** 0.5
    w1 = (jax.random.normal(k_w1, (num_experts, fc1_out, hidden)) / hidden ** 0.5).astype(dtype)
    w2 = (jax.random.normal(k_w2, (num_experts, hidden, intermediate)) / intermediate ** 0.5).astype(dtype)
    b1 = jnp.zeros((num_experts, fc1_out), dtype) if bias else None
    return router, w1, w2, b1


@functools.cache  # one class per process: `nn.X is nn.X`, isinstance and pytree treedefs agree
def _flax_module():
    from flax import nnx

    class FlaxMoE(nnx.Module):
        """Routed MoE FFN (flax.nnx): y = moe_layer(x, router, w1, w2, b1)."""

        def __init__(self, hidden: int, intermediate: int, num_experts: int, *, rngs: "nnx.Rngs", top_k: int = 2,
                     act: str = "swiglu", bias: bool = False, dtype=jnp.bfloat16,
                     glu_limit: Optional[float] = None):
            router, w1, w2, b1 = _init_weights(rngs.params(), num_experts, hidden, intermediate, act, dtype, bias)
            self.router, self.w1, self.w2 = nnx.Param(router), nnx.Param(w1), nnx.Param(w2)
            self.b1 = nnx.Param(b1) if bias else None
            self.top_k, self.act, self.glu_limit = top_k, act, glu_limit

        def __call__(self, x):
            """x (..., H) bf16/fp16 tokens -> y with x's shape (see `cudnn_moe_jax.nn.moe_layer`)."""
            b1 = None if self.b1 is None else self.b1[...]
            y, _ = moe_layer(x, self.router[...], self.w1[...], self.w2[...], b1, top_k=self.top_k, act=self.act,
                             glu_limit=self.glu_limit)
            return y

    return _public_name(FlaxMoE)


@functools.cache
def _equinox_module():
    import equinox as eqx

    class EquinoxMoE(eqx.Module):
        """Routed MoE FFN (equinox): y = moe_layer(x, router, w1, w2, b1)."""

        router: jax.Array
        w1: jax.Array
        w2: jax.Array
        b1: Optional[jax.Array]
        top_k: int = eqx.field(static=True)
        act: str = eqx.field(static=True)
        glu_limit: Optional[float] = eqx.field(static=True)

        def __init__(self, hidden: int, intermediate: int, num_experts: int, *, key, top_k: int = 2,
                     act: str = "swiglu", bias: bool = False, dtype=jnp.bfloat16,
                     glu_limit: Optional[float] = None):
            self.router, self.w1, self.w2, self.b1 = _init_weights(key, num_experts, hidden, intermediate, act,
                                                                   dtype, bias)
            self.top_k, self.act, self.glu_limit = top_k, act, glu_limit

        def __call__(self, x):
            """x (..., H) bf16/fp16 tokens -> y with x's shape (see `cudnn_moe_jax.nn.moe_layer`)."""
            y, _ = moe_layer(x, self.router, self.w1, self.w2, self.b1, top_k=self.top_k, act=self.act,
                             glu_limit=self.glu_limit)
            return y

    return _public_name(EquinoxMoE)


def _public_name(cls):
    """Name a class built inside a factory after where users find it: reprs read `EquinoxMoE(...)`, not
    `_equinox_module.<locals>.EquinoxMoE(...)`, and pickle finds it as cudnn_moe_jax.nn.<name>."""
    cls.__qualname__ = cls.__name__
    cls.__module__ = "cudnn_moe_jax.nn"
    return cls
