"""Gathered operands (kernels/sm90/mainloop_gather.py) through the public ops on the GPU: the M-grouped ops' `a_index`
on the padding-free suite's cases (lab/padfree_cases.py: every M-grouped op and epilogue, tiles straddling group
ends, 1-row and empty experts, rows past the last group, unsanitized offsets) plus 64- and 256-row groups (the
layer's and cuDNN's), with A (T, K) of another row count than m and an index per row that repeats rows, skips rows
and points outside [0, T) (zero rows); the weight gradient's `a_index` / `b_index` (token-major A / B gathered along
the tokens, as the layer's dW2 / dW1) on padding-free and 64-row token ends. The GPU suite
(tests/gpu/test_gather_gpu.py) checks each result bit for bit against the same op on the gathered rows
(`pregathered`), and against the float64 oracle. Bundle items:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.gather_cases:bundle_items
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax import aot
from lab import padfree_cases as padfree

TOKENS = 700          # A's rows: fewer than m (1000 / 1024), so rows repeat and some are never read
OUTSIDE = 0.05        # share of indices outside [0, TOKENS): -1 .. -3 and TOKENS .. TOKENS + 2
# (case, pattern): each M-grouped case of the padding-free suite on its patterns and 64- / 256-row groups (FP8 D:
# 256 only, its scale atoms need 128-row groups)
ITEMS = [(case, pattern) for case in padfree.CASES if case[1] != "wgrad"
         for pattern in case[3] + (("aligned256",) if case[2].get("d_dtype") == padfree.E4M3
                                   else ("aligned64", "aligned256"))]
# an N-major W2^T (the layer's dgrad reads W2 (L, H, I) as (L, I, H) with b_major="n")
ITEMS += [(("dswiglu_dbias_nmajor", "dglu", dict(act_func="dswiglu", generate_dbias=True, dbias_dtype=padfree.F32,
                                                 b_major="n"), ()), pattern) for pattern in ("straddle", "aligned64")]


# wgrad: (name, the gathered operands) on token ends of padding-free and 64-row groups; A (TOKENS, 256) / B (TOKENS,
# 512) token-major rows, the other operand (m, rows) in permuted order
WGRAD_CASES = [(f"wgrad_gather_{g}", "wgrad", {"gather": g}, ("straddle", "tail", "aligned64"))
               for g in ("a", "b", "ab")]
WGRAD_ROWS = {"a": padfree.K, "b": padfree.N}
ITEMS += [(case, pattern) for case in WGRAD_CASES for pattern in case[3]]


def _index(key, m):
    """m indices into TOKENS rows: repeats, skipped rows and a share OUTSIDE of them outside [0, TOKENS)."""
    keys = jax.random.split(key, 3)
    index = jax.random.randint(keys[0], (m,), 0, TOKENS, jnp.int32)
    outside = jax.random.randint(keys[1], (m,), -3, 3, jnp.int32)   # -3..-1 below, 0..2 -> TOKENS.. above
    pick = jax.random.uniform(keys[2], (m,)) < OUTSIDE
    return jnp.where(pick, jnp.where(outside < 0, outside, TOKENS + outside), index)


def inputs(item, seed: int = 0):
    """The padding-free case's inputs at `item`'s pattern, with A (TOKENS, K) and its a_index (m,); wgrad: A / B
    as token-major rows, gathered ones (TOKENS, rows) with their a_index / b_index (m,)."""
    (name, op, options, _), pattern = item
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 4)
    if op == "wgrad":
        m = padfree.PATTERNS[pattern][0]
        x = dict(offsets=jnp.asarray(padfree.PATTERNS[pattern][2], jnp.int32))
        for i, operand in enumerate("ab"):
            gathered = operand in options["gather"]
            shape = (TOKENS if gathered else m, WGRAD_ROWS[operand])
            x[operand] = jax.random.normal(keys[2 * i], shape).astype(padfree.BF)
            if gathered:
                x[f"{operand}_index"] = _index(keys[2 * i + 1], m)
        return x
    x = padfree.inputs(item, seed)
    m, k = x["a"].shape
    x["a"] = jax.random.normal(keys[0], (TOKENS, k)).astype(x["a"].dtype)
    x["a_index"] = _index(keys[1], m)
    return x


def _rows(x, index):
    valid = (index >= 0) & (index < x.shape[0])
    return jnp.where(valid[:, None], x[jnp.clip(index, 0, x.shape[0] - 1)], 0).astype(x.dtype)


def pregathered(x):
    """The same inputs with the gathered rows (tokens) gathered (zero rows for indices outside [0, TOKENS)) and no
    index."""
    out = {k: v for k, v in x.items() if not k.endswith("_index")}
    for operand in "ab":
        if f"{operand}_index" in x:
            out[operand] = _rows(x[operand], x[f"{operand}_index"])
    return out


def call(item, x):
    """padfree_cases.call (which passes `a_index` when x has it); wgrad on token-major rows (dY / x of a layer)."""
    (name, op, options, _), pattern = item
    if op != "wgrad":
        return padfree.call(item, x)
    return cmj.grouped_gemm_wgrad(x["a"].T, x["b"].T, x["offsets"], wgrad_dtype=padfree.F32, a_major="m",
                                  b_major="n", a_index=x.get("a_index"), b_index=x.get("b_index"))


def bundle_items():
    """Both calls of every item: gathered, and the pre-gathered reference run on the kernel too."""
    return (aot.lowering_items(ITEMS, inputs, call)
            + aot.lowering_items(ITEMS, lambda item: pregathered(inputs(item)), call))
