"""CPU checks of the backward-family kernels (dglu / dsrelu epilogues, the K-grouped wgrad schedule, bf16 or
block-scaled) and of the N / M-major operand mainloop: each compiles for sm_90a, its SASS has HGMMA and TMA, no
local-memory spills (the block-scaled wgrad: no cp.async either), and its k-loop issues a stage's wgmmas back to
back (ptxas serializes wgmma, with a wait after each, when it cannot prove the accumulators retired). The wgrad
modules are exported for a symbolic token count, as the runtime builds them (one module per problem whatever T).
Skipped without the CuTe DSL compiler; ~30 modules x 2-30 s.
"""

from __future__ import annotations

import re

import pytest

from lab import dgrad_cases
from lab.compile_cases import BACKWARD as CASES
from lab.compile_cases import dgrad
from lab.sass import compile_or_skip, cuobjdump, require_compiler, sass_of

from cudnn_moe_jax.kernels.sm90 import GroupedGemmSm90

BF, F16, F32 = "bfloat16", "float16", "float32"
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _workers(name):
    from cudnn_moe_jax.kernels.sm90.config import Config

    return CASES[name], Config(cluster_m=1, dequant_a="workers")


# block-scaled wgrad with A converted by the stage workers like B (Config.dequant_a, the lab's alternative)
CONFIG_CASES = {"wgrad_mxfp8_c1_workers": lambda: _workers("wgrad_mxfp8_c1"),
                "wgrad_mxfp8_tokmajor_c1_workers": lambda: _workers("wgrad_mxfp8_tokmajor_c1")}


@pytest.mark.parametrize("name", list(CASES) + list(CONFIG_CASES))
def test_backward_kernel_compiles_unserialized_without_spills(name):
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed")
    problem, config = CONFIG_CASES[name]() if name in CONFIG_CASES else (CASES[name], None)
    # wgrad: T symbolic, as the runtime compiles it; the others at concrete m (the m-symbolic export is
    # tests/test_kernels_compile.py's)
    sass = sass_of(compile_or_skip(problem, config, axis="auto" if problem.op == "wgrad" else None), tool)
    assert "arch = sm_90a" in sass and "HGMMA" in sass and "UTMALDG" in sass
    # stored from registers: an fp32 W accumulated into (8-byte pairs), a dgrad's D exactly where that buys an A/B
    # stage over the TMA's buffers (16-byte row chunks); the rest by TMA
    kernel = GroupedGemmSm90(problem, config)
    registers = kernel.d_from_registers
    if problem.op in ("dglu", "dsrelu"):
        tma = max(min(kernel._smem_fit(s), 4) for s in kernel.epi_stage_candidates() if kernel.epi_steps % s == 0)
        assert registers == (min(kernel.ab_stages, 4) > tma)
    else:
        assert registers == (problem.op == "wgrad" and problem.accumulate and problem.wgrad_dtype == "float32")
    stg = "STG.E.64" if problem.op == "wgrad" else "STG.E.128"
    assert ("UTMASTG" in sass) != registers and (not registers or stg in sass)
    local = sum(int(x) for x in re.findall(r"LOCAL:(\d+)", sass))
    assert local == 0 and not re.search(r"\b(LDL|STL)\b", sass), f"{local} bytes of local memory (spills)"
    if problem.op == "wgrad" and problem.block_scaled:   # segment scales by TMA boxes, no thread-issued copy
        assert "LDGSTS" not in sass                        # into shared memory (racecheck pairs those with reads)
    events = re.findall(r"\b(HGMMA|WARPGROUP\.DEPBAR)\b", sass)
    runs = "".join("H" if e == "HGMMA" else "|" for e in events)
    assert "HHHH" in runs, "wgmma serialized: a wait between the wgmmas of a stage"


@pytest.mark.parametrize("name", ["dswiglu_e4m3_bias_amax", "dsrelu_e5m2_segsfd_noprob", "dswiglu_e4m3c_bias_amax",
                                  "dsrelu_e5m2c_e4m3"])
def test_fp8_dgrad_op_lowers_to_the_kernel(name):
    """The public op with an FP8 d_dtype or an FP8 saved C lowers for CUDA to the kernel (a fallback to the
    reference would warn, and the warning is an error here), with every FP8 output present
    (lab/dgrad_cases.py: its GPU cases)."""
    require_compiler()
    import functools
    import warnings

    import jax

    case = next(c for c in dgrad_cases.CASES if c[0] == name)
    fn = jax.jit(functools.partial(dgrad_cases.call, case))
    x = dgrad_cases.inputs(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "CuteDSLRT_NvJaxCutlassCall" in line]
    assert len(calls) == 1, f"expected one kernel custom call, found {len(calls)}"
    out = jax.eval_shape(fn, x)
    m, width = x["c"].shape
    assert str(x["c"].dtype) == case[5]
    d_dtype = case[3].get("d_dtype", BF)
    if d_dtype not in (E4M3, E5M2):
        assert (out["d_row_tensor"].shape, str(out["d_row_tensor"].dtype)) == ((m, width), d_dtype)
        assert out["d_col_tensor"] is None and out["sfd_row_tensor"] is None
        return
    for key in ("d_row_tensor", "d_col_tensor"):
        assert (out[key].shape, str(out[key].dtype)) == ((m, width), d_dtype), key
    assert out["sfd_row_tensor"].shape == (1, m // 128, -(-width // 128), 32, 4, 4)
    if case[3].get("discrete_col_sfd"):
        assert out["sfd_col_tensor"].shape == (-(-width // 128) * 128 * m // 32,)
    else:
        assert out["sfd_col_tensor"].shape == (1, -(-width // 128), m // 128, 32, 4, 4)


def test_fp8_dgrad_supports_and_launch_outputs():
    """CPU only: FP8 D_row is supported with SFD (both SFD_col layouts) and refused without; the launch writes d,
    d_col, the partial sums, sfd_row, sfd_col, and the lowering's finish passes the FP8 outputs through in the op's
    order (d_row, d_col, dprob, dbias, amax, sfd_row, sfd_col)."""
    import jax.numpy as jnp
    import numpy as np

    from cudnn_moe_jax import operands as table
    from cudnn_moe_jax.kernels.sm90 import config, operands

    for name in ("dswiglu_e4m3", "dsrelu_e5m2_segsfd", "dswiglu_e4m3c", "dsrelu_e5m2c_e4m3"):
        assert config.supports(CASES[name]) is None, name
    no_sfd = dgrad("dglu", "dswiglu", c_dtype=BF, d_dtype=E4M3)
    seg_no_fp8 = dgrad("dsrelu", "dsrelu", c_dtype=BF, d_dtype=BF, discrete_col_sfd=True)
    for p in (no_sfd, seg_no_fp8):
        assert "generate_sfd" in config.supports(p)

    p = CASES["dswiglu_e4m3"]   # dbias + amax
    cfg = config.default_config(p)
    _, outs = operands.launcher_operands(p)
    assert [n for n, _ in outs] == ["d", "d_col", "dprob_parts", "dbias_parts", "amax", "sfd_row", "sfd_col"]
    launch = table.launch_outputs(p, cfg)
    fake = [jnp.full(a.shape, i + 1, a.dtype) for i, a in enumerate(launch)]
    offsets = jnp.asarray([512, 1024, 1536, 2048], jnp.int32)
    got = table.finish(p)(fake, {"padded_offsets": offsets})
    want = [(s, d) for s, d in table.output_specs(p).values() if s is not None]
    assert [(tuple(x.shape), str(x.dtype)) for x in got] == [(tuple(s), d) for s, d in want]
    for x, src in zip(got[:2] + got[-3:], fake[:2] + fake[-3:]):   # d_row, d_col, amax, sfd_row, sfd_col
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(src).view(np.uint8))
    parts = launch[2].shape[0]
    np.testing.assert_array_equal(np.asarray(got[2]), np.full(p.m, 3.0 * parts, np.float32))   # dprob


@pytest.mark.parametrize("dbias,stages", [(False, (3, 1, False)), (True, (3, 1, True))])
def test_mxfp8_dglu_stage_count(dbias, stages):
    """(A/B stages, D buffers, D from registers) of an MXFP8 dglu (58.9 KB dequantizing stages): 3 A/B stages fit
    beside one D buffer because the dgrad's dbias column table (4 KB) is allocated only with dbias (RESULTS run 59:
    317 -> 458 TFLOP/s on the fc step's dglu); with it, D's TMA buffers would leave 2, so D is stored from registers
    (no D buffers) and 3 fit; the module's shared memory fits either way (it compiles)."""
    from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
    from cudnn_moe_jax.kernels.sm90.kernel import GroupedGemmSm90

    require_compiler()
    epi = Epilogue(act="dswiglu", c_dtype=BF, d_dtype=BF, compute_amax=False, dbias_dtype=F32 if dbias else None)
    p = GroupedGemmProblem(op="dglu", m=2048, n=512, k=1024, num_groups=4, ab_dtype=E4M3,
                           sf_dtype="float8_e8m0fnu", sf_vec_size=32, epilogue=epi)
    kernel = GroupedGemmSm90(p)
    assert (kernel.ab_stages, kernel.epi_stages, kernel.d_from_registers) == stages
    compile_or_skip(p)


@pytest.mark.parametrize("kind,stages", [("bf16", (4, 4)), ("fp32", (4, 2)), ("fp32_accumulate", (4, 1)),
                                         ("nvfp4_staged", (4, 2)),
                                         ("bf16_gathered", (4, 4))])
def test_wgrad_store_buffer_count(kind, stages):
    """(A/B stages, W buffers) of the wgrad: a bf16 W from 16-bit operands (read by TMA or gathered) gets 4 store
    buffers, which still leave 4 A/B stages (RESULTS runs 166-167, 170: the bf16 wgrad +5-7% with few tokens per
    expert); the staged block-scaled wgrads keep 2 (measured mixed there), as an fp32 W (4 would cost an A/B stage);
    an fp32 W accumulated into, stored from registers, 1 (unused but for the thread layout)."""
    from cudnn_moe_jax._problem import GroupedGemmProblem
    from cudnn_moe_jax.kernels.sm90.kernel import GroupedGemmSm90

    require_compiler()
    common = dict(op="wgrad", m=1024, n=4096, k=16384, num_groups=128)
    problem = {
        "bf16": GroupedGemmProblem(ab_dtype=BF, wgrad_dtype=BF, **common),
        "fp32": GroupedGemmProblem(ab_dtype=BF, wgrad_dtype=F32, **common),
        "fp32_accumulate": GroupedGemmProblem(ab_dtype=BF, wgrad_dtype=F32, accumulate=True, **common),
        "nvfp4_staged": GroupedGemmProblem(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", sf_vec_size=16,
                                           wgrad_dtype=BF, staged=True, **common),
        "bf16_gathered": GroupedGemmProblem(ab_dtype=BF, wgrad_dtype=BF, a_major="m", b_major="n", b_rows=20000,
                                            **common),
    }[kind]
    kernel = GroupedGemmSm90(problem)
    assert (kernel.ab_stages, kernel.epi_stages) == stages
