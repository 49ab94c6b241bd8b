"""Weight-gradient cases (grouped_gemm_wgrad through the public op) for the GPU suite, and the bundle items that
record their kernel modules on the CPU machine:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants tests.gpu.wgrad_cases:bundle_items
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj

MW, NW, T, L = 384, 320, 2000, 5   # A (MW, T), B (NW, T) -> W (L, MW, NW); T % 8 == 0, tiles straddle experts
PATTERNS = {
    "unaligned": (300, 333, 1024, 1500, 2000),      # ends inside k-tiles, one 33-token expert
    "empty_and_tail": (0, 640, 640, 1900, 1900),    # experts 0, 2, 4 empty; tokens 1900.. in no expert
    "unsanitized": (700, 300, 9999, -5, 2000),      # -> 700, 700, 2000, 2000, 2000
    "one_expert": (0, 0, 2000, 2000, 2000),
}

# (name, ab dtype, wgrad dtype)
CASES = [("bf16_to_bf16", "bfloat16", "bfloat16"), ("bf16_to_f32", "bfloat16", "float32"),
         ("f16_to_f16", "float16", "float16")]


def inputs(case, pattern: str = "unaligned", seed: int = 0):
    _, ab, _ = case
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    return dict(a=jax.random.normal(ka, (MW, T)).astype(ab), b=jax.random.normal(kb, (NW, T)).astype(ab),
                offsets=jnp.asarray(PATTERNS[pattern], jnp.int32))


def call(case, x):
    return cmj.grouped_gemm_wgrad(x["a"], x["b"], x["offsets"], wgrad_dtype=case[2])


def bundle_items():
    items = []
    for case in CASES:
        fn = jax.jit(functools.partial(call, case))
        x = inputs(case)
        items.append(lambda fn=fn, x=x: fn.trace(x).lower(lowering_platforms=("cuda",)))
    return items
