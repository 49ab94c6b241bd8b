"""`jax.value_and_grad` of nn.moe_mlp and nn.moe_layer (the kernels' training path) for the GPU suite, the plain-jnp
layer it is checked against, and the bundle items that record the kernel modules of exactly those jitted functions:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants tests.gpu.nn_grads_cases:bundle_items

The shapes are the one-device run of examples/moe_expert_parallel.py (4 experts, H = I = 256, 1792 permuted rows),
so the swiglu modules serve both. The wgrad modules are specific to the token count (1792; kernels/NOTES.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_moe_jax import aot, nn

L, H, I, T, TOP_K = 4, 256, 256, 384, 2       # moe_layer: T tokens -> permuted_rows(384, 2, 4) = 1792 rows
M = 1792                                       # moe_mlp rows (the same m: one wgrad module per weight shape)
MLP_ENDS = (768, 768, 1024, 1536)              # expert 1 empty, expert 0 holds 3x expert 2; rows 1536.. in no group
ACTS = ("swiglu", "geglu", "srelu")
# (name, layer, act, bias)
CASES = [(f"{layer}_{act}{'_bias' if bias else ''}", layer, act, bias)
         for layer in ("moe_mlp", "moe_layer") for act in ACTS for bias in (False, True)]
EMPTY_EXPERT, BIG_EXPERT = 3, 0                # moe_layer's router sends no token to expert 3, most to expert 0


def inputs(case, seed: int = 0) -> dict:
    """Random operands (never zeros): x ~ N(0, 1), W scaled so C and y are O(1), b1 ~ 0.1 N(0, 1)."""
    _, layer, act, bias = case
    n1 = I if act == "srelu" else 2 * I
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 9))
    rows = M if layer == "moe_mlp" else T
    x = jax.random.normal(next(k), (rows, H))
    out = {"w1": (jax.random.normal(next(k), (L, n1, H)) / H ** 0.5).astype(jnp.bfloat16),
           "w2": (jax.random.normal(next(k), (L, H, I)) / I ** 0.5).astype(jnp.bfloat16),
           "target": jax.random.normal(next(k), (rows, H))}
    if bias:
        out["b1"] = (0.1 * jax.random.normal(next(k), (L, n1))).astype(jnp.bfloat16)
    if layer == "moe_mlp":
        out["prob"] = jax.random.uniform(next(k), (M,), minval=0.1, maxval=1.0)
        out["offsets"] = jnp.asarray(MLP_ENDS, jnp.int32)
    else:
        # the tokens share a mean direction v (random signs, 0.5 per feature: x.v/16 = 8 + N(0, 1)); router column 3
        # is -v/16, so expert 3's logit is ~ -8 against ~N(0, 1.25) for the others: never routed to (an empty
        # expert); column 0 gets +v/128 (+1 on its logit): most tokens (skewed groups). Every router entry stays
        # ~1/16, so no feature of dx carries an outsized share of the router path's gradient.
        v = jnp.where(jax.random.bernoulli(next(k), 0.5, (H,)), 1.0, -1.0)
        x = x + 0.5 * v
        router = jax.random.normal(next(k), (H, L)) / H ** 0.5
        out["router"] = router.at[:, EMPTY_EXPERT].set(-v / 16).at[:, BIG_EXPERT].add(v / 128)
    out["x"] = x.astype(jnp.bfloat16)
    return out


def _loss_mlp(act, params, x):
    y = nn.moe_mlp(params["x"], params["w1"], params["w2"], params["prob"], params.get("b1"), x["offsets"], act)
    return jnp.sum(y.astype(jnp.float32) * x["target"]), {}


def _loss_layer(act, params, x):
    y, aux = nn.moe_layer(params["x"], params["router"], params["w1"], params["w2"], params.get("b1"), top_k=TOP_K,
                          act=act)
    return jnp.sum(y.astype(jnp.float32) * x["target"]), {"expert_load": aux["expert_load"]}


DIFF = {"moe_mlp": ("x", "w1", "w2", "prob", "b1"), "moe_layer": ("x", "router", "w1", "w2", "b1")}


def call(case, x):
    """(loss, aux, grads {name: gradient}) of the library's layer: what the GPU test jits and the bundle records.
    The router's f32 dot runs at HIGHEST precision (not TF32) so that routing and the reference agree."""
    _, layer, act, _ = case
    params = {k: x[k] for k in DIFF[layer] if k in x}
    fn = _loss_mlp if layer == "moe_mlp" else _loss_layer
    with jax.default_matmul_precision("highest"):
        (loss, aux), grads = jax.value_and_grad(lambda p: fn(act, p, x), has_aux=True)(params)
    return loss, aux, grads


def bundle_items():
    return aot.lowering_items(CASES, inputs, call)


# ------------------------------------------------------------------------------------------------ plain reference
# Written from docs/activations.md and the nn docstrings, not from the library: dense over experts (every token
# through every expert, masked by its gate weight), float32 with HIGHEST-precision einsums, differentiated by JAX.

def _act(act, c):
    """act(C) on the 32-column gate/up interleave (gate = even blocks, up = odd blocks)."""
    if act == "srelu":
        return jnp.square(jnp.maximum(c, 0.0))
    blocks = c.reshape(c.shape[:-1] + (c.shape[-1] // 64, 2, 32))
    g, u = blocks[..., 0, :], blocks[..., 1, :]
    if act == "swiglu":
        out = u * g * jax.nn.sigmoid(g)
    else:  # cuDNN's geglu: default clamps g <= 7, -7 <= u <= 7; (u + 1) * g * sigmoid(1.702 g)
        g, u = jnp.minimum(g, 7.0), jnp.clip(u, -7.0, 7.0)
        out = (u + 1.0) * g * jax.nn.sigmoid(1.702 * g)
    return out.reshape(c.shape[:-1] + (c.shape[-1] // 2,))


def _experts(act, p, x, gate):
    """sum_e gate[:, e] * (act(x W1[e]^T + b1[e]) W2[e]^T) for x (R, H), gate (R, L)."""
    hi = jax.lax.Precision.HIGHEST
    c = jnp.einsum("rh,enh->ern", x, p["w1"], precision=hi)
    if "b1" in p:
        c = c + p["b1"][:, None, :]
    y = jnp.einsum("eri,ehi->erh", _act(act, c), p["w2"], precision=hi)
    return jnp.einsum("re,erh->rh", gate, y, precision=hi)


def _ref_loss(case, p, x):
    _, layer, act, _ = case
    if layer == "moe_mlp":
        ends = np.asarray(x["offsets"])
        starts = np.concatenate([[0], ends[:-1]])
        r = np.arange(M)[:, None]
        member = jnp.asarray((r >= starts[None]) & (r < ends[None]), jnp.float32)      # (M, L), rows past 1536: 0
        y = _experts(act, p, p["x"], member * p["prob"][:, None])
        load = None
    else:
        logits = jnp.einsum("th,hl->tl", p["x"], p["router"], precision=jax.lax.Precision.HIGHEST)
        w, e = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), TOP_K)
        w = w / jnp.sum(w, axis=-1, keepdims=True)
        gate = jnp.sum(jax.nn.one_hot(e, L) * w[..., None], axis=1)                     # (T, L)
        y = _experts(act, p, p["x"], gate)
        load = jnp.sum(jax.nn.one_hot(e, L, dtype=jnp.int32), axis=(0, 1))
    terms = y * x["target"]
    return jnp.sum(terms), (load, jnp.sqrt(jnp.sum(terms * terms)))


def reference(case, x):
    """(loss, (expert load or None, l2 norm of the loss's terms), grads) of the plain layer, float32 on the CPU, the
    inputs' exact values."""
    _, layer, _, _ = case
    cpu = jax.devices("cpu")[0]
    x = {k: jax.device_put(v, cpu) for k, v in x.items()}
    p = {k: x[k].astype(jnp.float32) for k in DIFF[layer] if k in x}
    with jax.default_device(cpu):
        (loss, aux), grads = jax.jit(jax.value_and_grad(lambda p: _ref_loss(case, p, x), has_aux=True))(p)
    return loss, aux, grads


# ------------------------------------------------------------------------------------------------ tolerance
# The library's layer stores in bf16 (unit roundoff u = 2^-8) where the reference keeps float32: forward C, h
# (= prob * act(C)) and y_perm, moe_layer's bf16 sum of a token's k outputs; backward dy, dC (dglu / dsrelu output)
# and the gradient itself. Each store moves a value by at most u relative; the gradients are (multi)linear in
# those values, so each store adds at most u * |g| where it passes pointwise and, where it passes through a
# contraction (token sums in dW / db1, feature sums in dx / dprob / the router), a sum of independent rounding
# errors whose size is u times the rms of the contraction's result, not of its element. Hence
#     |got - ref| <= ROUNDINGS * u * (|ref| + rms(ref))
# with ROUNDINGS = 8 (6 stores on the longest path, dprob -> router, plus 2 for fp32 summation order and the
# tails of 10^5 elements). Structural faults (a wrong tile, expert, row or missing partial sum) are O(1).
# tests/test_nn_grads_reference.py checks the bound holds on the CPU reference backend (the same bf16 stores, fp32
# math), where it is met with room to spare.
ROUNDINGS, U = 8, 2.0 ** -8


def _bound(name, ref):
    """ROUNDINGS * u * (|ref| + rms), the rms per expert (weight gradients: a sum over that expert's tokens) or per
    token row (dx: its own gate weights), else over the tensor: a contraction's rounding error grows with its own
    terms, so an expert with 3x the tokens of another gets the larger allowance it needs. An empty expert's
    gradient (rms 0) must be exactly zero."""
    axes = tuple(range(1, ref.ndim)) if name in PER_LEADING and ref.ndim > 1 else None
    rms = np.sqrt(np.mean(ref * ref, axis=axes, keepdims=axes is not None))
    return ROUNDINGS * U * (np.abs(ref) + rms) + 1e-30


PER_LEADING = ("x", "w1", "w2", "b1")


def _ratios(got, want) -> dict:
    out = {}
    for k in sorted(set(got[2]) & set(want[2])):
        g = np.asarray(jnp.asarray(got[2][k]).astype(jnp.float32), np.float64)
        r = np.asarray(want[2][k], np.float64)
        out[k] = (g, r, np.abs(g - r) / _bound(k, r) if g.shape == r.shape else None)
    return out


def compare(case, got, want) -> list[str]:
    """Problems of the library's (loss, aux, grads) against the reference's; [] = ok."""
    loss, aux, grads = got
    rloss, (rload, rl2), rgrads = want
    errs = []
    if rload is not None and not np.array_equal(np.asarray(aux["expert_load"]), np.asarray(rload)):
        errs.append(f"expert load {np.asarray(aux['expert_load'])} != reference {np.asarray(rload)} (routing)")
    loss, rloss = float(loss), float(rloss)
    # a sum of 10^5 terms with random signs: its rounding errors scale with the terms' l2 norm, not with the sum
    if not abs(loss - rloss) <= ROUNDINGS * U * float(rl2):
        errs.append(f"loss {loss} vs reference {rloss}")
    if set(grads) != set(rgrads):
        errs.append(f"gradients of {sorted(grads)}, reference {sorted(rgrads)}")
    for k, (g, r, ratio) in _ratios(got, want).items():
        if ratio is None:
            errs.append(f"d{k}: shape {g.shape} != {r.shape}")
        elif not np.isfinite(g).all():
            errs.append(f"d{k}: {int((~np.isfinite(g)).sum())} non-finite values")
        elif ratio.max() > 1:
            i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            errs.append(f"d{k}: {int((ratio > 1).sum())}/{ratio.size} elements out of tolerance, worst "
                        f"{ratio.max():.2f} x the bound at {tuple(map(int, i))}: got {g[i]:.6g} ref {r[i]:.6g}")
    return errs


def worst_ratio(got, want) -> dict:
    """{gradient: max |got - ref| / bound}: how much room the bound leaves (printed by the tests)."""
    return {k: round(float(np.max(ratio)), 3) for k, (_, _, ratio) in _ratios(got, want).items()
            if ratio is not None}
