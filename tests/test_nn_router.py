"""nn router: every RouterConfig option against a float64 numpy oracle written from the rules of nn/router.py's
module doc, the router GEMM's precision and gradients, precomputed gatings, and the router losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_moe_jax import nn
from cudnn_moe_jax.nn import router as router_module

T, L = 96, 16


def np_gate(logits, config: nn.RouterConfig, bias=None):
    """(experts, weights) in float64: the documented rules, one line each."""
    logits = np.asarray(logits, np.float64)
    if config.bias == "logits":
        logits = logits + bias
    if config.score == "softmax":
        e = np.exp(logits - logits.max(1, keepdims=True))
        scores = e / e.sum(1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    key = (logits if config.topk_first else scores).copy()
    if config.bias == "selection":
        key = key + bias
    if config.topk_groups < config.n_groups:
        g = key.reshape(len(key), config.n_groups, -1)
        value = np.sort(g, axis=2)[:, :, -2:].sum(2) if config.group_score == "top2_sum" else g.max(2)
        best = np.argsort(-value, axis=1, kind="stable")[:, :config.topk_groups]
        allowed = np.zeros(value.shape, bool)
        np.put_along_axis(allowed, best, True, axis=1)
        key = np.where(np.repeat(allowed, g.shape[2], axis=1), key, -np.inf)
    experts = np.argsort(-key, axis=1, kind="stable")[:, :config.top_k]
    if config.topk_first:
        chosen = np.take_along_axis(logits, experts, 1)
        if config.score == "softmax":
            w = np.exp(chosen - chosen.max(1, keepdims=True))
            weights = w / w.sum(1, keepdims=True)
        else:
            weights = 1 / (1 + np.exp(-chosen))
    else:
        weights = np.take_along_axis(scores, experts, 1)
    if config.normalize:
        weights = weights / weights.sum(1, keepdims=True)
    return experts, weights * config.scaling


CONFIGS = {
    "default": nn.RouterConfig(),
    "top1_switch": nn.RouterConfig(top_k=1, normalize=False),
    "mixtral_topk_first": nn.RouterConfig(top_k=2, topk_first=True),
    "qwen_no_renorm": nn.RouterConfig(top_k=4, normalize=False),
    "sigmoid_renorm_scaled": nn.RouterConfig(top_k=3, score="sigmoid", scaling=2.5),
    "sigmoid_topk_first_raw": nn.RouterConfig(top_k=3, score="sigmoid", topk_first=True, normalize=False),
    "selection_bias_softmax": nn.RouterConfig(top_k=2, bias="selection"),
    "logits_bias_topk_first": nn.RouterConfig(top_k=4, topk_first=True, bias="logits"),
    "groups_top2_sum": nn.RouterConfig(top_k=4, score="sigmoid", n_groups=4, topk_groups=2),
    "groups_max_softmax": nn.RouterConfig(top_k=3, n_groups=8, topk_groups=3, group_score="max"),
    "deepseek_v3": nn.RouterConfig(top_k=6, score="sigmoid", bias="selection", n_groups=8, topk_groups=4,
                                   scaling=2.5),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gate_matches_the_documented_rules(name):
    config = CONFIGS[name]
    logits = 2.0 * jax.random.normal(jax.random.PRNGKey(0), (T, L))
    bias = None if config.bias is None else 0.3 * jax.random.normal(jax.random.PRNGKey(1), (L,))
    biased = logits + bias if config.bias == "logits" else logits
    gating = nn.gate(biased, config, bias)
    experts, weights = np_gate(logits, config, None if bias is None else np.asarray(bias, np.float64))
    np.testing.assert_array_equal(np.asarray(gating.experts), experts)
    np.testing.assert_allclose(np.asarray(gating.weights), weights, rtol=2e-6, atol=1e-7)
    assert gating.experts.dtype == jnp.int32 and gating.weights.dtype == jnp.float32


def test_top_k_indices_equals_lax_top_k():
    """The reduction top-k (large T) against jax.lax.top_k: random keys and keys full of ties, +-0, +-inf and
    +-NaN (IEEE total order, lower index first on ties)."""
    rng = np.random.default_rng(0)
    specials = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 0.5], np.float32)
    for trial in range(60):
        rows, width = int(rng.choice([1, 9, 64])), int(rng.choice([2, 8, 64, 128]))
        k = int(rng.integers(1, min(width, 8) + 1))
        key = (rng.choice(specials, (rows, width)) if trial % 2 else
               rng.standard_normal((rows, width)).astype(np.float32))
        np.testing.assert_array_equal(np.asarray(router_module.top_k_indices(jnp.asarray(key), k)),
                                      np.asarray(jax.lax.top_k(jnp.asarray(key), k)[1]))


@pytest.mark.parametrize("name", ["default", "deepseek_v3"])
def test_gate_at_many_tokens_uses_reductions(name):
    """From TOP_K_REDUCTIONS_FROM tokens the gate selects without a sort, with the documented result."""
    config = CONFIGS[name]
    tokens = router_module.TOP_K_REDUCTIONS_FROM
    logits = 2.0 * jax.random.normal(jax.random.PRNGKey(5), (tokens, L))
    bias = None if config.bias is None else 0.3 * jax.random.normal(jax.random.PRNGKey(6), (L,))
    gating = nn.gate(logits, config, bias)
    experts, _ = np_gate(logits, config, None if bias is None else np.asarray(bias, np.float64))
    np.testing.assert_array_equal(np.asarray(gating.experts), experts)
    jaxpr = jax.make_jaxpr(lambda z: nn.gate(z, nn.RouterConfig(top_k=2)).experts)(logits).jaxpr
    assert not {e.primitive.name for e in jaxpr.eqns} & {"sort", "top_k"}


def test_gate_option_effects():
    """Each option changes what it says and nothing else on random logits."""
    logits = 2.0 * jax.random.normal(jax.random.PRNGKey(2), (T, L))
    base = nn.gate(logits, nn.RouterConfig(top_k=4))
    # Mixtral's top-k-then-softmax equals softmax-top-k-renormalize (same experts, same weights up to rounding)
    mixtral = nn.gate(logits, nn.RouterConfig(top_k=4, topk_first=True))
    np.testing.assert_array_equal(np.asarray(mixtral.experts), np.asarray(base.experts))
    np.testing.assert_allclose(np.asarray(mixtral.weights), np.asarray(base.weights), rtol=1e-6)
    raw = nn.gate(logits, nn.RouterConfig(top_k=4, normalize=False))
    assert float(jnp.max(jnp.sum(raw.weights, 1))) < 1 and np.allclose(np.sum(base.weights, 1), 1, atol=1e-6)
    scaled = nn.gate(logits, nn.RouterConfig(top_k=4, scaling=2.5))
    np.testing.assert_allclose(np.asarray(scaled.weights), 2.5 * np.asarray(base.weights), rtol=1e-6)
    # a large selection bias forces expert 5 everywhere without changing the weights' source (the scores)
    bias = jnp.zeros((L,)).at[5].set(10.0)
    forced = nn.gate(logits, nn.RouterConfig(top_k=4, bias="selection", normalize=False), bias)
    assert np.all(np.asarray(forced.experts)[:, 0] == 5)
    np.testing.assert_allclose(np.asarray(forced.weights[:, 0]), np.asarray(base.scores[:, 5]), rtol=1e-6)


def test_router_gemm_precision_and_gradients():
    """Default: bf16 operands, fp32 accumulation and result, float32 master gradient (not rounded to bf16), no
    float32 copy of x in the forward or the backward. dtype=float32 computes on float32 operands."""
    x = jax.random.normal(jax.random.PRNGKey(3), (T, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(4), (64, L)) / 8
    g = jax.random.normal(jax.random.PRNGKey(5), (T, L))
    x64 = np.asarray(x, np.float64)
    w_bf16 = np.asarray(w.astype(jnp.bfloat16), np.float64)
    logits = router_module.matmul_f32_acc(x, w, "bfloat16")
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), x64 @ w_bf16, rtol=1e-5, atol=1e-5)
    dx, dw = jax.grad(lambda x, w: jnp.sum(router_module.matmul_f32_acc(x, w, "bfloat16") * g), (0, 1))(x, w)
    g_bf16 = np.asarray(g.astype(jnp.bfloat16), np.float64)
    assert dw.dtype == jnp.float32 and dx.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dw), x64.T @ g_bf16, rtol=1e-5, atol=1e-5)   # fp32 sum, no bf16 store
    np.testing.assert_allclose(np.asarray(dx, np.float64), g_bf16 @ w_bf16.T, rtol=1e-2, atol=1e-2)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(nn.apply_router(x, w, nn.RouterConfig()).weights),
                                    (0, 1)))(x, w)
    copies = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "convert_element_type"
              and e.invars[0].aval.shape == x.shape and e.outvars[0].aval.dtype == jnp.float32]
    assert not copies, copies
    f32 = nn.apply_router(x, w, nn.RouterConfig(dtype=jnp.float32, precision="highest"))
    np.testing.assert_allclose(np.asarray(f32.logits), x64 @ np.asarray(w, np.float64), rtol=1e-5, atol=1e-5)


def _layer_args(num_experts=8, hidden=64, inter=64, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], (2, 24, hidden)).astype(jnp.bfloat16)
    router = jax.random.normal(k[1], (hidden, num_experts)) / 8
    w1 = (jax.random.normal(k[2], (num_experts, 2 * inter, hidden)) / 8).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[3], (num_experts, hidden, inter)) / 8).astype(jnp.bfloat16)
    return x, router, w1, w2


def test_aux_carries_the_routing_and_precomputed_gating_reproduces_it():
    x, router, w1, w2 = _layer_args()
    config = nn.RouterConfig(top_k=3, score="sigmoid")
    y, aux = nn.moe_layer(x, router, w1, w2, router_config=config)
    assert aux["experts"].shape == (2, 24, 3) and aux["weights"].shape == (2, 24, 3)
    assert aux["logits"].shape == (2, 24, 8) and aux["scores"].shape == (2, 24, 8)
    want = nn.apply_router(x.reshape(-1, 64), router, config)
    np.testing.assert_array_equal(np.asarray(aux["experts"]).reshape(-1, 3), np.asarray(want.experts))
    np.testing.assert_array_equal(np.asarray(aux["logits"]).reshape(-1, 8), np.asarray(want.logits))
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]),
                                  np.bincount(np.asarray(want.experts).ravel(), minlength=8))
    # the same decision passed in: the same output, no router arguments
    y2, aux2 = nn.moe_layer(x, None, w1, w2, gating=(aux["experts"], aux["weights"]))
    np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y, np.float32))
    assert "logits" not in aux2 and aux2["experts"].shape == (2, 24, 3)
    # an expert id outside [0, L) contributes nothing
    bad = aux["experts"].at[:, :, 2].set(8)
    y3 = nn.moe_layer(x, None, w1, w2, gating=(bad, aux["weights"]))[0]
    y4 = nn.moe_layer(x, None, w1, w2, gating=(aux["experts"], aux["weights"].at[:, :, 2].set(0.0)))[0]
    np.testing.assert_array_equal(np.asarray(y3, np.float32), np.asarray(y4, np.float32))


BAD_ROUTER_ARGS = [
    (lambda: nn.RouterConfig(score="relu"), ValueError, "score='relu'"),
    (lambda: nn.RouterConfig(top_k=0), ValueError, "top_k=0"),
    (lambda: nn.RouterConfig(bias="both"), ValueError, "bias='both'"),
    (lambda: nn.RouterConfig(scaling=0.0), ValueError, "scaling=0.0"),
    (lambda: nn.RouterConfig(n_groups=4, topk_groups=5), ValueError, "topk_groups=5"),
    (lambda: nn.RouterConfig(dtype=jnp.int8), ValueError, "dtype="),
    (lambda: nn.RouterConfig(precision="tf32"), ValueError, "precision='tf32'"),
    (lambda: nn.RouterConfig(normalize=1), TypeError, "normalize=1"),
]


@pytest.mark.parametrize("i", range(len(BAD_ROUTER_ARGS)))
def test_router_config_rejects_bad_values(i):
    make, exc, fragment = BAD_ROUTER_ARGS[i]
    with pytest.raises(exc, match=None) as info:
        make()
    assert fragment in str(info.value), str(info.value)


def test_layer_rejects_inconsistent_router_arguments():
    x, router, w1, w2 = _layer_args()
    bias = jnp.zeros((8,))
    cases = [
        (dict(router_config=nn.RouterConfig(n_groups=3)), "n_groups=3 must divide"),
        (dict(router_config=nn.RouterConfig(top_k=5, n_groups=4, topk_groups=2)), "top_k=5 exceeds"),
        (dict(router_config=nn.RouterConfig(bias="selection")), "needs the router_bias"),
        (dict(router_bias=bias), "RouterConfig.bias is None"),
        (dict(router_config=nn.RouterConfig(bias="logits"), router_bias=bias[:4]), "router_bias must have shape"),
        (dict(top_k=3, router_config=nn.RouterConfig(top_k=2)), "top_k=3 disagrees"),
        (dict(top_k=9), "top_k=9 must be in [1, L=8]"),
        (dict(gating=(jnp.zeros((2, 24, 2), jnp.int32), jnp.ones((2, 24, 2)))), "replaces the router"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(ValueError) as info:
            nn.moe_layer(x, router, w1, w2, **kwargs)
        assert fragment in str(info.value), (kwargs, str(info.value))
    with pytest.raises(ValueError, match="token shape"):
        nn.moe_layer(x, None, w1, w2, gating=(jnp.zeros((48, 2), jnp.int32), jnp.ones((48, 2))))
    with pytest.raises(TypeError, match="integer expert ids"):
        nn.moe_layer(x, None, w1, w2, gating=(jnp.zeros((2, 24, 2)), jnp.ones((2, 24, 2))))


# ------------------------------------------------------------------------------------------------ losses

def np_switch_loss(scores, experts, mask=None):
    """E * sum_i f_i P_i over one set of tokens (f over the T*k assignments, P of the per-token normalized
    scores)."""
    scores = np.asarray(scores, np.float64).reshape(-1, scores.shape[-1])
    experts = np.asarray(experts).reshape(-1, experts.shape[-1])
    w = np.ones(len(scores)) if mask is None else np.asarray(mask, np.float64).reshape(-1)
    num_experts, k = scores.shape[1], experts.shape[1]
    counts = np.zeros(num_experts)
    for t in range(len(experts)):
        for e in experts[t]:
            counts[e] += w[t]
    f = counts / (w.sum() * k)
    p = (scores / scores.sum(1, keepdims=True) * w[:, None]).sum(0) / w.sum()
    return num_experts * np.sum(f * p)


def test_load_balancing_loss():
    logits = jax.random.normal(jax.random.PRNGKey(6), (3, 40, L))
    g = nn.gate(logits.reshape(-1, L), nn.RouterConfig(top_k=2))
    scores, experts = g.scores.reshape(3, 40, L), g.experts.reshape(3, 40, 2)
    got = nn.load_balancing_loss(scores, experts)
    np.testing.assert_allclose(float(got), np_switch_loss(scores, experts), rtol=1e-5)
    # Hugging Face Mixtral's load_balancing_loss_func, written out: E * sum over choices and experts of
    # mean_t(one_hot) * mean_t(softmax); it counts per choice, so it is k times ours
    one_hot = np.eye(L)[np.asarray(experts).reshape(-1, 2)]                       # (T, k, E)
    hf = L * np.sum(one_hot.mean(0) * np.asarray(scores, np.float64).reshape(-1, L).mean(0)[None])
    np.testing.assert_allclose(2 * float(got), hf, rtol=1e-5)
    per_seq = nn.load_balancing_loss(scores, experts, per_sequence=True)
    np.testing.assert_allclose(float(per_seq), np.mean([np_switch_loss(scores[b], experts[b]) for b in range(3)]),
                               rtol=1e-5)
    mask = jax.random.bernoulli(jax.random.PRNGKey(7), 0.7, (3, 40))
    np.testing.assert_allclose(float(nn.load_balancing_loss(scores, experts, mask=mask)),
                               np_switch_loss(scores, experts, mask), rtol=1e-5)
    # uniform routing and scores give exactly 1; sigmoid scores are normalized per token first
    uniform = jnp.full((L, L), 0.3)
    round_robin = jnp.stack([jnp.arange(L), (jnp.arange(L) + 1) % L], axis=1)
    np.testing.assert_allclose(float(nn.load_balancing_loss(uniform, round_robin)), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="per_sequence"):
        nn.load_balancing_loss(scores[0], experts[0], per_sequence=True)


def test_router_z_loss_and_bias_update():
    logits = 3 * jax.random.normal(jax.random.PRNGKey(8), (2, 30, L))
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    np.testing.assert_allclose(float(nn.router_z_loss(logits)), np.mean(lse ** 2), rtol=1e-5)
    mask = jnp.arange(30)[None, :] < jnp.array([[10], [30]])
    np.testing.assert_allclose(float(nn.router_z_loss(logits, mask)), np.mean(np.concatenate(
        [lse[0, :10], lse[1]]) ** 2), rtol=1e-5)
    bias = jnp.linspace(-1, 1, 4).astype(jnp.bfloat16)
    new = nn.balancing_bias_update(bias, jnp.array([10, 30, 20, 20]), rate=0.125)
    assert new.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(bias, np.float32) + [0.125, -0.125, 0, 0])


def test_losses_differentiate_through_the_layers_own_router_pass():
    """loss + lb + z on the layer's aux: the router gradient equals the one through a separate router pass (up to
    bf16 rounding)."""
    x, router, w1, w2 = _layer_args()
    cot = jax.random.normal(jax.random.PRNGKey(9), x.shape)

    def with_aux(router):
        y, aux = nn.moe_layer(x, router, w1, w2)
        lb = nn.load_balancing_loss(aux["scores"], aux["experts"], per_sequence=True)
        return jnp.sum(y.astype(jnp.float32) * cot) + 0.1 * lb + 0.01 * nn.router_z_loss(aux["logits"])

    def second_pass(router):
        y, _ = nn.moe_layer(x, router, w1, w2)
        g = nn.apply_router(x.reshape(-1, 64), router, nn.RouterConfig())
        lb = nn.load_balancing_loss(g.scores.reshape(2, 24, -1), g.experts.reshape(2, 24, -1), per_sequence=True)
        return jnp.sum(y.astype(jnp.float32) * cot) + 0.1 * lb + 0.01 * nn.router_z_loss(g.logits)

    got, want = jax.grad(with_aux)(router), jax.grad(second_pass)(router)
    # one pass sums the three logit cotangents before the router GEMM's bf16 operand, two passes round each
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 5e-3
    lb_only = jax.grad(lambda r: nn.load_balancing_loss(*(lambda a: (a["scores"], a["experts"]))(
        nn.moe_layer(x, r, w1, w2)[1])))(router)
    assert float(jnp.linalg.norm(lb_only)) > 0
