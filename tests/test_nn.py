"""nn: routing into padding-free (or m_aligned-padded) groups, and the custom_vjp MoE MLP's gradients against
jax.grad of plain jnp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_moe_jax import nn
from cudnn_moe_jax.nn import moe as moe_module
from np_ops import np_glu_value


@pytest.mark.parametrize("m_aligned,ends,rows", [(1, [3, 4, 7, 8, 8], 8), (8, [8, 16, 24, 32, 32], 48),
                                                 (256, [256, 512, 768, 1024, 1024], 1536)])
def test_route_builds_contiguous_groups(m_aligned, ends, rows):
    experts = jnp.array([[0, 2], [2, 1], [0, 2], [3, 0]], jnp.int32)  # expert 3: one token; all experts used
    plan = nn.route(experts, num_experts=5, m_aligned=m_aligned)       # expert 4 empty
    offsets = np.asarray(plan.padded_offsets)
    np.testing.assert_array_equal(offsets, ends)
    m = nn.permuted_rows(4, 2, 5, m_aligned)
    assert m == rows and plan.row_token.shape == (m,) and m % max(m_aligned, 8) == 0 and m >= offsets[-1]
    dest, row_token = np.asarray(plan.dest_row), np.asarray(plan.row_token)
    starts = np.concatenate([[0], offsets[:-1]])
    for t in range(4):
        for j in range(2):
            e = int(experts[t, j])
            assert starts[e] <= dest[t, j] < offsets[e] and row_token[dest[t, j]] == t
            # token order kept inside a group: the rank is the number of earlier tokens with this expert
            assert dest[t, j] - starts[e] == int(np.sum(np.asarray(experts)[:t] == e))
    assert np.sum(row_token < 4) == 8  # every assignment placed exactly once, the rest are padding


@pytest.mark.parametrize("tokens,top_k,num_experts,m_aligned", [(300, 4, 64, 64), (97, 2, 8, 1), (50, 8, 128, 16),
                                                                  (1, 1, 3, 256)])
@pytest.mark.parametrize("by_sort", [False, True])
def test_route_matches_a_stable_sort(tokens, top_k, num_experts, m_aligned, by_sort, monkeypatch):
    """route's grouping (a cumsum of one-hot rows; past RANK_BY_COUNTING_MAX elements a stable sort) against numpy's
    stable argsort of the expert ids, on random ids (repeats inside a token, empty experts)."""
    if by_sort:
        monkeypatch.setattr(nn.routing, "RANK_BY_COUNTING_MAX", 0)
    rng = np.random.default_rng(tokens)
    experts = rng.integers(0, num_experts, (tokens, top_k)).astype(np.int32)
    plan = nn.route(jnp.asarray(experts), num_experts, m_aligned=m_aligned)
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts)
    padded = -(-counts // m_aligned) * m_aligned
    ends = np.cumsum(padded)
    dest = np.empty_like(flat)
    dest[order] = (ends - padded)[flat[order]] + np.arange(flat.size) - (np.cumsum(counts) - counts)[flat[order]]
    row_token = np.full(nn.permuted_rows(tokens, top_k, num_experts, m_aligned), tokens, np.int32)
    row_token[dest] = np.arange(flat.size) // top_k
    np.testing.assert_array_equal(np.asarray(plan.padded_offsets), ends)
    np.testing.assert_array_equal(np.asarray(plan.dest_row), dest.reshape(tokens, top_k))
    np.testing.assert_array_equal(np.asarray(plan.row_token), row_token)


def test_default_layout_pads_groups_to_64_rows():
    """The layer's buffer holds the routed rows plus at most 63 per expert: 512 tokens, top-2, 64 experts -> 5056
    rows (padding-free: 1024; cuDNN's 256-padded worst case: 17408)."""
    assert nn.permuted_rows(512, 2, 64) == 5056
    assert nn.permuted_rows(512, 2, 64, m_aligned=1) == 1024
    assert nn.permuted_rows(512, 2, 64, m_aligned=256) == 17408
    assert nn.permuted_rows(1001, 3, 8, m_aligned=1) == 3008


def test_permute_unpermute_roundtrip():
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (40, 16))
    experts, weights = nn.top_k_gating(jax.random.normal(jax.random.PRNGKey(1), (40, 6)), 2)
    plan = nn.route(experts, 6)
    x_perm, prob = nn.permute(x, weights, plan)
    np.testing.assert_allclose(np.sum(np.asarray(prob)), 40.0, rtol=1e-5)  # normalized top-k weights
    back = nn.unpermute(x_perm * prob[:, None], plan, 40)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [2, 3])
def test_permute_unpermute_grads_are_gathers(top_k):
    """permute / unpermute have hand-written gradients (gathers through the inverse map): they must equal jax.grad
    of the plain formulation (a gather and a scatter-add), and no scatter-add may be left in either direction."""
    tokens, hidden, experts_n = 50, 16, 5
    x = jax.random.normal(jax.random.PRNGKey(2), (tokens, hidden))
    experts, weights = nn.top_k_gating(jax.random.normal(jax.random.PRNGKey(3), (tokens, experts_n)), top_k)
    plan = nn.route(experts, experts_n)
    scale = jax.random.normal(jax.random.PRNGKey(4), (plan.row_token.shape[0], hidden))

    def ours(x):
        x_perm, prob = nn.permute(x, weights, plan)
        return jnp.sum(nn.unpermute(jnp.tanh(x_perm * scale) * prob[:, None], plan, tokens) ** 2)

    def plain(x):
        x_perm = jnp.concatenate([x, jnp.zeros((1, hidden))])[plan.row_token]
        prob = jnp.zeros((plan.row_token.shape[0],)).at[plan.dest_row.reshape(-1)].set(weights.reshape(-1))
        y = jnp.zeros((tokens, hidden)).at[plan.row_token].add(jnp.tanh(x_perm * scale) * prob[:, None], mode="drop")
        return jnp.sum(y ** 2)

    np.testing.assert_allclose(ours(x), plain(x), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(plain)(x), rtol=1e-5, atol=1e-6)
    hlo = jax.jit(jax.value_and_grad(ours)).lower(x).as_text()
    adds = [line for line in hlo.splitlines() if "stablehlo.scatter" in line]
    assert len(adds) == 1, "only prob's scatter-set (m floats) may remain; the (m, H) rows must move by gathers"


def _plain_mlp(x_perm, w1, w2, prob, b1, offsets, act, glu_limit=None):
    """The same expert MLP in plain jnp f32 (differentiated by jax.grad)."""
    x = x_perm.astype(jnp.float32)
    rows = jnp.arange(x.shape[0])
    group = jnp.searchsorted(offsets, rows, side="right")
    in_group = group < w1.shape[0]
    g = jnp.minimum(group, w1.shape[0] - 1)
    c = jnp.einsum("mk,mnk->mn", x, w1.astype(jnp.float32)[g], precision="highest")
    if b1 is not None:
        c = c + b1.astype(jnp.float32)[g]
    if act == "srelu":
        h = jnp.maximum(c, 0.0) ** 2
    else:  # the float64 oracle's GLU formula (tests/np_ops.py), in jnp; an unknown act raises
        blocks = c.reshape(c.shape[0], -1, 2, 32)
        options = dict(glu_limit=glu_limit)
        h = np_glu_value(blocks[:, :, 0], blocks[:, :, 1], act, options, xp=jnp).reshape(c.shape[0], -1)
    h = h * prob[:, None] * in_group[:, None]
    return jnp.einsum("mi,mhi->mh", h, w2.astype(jnp.float32)[g], precision="highest")


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("act, bias, glu_limit", [("swiglu", False, None), ("geglu", True, None),
                                                  ("srelu", True, None), ("swiglu", True, 2.5),
                                                  ("gpt_oss_swiglu", True, None), ("gpt_oss_swiglu", False, 3.0)])
def test_moe_mlp_gradients_match_plain_jnp(act, bias, glu_limit):
    num_experts, hidden, inter = 4, 64, 64
    offsets = jnp.array([256, 256, 768, 1024], jnp.int32)  # an empty expert; rows 1024.. outside every group
    m = 1280
    keys = jax.random.split(jax.random.PRNGKey(7), 6)
    fc1_out = inter if act == "srelu" else 2 * inter
    x = jax.random.normal(keys[0], (m, hidden)).astype(jnp.bfloat16)
    w1 = (jax.random.normal(keys[1], (num_experts, fc1_out, hidden)) / 8).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (num_experts, hidden, inter)) / 8).astype(jnp.bfloat16)
    prob = jax.random.uniform(keys[3], (m,), minval=0.1, maxval=1.0)
    b1 = (0.1 * jax.random.normal(keys[4], (num_experts, fc1_out))).astype(jnp.bfloat16) if bias else None
    cot = jax.random.normal(keys[5], (m, hidden))

    def ours(x, w1, w2, prob, b1):
        y = nn.moe_mlp(x, w1, w2, prob, b1, offsets, act, glu_limit)
        return jnp.sum(y.astype(jnp.float32) * cot)

    def plain(x, w1, w2, prob, b1):
        return jnp.sum(_plain_mlp(x, w1, w2, prob, b1, offsets, act, glu_limit) * cot)

    argnums = (0, 1, 2, 3, 4) if bias else (0, 1, 2, 3)
    got = jax.jit(jax.grad(ours, argnums=argnums))(x, w1, w2, prob, b1)
    want = jax.grad(plain, argnums=argnums)(x, w1, w2, prob, b1)
    for name, g, w in zip(("dx", "dw1", "dw2", "dprob", "db1"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        err = _rel_err(g, w)
        # bf16 storage of C, h, dC and the outputs bounds the error at a few bf16 ulps (2^-8) in norm.
        assert err < 2e-2, f"{name}: relative error {err:.3e}"
    np.testing.assert_array_equal(np.asarray(got[0], np.float32)[1024:], 0.0)  # rows outside every group


def test_moe_layer_router_gradient_matches_plain_jnp():
    tokens, hidden, inter, num_experts = 96, 64, 64, 4
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    x = jax.random.normal(keys[0], (tokens, hidden)).astype(jnp.bfloat16)
    router = jax.random.normal(keys[1], (hidden, num_experts)) / 8
    w1 = (jax.random.normal(keys[2], (num_experts, 2 * inter, hidden)) / 8).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[3], (num_experts, hidden, inter)) / 8).astype(jnp.bfloat16)
    cot = jax.random.normal(keys[4], (tokens, hidden))

    def ours(router, w1):
        y, _ = nn.moe_layer(x, router, w1, w2, top_k=2)
        return jnp.sum(y.astype(jnp.float32) * cot)

    def plain(router, w1):
        with_plain = lambda xp, a, b, p, bias, off, act, lim, m_aligned: _plain_mlp(xp, a, b, p, bias, off, act, lim)
        original = moe_module.moe_mlp
        moe_module.moe_mlp = with_plain
        try:
            y, _ = nn.moe_layer(x, router, w1, w2, top_k=2)
        finally:
            moe_module.moe_mlp = original
        return jnp.sum(y.astype(jnp.float32) * cot)

    got = jax.jit(jax.grad(ours, argnums=(0, 1)))(router, w1)
    want = jax.grad(plain, argnums=(0, 1))(router, w1)
    for g, w in zip(got, want):
        assert _rel_err(g, w) < 2e-2


@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_framework_modules_train_step(framework):
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 64)).astype(jnp.bfloat16)
    if framework == "flax":
        nnx = pytest.importorskip("flax.nnx")
        model = nn.FlaxMoE(64, 64, 4, rngs=nnx.Rngs(0), bias=True)
        loss = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)
        value, grads = nnx.value_and_grad(loss)(model)
        leaves = jax.tree_util.tree_leaves(nnx.state(grads))
        direct = nn.moe_layer(x, model.router[...], model.w1[...], model.w2[...], model.b1[...])[0]
    else:
        eqx = pytest.importorskip("equinox")
        model = nn.EquinoxMoE(64, 64, 4, key=jax.random.PRNGKey(0), act="srelu")
        loss = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)
        leaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array))
        direct = nn.moe_layer(x, model.router, model.w1, model.w2, act="srelu")[0]
    np.testing.assert_allclose(float(value), float(jnp.mean(direct.astype(jnp.float32) ** 2)), rtol=1e-5)
    assert len(leaves) >= 3 and all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in leaves)
    assert any(float(jnp.linalg.norm(g.astype(jnp.float32))) > 0 for g in leaves)


def test_moe_mlp_rejects_bad_static_options():
    x = jnp.zeros((256, 64), jnp.bfloat16)
    w1, w2 = jnp.zeros((1, 128, 64), jnp.bfloat16), jnp.zeros((1, 64, 64), jnp.bfloat16)
    prob, offsets = jnp.ones((256,)), jnp.array([256], jnp.int32)
    with pytest.raises(ValueError, match="act='relu'"):
        nn.moe_mlp(x, w1, w2, prob, None, offsets, "relu")
    with pytest.raises(ValueError, match="glu_limit"):                 # would be silently ignored
        nn.moe_mlp(x, w1[:, :64], w2, prob, None, offsets, "srelu", 1.0)


@pytest.mark.parametrize("name,package", [("FlaxMoE", "flax"), ("EquinoxMoE", "equinox")])
def test_framework_module_class_is_created_once(name, package):
    pytest.importorskip(package)
    assert getattr(nn, name) is getattr(nn, name)       # isinstance checks and pytree treedefs rely on it


# ---------------------------------------------------------------------------------------------------------------
# What a first user hits: batched tokens, errors in their own argument names, checkpoint gate/up layouts

def _layer_params(key, num_experts=4, hidden=64, inter=64, act="swiglu"):
    keys = jax.random.split(jax.random.PRNGKey(key), 3)
    fc1_out = inter if act == "srelu" else 2 * inter
    router = jax.random.normal(keys[0], (hidden, num_experts)) / 8
    w1 = (jax.random.normal(keys[1], (num_experts, fc1_out, hidden)) / 8).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (num_experts, hidden, inter)) / 8).astype(jnp.bfloat16)
    return router, w1, w2


def test_moe_layer_takes_batched_tokens_and_differentiates():
    router, w1, w2 = _layer_params(5)
    x = jax.random.normal(jax.random.PRNGKey(6), (2, 3, 16, 64)).astype(jnp.bfloat16)
    y, aux = nn.moe_layer(x, router, w1, w2)
    flat, flat_aux = nn.moe_layer(x.reshape(-1, 64), router, w1, w2)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(flat, np.float32).reshape(x.shape))
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]), np.asarray(flat_aux["expert_load"]))

    def loss(x, w1):
        return jnp.sum(nn.moe_layer(x, router, w1, w2)[0].astype(jnp.float32) ** 2)

    dx, dw1 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w1)
    dx_flat, dw1_flat = jax.jit(jax.grad(loss, argnums=(0, 1)))(x.reshape(-1, 64), w1)
    assert dx.shape == x.shape and dw1.shape == w1.shape
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_flat, np.float32).reshape(x.shape))
    np.testing.assert_array_equal(np.asarray(dw1, np.float32), np.asarray(dw1_flat, np.float32))


@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_framework_modules_take_batched_tokens_and_read_well(framework):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 24, 64)).astype(jnp.bfloat16)
    if framework == "flax":
        nnx = pytest.importorskip("flax.nnx")
        cls = nn.FlaxMoE
        model = cls(64, 64, 4, rngs=nnx.Rngs(0))
    else:
        pytest.importorskip("equinox")
        cls = nn.EquinoxMoE
        model = cls(64, 64, 4, key=jax.random.PRNGKey(0))
        assert repr(model).startswith("EquinoxMoE(")
    assert cls.__qualname__ == cls.__name__ and cls.__module__ == "cudnn_moe_jax.nn"
    assert "(..., H)" in cls.__call__.__doc__
    y = model(x)
    assert y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(model(x.reshape(-1, 64)), np.float32).reshape(x.shape))


BAD_LAYER_ARGS = [
    # (description, change to (x, router, w1, w2, b1), exception, fragments the message must contain)
    ("x int32", lambda x, r, w1, w2, b1: (x.astype(jnp.int32), r, w1, w2, b1), TypeError,
     ["x: compute dtype int32", "x.astype(jnp.bfloat16)"]),
    ("x a vector", lambda x, r, w1, w2, b1: (x[0, 0], r, w1, w2, b1), ValueError, ["x must have shape (..., H)"]),
    ("w1 wrong H", lambda x, r, w1, w2, b1: (x, r, w1[:, :, :32], w2, b1), ValueError,
     ["w1 must have shape (L, 2I, H)", "interleave_glu_weights", "H=64"]),
    ("w1 2I not a multiple of 64", lambda x, r, w1, w2, b1: (x, r, w1[:, :96], w2, b1), ValueError,
     ["w1 (4, 96, 64)", "2I=96"]),
    ("w2 transposed", lambda x, r, w1, w2, b1: (x, r, w1, jnp.swapaxes(w2, 1, 2)[:, :32], b1), ValueError,
     ["w2 must have shape (L, H, I) = (4, 64, 64)"]),
    ("w2 other dtype", lambda x, r, w1, w2, b1: (x, r, w1, w2.astype(jnp.float16), b1), TypeError,
     ["w2 (float16) must have x's dtype (bfloat16)"]),
    ("b1 halves", lambda x, r, w1, w2, b1: (x, r, w1, w2, b1[:, :64]), ValueError,
     ["b1 must have shape (L, 2I) = (4, 128)"]),
    ("router transposed", lambda x, r, w1, w2, b1: (x, r.T, w1, w2, b1), ValueError,
     ["router_weight must have shape (H, L) = (64, 4)"]),
]


@pytest.mark.parametrize("case", BAD_LAYER_ARGS, ids=[c[0] for c in BAD_LAYER_ARGS])
def test_nn_errors_name_the_users_arguments(case):
    _, change, exc, fragments = case
    router, w1, w2 = _layer_params(8)
    x = jnp.zeros((2, 16, 64), jnp.bfloat16)
    b1 = jnp.zeros((4, 128), jnp.bfloat16)
    with pytest.raises(exc) as info:
        nn.moe_layer(*change(x, router, w1, w2, b1))
    message = str(info.value)
    assert all(f in message for f in fragments), message
    assert "a_tensor" not in message and "b_tensor" not in message, message


def test_moe_mlp_errors_name_its_arguments():
    router, w1, w2 = _layer_params(9)
    x = jnp.zeros((512, 64), jnp.bfloat16)
    prob, offsets = jnp.ones((512,)), jnp.array([256, 256, 512, 512], jnp.int32)
    for args, fragment in (((x[:300], w1, w2, prob[:300], None, offsets), "x_perm must have shape (m, H) with m a "
                                                                           "multiple of 64"),
                           ((x, w1, w2, prob[:256], None, offsets), "prob must have shape (m,) = (512,)"),
                           ((x, w1, w2, prob, None, offsets[:2]), "padded_offsets must have shape (L,) = (4,)"),
                           ((x, w1[:, :, :32], w2, prob, None, offsets), "x_perm's last dimension")):
        with pytest.raises(ValueError) as info:
            nn.moe_mlp(*args)
        assert fragment in str(info.value), str(info.value)


def test_glu_weight_interleave_roundtrip_and_meaning():
    """A checkpoint's [gate; up] halves, interleaved, give the MLP the checkpoint means: silu(x Wg^T) * (x Wu^T)."""
    num_experts, hidden, inter = 2, 64, 96
    keys = jax.random.split(jax.random.PRNGKey(10), 5)
    w_gate_up = (jax.random.normal(keys[0], (num_experts, 2 * inter, hidden)) / 8).astype(jnp.bfloat16)
    b_gate_up = (jax.random.normal(keys[1], (num_experts, 2 * inter)) / 8).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (num_experts, hidden, inter)) / 8).astype(jnp.bfloat16)
    w1 = nn.interleave_glu_weights(w_gate_up)
    b1 = nn.interleave_glu_weights(b_gate_up)
    np.testing.assert_array_equal(np.asarray(nn.deinterleave_glu_weights(w1)), np.asarray(w_gate_up))
    np.testing.assert_array_equal(np.asarray(nn.deinterleave_glu_weights(b1)), np.asarray(b_gate_up))
    np.testing.assert_array_equal(np.asarray(w1[1, 32:64]), np.asarray(w_gate_up[1, inter:inter + 32]))  # up block 0
    # other axes: one expert (2I, H) along 0, a transposed (L, H, 2I) store along -1
    np.testing.assert_array_equal(np.asarray(nn.interleave_glu_weights(w_gate_up[0], axis=0)), np.asarray(w1[0]))
    np.testing.assert_array_equal(np.asarray(nn.interleave_glu_weights(jnp.swapaxes(w_gate_up, 1, 2), axis=-1)),
                                  np.asarray(jnp.swapaxes(w1, 1, 2)))
    x = jax.random.normal(keys[3], (256 * num_experts, hidden)).astype(jnp.bfloat16)
    offsets = jnp.array([256, 512], jnp.int32)
    prob = jnp.ones((512,))
    y = nn.moe_mlp(x, w1, w2, prob, b1, offsets)
    f32 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    want = np.zeros((512, hidden))
    for e in range(num_experts):
        xe = f32(x[256 * e: 256 * (e + 1)])
        pre = xe @ f32(w_gate_up[e]).T + f32(b_gate_up[e])
        gate, up = pre[:, :inter], pre[:, inter:]
        want[256 * e: 256 * (e + 1)] = (gate / (1 + np.exp(-gate)) * up) @ f32(w2[e]).T
    assert _rel_err(y, want) < 2e-2
    with pytest.raises(ValueError, match="multiple of 32"):
        nn.interleave_glu_weights(w_gate_up[:, :100])
