"""CPU: the dequantize-first route of block-scaled calls with many rows per expert (cudnn_moe_jax._dequant_first).

- the rule (`_dequant_first.dequantize_first`): by rows per expert and data width (wgrad: tokens per expert); never
  an fp16 A or a symbolic m / T;
- the CUDA lowering hands the kernel lowering the block-scaled problem staged in the kernel where the rule says so
  and the kernel stages it (forward and dgrad ops, K-major operands, stacked weights), the bf16 problem on XLA's
  conversion where it does not (an N-major B, discrete weights), the block-scaled problem itself otherwise or under an
  explicit Config, with no fallback to the reference; a staged launch's workspaces come after its outputs;
- the route's outputs equal the block-scaled reference's bit for bit on every case of the block-scaled GPU suites
  (forward and dgrad, every format, stacked and discrete weights; wgrad with segment scales, token-major operands,
  global scales, accumulation; exact, adversarial and special values).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import blockscaled_checks as checks  # noqa: E402  (tests/gpu on sys.path: tests/conftest.py)

from cudnn_moe_jax import _dequant_first, _lowering, _primitive, formats, operands  # noqa: E402
from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem  # noqa: E402
from cudnn_moe_jax.kernels.sm90 import config  # noqa: E402
from lab import blockscaled_cases as cases  # noqa: E402
from lab import wgrad_cases  # noqa: E402

E4M3, FP4, E8M0 = "float8_e4m3fn", "float4_e2m1fn", "float8_e8m0fnu"
GLU = Epilogue(act="swiglu", c_dtype="bfloat16")


def _problem(rows: int, data=E4M3, sf="float8_e8m0fnu", vec=32, groups=8, **kw):
    return GroupedGemmProblem(op=kw.pop("op", "glu"), m=rows * groups, n=512, k=512, num_groups=groups,
                              ab_dtype=data, sf_dtype=sf, sf_vec_size=vec, epilogue=kw.pop("epilogue", GLU), **kw)


def test_rule_by_rows_per_expert_and_width():
    fp8, fp4 = _dequant_first.DEQUANT_FIRST_ROWS["fp8"], _dequant_first.DEQUANT_FIRST_ROWS["fp4"]
    assert _dequant_first.dequantize_first(_problem(fp8))
    assert not _dequant_first.dequantize_first(_problem(fp8 - 128))
    assert _dequant_first.dequantize_first(_problem(fp4, FP4, "float8_e4m3fn", 16))
    assert not _dequant_first.dequantize_first(_problem(fp4 - 128, FP4, "float8_e4m3fn", 16))
    assert _dequant_first.dequantize_first(_problem(fp8, a_dtype="bfloat16"))            # weight-only, bf16 A
    assert not _dequant_first.dequantize_first(_problem(fp8, a_dtype="float16"))    # fp16 A: no exact 16-bit pair
    nvfp4 = (FP4, "float8_e4m3fn", 16)   # ... but with NVFP4 weights (e4m3 scales) fp16 holds them exactly
    assert _dequant_first.dequantize_first(_problem(fp4, *nvfp4, a_dtype="float16"))
    assert not _dequant_first.dequantize_first(_problem(fp4, FP4, "float8_e8m0fnu", 32, a_dtype="float16"))
    dglu = Epilogue(act="dswiglu", c_dtype="bfloat16")
    assert _dequant_first.dequantize_first(_problem(fp8, op="dglu", epilogue=dglu))
    assert not _dequant_first.dequantize_first(dataclasses.replace(_problem(fp8), sf_dtype=None, sf_vec_size=None,
                                                           ab_dtype="bfloat16"))
    assert not _dequant_first.dequantize_first(_lowering.canonical_problem(_problem(fp8)))    # m symbolic: a module's
    tokens = _dequant_first.DEQUANT_FIRST_TOKENS
    wgrad = GroupedGemmProblem(op="wgrad", m=512, n=512, k=tokens * 8, num_groups=8, ab_dtype=FP4,
                               sf_dtype="float8_e8m0fnu", sf_vec_size=32, wgrad_dtype="bfloat16")
    assert _dequant_first.dequantize_first(wgrad)
    assert not _dequant_first.dequantize_first(dataclasses.replace(wgrad, k=tokens * 8 - 64))
    assert not _dequant_first.dequantize_first(_lowering.canonical_problem(wgrad))    # T symbolic


def test_half_problem_keeps_the_op_and_epilogue():
    p = dataclasses.replace(_problem(2048, a_dtype="bfloat16"), b_major="n", m_aligned=128)
    q = _dequant_first.half_problem(p)
    assert (q.ab_dtype, q.sf_dtype, q.sf_vec_size, q.a_dtype, q.a_major, q.b_major) == (
        "bfloat16", None, None, None, "k", "n")     # an N-major B: read in place, as bf16 (no transposed copy)
    assert (q.op, q.m, q.n, q.k, q.num_groups, q.epilogue, q.m_aligned) == (p.op, p.m, p.n, p.k, p.num_groups,
                                                                          p.epilogue, p.m_aligned)
    assert config.supports(q) is None
    f16 = _dequant_first.half_problem(_problem(2048, FP4, "float8_e4m3fn", 16, a_dtype="float16"))
    assert (f16.ab_dtype, f16.a_dtype, f16.sf_dtype) == ("float16", None, None) and config.supports(f16) is None


def _lowered_problems(fn, args, monkeypatch):
    """The problems the CUDA lowering of jit(fn)(*args) hands the kernel lowering (recorded, then the reference)."""
    seen = []

    def record(problem, *a, **k):
        seen.append(problem)
        raise _lowering.KernelUnavailable("recorded")

    monkeypatch.setattr(_lowering, "kernel_lowering", record)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return seen


@pytest.mark.parametrize("rows", [256, 2048])
def test_cuda_lowering_takes_the_route_by_the_rule(rows, monkeypatch):
    from cudnn_moe_jax import formats

    import cudnn_moe_jax as cmj

    groups, n, k = 2, 256, 256
    key = jax.random.PRNGKey(0)
    a, sfa = formats.to_block_scaled(jax.random.normal(key, (rows * groups, k)), E4M3)
    b, sfb = formats.to_block_scaled(jax.random.normal(key, (groups, n, k)), E4M3)
    offsets = jnp.asarray(np.arange(1, groups + 1, dtype=np.int32) * rows)

    def glu(a, b, sfa, sfb, hints=None):
        kw = {} if hints is None else dict(mma_tiler_mn=(256, 128), cluster_shape_mn=(1, 1))
        return cmj.grouped_gemm_glu(a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb,
                                    padded_offsets=offsets, alpha_tensor=jnp.ones((groups,)),
                                    prob_tensor=jnp.ones((rows * groups,)), sf_vec_size=32, act_func="swiglu", **kw)

    for hints in (None, True):
        (seen,) = _lowered_problems(lambda *x: glu(*x, hints=hints), (a, b, sfa, sfb), monkeypatch)
        # a forward op past the rule is staged in the kernel (the same block-scaled problem, staged)
        assert seen.ab_dtype == E4M3 and seen.staged == (rows >= _dequant_first.DEQUANT_FIRST_ROWS["fp8"]), seen


def test_explicit_config_pins_the_dequantizing_kernel(monkeypatch):
    p = _problem(_dequant_first.DEQUANT_FIRST_ROWS["fp8"], groups=2)
    x = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in operands.input_specs(p).items()}
    for cfg, staged in ((None, True), (config.default_config(p), False)):
        (seen,) = _lowered_problems(lambda x, cfg=cfg: _primitive.bind(p, x, cfg), (x,), monkeypatch)
        assert (seen.ab_dtype, seen.staged) == (E4M3, staged)


def test_problems_the_kernel_does_not_stage_take_xla_route(monkeypatch):
    """An N-major B and discrete weights past the rule: XLA's conversion, then the bf16 problem."""
    rows = _dequant_first.DEQUANT_FIRST_ROWS["fp8"]
    for p in (dataclasses.replace(_problem(rows, groups=2), b_major="n"),
              dataclasses.replace(_problem(rows, groups=2), discrete_weights=True)):
        assert _dequant_first.staged_problem(p) is None
        specs = operands.input_specs(p)
        x = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in specs.items()}
        if p.discrete_weights:   # b:0, b:1, ... as one tuple, as the public ops bind them
            x = _primitive._regroup(list(specs), list(x.values()))
        seen = _lowered_problems(lambda x, p=p: _primitive.bind(p, x), (x,), monkeypatch)
        assert seen and all(q.ab_dtype == "bfloat16" and not q.staged for q in seen), seen


def test_staged_problem_where_the_kernel_stages_it():
    rows = _dequant_first.DEQUANT_FIRST_ROWS["fp4"]
    for p in (_problem(rows), _problem(rows, FP4, "float8_e4m3fn", 16), _problem(rows, a_dtype="bfloat16"),
              _problem(rows, op="quant", epilogue=Epilogue()), dataclasses.replace(_problem(rows), m_aligned=128),
              _problem(rows, op="dglu", epilogue=Epilogue(act="dswiglu", c_dtype="bfloat16", d_dtype="bfloat16")),
              _problem(rows, FP4, "float8_e4m3fn", 16, op="dsrelu",
                       epilogue=Epilogue(act="dsrelu", c_dtype="bfloat16", d_dtype="bfloat16"))):
        staged = _dequant_first.staged_problem(p)
        assert staged == dataclasses.replace(p, staged=True) and config.supports(staged) is None
    assert _dequant_first.staged_problem(_problem(rows, a_dtype="float16")) is None   # MXFP8: fp16 cannot hold B
    f16 = _problem(rows, FP4, "float8_e4m3fn", 16, a_dtype="float16")                   # NVFP4: it can
    assert _dequant_first.staged_problem(f16) == dataclasses.replace(f16, staged=True)
    assert "m_aligned" in config.supports(dataclasses.replace(_problem(rows), m_aligned=64, staged=True))
    assert "block-scaled" in config.supports(dataclasses.replace(_problem(rows), sf_dtype=None, sf_vec_size=None,
                                                                   ab_dtype="bfloat16", staged=True))


def test_staged_wgrad_by_layout_and_size():
    """The block-scaled wgrad past the token rule is staged: token-contiguous always, token-major FP8 where the GEMM
    does enough FLOPs per converted code (`STAGED_TOKEN_MAJOR_FLOPS_PER_CODE`: the fc step's W2, not `small`'s);
    token-major FP4 never (XLA's way)."""
    from cudnn_moe_jax._problem import GroupedGemmProblem

    def wgrad(m, n, data=E4M3, sf=E8M0, vec=32, **majors):
        return GroupedGemmProblem(op="wgrad", m=m, n=n, k=16384, num_groups=8, ab_dtype=data, sf_dtype=sf,
                                  sf_vec_size=vec, wgrad_dtype="bfloat16", **majors)

    tok = dict(a_major="m", b_major="n")
    for p in (wgrad(7168, 2048), wgrad(2048, 768), wgrad(7168, 2048, FP4, E8M0), wgrad(7168, 2048, **tok),
              wgrad(4096, 1024, **tok)):
        assert _dequant_first.dequantize_first(p)
        assert _dequant_first.staged_problem(p) == dataclasses.replace(p, staged=True)
    for p in (wgrad(2048, 768, **tok), wgrad(7168, 2048, FP4, E8M0, **tok)):
        assert _dequant_first.staged_problem(p) is None


def test_staged_launch_writes_its_workspaces_after_the_outputs():
    """A staged launch writes the op's outputs, then its bf16 workspaces and ready flags (A's only where a
    block-scaled A is staged in a workspace: a K tail, N > 4096, or `Config.dequant_a='workspace'`; else the
    kernel's consumers convert A in registers), which `finish` drops."""
    from cudnn_moe_jax.kernels.sm90.config import Config

    p = dataclasses.replace(_problem(1024, groups=2), staged=True)
    assert operands.staged_a_in_registers(p)
    assert [b.name for b in operands.launch_outputs(p)] == ["c", "d", "staged_b", "staged_b_flags"]
    workspace = Config(dequant_a="workspace")
    names = [b.name for b in operands.launch_outputs(p, workspace)]
    assert names == ["c", "d", "staged_a", "staged_a_flags", "staged_b", "staged_b_flags"]
    for q in (dataclasses.replace(p, k=p.k + 32), dataclasses.replace(p, n=4096 + 128)):   # K tail; N > 4096
        assert not operands.staged_a_in_registers(q)
        assert [b.name for b in operands.launch_outputs(q)] == names
    fp4 = dataclasses.replace(p, n=4096, ab_dtype=FP4, sf_dtype="float8_e4m3fn", sf_vec_size=16)
    assert operands.staged_a_in_registers(fp4) and not operands.staged_a_in_registers(dataclasses.replace(fp4, n=4224))
    shapes = {b.name: b.shape for b in operands.launch_outputs(p, workspace)}
    assert shapes["staged_a"] == (p.m, p.k) and shapes["staged_b"] == (2, p.n, p.k)
    # the job counter, then 2 experts x 4 row blocks x 1 chunk
    assert shapes["staged_b_flags"] == (1 + 2 * 4 * 1,)
    w = dataclasses.replace(p, a_dtype="bfloat16")
    assert [b.name for b in operands.launch_outputs(w, workspace)] == ["c", "d", "staged_b", "staged_b_flags"]
    dtypes = {b.name: b.dtype for b in operands.launch_outputs(p, workspace)}
    assert dtypes["staged_a"] == dtypes["staged_b"] == "bfloat16"
    w16 = dataclasses.replace(p, ab_dtype=FP4, sf_dtype="float8_e4m3fn", sf_vec_size=16, a_dtype="float16")
    assert {b.name: b.dtype for b in operands.launch_outputs(w16)}["staged_b"] == "float16"   # for the fp16 kernel
    outs = [np.zeros(1)] * len(names)
    assert len(operands.finish(p)(outs, {})) == 2


def _spy_bind(monkeypatch):
    calls = []
    original = _primitive.bind

    def spy(problem, inputs, config=None):
        calls.append((problem, dict(inputs)))
        return original(problem, inputs, config)

    monkeypatch.setattr(_primitive, "bind", spy)
    return calls


ROUTED = [c for c in cases.ALL_CASES if cases.a_half(c[2]) is not jnp.float16
          or formats.exact_in_float16(*cases.FORMATS[c[2]][:2])]   # fp16 A: where fp16 holds B


@pytest.mark.parametrize("mode", ["exact", "specials"])
@pytest.mark.parametrize("case", ROUTED, ids=[c[0] for c in ROUTED])
def test_route_equals_the_block_scaled_reference(case, mode, monkeypatch):
    """On the CPU (the reference backend) the route's bf16 problem on dequantized operands gives the block-scaled
    problem's outputs bit for bit (NaN where NaN): the conversion is exact and the math the same."""
    x = checks.inputs(case, mode=mode)
    calls = _spy_bind(monkeypatch)
    for discrete in (False, True):
        xx = cases.expert_lists(x) if discrete else x
        want = cases.call(case, xx, discrete=discrete)
        problem, inputs = calls[-1]
        got = _primitive.bind_dequantized(problem, inputs)
        for key, value in want.items():
            if value is None:
                assert got[key] is None, key
                continue
            w, g = np.asarray(value), np.asarray(got[key])
            assert g.dtype.itemsize == w.dtype.itemsize and g.shape == w.shape, key   # SF: bytes or typed
            same = (g.view(np.uint8) == w.view(np.uint8)) if w.dtype.itemsize == 1 else (
                (g == w) | (np.isnan(g.astype(np.float32)) & np.isnan(w.astype(np.float32))))
            assert same.all(), (key, int((~same).sum()), same.size)


@pytest.mark.parametrize("mode", ["exact", "specials"])
@pytest.mark.parametrize("case", wgrad_cases.BS_CASES, ids=[c[0] for c in wgrad_cases.BS_CASES])
def test_wgrad_route_equals_the_block_scaled_reference(case, mode, monkeypatch):
    """The weight gradient's route (segment-scaled token operands converted by XLA) on the CPU: W bit for bit."""
    x = wgrad_cases.bs_run_inputs(case, "unaligned" if mode == "exact" else "a8", mode, None)
    calls = _spy_bind(monkeypatch)
    want = np.asarray(wgrad_cases.bs_call(case, x).wgrad_tensor)
    problem, inputs = calls[-1]
    got = np.asarray(_primitive.bind_dequantized(problem, inputs)["wgrad_tensor"])
    same = (got == want) | (np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
    assert got.dtype == want.dtype and same.all(), int((~same).sum())
