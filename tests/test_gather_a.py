"""Gathered A rows (`a_index`, docs/ops.md#gathered-a-rows), on CPU: each M-grouped op but the Hadamard one with
`a_index` equals the op on the gathered rows `a_eff` (a zero row where the index is outside [0, T)) bit for bit in
every output, eagerly and under jit; the errors; the problem's `a_rows`, the operand table's rows (A (T, K) of kind
"gathered_rows", "a_index" right after "padded_offsets"); and the lowering's module avals, which keep T symbolic
beside m, so one module serves every T.

No CUDA kernel is compiled here (the gathering kernel's tests are the GPU suites').
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_moe_jax as cmj
from cudnn_moe_jax import _lowering, _primitive, _runtime, formats, operands
from cudnn_moe_jax._problem import GATHER_OPS, Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import variants

T, M, K, N, L = 300, 512, 64, 128, 3      # T tokens, M GEMM rows (T != M), I = N / 2 for dglu
INT32 = np.iinfo(np.int32)
OFFSETS = {256: [256, 256, 512],          # expert 1 empty
           64: [64, 320, 448]}            # rows 448.. outside every group
E4M3 = "float8_e4m3fn"


def _random(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.PRNGKey(key), shape).astype(dtype)


def _index(seed=0, rows=M, tokens=T):
    """Mostly valid rows (repeats included), plus negative ones and ones >= T, the int32 extremes among them."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, tokens, rows).astype(np.int32)
    bad = rng.choice(rows, 24, replace=False)
    index[bad] = [-1, -7, INT32.min, tokens, tokens + 5, INT32.max] * 4
    return index


def _gathered(a, index):
    """The definition, in NumPy: row r is a[index[r]], a zero row where index[r] is outside [0, T)."""
    a, index = np.asarray(a), np.asarray(index)
    valid = (index >= 0) & (index < a.shape[0])
    return jnp.asarray(np.where(valid[:, None], a[np.clip(index, 0, a.shape[0] - 1)], np.zeros((), a.dtype)))


@pytest.fixture(scope="module")
def data():
    return dict(a=_random(1, (T, K)), b=_random(2, (L, N, K)), b_dgrad=_random(3, (L, N // 2, K)),
                prob=jax.random.uniform(jax.random.PRNGKey(4), (M,), minval=0.1, maxval=1.0),
                alpha=jnp.array([1.0, 2.0, 0.5], jnp.float32), bias=_random(5, (L, N), jnp.float32),
                c_glu=_random(6, (M, N)), c_srelu=_random(7, (M, N // 2)), c_f32=_random(8, (M, N), jnp.float32),
                index=jnp.asarray(_index()))


def _ops(x, aligned):
    """op name -> call(a, **kw): each op with the options that give it the most outputs at this m_aligned (FP8 D
    and its scale factors need 256, the default: then the call does not name it)."""
    off = jnp.asarray(OFFSETS[aligned], jnp.int32)
    gemm = dict(padded_offsets=off, alpha_tensor=x["alpha"], prob_tensor=x["prob"])
    gemm.update({} if aligned == 256 else {"m_aligned": aligned})
    fp8 = dict(d_dtype=E4M3, norm_const_tensor=jnp.array([0.5], jnp.float32)) if aligned == 256 else {}
    return {
        "quant": lambda a, **kw: cmj.grouped_gemm_quant(a, x["b"], bias_tensor=x["bias"], compute_amax=True,
                                                        **gemm, **fp8, **kw),
        "srelu": lambda a, **kw: cmj.grouped_gemm_srelu(a, x["b"], c_dtype="float32", tanh_clamp_scale=3.0,
                                                        **gemm, **fp8, **kw),
        "glu": lambda a, **kw: cmj.grouped_gemm_glu(a, x["b"], bias_tensor=x["bias"], act_func="geglu",
                                                    glu_limit=2.0, **gemm, **kw),
        "dglu": lambda a, **kw: cmj.grouped_gemm_dglu(a, x["b_dgrad"], x["c_glu"], generate_dbias=True,
                                                      compute_amax=True, **gemm, **fp8, **kw),
        "dsrelu": lambda a, **kw: cmj.grouped_gemm_dsrelu(a, x["b_dgrad"], x["c_srelu"], generate_dbias=True,
                                                          dbias_dtype="float32", **gemm, **kw),
    }


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for key in got.keys():
        if want[key] is None:
            assert got[key] is None, key
            continue
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        assert jnp.array_equal(got[key], want[key], equal_nan=True), key


# ------------------------------------------------------------------------------------------------ the semantics

@pytest.mark.parametrize("aligned", sorted(OFFSETS))
@pytest.mark.parametrize("op", GATHER_OPS)
def test_gathered_rows_equal_the_op_on_the_gathered_a(data, op, aligned):
    call = _ops(data, aligned)[op]
    got = call(data["a"], a_index=data["index"])
    _assert_same(got, call(_gathered(data["a"], data["index"])))
    assert got[0].shape[0] == M and any(jnp.any(v != 0) for v in got.values() if v is not None)


@pytest.mark.parametrize("op", ["glu", "dsrelu"])
def test_gathered_rows_under_jit(data, op):
    call = _ops(data, 256)[op]
    jitted = jax.jit(lambda a, index: call(a, a_index=index))(data["a"], data["index"])
    _assert_same(jitted, call(_gathered(data["a"], data["index"])))


def test_fp16_discrete_weights_and_one_row(data):
    """fp16 operands, per-expert weights, and a one-row A (every valid index names it)."""
    a, b = data["a"].astype(jnp.float16), data["b"].astype(jnp.float16)
    off = jnp.asarray(OFFSETS[256], jnp.int32)
    for rows in (a, a[:1]):
        index = jnp.asarray(_index(seed=1, tokens=rows.shape[0]))
        got = cmj.grouped_gemm_quant(rows, b_tensors=list(b), padded_offsets=off, a_index=index, d_dtype="float32")
        _assert_same(got, cmj.grouped_gemm_quant(_gathered(rows, index), b_tensors=list(b), padded_offsets=off,
                                                 d_dtype="float32"))


def test_every_index_outside_gives_zero_rows(data):
    index = jnp.asarray(np.where(np.arange(M) % 2, -1, T), np.int32)
    out = cmj.grouped_gemm_quant(data["a"], data["b"], padded_offsets=jnp.asarray(OFFSETS[256]), a_index=index)
    assert not jnp.any(out.d_tensor) and not jnp.any(out.amax_tensor)


# ------------------------------------------------------------------------------------------------ the errors

def _quant(x, a=None, **kw):
    kw.setdefault("a_index", x["index"])
    return cmj.grouped_gemm_quant(x["a"] if a is None else a, kw.pop("b", x["b"]),
                                  padded_offsets=kw.pop("padded_offsets", jnp.asarray(OFFSETS[256])), **kw)


def test_a_index_dtype_and_shape_errors(data):
    index = data["index"]
    for wrong in (index.astype(jnp.float32), np.asarray(index, np.int16), np.asarray(index, np.uint32)):
        with pytest.raises(TypeError, match="a_index must be int32"):
            _quant(data, a_index=wrong)
    with pytest.raises(ValueError, match=r"a_index must have shape \(m,\)"):
        _quant(data, a_index=index.reshape(M, 1))
    with pytest.raises(ValueError, match=r"a_index: rows m=500 must be a positive multiple of 256"):
        _quant(data, a_index=index[:500])
    with pytest.raises(ValueError, match=r"a_index: rows m=0"):
        _quant(data, a_index=index[:0])
    with pytest.raises(ValueError, match="a_tensor: with a_index it must have at least one row"):
        _quant(data, a=data["a"][:0])


def test_shapes_follow_m_not_t(data):
    with pytest.raises(ValueError, match=rf"prob_tensor must have shape \({M},\)"):
        _quant(data, prob_tensor=jnp.ones((T,)))
    with pytest.raises(ValueError, match=rf"padded_offsets\[2\]={M + 256} is outside \[0, {M}\]"):
        _quant(data, padded_offsets=jnp.asarray([256, 512, M + 256], jnp.int32))
    with pytest.raises(ValueError, match=rf"c_tensor \(the saved forward pre-activation\) must have shape \({M}, "):
        cmj.grouped_gemm_dsrelu(data["a"], data["b_dgrad"], data["c_srelu"][:T], padded_offsets=jnp.asarray(
            OFFSETS[256]), a_index=data["index"])


def test_gathered_a_must_be_plain_16_bit(data):
    rule = r"a_index \(gathered A rows\) needs a plain 16-bit A"
    qa, sfa = formats.to_block_scaled(data["a"].astype(jnp.float32), "mxfp8")
    qb, sfb = formats.to_block_scaled(data["b"].astype(jnp.float32), "mxfp8")
    with pytest.raises(ValueError, match=rule + ".*got a_tensor float8_e4m3fn, b_tensor float8_e4m3fn"):
        _quant(data, a=qa, b=qb, sfa_tensor=sfa, sfb_tensor=sfb)
    with pytest.raises(ValueError, match=rule + ".*got a_tensor bfloat16, b_tensor float8_e4m3fn"):
        _quant(data, b=qb, sfb_tensor=sfb)                      # weight-only quantization
    with pytest.raises(ValueError, match=rule + ".*and an sfa_tensor"):
        _quant(data, sfa_tensor=sfa)
    with pytest.raises(ValueError, match=rule):
        cmj.grouped_gemm_dglu(qa, qb[:, :64], data["c_glu"], sfa, sfb, padded_offsets=jnp.asarray(OFFSETS[256]),
                              a_index=data["index"])


def test_the_hadamard_op_takes_no_gather(data):
    off = jnp.asarray(OFFSETS[256])
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['a_index'\]"):
        cmj.grouped_gemm_glu_hadamard_quant(data["a"], data["b"], padded_offsets=off, a_index=data["index"])
    with pytest.raises(ValueError, match="a_rows .* applies to the ops .*, not 'glu_hadamard_quant'"):
        GroupedGemmProblem(op="glu_hadamard_quant", m=M, n=N, k=K, num_groups=L, ab_dtype="bfloat16", a_rows=T)
    with pytest.raises(ValueError, match="b_rows .* applies to wgrad only, not 'glu'"):
        GroupedGemmProblem(op="glu", m=M, n=N, k=K, num_groups=L, ab_dtype="bfloat16", b_rows=T)


# ------------------------------------------------------------------------------------------------ wgrad

W_TOKENS, W_SRC = 256, 100      # the wgrad's token count T, the gathered operands' own token count


def _wgrad_data():
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    return dict(a=jax.random.normal(keys[0], (W_SRC, 128)).astype(jnp.bfloat16),        # (T_a, m_w) row-major
                b=jax.random.normal(keys[1], (W_SRC + 7, 64)).astype(jnp.bfloat16),     # (T_b, n_w)
                ia=jax.random.randint(keys[2], (W_TOKENS,), -3, W_SRC + 3, jnp.int32),
                ib=jax.random.randint(keys[3], (W_TOKENS,), -3, W_SRC + 10, jnp.int32),
                off=jnp.asarray([50, 50, 200, W_TOKENS], jnp.int32))


def _rows(x, index):
    valid = (index >= 0) & (index < x.shape[0])
    return jnp.where(valid[:, None], x[jnp.clip(index, 0, x.shape[0] - 1)], 0).astype(x.dtype)


@pytest.mark.parametrize("gathered", ["a", "b", "ab"])
def test_wgrad_gathered_tokens_equal_the_op_on_gathered_tokens(gathered):
    d = _wgrad_data()
    fill = jnp.arange(W_TOKENS, dtype=jnp.int32) % W_SRC
    a_rows, b_rows = _rows(d["a"], d["ia"] if "a" in gathered else fill), _rows(d["b"], d["ib"] if "b" in gathered
                                                                               else fill)
    kw = dict(wgrad_dtype="float32", a_major="m", b_major="n")
    if "a" in gathered:
        kw["a_index"] = d["ia"]
    if "b" in gathered:
        kw["b_index"] = d["ib"]
    got = jax.jit(lambda a, b: cmj.grouped_gemm_wgrad(a.T, b.T, d["off"], **kw)["wgrad_tensor"])(
        d["a"] if "a" in gathered else a_rows, d["b"] if "b" in gathered else b_rows)
    kw = {k: v for k, v in kw.items() if not k.endswith("_index")}
    want = cmj.grouped_gemm_wgrad(a_rows.T, b_rows.T, d["off"], **kw)["wgrad_tensor"]
    assert bool(jnp.any(want != 0)) and jnp.array_equal(got, want)


def test_wgrad_gather_rules():
    d = _wgrad_data()
    with pytest.raises(ValueError, match="a_index .* token-major .*a_major='m'"):
        cmj.grouped_gemm_wgrad(d["a"].T, d["a"].T, d["off"], a_index=d["ia"])
    with pytest.raises(ValueError, match="b_index .* token-major .*b_major='n'"):
        cmj.grouped_gemm_wgrad(d["b"].T, d["b"].T, d["off"], b_index=d["ib"], a_major="m")
    with pytest.raises(TypeError, match="b_index must be int32"):
        cmj.grouped_gemm_wgrad(d["b"].T, d["b"].T, d["off"], b_index=d["ib"].astype(jnp.int16), b_major="n")
    with pytest.raises(ValueError, match="one length"):
        cmj.grouped_gemm_wgrad(d["a"].T, d["b"].T, d["off"], a_index=d["ia"], b_index=d["ib"][:128], a_major="m",
                               b_major="n")
    with pytest.raises(ValueError, match="b_tensor: token count 107 does not match the token count 256 of a_index"):
        cmj.grouped_gemm_wgrad(d["a"].T, d["b"].T, d["off"], a_index=d["ia"], a_major="m", b_major="n")
    with pytest.raises(ValueError, match="a_index: K=250 must be a multiple of 8"):
        cmj.grouped_gemm_wgrad(d["a"].T, d["b"].T, d["off"], a_index=d["ia"][:250], b_index=d["ib"][:250],
                               a_major="m", b_major="n")


def test_wgrad_gathered_problem_keeps_its_token_counts_symbolic():
    p = GroupedGemmProblem(op="wgrad", m=128, n=64, k=W_TOKENS, num_groups=4, ab_dtype="bfloat16",
                           wgrad_dtype="float32", a_major="m", b_major="n", a_rows=W_SRC, b_rows=W_SRC + 7)
    names = operands.input_names(p)
    assert names[:5] == ("a", "b", "padded_offsets", "a_index", "b_index")
    assert operands.gathered_axes(p) == {"a": (1, "a_rows"), "b": (1, "b_rows")}
    canon = _lowering.canonical_problem(p)
    assert str(canon.a_rows) == "a_rows" and str(canon.b_rows) == "b_rows" and canon.a_rows.scope is canon.k.scope
    ins, _ = _lowering.grouped_gemm_avals(p, None, names, list(variants.input_avals(p).values()))
    got = dict(zip(names, (a.shape for a in ins)))
    assert got["a"] == (128, canon.a_rows) and got["b"] == (64, canon.b_rows) and got["a_index"] == (canon.k,)
    other = dataclasses.replace(p, k=512, a_rows=3, b_rows=9)
    assert _lowering.canonical_problem(other) == canon


# ------------------------------------------------------------------------------------------------ the operand table

def _problem(op="glu", m=M, a_rows=T, **kw):
    act = {"glu": "swiglu", "srelu": "srelu", "dglu": "dswiglu", "dsrelu": "dsrelu"}.get(op)
    c_dtype = None if op == "quant" else "bfloat16"
    epi = Epilogue(act=act, c_dtype=c_dtype, compute_amax=True,
                   dbias_dtype="float32" if op.startswith("d") else None)
    return GroupedGemmProblem(op=op, m=m, n=N, k=K, num_groups=L, ab_dtype="bfloat16", epilogue=epi, a_rows=a_rows,
                              **kw)


@pytest.mark.parametrize("discrete", [False, True])
@pytest.mark.parametrize("op", GATHER_OPS)
def test_operand_rows_of_a_gathered_problem(op, discrete):
    p = _problem(op, discrete_weights=discrete)
    plain = dataclasses.replace(p, a_rows=None)
    names = operands.input_names(p)
    assert names[names.index("padded_offsets") + 1] == "a_index"
    assert tuple(n for n in names if n != "a_index") == operands.input_names(plain)
    bound = {b.name: b for b in operands.inputs(p)}
    assert bound["a"] == operands.Bound("a", "gathered_rows", (T, K), "bfloat16")
    assert bound["a_index"] == operands.Bound("a_index", "m_vector", (M,), "int32")
    field, axes = operands.dynamic_axes(p)
    assert field == "m" and "a" not in axes and axes["a_index"] == (0, 1)
    assert operands.gathered_axes(p) == {"a": (0, "a_rows")}
    assert operands.output_specs(p) == operands.output_specs(plain)   # the outputs follow m
    assert "a_index" not in operands.input_names(plain) and operands.gathered_axes(plain) == {}
    assert operands.dynamic_axes(plain)[1]["a"] == (0, 1)


@pytest.mark.parametrize("aligned", sorted(OFFSETS))
@pytest.mark.parametrize("op", GATHER_OPS)
def test_public_ops_bind_the_gathered_problem_in_table_order(data, op, aligned):
    call = _ops(data, aligned)[op]
    jaxpr = jax.make_jaxpr(lambda a, index: call(a, a_index=index))(data["a"], data["index"])
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is _primitive.grouped_gemm_p]
    p = eqn.params["problem"]
    assert (p.op, p.m, p.a_rows, p.m_aligned) == (op, M, T, aligned)
    assert eqn.params["input_names"] == operands.input_names(p)
    assert [(v.aval.shape, str(v.aval.dtype)) for v in eqn.invars] == [
        (s, str(jnp.dtype(d))) for s, d in operands.input_specs(p).values()]


# ------------------------------------------------------------------------------------------------ the lowering

@pytest.mark.parametrize("op", ["quant", "glu", "srelu"])
def test_module_avals_keep_the_gathered_rows_symbolic(op):
    p = _problem(op)
    canon = _lowering.canonical_problem(p)
    rows, m = _runtime.symbolic_a_rows(p.m_aligned), _runtime.symbolic_m(p.m_aligned)
    assert canon.a_rows is rows and canon.m is m and str(rows) == "a_rows" and rows.scope is m.scope
    names, avals = operands.input_names(p), list(variants.input_avals(p).values())
    ins, outs = _lowering.grouped_gemm_avals(p, None, names, avals)
    got = {name: a.shape for name, a in zip(names, ins)}
    assert got["a"] == (rows, K) and got["a_index"] == (m,) and got["prob"] == (m,)
    assert [a.shape for a in ins] == [s for s, _ in operands.input_specs(canon).values()]
    assert outs == _lowering.launch_avals(canon, None)[0] and outs[0].shape == (m, N)
    sym = variants.symbolic_avals(p, m, {"a_rows": rows})
    assert [a.shape for a in sym.values()] == [a.shape for a in ins]
    bad = [jax.ShapeDtypeStruct((T + 1, K), jnp.bfloat16) if n == "a" else a for n, a in zip(names, avals)]
    with pytest.raises(_runtime.KernelUnavailable, match=rf"input a \({T + 1}, {K}\): axis 0 must be a_rows = {T}"):
        _lowering.grouped_gemm_avals(p, None, names, bad)


def test_one_module_serves_every_token_and_row_count():
    """Problems differing only in T (and m) have one canonical problem, hence one fingerprint; an ungathered
    problem is another module."""
    problems = [_problem("glu", m=m, a_rows=t) for m, t in ((M, T), (2 * M, 7), (M, 4096))]
    canon = {_lowering.canonical_problem(p) for p in problems}
    assert len(canon) == 1
    names = operands.input_names(problems[0])
    prints = {_lowering.grouped_gemm_fingerprint(p, names, None) for p in problems}
    assert len(prints) == 1
    plain = _problem("glu", a_rows=None)
    assert _lowering.grouped_gemm_fingerprint(plain, operands.input_names(plain), None) not in prints
    with pytest.raises(ValueError, match="operand table"):   # a binding without a_index is not this problem's
        _lowering.grouped_gemm_avals(problems[0], None, operands.input_names(plain),
                                     list(variants.input_avals(plain).values()))


# ------------------------------------------------------------------------------------------------ nn

@pytest.mark.parametrize("gather_x", [True, False])
def test_routed_mlp_is_the_permuted_mlp_bit_for_bit(gather_x, monkeypatch):
    """nn.moe.routed_mlp (the kernels read dY, and with gather_x x, through the row map) ==
    unpermute(moe_mlp(permute(x))), outputs and every gradient, bit for bit (here on the reference; the gathered kernels equal the kernels on the
    gathered rows, tests/gpu/test_gather_gpu.py)."""
    from cudnn_moe_jax.nn import moe, routing

    monkeypatch.setattr(moe, "GATHER_X_ROWS_PER_EXPERT", 1 << 20 if gather_x else 0)
    t, h, i, e, k = 96, 64, 64, 4, 2
    keys = jax.random.split(jax.random.PRNGKey(5), 6)
    x = jax.random.normal(keys[0], (t, h)).astype(jnp.bfloat16)
    w1 = (jax.random.normal(keys[1], (e, 2 * i, h)) / 8).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (e, h, i)) / 8).astype(jnp.bfloat16)
    b1 = jax.random.normal(keys[3], (e, 2 * i), jnp.float32)
    experts = jax.lax.top_k(jax.random.normal(keys[4], (t, e)), k)[1].astype(jnp.int32)
    weights = jax.random.uniform(keys[5], (t, k), minval=0.1, maxval=1.0)
    plan = routing.route(experts, e)

    def routed(x, w1, w2, b1, weights):
        prob = routing.permuted_prob(weights, plan)
        return moe.routed_mlp(x, w1, w2, prob, b1, plan).astype(jnp.float32).sum()

    def permuted(x, w1, w2, b1, weights):
        x_perm, prob = routing.permute(x, weights, plan)
        y_perm = moe.moe_mlp(x_perm, w1, w2, prob, b1, plan.padded_offsets)
        return routing.unpermute(y_perm, plan, t).astype(jnp.float32).sum()

    args = (x, w1, w2, b1, weights)
    got = jax.jit(jax.value_and_grad(routed, argnums=range(5)))(*args)
    want = jax.jit(jax.value_and_grad(permuted, argnums=range(5)))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and jnp.array_equal(g, w)
    assert bool(jnp.any(got[1][0] != 0))
