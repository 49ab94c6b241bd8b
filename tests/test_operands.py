"""The operand table (cudnn_moe_jax/operands.py) and everything derived from it, on CPU: what the public ops bind,
the primitive's output avals, the dynamic axes, the kernels' launcher operands, TensorSpecs and unpacking, the
aot variants' avals; a binding whose names are not the table's is an error naming both lists."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_moe_jax as cmj
from cudnn_moe_jax import _lowering, _primitive, _runtime, formats, operands
from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.limits import GROUP_ALIGN, TOKEN_ALIGN
from cudnn_moe_jax.kernels.sm90 import config as sm90_config
from cudnn_moe_jax.kernels.sm90 import operands as launcher
from cudnn_moe_jax.kernels.sm90 import variants

BF, F16, F32, E4M3, E5M2, FP4 = "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"
try:
    HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None
except ImportError:
    HAVE_CUTLASS = False


def _dgrad(op, act, ab=BF, **epi):
    return GroupedGemmProblem(op=op, m=1024, n=256, k=128, num_groups=3, ab_dtype=ab, epilogue=Epilogue(act=act, **epi))


def _wgrad(**kw):
    return GroupedGemmProblem(op="wgrad", m=384, n=320, k=kw.pop("k", 2000), num_groups=5,
                              ab_dtype=kw.pop("ab", BF), wgrad_dtype=kw.pop("wgrad_dtype", BF), **kw)


KERNEL_PROBLEMS = variants.problems() + variants.problems((4096, 1024, 512, 8), mxfp8=False) + [
    _dgrad("dsrelu", "dsrelu", c_dtype=BF, d_dtype=BF, compute_amax=True, dbias_dtype=F32),
    _dgrad("dsrelu", "dsrelu", c_dtype=F32, d_dtype=BF, tanh_clamp_scale=2.0, has_prob=False),
    _dgrad("dglu", "dgeglu", ab=F16, c_dtype=F32, d_dtype=F32, dbias_dtype=BF),
    _dgrad("dglu", "dswiglu", c_dtype=BF, d_dtype=E4M3, generate_sfd=True, compute_amax=True, dbias_dtype=F32),
    _dgrad("dsrelu", "dsrelu", c_dtype=E5M2, d_dtype=E5M2, generate_sfd=True, discrete_col_sfd=True),
    _wgrad(),
    _wgrad(ab=F16, wgrad_dtype=F32, a_major="m", b_major="n"),
    _wgrad(accumulate=True, has_global_scales=True),
    _wgrad(ab=E4M3, sf_dtype="float8_e8m0fnu", sf_vec_size=32, k=512),
    _wgrad(ab=FP4, sf_dtype=E4M3, sf_vec_size=16, k=512, has_global_scales=True, accumulate=True),
    _wgrad(ab=E4M3, sf_dtype="float8_e8m0fnu", sf_vec_size=32, k=512, a_major="m", b_major="n"),
]
# Problems no sm90 kernel takes: the table still describes them (the reference runs them).
OTHER_PROBLEMS = [
    GroupedGemmProblem(op="glu_hadamard_quant", m=512, n=512, k=128, num_groups=2, ab_dtype=BF,
                       epilogue=Epilogue(act="swiglu", c_dtype=BF, d_dtype=d, rht=rht, rht_dtype=rdt,
                                         has_hadamard=rht is not None, compute_amax=d == BF))
    for d, rht, rdt in ((BF, None, None), (FP4, "rowwise", BF), (BF, "rowwise", FP4), (FP4, "colwise", FP4))
] + [
    GroupedGemmProblem(op="glu", m=512, n=256, k=128, num_groups=3, ab_dtype=FP4, sf_dtype=E4M3, sf_vec_size=16,
                       discrete_weights=True, epilogue=Epilogue(act="geglu", c_dtype=BF, d_dtype=BF)),
]


def _at(problem, extent):
    field, _ = operands.dynamic_axes(problem)
    return dataclasses.replace(problem, **{field: extent})


@pytest.mark.parametrize("p", KERNEL_PROBLEMS + OTHER_PROBLEMS, ids=lambda p: f"{p.op}-{p.ab_dtype}")
def test_dynamic_axes_follow_the_shape_rules(p):
    """Each declared dynamic axis is the one axis whose extent follows m (wgrad: T) at `per` rows an index; the
    module's symbolic avals are the shape rules evaluated at the symbolic extent."""
    _, axes = operands.dynamic_axes(p)
    unit = 64 * TOKEN_ALIGN if p.op == "wgrad" else GROUP_ALIGN   # (wgrad's SF segments grow per 4 * vec tokens)
    one, two = operands.input_specs(_at(p, 4 * unit)), operands.input_specs(_at(p, 8 * unit))
    for name, (shape, _) in one.items():
        changed = [i for i, (x, y) in enumerate(zip(shape, two[name][0])) if x != y]
        if name in axes:
            axis, per = axes[name]
            assert changed == [axis] and shape[axis] == operands.axis_extent(per, 4 * unit), name
        else:
            assert not changed, name
    if p in KERNEL_PROBLEMS:
        canon = _lowering.canonical_problem(p)
        sym = variants.symbolic_avals(p, getattr(canon, operands.dynamic_axes(p)[0]))
        assert {k: (a.shape, str(a.dtype)) for k, a in sym.items()} == {
            k: (s, str(jnp.dtype(d))) for k, (s, d) in operands.input_specs(canon).items()}


@pytest.mark.parametrize("p", KERNEL_PROBLEMS, ids=lambda p: f"{p.op}-{p.ab_dtype}")
def test_kernel_side_lists_are_the_table(p):
    """launcher_operands, the aliases, the unpacking, input_avals and the runtime's launch avals: all the table's."""
    cfg = sm90_config.default_config(p)
    assert sm90_config.supports(p) is None
    ins, outs = launcher.launcher_operands(p, cfg)
    assert [n for n, _ in ins] == list(operands.input_names(p)) == list(variants.input_avals(p))
    launch = operands.launch_outputs(p, cfg)
    assert [(n, k) for n, k in outs] == [(b.name, b.kind) for b in launch]
    present = [k for k, v in operands.output_specs(p).items() if v is not None]
    assert len(launch) == len(present)
    for b, key in zip(launch, present):   # a launch output is the op's output, or its partial sums
        short = "d" if key == "d_row_tensor" else key.removesuffix("_tensor")
        assert b.name in (short, short + "_parts"), (b, key)
    assert [a.shape for a in variants.input_avals(p).values()] == [s for s, _ in operands.input_specs(p).values()]
    avals, finish = _runtime.launch_avals(p, cfg)
    assert [(a.shape, str(a.dtype)) for a in avals] == [(b.shape, str(jnp.dtype(b.dtype))) for b in launch]
    assert (finish is None) == (p.op not in ("dglu", "dsrelu"))
    # the launcher's unpacking: every tensor under its name; an aliased output is passed once, as its input
    aliases = launcher.input_output_aliases(p)
    assert aliases == ({len(ins) - 1: 0} if p.op == "wgrad" and p.accumulate else {})
    handed = [n for n, _ in ins] + [n for j, (n, _) in enumerate(outs) if j not in aliases.values()]
    named = launcher.unpack(p, [f"tensor:{n}" for n in handed])
    assert {k: v for k, v in named.items() if v is not None} == {n: f"tensor:{n}" for n in handed}
    for name in ("beta", "dprob_parts", "global_scale_a", "sfd_col", "bias"):   # what the kernel may look up
        assert name in named
    with pytest.raises(ValueError, match="expected"):
        launcher.unpack(p, handed[:-1])


@pytest.mark.skipif(not HAVE_CUTLASS, reason="needs the CuTe DSL compiler (cutlass.jax.TensorSpec)")
@pytest.mark.parametrize("p", KERNEL_PROBLEMS[::3], ids=lambda p: f"{p.op}-{p.ab_dtype}")
def test_tensor_specs_cover_the_launch_operands(p):
    from cudnn_moe_jax.kernels.sm90 import jax_bridge

    cfg = sm90_config.default_config(p)
    ins, outs = jax_bridge.tensor_specs(p, cfg)
    assert len(ins) == len(operands.inputs(p)) and len(outs) == len(operands.launch_outputs(p, cfg))
    for spec, b in zip(ins, operands.inputs(p)):
        assert bool(spec.static) == (b.kind in ("static", "weights")), b
        if b.kind == "rows":
            assert tuple(spec.divisibility) == (256, b.shape[1])


def test_output_rows_are_the_op_results_and_the_abstract_eval():
    for p in KERNEL_PROBLEMS + OTHER_PROBLEMS:
        specs = operands.output_specs(p)
        assert tuple(specs) == operands.output_keys(p.op)
        got = _primitive._abstract_eval(problem=p, input_names=(), config=None)
        assert [(a.shape, str(a.dtype)) for a in got] == [
            (s, str(jnp.dtype(d))) for s, d in (v for v in specs.values() if v is not None)]
    assert variants.INPUT_NAMES == operands.input_order("glu")
    assert operands.input_order("wgrad")[2] == "padded_offsets"   # one name for the group ends of every op


def _public_calls():
    """(name, thunk) of public op calls over a spread of operand sets."""
    r = np.random.default_rng(0)
    m, k, n, L = 512, 64, 128, 2
    a = jnp.asarray(r.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(r.standard_normal((L, n, k)), jnp.bfloat16)
    off, prob, nc = jnp.asarray([256, 512], jnp.int32), jnp.ones((m,), jnp.float32), jnp.ones((1,), jnp.float32)
    qa, sfa = formats.to_block_scaled(a.astype(jnp.float32), E4M3)
    qb, sfb = formats.to_block_scaled(b.astype(jnp.float32), E4M3)
    b2 = jnp.concatenate([b, b], 1)
    c = jnp.ones((m, n), jnp.bfloat16)
    tokens_a, tokens_b = jnp.ones((64, 512), jnp.bfloat16), jnp.ones((32, 512), jnp.bfloat16)
    return {
        "quant_bias": lambda: cmj.grouped_gemm_quant(a, b, padded_offsets=off, prob_tensor=prob,
                                                     bias_tensor=jnp.ones((L, n), jnp.float32)),
        "srelu_mxfp8_fp8d": lambda: cmj.grouped_gemm_srelu(qa, qb, sfa, sfb, off, prob_tensor=prob, d_dtype=E4M3,
                                                           norm_const_tensor=nc),
        "glu_discrete_mxfp8": lambda: cmj.grouped_gemm_glu(qa, b_tensors=[qb[0], qb[1]], sfa_tensor=sfa,
                                                           sfb_tensors=[sfb[:1], sfb[1:]], padded_offsets=off),
        "hadamard_colwise": lambda: cmj.grouped_gemm_glu_hadamard_quant(
            a, b2, padded_offsets=off, prob_tensor=prob, d_dtype=FP4, norm_const_tensor=nc, rht_mode="colwise",
            rht_norm_const_tensor=nc, hadamard_tensor=jnp.eye(16)),
        "dglu_fp8d_dbias": lambda: cmj.grouped_gemm_dglu(a, b[:, : n // 2], c, padded_offsets=off, prob_tensor=prob,
                                                         d_dtype=E4M3, norm_const_tensor=nc, generate_dbias=True),
        "dsrelu_no_prob": lambda: cmj.grouped_gemm_dsrelu(a, b, c, padded_offsets=off),
        "wgrad": lambda: cmj.grouped_gemm_wgrad(tokens_a, tokens_b, off),
        "wgrad_accumulate": lambda: cmj.grouped_gemm_wgrad(
            tokens_a, tokens_b, off, global_scale_a=jnp.ones((L,)), global_scale_b=jnp.ones((L,)),
            wgrad_tensor=jnp.ones((L, 64, 32), jnp.float32), accumulate_on_output=True),
    }


@pytest.mark.parametrize("name", list(_public_calls()))
def test_public_ops_bind_in_table_order(name):
    """What each public op binds: the table's names, avals and outputs (the ops' dicts are in any order)."""
    call = _public_calls()[name]
    jaxpr = jax.make_jaxpr(call)()
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is _primitive.grouped_gemm_p]
    p = eqn.params["problem"]
    assert eqn.params["input_names"] == operands.input_names(p)
    assert [(v.aval.shape, str(v.aval.dtype)) for v in eqn.invars] == [
        (s, str(jnp.dtype(d))) for s, d in operands.input_specs(p).values()]
    assert [(v.aval.shape, str(v.aval.dtype)) for v in eqn.outvars] == [
        (s, str(jnp.dtype(d))) for s, d in (v for v in operands.output_specs(p).values() if v is not None)]
    assert call().keys() == operands.output_keys(p.op)


def _quant():
    p = GroupedGemmProblem(op="quant", m=512, n=128, k=64, num_groups=2, ab_dtype=BF)
    avals = variants.input_avals(p)
    arrays = {name: jnp.ones(a.shape, a.dtype) for name, a in avals.items()}
    return p, arrays


def test_binding_order_is_checked_by_name():
    """A binding whose names are the table's in another order lowers to nothing, on every platform: a ValueError
    naming both lists (the kernels take their operands by position), not a silent reference fallback."""
    p, arrays = _quant()
    names = list(arrays)
    assert names == ["a", "b", "padded_offsets", "alpha", "prob"]
    swapped = ["a", "b", "alpha", "padded_offsets", "prob"]

    def bound(*xs):
        return _primitive.grouped_gemm_p.bind(*xs, problem=p, input_names=tuple(swapped), config=None)

    xs = [arrays[n] for n in swapped]
    want = r"bound as \['a', 'b', 'alpha', 'padded_offsets', 'prob'\].*orders.*\['a', 'b', 'padded_offsets', 'alpha'"
    with pytest.raises(ValueError, match=want):
        jax.jit(bound).lower(*xs)                                           # the reference lowering (CPU)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)                      # no fallback warning either
        with pytest.raises(ValueError, match=want):
            jax.jit(bound).trace(*xs).lower(lowering_platforms=("cuda",))   # the kernel lowering
    with pytest.raises(ValueError, match=want):                            # aot / a direct KernelSpec
        _runtime.grouped_gemm_spec(p, None, swapped, [arrays[n] for n in swapped])
    # the right order lowers
    jax.jit(lambda *xs: _primitive.grouped_gemm_p.bind(*xs, problem=p, input_names=tuple(names), config=None)
            ).lower(*[arrays[n] for n in names])


def test_bind_orders_by_the_table_and_checks_presence():
    p, arrays = _quant()
    reordered = dict(reversed(list(arrays.items())))
    np.testing.assert_array_equal(np.asarray(_primitive.bind(p, reordered)["d_tensor"], np.float32),
                                  np.asarray(_primitive.bind(p, arrays)["d_tensor"], np.float32))
    with pytest.raises(ValueError, match=r"inputs .* are not this problem's operands"):
        _primitive.bind(p, {**arrays, "prob": None})                       # has_prob, but no prob
    with pytest.raises(ValueError, match=r"inputs .* are not this problem's operands"):
        _primitive.bind(p, {**arrays, "bias": arrays["b"][:, :, 0]})       # a bias the problem does not have
