"""`jax.value_and_grad` of nn.moe_mlp and nn.moe_layer (the kernels' training path) for the GPU suite, the plain-jnp
layer it is checked against, and the bundle items that record the kernel modules of exactly those jitted functions:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.nn_grads_cases:bundle_items

The shapes are the one-device run of examples/moe_expert_parallel.py (4 experts, H = I = 256, 1792 permuted rows),
so the swiglu modules serve both. The wgrad modules are specific to the token count (1792; kernels/NOTES.md).

OPTIONS adds moe_layer cases for the router variants and expert-block pieces (docs/nn.md): a sigmoid,
group-limited router with a selection bias and routed scaling, a shared expert, (E, in, out) gate / up halves and
float32 master weights (DeepSeek-V3 style); top-k-first softmax with a logits bias, GPT-OSS's SwiGLU, FC1 and
gate-weighted FC2 biases (GPT-OSS style); fp16 compute on float32 masters, unnormalized weights and a gated shared
expert (Qwen style). The shared expert adds the one-group modules of 512 rows; float32 masters the float32
wgrad outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_moe_jax import activations, aot, nn

L, H, I, T, TOP_K = 4, 256, 256, 384, 2       # moe_layer: T tokens -> permuted_rows(384, 2, 4) = 1792 rows
M = 1792                                       # moe_mlp rows (the same m: one wgrad module per weight shape)
MLP_ENDS = (768, 768, 1024, 1536)              # expert 1 empty, expert 0 holds 3x expert 2; rows 1536.. in no group
ACTS = tuple(activations.TABLE)                 # every activation
# (name, layer, act, bias)
CASES = [(f"{layer}_{act}{'_bias' if bias else ''}", layer, act, bias)
         for layer in ("moe_mlp", "moe_layer") for act in ACTS for bias in (False, True)]
EMPTY_EXPERT, BIG_EXPERT = 3, 0                # moe_layer's router sends no token to expert 3, most to expert 0
                                               # (the plain cases; OPTIONS cases route by their own rules)
S_I = 256                                      # shared expert intermediate size
OPTIONS = {
    "moe_layer_deepseek_style": dict(act="swiglu", bias=False, dtype="bfloat16", master=True, layout="in_out",
                                     router=dict(score="sigmoid", bias="selection", n_groups=2, topk_groups=1,
                                                 scaling=2.5), shared="plain"),
    # GPT-OSS's clamps (at 7) stay inactive here: where C is within a bf16 rounding of +-7 the forward
    # (fp32 C) and the backward (the stored bf16 C) may see the clamp differently from a float32 reference, an
    # O(1) local difference no per-element bound admits; the clamps are covered by the op tests and
    # tests/test_nn_models.py
    "moe_layer_gpt_oss_style": dict(act="gpt_oss_swiglu", bias=True, b2=True, dtype="bfloat16",
                                    router=dict(topk_first=True, bias="logits")),
    "moe_layer_qwen_style_fp16": dict(act="swiglu", bias=False, dtype="float16", master=True,
                                      router=dict(normalize=False), shared="gated"),
}
CASES += [(name, "moe_layer", o["act"], o["bias"]) for name, o in OPTIONS.items()]


def inputs(case, seed: int = 0) -> dict:
    """Random operands (never zeros): x ~ N(0, 1), W scaled so C and y are O(1), b1 ~ 0.1 N(0, 1)."""
    _, layer, act, bias = case
    n1 = activations.TABLE[act].input_width(I)
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 9))
    rows = M if layer == "moe_mlp" else T
    x = jax.random.normal(next(k), (rows, H))
    out = {"w1": (jax.random.normal(next(k), (L, n1, H)) / H ** 0.5).astype(jnp.bfloat16),
           "w2": (jax.random.normal(next(k), (L, H, I)) / I ** 0.5).astype(jnp.bfloat16),
           "target": jax.random.normal(next(k), (rows, H))}
    if case[0] in OPTIONS:
        return _option_inputs(case[0], seed)
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


def _option_inputs(name, seed):
    """The OPTIONS case's parameters, named as the model stores them: w_gate / w_up (L, I, H), or (L, H, I) with
    layout "in_out", w2, b_gate / b_up, b2, router_bias, s_gate / s_up / s_w2 / s_g (shared expert); float32 when
    `master`, else the compute dtype. Tokens as the plain cases, a random router (no expert pushed away: the
    routing rules decide)."""
    o = OPTIONS[name]
    base = inputs(("moe_layer_swiglu", "moe_layer", "swiglu", False), seed)
    k = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 16))
    store = jnp.float32 if o.get("master") else jnp.dtype(o["dtype"])
    in_out = o.get("layout") == "in_out"
    w = lambda shape, fan, scale=1.0: (scale * jax.random.normal(next(k), shape) / fan ** 0.5).astype(store)  # noqa
    turn = lambda shape: shape[:-2] + shape[-2:][::-1] if in_out else shape  # noqa: E731  (out, in) -> (in, out)
    out = {"x": base["x"].astype(o["dtype"]), "router": jax.random.normal(next(k), (H, L)) / H ** 0.5,
           "target": base["target"], "w_gate": w(turn((L, I, H)), H), "w_up": w(turn((L, I, H)), H),
           "w2": w(turn((L, H, I)), I)}
    if o["router"].get("bias"):
        out["router_bias"] = 0.2 * jax.random.normal(next(k), (L,))
    if o["bias"]:
        out["b_gate"], out["b_up"] = w((L, I), 1, 0.5), w((L, I), 1, 0.5)
    if o.get("b2"):
        out["b2"] = w((L, H), 1, 0.5)
    if o.get("shared"):
        out["s_gate"], out["s_up"] = w(turn((S_I, H)), H), w(turn((S_I, H)), H)
        out["s_w2"] = w(turn((H, S_I)), S_I)
        if o["shared"] == "gated":
            out["s_g"] = w((H,), H)
    return out


def _loss_options(name, params, x):
    o = OPTIONS[name]
    shared = None
    if "s_gate" in params:
        shared = nn.SharedExpert((params["s_gate"], params["s_up"]), params["s_w2"], None, params.get("s_g"))
    b1 = (params["b_gate"], params["b_up"]) if "b_gate" in params else None
    y, aux = nn.moe_layer(params["x"], params["router"], (params["w_gate"], params["w_up"]), params["w2"], b1,
                          act=o["act"], router_config=nn.RouterConfig(top_k=TOP_K, **o["router"]),
                          router_bias=params.get("router_bias"), b2=params.get("b2"), shared=shared,
                          weight_layout=o.get("layout", "out_in"), dtype=o["dtype"])
    return jnp.sum(y.astype(jnp.float32) * x["target"]), {"expert_load": aux["expert_load"]}


def _loss_mlp(act, params, x):
    y = nn.moe_mlp(params["x"], params["w1"], params["w2"], params["prob"], params.get("b1"), x["offsets"], act)
    return jnp.sum(y.astype(jnp.float32) * x["target"]), {}


def _loss_layer(act, params, x):
    y, aux = nn.moe_layer(params["x"], params["router"], params["w1"], params["w2"], params.get("b1"), top_k=TOP_K,
                          act=act)
    return jnp.sum(y.astype(jnp.float32) * x["target"]), {"expert_load": aux["expert_load"]}


DIFF = {"moe_mlp": ("x", "w1", "w2", "prob", "b1"), "moe_layer": ("x", "router", "w1", "w2", "b1")}


def _diff_names(case, x):
    if case[0] in OPTIONS:
        return tuple(k for k in x if k != "target")
    return tuple(k for k in DIFF[case[1]] if k in x)


def call(case, x):
    """(loss, aux, grads {name: gradient}) of the library's layer: what the GPU test jits and the bundle records.
    The router GEMM runs on operands in the compute dtype with fp32 accumulation (its default)."""
    name, layer, act, _ = case
    params = {k: x[k] for k in _diff_names(case, x)}
    if name in OPTIONS:
        fn = lambda p: _loss_options(name, p, x)  # noqa: E731
    else:
        fn = lambda p: (_loss_mlp if layer == "moe_mlp" else _loss_layer)(act, p, x)  # noqa: E731
    (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(params)
    return loss, aux, grads


def bundle_items():
    return aot.lowering_items(CASES, inputs, call)


# ------------------------------------------------------------------------------------------------ plain reference
# Written from docs/activations.md and the nn docstrings, not from the library: dense over experts (every token
# through every expert, masked by its gate weight), float32 with HIGHEST-precision einsums, differentiated by JAX.

def _glu(act, g, u):
    """act(g, u) of a GLU: the float64 oracle's formula (tests/np_ops.py) in jnp; an unknown act raises."""
    from np_ops import np_glu_value   # tests/ on sys.path (tests/conftest.py; tools/gpu/_paths.py)

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
        member = jnp.asarray((r >= starts[None]) & (r < ends[None]), jnp.float32)      # (M, L), rows past 1536: 0
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
    p = {k: x[k].astype(jnp.float32) for k in _diff_names(case, x)}
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
