"""Weight-gradient cases (grouped_gemm_wgrad through the public op) of the GPU suite (tests/gpu/test_wgrad_gpu.py:
the runs and every check against the float64 oracle; also accumulate_on_output / global scales), and the bundle
items that record their kernel modules on the CPU machine (each module is recorded at T = 2000 only: it serves
every T):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.wgrad_cases:bundle_items
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax import aot

NW, T, L = 320, 2000, 5   # A (MW, T), B (NW, T) -> W (L, MW, NW); T % 8 == 0
PATTERNS = {
    "a64": (384, 640, 1024, 1600, 1984),            # every range starts on a 64-token tile; 1984.. in no expert
    "a8": (304, 640, 1024, 1600, 1984),             # starts on 8 tokens (16 bytes), ends inside k-tiles
    "unaligned": (300, 333, 1024, 1500, 2000),      # ends inside k-tiles, one 33-token expert
    "empty_and_tail": (0, 640, 640, 1900, 1900),    # experts 0, 2, 4 empty; tokens 1900.. in no expert
    "unsanitized": (700, 300, 9999, -5, 2000),      # -> 700, 700, 2000, 2000, 2000
}

# (name, ab dtype, wgrad dtype, MW, token-major operands): MW 384 runs 1x1 clusters, 512 2x1
CASES = [("c1_bf16", "bfloat16", "bfloat16", 384, False), ("c2_bf16_f32", "bfloat16", "float32", 512, False),
         ("c2_bf16_tokmajor", "bfloat16", "bfloat16", 512, True), ("c1_f16_tokmajor", "float16", "float16", 384, True)]


def inputs(case, pattern: str = "unaligned", seed: int = 0):
    _, ab, _, mw, token_major = case
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    a, b = jax.random.normal(ka, (mw, T)).astype(ab), jax.random.normal(kb, (NW, T)).astype(ab)
    if token_major:  # the activations as a training step holds them: (T, rows)
        return dict(a_tok=a.T, b_tok=b.T, offsets=jnp.asarray(PATTERNS[pattern], jnp.int32))
    return dict(a=a, b=b, offsets=jnp.asarray(PATTERNS[pattern], jnp.int32))


def operands(case, x):
    """(A (MW, T), B (NW, T)) as the op sees them."""
    return (x["a_tok"].T, x["b_tok"].T) if case[4] else (x["a"], x["b"])


def call(case, x):
    a, b = operands(case, x)
    majors = dict(a_major="m", b_major="n") if case[4] else {}
    return cmj.grouped_gemm_wgrad(a, b, x["offsets"], wgrad_dtype=case[2], **majors)


# accumulate_on_output / global scales: (name, ab dtype, W dtype, MW, token-major, global scales, accumulate). The
# GPU test runs each at both token counts of T_VALUES on the one module recorded at T.
ACCUM_CASES = [("acc_c1_bf16_gs", "bfloat16", "bfloat16", 384, False, True, True),
               ("acc_c2_f32_tokmajor", "bfloat16", "float32", 512, True, False, True),
               ("gs_c2_f16", "float16", "float16", 512, False, True, False)]
T_VALUES = (T, 1024)


def accum_inputs(case, pattern: str = "empty_and_tail", tokens: int = T, old: str = "random", seed: int = 0):
    """Inputs with `tokens` tokens (the pattern's offsets clip to it); old W random normal, or all NaN ("nan")."""
    _, ab, wd, mw, token_major, gs, acc = case
    ka, kb, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
    a, b = jax.random.normal(ka, (mw, tokens)).astype(ab), jax.random.normal(kb, (NW, tokens)).astype(ab)
    x = {"a_tok": a.T, "b_tok": b.T} if token_major else {"a": a, "b": b}
    x["offsets"] = jnp.asarray(PATTERNS[pattern], jnp.int32)
    if gs:  # negative scales on a computed expert (1) and an empty one (4, empty in both patterns: adds -0.0)
        g = jax.random.uniform(kg, (2, L), jnp.float32, 0.25, 4.0)
        x["gsa"], x["gsb"] = g[0].at[1].multiply(-1.0).at[4].multiply(-1.0), g[1]
    if acc:
        w = jax.random.normal(kw, (L, mw, NW), jnp.float32) * 8.0
        x["w"] = (jnp.full_like(w, jnp.nan) if old == "nan" else w).astype(wd)
    return x


def accum_call(case, x):
    a, b = operands(case, x)
    majors = {"a_major": "m", "b_major": "n"} if case[4] else {}
    acc = case[6]
    return cmj.grouped_gemm_wgrad(a, b, x["offsets"], global_scale_a=x.get("gsa"), global_scale_b=x.get("gsb"),
                                  wgrad_tensor=x.get("w"), accumulate_on_output=acc,
                                  wgrad_dtype=None if acc else case[2], **majors)


def bundle_items():
    return aot.lowering_items(CASES, inputs, call) + aot.lowering_items(ACCUM_CASES, accum_inputs, accum_call)
