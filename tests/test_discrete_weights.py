"""CPU: discrete per-expert weights (`b_tensors` / `sfb_tensors`) on the sm90 kernels (kernels/sm90/experts.py).

- the support predicate routes every M-grouped op and input format with discrete weights to the kernel;
- the operand table: the experts bound one array each, the descriptor-table workspace launched last and dropped;
- the reference: the same call with stacked and with per-expert weights gives identical bytes;
- (CuTe DSL compiler) discrete kernels compile for sm_90a with bf16 wgmma (HGMMA) kept in flight, no local memory,
  the descriptor-table kernel beside the GEMM, the producer's acquire (UTMACCTL.IV) before its loads, and as many
  HGMMA as the stacked kernel; every GPU case (lab/discrete_cases.py: each op with b_tensors) lowers for CUDA to
  one kernel custom call with the fallback-to-the-reference warning turned into an error;
- the bundle items lower each case at exactly the GPU suite's input shapes and dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import numpy as np
import pytest

import blockscaled_checks as checks  # tests/gpu on sys.path (tests/conftest.py)
from runtime_helpers import custom_calls, needs_cutlass

from cudnn_moe_jax import operands
from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import config
from cudnn_moe_jax.kernels.sm90 import operands as launcher
from lab import blockscaled_cases as bc
from lab import discrete_cases as cases
from lab.sass import check_sass, compile_or_skip, cuobjdump, sass_of

BF, E4M3, E8M0 = "bfloat16", "float8_e4m3fn", "float8_e8m0fnu"
EPILOGUES = {"quant": Epilogue(d_dtype=BF), "srelu": Epilogue(act="srelu", c_dtype=BF),
             "glu": Epilogue(act="swiglu", c_dtype=BF), "dglu": Epilogue(act="dswiglu", c_dtype=BF),
             "dsrelu": Epilogue(act="dsrelu", c_dtype=BF)}


def _problem(op, fmt=(BF, None, None), **kw):
    data, sf, vec = fmt
    return GroupedGemmProblem(op=op, m=512, n=256, k=256, num_groups=3, ab_dtype=data, sf_dtype=sf, sf_vec_size=vec,
                              discrete_weights=True, epilogue=EPILOGUES[op], **kw)


def test_supports_routes_discrete_weights_to_the_kernel():
    for op in EPILOGUES:
        for fmt in ((BF, None, None), ("float16", None, None)) + config.BLOCK_FORMATS:
            assert config.supports(_problem(op, fmt)) is None, (op, fmt)
        assert config.supports(_problem(op, ("float4_e2m1fn", E4M3, 16), a_dtype=BF)) is None   # weight-only
        assert config.supports(_problem(op, b_major="n")) is None
    wgrad = GroupedGemmProblem(op="wgrad", m=256, n=256, k=512, num_groups=2, ab_dtype=BF, wgrad_dtype=BF,
                               discrete_weights=True)
    assert "wgrad" in config.supports(wgrad)


@pytest.mark.parametrize("fmt", [(BF, None, None), ("float4_e2m1fn", E4M3, 16)], ids=["bf16", "nvfp4"])
def test_operand_table_binds_experts_and_drops_the_workspace(fmt):
    p = _problem("glu", fmt)
    names = operands.input_names(p)
    assert names[1:4] == ("b:0", "b:1", "b:2")
    if p.block_scaled:
        assert [n for n in names if n.startswith("sfb")] == ["sfb:0", "sfb:1", "sfb:2"]
    cfg = config.default_config(p)
    launch = operands.launch_outputs(p, cfg)
    per_expert = 2 if p.block_scaled else 1   # B's descriptor (and SFB's), then its address
    assert launch[-1] == operands.Bound("expert_descriptors", "static",
                                        (per_expert * 3 * (operands.TMA_DESCRIPTOR_BYTES + 8),), "uint8")
    assert [b.name for b in launch[:-1]] == [b.name for b in operands.launch_outputs(
        dataclasses.replace(p, discrete_weights=False), cfg)]
    finish = operands.finish(p)
    outs = [f"out:{b.name}" for b in launch]
    assert finish(outs, {}) == outs[:-1]
    named = launcher.unpack(p, list(names) + [b.name for b in launch])
    assert named["expert_descriptors"] == "expert_descriptors" and named["b:2"] == "b:2" and named["b"] is None


def test_wgrad_discrete_output_mode_is_refused_with_the_reason():
    import jax.numpy as jnp

    import cudnn_moe_jax as cmj

    a, offsets = jnp.ones((128, 256), jnp.bfloat16), jnp.asarray([100, 256], jnp.int32)
    assert cmj.grouped_gemm_wgrad(a, a, offsets, output_mode="dense").wgrad_tensor.shape == (2, 128, 128)
    with pytest.raises(NotImplementedError, match="per-expert TMA store descriptors"):
        cmj.grouped_gemm_wgrad(a, a, offsets, output_mode="discrete")
    with pytest.raises(ValueError, match="output_mode"):
        cmj.grouped_gemm_wgrad(a, a, offsets, output_mode="sparse")


def _stacked_and_discrete(case):
    x = checks.case_inputs(case, *cases.runs(case)[0], discrete=True)
    return [jax.jit(functools.partial(bc.call, case, discrete=d))(x) for d in (False, True)]


@pytest.mark.parametrize("name", ["bf16_swiglu_bias_n384", "nvfp4_dswiglu_bias_amax", "w_mxfp8_quant_fp8d_k208_n384",
                                  "nvfp4_quant_300_experts"])
def test_reference_stacked_and_discrete_are_bit_identical(name):
    case = next(c for c in cases.CASES if c[0] == name)
    stacked, discrete = _stacked_and_discrete(case)
    for key, value in stacked.items():
        if value is not None:
            assert np.array_equal(np.asarray(value).view(np.uint8), np.asarray(discrete[key]).view(np.uint8)), key


# ------------------------------------------------------------------------------------------------ kernels (cutlass)

def _compile_cases():
    """The discrete-weights twin of known spill-free compile cases (lab/compile_cases.py: forward variants and
    backward cases), over the mainloops: bf16 (K- and N-major B), dequantizing (NVFP4, MXFP4, MXFP8, weight-only)
    and the opt-in FP8-wgmma MXFP8 one."""
    from lab import compile_cases

    known = compile_cases.all_cases()
    picked = {name: (known[name], None) for name in (
        "bf16-swiglu-bias-cbf16-dbf16", "dswiglu_nmajor", "quant_nmajor", "nvfp4-quant-nobias-c--dbf16",
        "mxfp4-srelu-bias-cf32-dbf16-opts", "dswiglu_nvfp4", "dsrelu_mxfp8_e4m3d")}
    picked["w_mxfp8-swiglu"] = (dataclasses.replace(known["e4m3-swiglu-nobias-cbf16-dbf16"], a_dtype=BF), None)
    picked["mxfp8-wgmma-swiglu"] = (known["e4m3-swiglu-nobias-cbf16-dbf16"], config.MXFP8_WGMMA)
    return {name: (dataclasses.replace(p, discrete_weights=True), cfg) for name, (p, cfg) in picked.items()}


COMPILE_CASES = _compile_cases()


def _hgmma(sass: str) -> int:
    return len(re.findall(r"\bHGMMA\.", sass))


@needs_cutlass
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_discrete_kernel_compiles(name):
    problem, cfg = COMPILE_CASES[name]
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    sass = sass_of(compile_or_skip(problem, cfg), tool)
    check_sass(sass, cfg is not None and cfg.mxfp8_wgmma, problem if cfg is None else None)
    assert "build_table" in sass, "no descriptor-table kernel"
    assert "UTMACCTL.IV" in sass, "no tensormap acquire before the expert's loads"
    stacked = sass_of(compile_or_skip(dataclasses.replace(problem, discrete_weights=False), cfg), tool)
    assert _hgmma(sass) == _hgmma(stacked) > 0


@needs_cutlass
@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_discrete_op_lowers_to_the_kernel(case):
    fn = jax.jit(functools.partial(bc.call, case, discrete=True))
    x = checks.case_inputs(case, *cases.runs(case)[0], discrete=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback to the reference warns
        text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    calls = custom_calls(text)
    assert len(calls) == 1, "expected one kernel custom call"
    # the experts reach the kernel as operands of their own (no stacked copy)
    _, _, fmt, k, n, _ = case
    row_bytes = k // 2 if bc.FORMATS[fmt][0] == "float4_e2m1fn" else k
    experts = len(bc.PATTERNS[cases.runs(case)[0][0]])
    assert calls[0]["types"].count(f"tensor<{n}x{row_bytes}x") == experts, calls[0]["types"]


@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_bundle_items_lower_at_the_suite_inputs(case):
    """lab.discrete_cases' bundle items lower each call at lab.blockscaled_cases.input_avals(case, pattern,
    discrete=True): exactly the shapes and dtypes of the GPU suite's inputs (per-expert lists included)."""
    def sds(v):
        if isinstance(v, (list, tuple)):
            return [sds(e) for e in v]
        return None if v is None else (tuple(v.shape), str(v.dtype))

    pattern, mode = cases.runs(case)[0]
    got = {k: sds(v) for k, v in checks.case_inputs(case, pattern, mode, discrete=True).items()}
    assert got == {k: sds(v) for k, v in bc.input_avals(case, pattern, discrete=True).items()}
