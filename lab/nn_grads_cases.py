"""`jax.value_and_grad` of nn.moe_mlp and nn.moe_layer (the kernels' training path) for the GPU suite (its check, the
plain-jnp layer and the tolerance: tests/gpu/nn_grads_checks.py), and the bundle items that record the kernel
modules of exactly those jitted functions:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.nn_grads_cases:bundle_items

The layers run the padding-free layout (m_aligned=1, passed explicitly; nn's default is 64): moe_layer's 384
tokens x top-2 are 768 permuted rows, its group ends wherever the router puts them; moe_mlp's ends are set inside
128-row tiles (tiles clipped at group ends in every GEMM, wgrad on unaligned token ranges). Kernel modules serve every m (and wgrad every
token count), so the swiglu modules also serve the one-device run of examples/moe_expert_parallel.py.

OPTIONS adds moe_layer cases for the router variants and expert-block pieces (docs/nn.md): a sigmoid,
group-limited router with a selection bias and routed scaling, a shared expert, (E, in, out) gate / up halves and
float32 master weights (DeepSeek-V3 style); top-k-first softmax with a logits bias, GPT-OSS's SwiGLU, FC1 and
gate-weighted FC2 biases (GPT-OSS style); fp16 compute on float32 masters, unnormalized weights and a gated shared
expert (Qwen style). The shared expert adds its one-group calls (one group of T rows); float32 masters the float32
wgrad outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cudnn_moe_jax import activations, aot, nn

L, H, I, T, TOP_K = 4, 256, 256, 384, 2       # moe_layer: T tokens -> permuted_rows(384, 2, 4) = 768 rows
M = 1792                                       # moe_mlp rows
MLP_ENDS = (771, 771, 1028, 1533)              # expert 1 empty, expert 0 holds 3x expert 2, ends inside 128-row
                                               # tiles; rows 1533.. in no group
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
                          weight_layout=o.get("layout", "out_in"), dtype=o["dtype"], m_aligned=1)
    return jnp.sum(y.astype(jnp.float32) * x["target"]), {"expert_load": aux["expert_load"]}


def _loss_mlp(act, params, x):
    y = nn.moe_mlp(params["x"], params["w1"], params["w2"], params["prob"], params.get("b1"), x["offsets"], act,
                   m_aligned=1)
    return jnp.sum(y.astype(jnp.float32) * x["target"]), {}


def _loss_layer(act, params, x):
    y, aux = nn.moe_layer(params["x"], params["router"], params["w1"], params["w2"], params.get("b1"), top_k=TOP_K,
                          act=act, m_aligned=1)
    return jnp.sum(y.astype(jnp.float32) * x["target"]), {"expert_load": aux["expert_load"]}


DIFF = {"moe_mlp": ("x", "w1", "w2", "prob", "b1"), "moe_layer": ("x", "router", "w1", "w2", "b1")}


def diff_names(case, x):
    if case[0] in OPTIONS:
        return tuple(k for k in x if k != "target")
    return tuple(k for k in DIFF[case[1]] if k in x)


def call(case, x):
    """(loss, aux, grads {name: gradient}) of the library's layer: what the GPU test jits and the bundle records.
    The router GEMM runs on operands in the compute dtype with fp32 accumulation (its default)."""
    name, layer, act, _ = case
    params = {k: x[k] for k in diff_names(case, x)}
    if name in OPTIONS:
        fn = lambda p: _loss_options(name, p, x)  # noqa: E731
    else:
        fn = lambda p: (_loss_mlp if layer == "moe_mlp" else _loss_layer)(act, p, x)  # noqa: E731
    (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(params)
    return loss, aux, grads


def bundle_items():
    return aot.lowering_items(CASES, inputs, call)
