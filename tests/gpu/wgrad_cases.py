"""Weight-gradient cases (grouped_gemm_wgrad through the public op) for the GPU suite and the sanitizer (`run_case`:
the run and every check), and the bundle items that record their kernel modules on the CPU machine:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants tests.gpu.wgrad_cases:bundle_items
"""

from __future__ import annotations

import functools
import warnings
import zlib

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


def bundle_items_for(cases):
    return aot.lowering_items(cases, inputs, call)


def bundle_items():
    return bundle_items_for(CASES)


# ------------------------------------------------------------------------------------------------ GPU run + checks
# (tests/gpu/test_wgrad_gpu.py, tools/gpu/sanitize_backward.py; need tests/ and tests/gpu/ on sys.path)

def run_case(case, pattern: str) -> list[str]:
    """Run one case on the GPU (W poisoned first, twice) and check every element against the float64 oracle
    (tests/np_ops.py); the problems found ([] = ok)."""
    import harness
    import np_ops
    import numpy as np

    x = inputs(case, pattern, seed=zlib.crc32(f"{case[0]}/{pattern}".encode()) % 1000)
    fn = jax.jit(functools.partial(call, case))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback to the reference would warn
        harness.poison_allocator()
        got = np.asarray(jax.block_until_ready(fn(x)).wgrad_tensor)
        harness.poison_allocator()
        again = np.asarray(jax.block_until_ready(fn(x)).wgrad_tensor)
    errs = [] if np.array_equal(got.view(np.uint8), again.view(np.uint8)) else ["two calls differ"]
    a, b = (np.asarray(v.astype(jnp.float32)) for v in operands(case, x))
    want = np_ops.grouped_gemm_wgrad(a, b, np.asarray(x["offsets"]), ab_dtype=case[1], wgrad_dtype=case[2])
    gv = got.astype(np.float32).astype(np.float64)
    if not np.all(np.isfinite(gv)):
        return errs + ["non-finite output (poison left in W?)"]
    pre, mag = want["_pre"]["wgrad"], want["_mag"]["wgrad"]
    bound = harness.ULP[case[2]] * np.abs(pre) + 1e-5 * mag + 1e-30
    err = np.abs(gv - pre)
    if not np.all(err <= bound):
        errs.append(f"worst {np.max(err / bound):.2f} x the bound")
    for e, (s, t) in enumerate(want["_groups"]):
        if t <= s and gv[e].any():
            errs.append(f"expert {e} has no token: W[e] must be zero")
    return errs
