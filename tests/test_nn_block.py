"""nn expert block: gate-weighted FC2 bias, shared experts, weight layouts converted inside, mixed precision (float32
master weights, the float32 reference path, fp16 with loss scaling) and the Flax / Equinox modules' new options."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_moe_jax import nn

HI = jax.lax.Precision.HIGHEST
T, H, I, L = 48, 64, 64, 4


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _params(seed=0, dtype=jnp.float32, shared_inter=96):
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 12))
    n = lambda shape, fan: (jax.random.normal(next(k), shape) / fan ** 0.5).astype(dtype)  # noqa: E731
    return {"router": jax.random.normal(next(k), (H, L)) / H ** 0.5,
            "w_gate": n((L, I, H), H), "w_up": n((L, I, H), H), "w2": n((L, H, I), I),
            "b_gate": n((L, I), 4), "b_up": n((L, I), 4), "b2": n((L, H), 4),
            "s_gate": n((shared_inter, H), H), "s_up": n((shared_inter, H), H), "s_w2": n((H, shared_inter), 96),
            "s_b1": n((2 * shared_inter,), 4), "s_g": n((H,), H)}


def _plain_layer(p, x, top_k=2):
    """float32 per-token formula of the whole block (block.py's module doc), dense over experts."""
    logits = jnp.dot(x, p["router"], precision=HI)
    w, e = jax.lax.top_k(jax.nn.softmax(logits), top_k)
    gates = jnp.sum(jax.nn.one_hot(e, L) * (w / jnp.sum(w, 1, keepdims=True))[..., None], axis=1)
    silu = lambda v: v * jax.nn.sigmoid(v)  # noqa: E731
    g = jnp.einsum("th,eih->eti", x, p["w_gate"], precision=HI) + p["b_gate"][:, None]
    u = jnp.einsum("th,eih->eti", x, p["w_up"], precision=HI) + p["b_up"][:, None]
    y = jnp.einsum("eti,ehi->eth", silu(g) * u, p["w2"], precision=HI) + p["b2"][:, None]
    routed = jnp.einsum("te,eth->th", gates, y, precision=HI)
    s_b1 = nn.deinterleave_glu_weights(p["s_b1"], axis=0)
    half = p["s_gate"].shape[0]
    sg = jnp.dot(x, p["s_gate"].T, precision=HI) + s_b1[:half]
    su = jnp.dot(x, p["s_up"].T, precision=HI) + s_b1[half:]
    shared = jnp.dot(silu(sg) * su, p["s_w2"].T, precision=HI)
    return routed + jax.nn.sigmoid(jnp.dot(x, p["s_g"], precision=HI))[:, None] * shared


def _ours(p, x, dtype):
    shared = nn.SharedExpert((p["s_gate"], p["s_up"]), p["s_w2"], p["s_b1"], p["s_g"])
    return nn.moe_layer(x, p["router"], (p["w_gate"], p["w_up"]), p["w2"], (p["b_gate"], p["b_up"]), b2=p["b2"],
                        shared=shared, dtype=dtype)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_fc2_bias_and_gated_shared_expert_match_the_formula(dtype, tol):
    """Every gradient of a block with FC1 / FC2 biases and a gated shared expert (Qwen2-MoE style), float32
    master weights, against the float32 formula on the values the layer computes with."""
    p = _params()
    x = jax.random.normal(jax.random.PRNGKey(1), (T, H))
    cot = jax.random.normal(jax.random.PRNGKey(2), (T, H))
    ours = lambda p, x: jnp.sum(_ours(p, x, dtype)[0].astype(jnp.float32) * cot)  # noqa: E731
    rounded = lambda a: a.astype(dtype).astype(jnp.float32)  # noqa: E731
    plain = lambda p, x: jnp.sum(_plain_layer(jax.tree.map(rounded, p), rounded(x)) * cot)  # noqa: E731
    got = jax.jit(jax.grad(ours, (0, 1)))(p, x)
    want = jax.jit(jax.grad(plain, (0, 1)))(p, x)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == jnp.float32 and float(jnp.linalg.norm(w)) > 0, jax.tree_util.keystr(path)
        assert _rel(g, w) < tol, (jax.tree_util.keystr(path), _rel(g, w))


def test_weight_layouts_are_converted_inside_with_the_gradient_converted_back():
    """(gate, up) pairs and weight_layout="in_out" give the interleaved call's output bit for bit, and their
    gradients are the interleaved gradients converted back to the layout given."""
    p = _params(dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.PRNGKey(3), (T, H)).astype(jnp.bfloat16)
    w1 = nn.interleave_glu_weights(jnp.concatenate([p["w_gate"], p["w_up"]], axis=1))
    b1 = nn.interleave_glu_weights(jnp.concatenate([p["b_gate"], p["b_up"]], axis=1))
    loss = lambda y: jnp.sum(y.astype(jnp.float32) ** 2)  # noqa: E731

    def fused(w1, w2, b1):
        return loss(nn.moe_layer(x, p["router"], w1, w2, b1)[0])

    def pairs_in_out(wg, wu, w2, bg, bu):
        return loss(nn.moe_layer(x, p["router"], (wg, wu), w2, (bg, bu), weight_layout="in_out")[0])

    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    args = (t(p["w_gate"]), t(p["w_up"]), t(p["w2"]), p["b_gate"], p["b_up"])
    assert float(fused(w1, p["w2"], b1)) == float(pairs_in_out(*args))
    dw1, dw2, db1 = jax.grad(fused, (0, 1, 2))(w1, p["w2"], b1)
    dwg, dwu, dw2_t, dbg, dbu = jax.grad(pairs_in_out, (0, 1, 2, 3, 4))(*args)
    halves = nn.deinterleave_glu_weights(dw1)
    for got, want in ((dwg, t(halves[:, :I])), (dwu, t(halves[:, I:])), (dw2_t, t(dw2)),
                      (dbg, nn.deinterleave_glu_weights(db1)[:, :I]), (dbu, nn.deinterleave_glu_weights(db1)[:, I:])):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="weight_layout='(E, in, out)'|weight_layout="):
        nn.moe_layer(x, p["router"], w1, p["w2"], weight_layout="E,H,I")
    with pytest.raises(ValueError, match="same shape"):
        nn.moe_layer(x, p["router"], (p["w_gate"], p["w_up"][:, :32]), p["w2"])
    with pytest.raises(ValueError, match="GLU activations"):
        nn.moe_layer(x, p["router"], (p["w_gate"], p["w_up"]), p["w2"], act="srelu")


def test_float32_master_weights_give_the_bf16_run_with_float32_gradients():
    """bf16 compute on float32 weights casts inside: the output is bit-identical to the run on pre-cast bf16 weights,
    and each weight gradient is the same fp32 accumulation stored in float32 (so rounding it to bf16 gives the bf16
    run's gradient exactly)."""
    p = _params()
    x = jax.random.normal(jax.random.PRNGKey(4), (T, H)).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(5), (T, H))
    names = ("w_gate", "w_up", "w2", "b_gate", "b_up")

    def loss(ws):
        y = nn.moe_layer(x, p["router"], (ws[0], ws[1]), ws[2], (ws[3], ws[4]))[0]
        return jnp.sum(y.astype(jnp.float32) * cot), y

    master = tuple(p[n] for n in names)
    half = tuple(a.astype(jnp.bfloat16) for a in master)
    (_, y32), g32 = jax.value_and_grad(loss, has_aux=True)(master)
    (_, y16), g16 = jax.value_and_grad(loss, has_aux=True)(half)
    np.testing.assert_array_equal(np.asarray(y32, np.float32), np.asarray(y16, np.float32))
    for name, a, b in zip(names, g32, g16):
        assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16), np.float32), np.asarray(b, np.float32))
        assert not np.array_equal(np.asarray(a), np.asarray(a.astype(jnp.bfloat16), np.float32)), name


def test_moe_mlp_weight_dtype_rules():
    x = jnp.ones((256, H), jnp.bfloat16)
    w1, w2 = jnp.ones((1, 2 * I, H), jnp.float16), jnp.ones((1, H, I), jnp.bfloat16)
    with pytest.raises(TypeError, match=r"w1 \(float16\) must have x_perm's dtype \(bfloat16\) or be float32"):
        nn.moe_mlp(x, w1, w2, jnp.ones((256,)), None, jnp.array([256], jnp.int32))
    y = nn.moe_mlp(x.astype(jnp.float32), w1, w2, jnp.ones((256,)), None, jnp.array([256], jnp.int32))
    assert y.dtype == jnp.float32     # float32 compute takes 16-bit weights too (exact upcast)


def test_fp16_loss_scaling_recipe():
    """docs/nn.md's fp16 recipe: a small model's fp16 gradients lose most of their bits in fp16's subnormal range;
    scaling the loss by 2^12 (and the gradients back) recovers them to fp16 accuracy."""
    p = {k: v for k, v in _params(seed=6).items() if k in ("router", "w_gate", "w_up", "w2")}
    x = jax.random.normal(jax.random.PRNGKey(7), (T, H))
    target = jax.random.normal(jax.random.PRNGKey(8), (T, H))

    def loss_fn(p, dtype):
        y = nn.moe_layer(x.astype(dtype), p["router"], (p["w_gate"], p["w_up"]), p["w2"])[0]
        return 1e-4 * jnp.mean((y.astype(jnp.float32) - target) ** 2)      # e.g. a small auxiliary-weighted term

    def scaled_grads(p, scale):
        grads = jax.grad(lambda p: loss_fn(p, jnp.float16) * scale)(p)
        return jax.tree.map(lambda g: g / scale, grads)

    want = jax.grad(lambda p: loss_fn(p, jnp.float32))(p)
    plain, scaled = scaled_grads(p, 1.0), scaled_grads(p, 2.0 ** 12)
    for name in ("router", "w_gate", "w_up", "w2"):
        assert _rel(plain[name], want[name]) > 0.1, name            # subnormal fp16 cotangents (measured 16-32%)
        assert _rel(scaled[name], want[name]) < 5e-3, name          # scaled: fp16 rounding only (measured 8e-4)
        assert bool(jnp.all(jnp.isfinite(scaled[name])))


# ------------------------------------------------------------------------------------------------ modules

@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_modules_float32_compute_and_master_weights(framework):
    """dtype=float32 constructs and runs (the jnp reference path); param_dtype=float32 with bf16 compute keeps
    float32 parameters and float32 gradients and equals the functional layer on the same parameters."""
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, H))
    for kwargs, param_dtype, y_dtype in (({"dtype": jnp.float32}, jnp.float32, jnp.float32),
                                         ({"param_dtype": jnp.float32}, jnp.float32, jnp.bfloat16),
                                         ({}, jnp.bfloat16, jnp.bfloat16)):
        model, params, grads = _module(framework, dict(bias=True, **kwargs), x)
        assert params["w1"].dtype == param_dtype and params["router"].dtype == jnp.float32
        assert all(g.dtype == params[n].dtype for n, g in grads.items())
        y = model(x.astype(kwargs.get("dtype", jnp.bfloat16)) if "dtype" in kwargs else x.astype(jnp.bfloat16))
        assert y.dtype == y_dtype and y.shape == x.shape
        direct = nn.moe_layer(x, params["router"], params["w1"], params["w2"], params["b1"], dtype=y_dtype)[0]
        np.testing.assert_allclose(np.asarray(model(x), np.float32), np.asarray(direct, np.float32), rtol=1e-6)


def _module(framework, kwargs, x):
    """(model, {name: param}, {name: gradient of mean(y^2)})."""
    loss = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
    if framework == "flax":
        nnx = pytest.importorskip("flax.nnx")
        model = nn.FlaxMoE(H, I, L, rngs=nnx.Rngs(0), **kwargs)
        grads = nnx.grad(loss)(model)
        params = {n: getattr(model, n)[...] for n in model.param_names}
        flat = {n: getattr(grads, n)[...] for n in model.param_names
                if isinstance(getattr(model, n), nnx.Param)}
        return model, params, flat
    eqx = pytest.importorskip("equinox")
    model = nn.EquinoxMoE(H, I, L, key=jax.random.PRNGKey(0), **kwargs)
    grads = eqx.filter_grad(loss)(model)
    names = [n for n in ("router", "router_bias", "w1", "w2", "b1", "b2", "shared_w1", "shared_w2", "shared_b1",
                         "shared_gate") if getattr(model, n) is not None]
    return model, {n: getattr(model, n) for n in names}, {n: getattr(grads, n) for n in names}


@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_modules_route_with_options_and_return_aux(framework):
    """A DeepSeek-style module (sigmoid, groups, selection bias, FC2 bias, gated shared expert): return_aux gives
    the routing of the same call, the selection bias is state (Flax: not an nnx.Param; no gradient) updated with
    nn.balancing_bias_update, and the module equals the functional layer on its parameters."""
    config = nn.RouterConfig(top_k=2, score="sigmoid", bias="selection", n_groups=2, topk_groups=1, scaling=2.0)
    kwargs = dict(router_config=config, fc2_bias=True, shared_intermediate=64, shared_gate=True,
                  param_dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, H)).astype(jnp.bfloat16)
    model, params, grads = _module(framework, kwargs, x)
    assert set(params) == {"router", "router_bias", "w1", "w2", "b2", "shared_w1", "shared_w2", "shared_gate"}
    y, aux = model(x, return_aux=True)
    shared = nn.SharedExpert(params["shared_w1"], params["shared_w2"], None, params["shared_gate"])
    y_ref, aux_ref = nn.moe_layer(x, params["router"], params["w1"], params["w2"], router_config=config,
                                  router_bias=params["router_bias"], b2=params["b2"], shared=shared)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(aux["experts"]), np.asarray(aux_ref["experts"]))
    new_bias = nn.balancing_bias_update(params["router_bias"], aux["expert_load"], rate=0.01)
    assert float(jnp.max(jnp.abs(new_bias))) == pytest.approx(0.01)
    if framework == "flax":
        nnx = pytest.importorskip("flax.nnx")
        assert "router_bias" not in grads and not isinstance(model.router_bias, nnx.Param)
        assert isinstance(model.router_bias, nn.FlaxMoE.BalancingBias)
        model.router_bias[...] = new_bias
        np.testing.assert_array_equal(np.asarray(model.router_bias[...]), np.asarray(new_bias))
    else:
        assert float(jnp.max(jnp.abs(grads["router_bias"]))) == 0.0
    assert all(float(jnp.linalg.norm(g)) > 0 for n, g in grads.items() if n != "router_bias"), grads.keys()


def test_module_rejects_a_gate_without_a_shared_expert():
    pytest.importorskip("equinox")
    with pytest.raises(ValueError, match="shared_gate=True needs a shared expert"):
        nn.EquinoxMoE(H, I, L, key=jax.random.PRNGKey(0), shared_gate=True)
