"""Weight-gradient cases (grouped_gemm_wgrad through the public op) for the GPU suite and the sanitizer (`run_case`:
the run and every check; `run_accum_case`: accumulate_on_output / global scales), and the bundle items that record
their kernel modules on the CPU machine (each module is recorded at T = 2000 only: it serves every T):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants tests.gpu.wgrad_cases:bundle_items
"""

from __future__ import annotations

import functools
import re
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
    return bundle_items_for(CASES) + aot.lowering_items(ACCUM_CASES, accum_inputs, accum_call)


# ------------------------------------------------------------------------------------------------ GPU run + checks
# (tests/gpu/test_wgrad_gpu.py, tools/gpu/sanitize_backward.py; need tests/ and tests/gpu/ on sys.path)

def _run_twice(fn, x):
    """W of two jitted calls (the allocator poisoned before each, a fallback to the reference an error): (the first
    W as numpy, ["two calls differ"] unless both are bit-identical)."""
    import harness
    import numpy as np

    fn = jax.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback to the reference would warn
        harness.poison_allocator()
        got = np.asarray(jax.block_until_ready(fn(x)).wgrad_tensor)
        harness.poison_allocator()
        again = np.asarray(jax.block_until_ready(fn(x)).wgrad_tensor)
    return got, ([] if np.array_equal(got.view(np.uint8), again.view(np.uint8)) else ["two calls differ"])


def run_case(case, pattern: str) -> list[str]:
    """Run one case on the GPU (W poisoned first, twice) and check every element against the float64 oracle
    (tests/np_ops.py); the problems found ([] = ok)."""
    import harness
    import np_ops
    import numpy as np

    x = inputs(case, pattern, seed=zlib.crc32(f"{case[0]}/{pattern}".encode()) % 1000)
    got, errs = _run_twice(functools.partial(call, case), x)
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


def _empty_experts(offsets, tokens):
    import numpy as np

    ends = np.maximum.accumulate(np.clip(np.asarray(offsets), 0, tokens))
    starts = np.concatenate([[0], ends[:-1]])
    return [e for e in range(len(ends)) if ends[e] <= starts[e]]


def run_accum_case(case, old: str, tokens: int) -> list[str]:
    """One ACCUM_CASES case on the GPU at `tokens` tokens (module recorded at T = 2000), twice (allocator poisoned
    first): W_out = W + gsa[e] gsb[e] A B^T (fp32 add, one rounding) vs the float64 oracle, every element; experts
    without tokens keep their W bit for bit (or are zero without accumulation); a NaN old W must come out NaN
    everywhere (the add reads every element; none is replaced by the fresh gradient). The problems ([] = ok)."""
    import harness
    import np_ops
    import numpy as np

    _, ab, wd, _, _, _, acc = case
    pattern = "empty_and_tail" if tokens == T else "unaligned"
    x = accum_inputs(case, pattern, tokens, old, seed=zlib.crc32(f"{case[0]}/{old}/{tokens}".encode()) % 1000)
    got, errs = _run_twice(functools.partial(accum_call, case), x)
    gv = got.astype(np.float32).astype(np.float64)
    if old == "nan":
        lost = int(np.sum(~np.isnan(gv)))
        return errs + ([f"{lost} elements lost the old W's NaN"] if lost else [])
    a, b = (np.asarray(v.astype(jnp.float32)) for v in operands(case, x))
    w_old = np.asarray(x["w"].astype(jnp.float32)) if acc else None
    want = np_ops.grouped_gemm_wgrad(a, b, np.asarray(x["offsets"]), global_scale_a=x.get("gsa"),
                                     global_scale_b=x.get("gsb"), wgrad_tensor=w_old, ab_dtype=ab, wgrad_dtype=wd)
    if not np.all(np.isfinite(gv)):
        return errs + ["non-finite output"]
    pre, mag = want["_pre"]["wgrad"], want["_mag"]["wgrad"]
    bound = harness.ULP[wd] * np.abs(pre) + 1e-5 * mag + 1e-30
    err = np.abs(gv - pre)
    if not np.all(err <= bound):
        errs.append(f"worst {np.max(err / bound):.2f} x the bound")
    empty = _empty_experts(x["offsets"], tokens)
    if not empty:
        errs.append("the pattern must leave an expert without tokens")
    for e in empty:
        if acc and not np.array_equal(got[e].view(np.uint8), np.asarray(x["w"])[e].view(np.uint8)):
            errs.append(f"expert {e} has no token: its W must be unchanged")   # old + (+-0.0) is old
        if not acc and gv[e].any():
            errs.append(f"expert {e} has no token: W[e] must be zero")
    return errs


def module_keys(case) -> set:
    """The kernel module keys the case's lowerings at every T of T_VALUES ask for (one module serves them all)."""
    keys = set()
    for tokens in T_VALUES:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)   # a fallback to the reference would warn
            text = jax.jit(functools.partial(accum_call, case)).lower(accum_inputs(case, tokens=tokens)).as_text()
        calls = [line for line in text.splitlines() if "CuteDSLRT_NvJaxCutlassCall" in line]
        keys |= {re.search(r'key = "((?:[^"\\]|\\.)*)"', c).group(1) for c in calls}
    return keys
