"""Parity of nn.moe_layer with the MoE blocks of public models, on the CPU: Mixtral, DeepSeek-V3 and GPT-OSS.

Each reference block is written here from the model's published equations (papers / model cards), as float32 jnp,
per token and dense over the experts (every expert runs on every token, masked by its gate weight) -- no routing
code shared with the library. Each is checked twice, outputs and every gradient:

- compute dtype float32 (the layer's jnp reference path) against the block on the same float32 values: the same
  math, so within float32 summation-order noise (1e-5);
- compute dtype bfloat16 with float32 master weights (the training setting; the kernels' stores on the CPU
  reference backend) against the block on the bf16-rounded inputs and weights the layer computes with: no token
  may be routed differently, and everything within bf16 storage noise (2e-2 relative, the bound of test_nn.py).

The weights are given in each model's own layout (Mixtral / DeepSeek: separate gate and up projections, torch's
(out, in) and MaxText's (in, out); GPT-OSS: one FC1 whose even / odd rows are gate / up), converted inside the
layer, so the gradients are checked in those layouts too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_moe_jax import nn

HI = jax.lax.Precision.HIGHEST
B, S, H, I = 2, 32, 64, 64          # tokens (batch, seq), hidden, expert intermediate
f32 = lambda a: a.astype(jnp.float32)  # noqa: E731


def _rounded(params, dtype):
    """What the layer computes with: every array rounded to the compute dtype (identity for float32)."""
    return jax.tree.map(lambda a: f32(a.astype(dtype)), params)


def _silu(v):
    return v * jax.nn.sigmoid(v)


def _dense_combine(x, experts_fn, gates):
    """sum_e gates[t, e] * expert_e(x_t) for x (T, H), gates (T, L): every expert on every token."""
    ys = jax.vmap(experts_fn, in_axes=(None, 0))(x, jnp.arange(gates.shape[1]))          # (L, T, H)
    return jnp.einsum("te,eth->th", gates, ys, precision=HI)


def _gates(experts, weights, num_experts):
    return jnp.sum(jax.nn.one_hot(experts, num_experts) * weights[..., None], axis=1)


# ------------------------------------------------------------------------------------------------ Mixtral
# Mixtral of Experts (Jiang et al. 2024), eq. 1-2: y = sum_{i in top2} softmax(Top2(x W_g))_i * SwiGLU_i(x),
# SwiGLU_i(x) = w2_i (silu(w1_i x) * w3_i x); torch Linear layouts: w1, w3 (E, I, H), w2 (E, H, I), W_g (H, E).

def mixtral_block(p, x, top_k=2):
    logits = jnp.dot(x, p["router"], precision=HI)
    top, experts = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(top, axis=-1)

    def expert(x, e):
        h = _silu(jnp.dot(x, p["w1"][e].T, precision=HI)) * jnp.dot(x, p["w3"][e].T, precision=HI)
        return jnp.dot(h, p["w2"][e].T, precision=HI)
    return _dense_combine(x, expert, _gates(experts, weights, p["router"].shape[1])), experts


def mixtral_ours(p, x, dtype):
    config = nn.RouterConfig(top_k=2, topk_first=True)
    return nn.moe_layer(x, p["router"], (p["w1"], p["w3"]), p["w2"], router_config=config, dtype=dtype)


def mixtral_params(key, num_experts=8):
    k = jax.random.split(key, 4)
    return {"router": jax.random.normal(k[0], (H, num_experts)) / H ** 0.5,
            "w1": jax.random.normal(k[1], (num_experts, I, H)) / H ** 0.5,
            "w3": jax.random.normal(k[2], (num_experts, I, H)) / H ** 0.5,
            "w2": jax.random.normal(k[3], (num_experts, H, I)) / I ** 0.5}


# ------------------------------------------------------------------------------------------------ DeepSeek-V3
# DeepSeek-V3 technical report (2024), eq. 12-16: s_i = sigmoid(u . e_i); top-K of s_i + b_i (b: the
# auxiliary-loss-free balancing bias, selection only), restricted to the experts of the topk_group groups (of
# n_group) with the largest sum of their two largest s_i + b_i (node-limited routing as in the released
# configuration); g_i = s_i / sum_{chosen} s_j, times routed_scaling_factor; h = u + sum_shared FFN(u) +
# sum_chosen g_i FFN_i(u). MaxText kernel layouts (in, out): wi_0 / wi_1 (E, H, I), wo (E, I, H).

DS = dict(num_experts=16, n_group=4, topk_group=2, top_k=4, scaling=2.5, shared_inter=64)


def deepseek_block(p, x):
    s = jax.nn.sigmoid(jnp.dot(x, p["router"], precision=HI))
    key = s + p["bias"]
    tokens = x.shape[0]
    grouped = key.reshape(tokens, DS["n_group"], -1)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, groups = jax.lax.top_k(group_score, DS["topk_group"])
    allowed = jnp.zeros((tokens, DS["n_group"]), bool).at[jnp.arange(tokens)[:, None], groups].set(True)
    key = jnp.where(jnp.repeat(allowed, DS["num_experts"] // DS["n_group"], axis=1), key, -jnp.inf)
    _, experts = jax.lax.top_k(key, DS["top_k"])
    g = jnp.take_along_axis(s, experts, axis=1)
    g = g / jnp.sum(g, axis=1, keepdims=True) * DS["scaling"]

    def ffn(x, wi0, wi1, wo):
        return jnp.dot(_silu(jnp.dot(x, wi0, precision=HI)) * jnp.dot(x, wi1, precision=HI), wo, precision=HI)

    routed = _dense_combine(x, lambda x, e: ffn(x, p["wi0"][e], p["wi1"][e], p["wo"][e]),
                            _gates(experts, g, DS["num_experts"]))
    return routed + ffn(x, p["s_wi0"], p["s_wi1"], p["s_wo"]), experts


def deepseek_ours(p, x, dtype):
    config = nn.RouterConfig(top_k=DS["top_k"], score="sigmoid", bias="selection", n_groups=DS["n_group"],
                             topk_groups=DS["topk_group"], scaling=DS["scaling"])
    shared = nn.SharedExpert((p["s_wi0"], p["s_wi1"]), p["s_wo"])
    return nn.moe_layer(x, p["router"], (p["wi0"], p["wi1"]), p["wo"], router_config=config, router_bias=p["bias"],
                        shared=shared, weight_layout="in_out", dtype=dtype)


def deepseek_params(key):
    e, si = DS["num_experts"], DS["shared_inter"]
    k = jax.random.split(key, 8)
    return {"router": jax.random.normal(k[0], (H, e)) / H ** 0.5,
            "bias": 0.1 * jax.random.normal(k[1], (e,)),
            "wi0": jax.random.normal(k[2], (e, H, I)) / H ** 0.5, "wi1": jax.random.normal(k[3], (e, H, I)) / H ** 0.5,
            "wo": jax.random.normal(k[4], (e, I, H)) / I ** 0.5,
            "s_wi0": jax.random.normal(k[5], (H, si)) / H ** 0.5, "s_wi1": jax.random.normal(k[6], (H, si)) / H ** 0.5,
            "s_wo": jax.random.normal(k[7], (si, H)) / si ** 0.5}


# ------------------------------------------------------------------------------------------------ GPT-OSS
# gpt-oss model card (OpenAI 2025), MoE block: router logits = x W + b; top-4 of the logits, softmax over those
# four; per expert h = W1 x + b1 with gate = h[0::2], up = h[1::2] (interleaved rows), gate = min(gate, 7),
# up = clip(up, -7, 7), a = gate * sigmoid(1.702 gate) * (up + 1); y_e = W2 a + b2; y = sum softmax-weight * y_e.

GPT_OSS_LIMIT = 7.0


def gpt_oss_block(p, x, top_k=4):
    logits = jnp.dot(x, p["router"], precision=HI) + p["router_b"]
    top, experts = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(top, axis=-1)

    def expert(x, e):
        h = jnp.dot(x, p["w1"][e].T, precision=HI) + p["b1"][e]
        gate, up = jnp.minimum(h[:, 0::2], GPT_OSS_LIMIT), jnp.clip(h[:, 1::2], -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
        a = gate * jax.nn.sigmoid(1.702 * gate) * (up + 1.0)
        return jnp.dot(a, p["w2"][e].T, precision=HI) + p["b2"][e]
    return _dense_combine(x, expert, _gates(experts, weights, p["router"].shape[1])), experts


def gpt_oss_ours(p, x, dtype, act="geglu", glu_limit=None):
    config = nn.RouterConfig(top_k=4, topk_first=True, bias="logits")
    w1, b1 = p["w1"], p["b1"]
    return nn.moe_layer(x, p["router"], (w1[:, 0::2], w1[:, 1::2]), p["w2"], (b1[:, 0::2], b1[:, 1::2]),
                        router_config=config, router_bias=p["router_b"], b2=p["b2"], act=act, glu_limit=glu_limit,
                        dtype=dtype)


def gpt_oss_params(key, num_experts=8):
    k = jax.random.split(key, 6)
    # scaled up so that the clamps at +-7 are active for some gate / up values
    return {"router": jax.random.normal(k[0], (H, num_experts)) / H ** 0.5,
            "router_b": 0.5 * jax.random.normal(k[1], (num_experts,)),
            "w1": 4 * jax.random.normal(k[2], (num_experts, 2 * I, H)) / H ** 0.5,
            "b1": jax.random.normal(k[3], (num_experts, 2 * I)),
            "w2": jax.random.normal(k[4], (num_experts, H, I)) / I ** 0.5,
            "b2": jax.random.normal(k[5], (num_experts, H))}


# ------------------------------------------------------------------------------------------------ the check

def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check(block, ours, params, dtype, tol, zero_grad=()):
    """Outputs, routing and every gradient of loss = sum(y * cot), ours (batched tokens) vs the block."""
    kx, kc = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (B, S, H))
    cot = jax.random.normal(kc, (B, S, H))

    def loss_ours(p, x):
        y, aux = ours(p, x, dtype)
        assert y.shape == x.shape and y.dtype == jnp.dtype(dtype)
        return jnp.sum(f32(y) * cot), aux

    def loss_ref(p, x):
        y, experts = block(_rounded(p, dtype), f32(x.astype(dtype)).reshape(-1, H))
        return jnp.sum(y.reshape(x.shape) * cot), experts

    (value, aux), grads = jax.jit(jax.value_and_grad(loss_ours, argnums=(0, 1), has_aux=True))(params, x)
    (want, experts), want_grads = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1), has_aux=True))(params, x)
    np.testing.assert_array_equal(np.sort(np.asarray(aux["experts"]).reshape(-1, experts.shape[1]), axis=1),
                                  np.sort(np.asarray(experts), axis=1))               # no token routed differently
    assert abs(float(value) - float(want)) <= tol * float(jnp.sum(jnp.abs(cot))), (value, want)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    want_flat = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, g in flat:
        name = jax.tree_util.keystr(path)
        w = want_flat[path]
        assert g.shape == w.shape and g.dtype == jnp.float32, name        # float32 master: float32 gradients
        if any(z in name for z in zero_grad):
            assert float(jnp.max(jnp.abs(w))) == 0.0 and float(jnp.max(jnp.abs(g))) == 0.0, name
            continue
        assert float(jnp.linalg.norm(w)) > 0, name
        err = _rel(g, w)
        assert err < tol, f"{name}: relative error {err:.3e} (tol {tol})"
    return aux


MODELS = {
    "mixtral": (mixtral_block, mixtral_ours, mixtral_params, ()),
    "deepseek_v3": (deepseek_block, deepseek_ours, deepseek_params, ("'bias'",)),   # selection only: no gradient
    "gpt_oss": (gpt_oss_block, gpt_oss_ours, gpt_oss_params, ()),
}


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("model", list(MODELS))
def test_block_parity(model, dtype, tol):
    block, ours, make, zero_grad = MODELS[model]
    _check(block, ours, make(jax.random.PRNGKey(0)), dtype, tol, zero_grad)


def test_gpt_oss_clamps_are_exercised():
    """The GPT-OSS data reaches both sides of the clamps (else the parity test would not cover them)."""
    p = gpt_oss_params(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (B * S, H))
    h = jnp.einsum("th,enh->etn", x, p["w1"]) + p["b1"][:, None]
    assert float(jnp.mean(h[..., 0::2] > GPT_OSS_LIMIT)) > 0.01
    assert float(jnp.mean(jnp.abs(h[..., 1::2]) > GPT_OSS_LIMIT)) > 0.01


def test_deepseek_groups_and_bias_change_the_routing():
    """The group limit and the selection bias both matter on this data: dropping either changes some choices."""
    p = deepseek_params(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (B * S, H))
    _, experts = deepseek_block(p, x)
    no_bias = deepseek_block({**p, "bias": jnp.zeros_like(p["bias"])}, x)[1]
    assert not np.array_equal(np.sort(experts, 1), np.sort(no_bias, 1))
    config = nn.RouterConfig(top_k=DS["top_k"], score="sigmoid", bias="selection")          # no group limit
    flat = nn.apply_router(x, p["router"], config, p["bias"], "float32").experts
    assert not np.array_equal(np.sort(experts, 1), np.sort(flat, 1))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_gpt_oss_parity_with_its_own_activation(dtype, tol):
    """GPT-OSS's clamped SwiGLU by name: equal to cuDNN's geglu at the model's limit 7 (docs/nn.md)."""
    def ours(p, x, dtype):
        return gpt_oss_ours(p, x, dtype, act="gpt_oss_swiglu", glu_limit=GPT_OSS_LIMIT)
    _check(gpt_oss_block, ours, gpt_oss_params(jax.random.PRNGKey(0)), dtype, tol)
