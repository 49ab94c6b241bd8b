"""The GPU nn-grads suite's check (tests/gpu/test_nn_grads_gpu.py; on the CPU, tests/test_nn_grads_reference.py): the
plain-jnp float32 layer the kernels' `jax.value_and_grad` is compared with, and the bf16-derived tolerance. The cases,
their inputs and the jitted calls are lab/nn_grads_cases.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from np_ops import np_glu_value

from lab.nn_grads_cases import L, M, OPTIONS, TOP_K, diff_names

# ------------------------------------------------------------------------------------------------ plain reference
# Written from docs/activations.md and the nn docstrings, not from the library: dense over experts (every token
# through every expert, masked by its gate weight), float32 with HIGHEST-precision einsums, differentiated by JAX.

def _glu(act, g, u):
    """act(g, u) of a GLU: the float64 oracle's formula (tests/np_ops.py) in jnp; an unknown act raises."""
    return np_glu_value(g, u, act, {}, xp=jnp)


def _act(act, c):
    """act(C) on the 32-column gate/up interleave (gate = even blocks, up = odd blocks)."""
    if act == "srelu":
        return jnp.square(jnp.maximum(c, 0.0))
    blocks = c.reshape(c.shape[:-1] + (c.shape[-1] // 64, 2, 32))
    out = _glu(act, blocks[..., 0, :], blocks[..., 1, :])
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
        member = jnp.asarray((r >= starts[None]) & (r < ends[None]), jnp.float32)      # (M, L), rows past 1533: 0
        y = _experts(act, p, p["x"], member * p["prob"][:, None])
        load = None
    elif case[0] in OPTIONS:
        y, load = _ref_options(case[0], p)
    else:
        router = _rounded(p["router"], jnp.bfloat16)                      # the router GEMM's bf16 operand
        logits = jnp.einsum("th,hl->tl", p["x"], router, precision=jax.lax.Precision.HIGHEST)
        w, e = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), TOP_K)
        w = w / jnp.sum(w, axis=-1, keepdims=True)
        gate = jnp.sum(jax.nn.one_hot(e, L) * w[..., None], axis=1)                     # (T, L)
        y = _experts(act, p, p["x"], gate)
        load = jnp.sum(jax.nn.one_hot(e, L, dtype=jnp.int32), axis=(0, 1))
    terms = y * x["target"]
    return jnp.sum(terms), (load, jnp.sqrt(jnp.sum(terms * terms)))


def _rounded(a, dtype):
    """a rounded to `dtype`, with the float32 gradient passed straight through (a cast's own transpose would
    round the cotangent too)."""
    return a + jax.lax.stop_gradient(a.astype(dtype).astype(jnp.float32) - a)


def _ref_gates(o, logits, bias):
    """(T, L) gate matrix by docs/nn.md's routing rules, and the (L,) load."""
    r = o["router"]
    if r.get("bias") == "logits":
        logits = logits + bias
    scores = jax.nn.sigmoid(logits) if r.get("score") == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    key = logits if r.get("topk_first") else scores
    if r.get("bias") == "selection":
        key = key + bias
    if r.get("n_groups", 1) > 1:
        grouped = key.reshape(key.shape[0], r["n_groups"], -1)
        _, best = jax.lax.top_k(jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1), r["topk_groups"])
        keep = jnp.sum(jax.nn.one_hot(best, r["n_groups"]), axis=1) > 0
        key = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(key.shape)
    _, e = jax.lax.top_k(key, TOP_K)
    if r.get("topk_first"):
        w = jax.nn.softmax(jnp.take_along_axis(logits, e, axis=1), axis=-1)
    else:
        w = jnp.take_along_axis(scores, e, axis=1)
    if r.get("normalize", True):
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    w = w * r.get("scaling", 1.0)
    return jnp.sum(jax.nn.one_hot(e, L) * w[..., None], axis=1), jnp.sum(jax.nn.one_hot(e, L, dtype=jnp.int32),
                                                                        axis=(0, 1))


def _ref_options(name, p):
    """The OPTIONS block in float32 on the values the layer computes with (parameters rounded to the compute
    dtype; biases of the router stay float32): routed experts + gate-weighted b2 + (gated) shared expert."""
    o = OPTIONS[name]
    hi = jax.lax.Precision.HIGHEST
    rnd = lambda a: _rounded(a, o["dtype"])  # noqa: E731
    out_in = (lambda a: jnp.swapaxes(a, -1, -2)) if o.get("layout") == "in_out" else (lambda a: a)
    x = p["x"]
    gates, load = _ref_gates(o, jnp.einsum("th,hl->tl", x, rnd(p["router"]), precision=hi), p.get("router_bias"))
    g = jnp.einsum("th,eih->eti", x, rnd(out_in(p["w_gate"])), precision=hi)
    u = jnp.einsum("th,eih->eti", x, rnd(out_in(p["w_up"])), precision=hi)
    if "b_gate" in p:
        g, u = g + rnd(p["b_gate"])[:, None], u + rnd(p["b_up"])[:, None]
    y = jnp.einsum("eti,ehi->eth", _glu(o["act"], g, u), rnd(out_in(p["w2"])), precision=hi)
    if "b2" in p:
        y = y + rnd(p["b2"])[:, None]
    y = jnp.einsum("te,eth->th", gates, y, precision=hi)
    if "s_gate" in p:
        h = _glu(o["act"], jnp.dot(x, rnd(out_in(p["s_gate"])).T, precision=hi),
                 jnp.dot(x, rnd(out_in(p["s_up"])).T, precision=hi))
        shared = jnp.dot(h, rnd(out_in(p["s_w2"])).T, precision=hi)
        if "s_g" in p:
            shared = shared * jax.nn.sigmoid(jnp.dot(x, rnd(p["s_g"]), precision=hi))[:, None]
        y = y + shared
    return y, load


def reference(case, x):
    """(loss, (expert load or None, l2 norm of the loss's terms), grads) of the plain layer, float32 on the CPU, the
    inputs' exact values."""
    _, layer, _, _ = case
    cpu = jax.devices("cpu")[0]
    x = {k: jax.device_put(v, cpu) for k, v in x.items()}
    p = {k: x[k].astype(jnp.float32) for k in diff_names(case, x)}
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


PER_LEADING = ("x", "w1", "w2", "b1", "w_gate", "w_up", "b_gate", "b_up", "b2")


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
