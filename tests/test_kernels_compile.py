"""CPU checks of the sm90 kernels: every default variant compiles for sm_90a through `cutlass_call` + `jax.export`
(symbolic m: one module for every m), and its SASS has bf16/fp16 wgmma (HGMMA; block-scaled inputs are dequantized
to bf16 on chip) issued back to back within a stage (ptxas must not serialize them) and no local-memory spills
(LDL/STL); with the opt-in FP8-wgmma MXFP8 mainloop (Config.mxfp8_wgmma) one scale-product HGMMA per data QGMMA,
issued back to back.

Skipped when the CuTe DSL compiler is not installed. ~24 bf16/fp16 variants x ~2 s + 15 block-scaled variants x
~10 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import config as sm90_config
from cudnn_moe_jax.kernels.sm90 import variants
from lab.compile_cases import F16_A, FP4_OUT, forward_id
from lab.sass import check_sass, compile_or_skip, cuobjdump, fatbins, require_compiler, sass_of

VARIANTS = variants.problems()


@pytest.mark.parametrize("problem", VARIANTS, ids=[forward_id(p) for p in VARIANTS])
def test_variant_compiles_with_wgmma_and_no_spills(problem):
    module = compile_or_skip(problem)
    assert fatbins(module), "no fatbin in the compiled module"
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    check_sass(sass_of(module, tool), False)


@pytest.mark.parametrize("cfg", [sm90_config.Config(tile_n=128, cluster_m=1, epi_stages=1),
                                 sm90_config.Config(tile_n=256, cluster_m=1),
                                 sm90_config.Config(tile_n=256, cluster_m=1, cluster_n=2)],
                         ids=["128x128-1x1-e1", "128x256-1x1", "128x256-1x2"])
def test_other_configs_compile(cfg):
    problem = GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=4, ab_dtype="bfloat16",
                                 epilogue=Epilogue(act="swiglu", c_dtype="bfloat16", compute_amax=True))
    assert fatbins(compile_or_skip(problem, cfg))


@pytest.mark.parametrize("ab", ["bfloat16", "float16"])
def test_many_experts_glu_default_compiles_without_spills(ab):
    """GLU with >= 64 experts defaults to one epilogue buffer (4 A/B stages at 128 x 256, config.default_config)."""
    problem = GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=64, ab_dtype=ab,
                                 epilogue=Epilogue(act="swiglu", has_bias=True, bias_dtype=ab, c_dtype=ab,
                                                   d_dtype=ab, compute_amax=True))
    assert sm90_config.default_config(problem).epi_stages == 1
    module = compile_or_skip(problem)
    tool = cuobjdump()
    if tool is not None:
        check_sass(sass_of(module, tool), False)


@pytest.mark.parametrize("m_aligned", [256, 128])
def test_weight_only_fp8_glu_default_takes_a_third_stage(m_aligned):
    """Weight-only MXFP8 GLU: one epilogue buffer by default, so 3 A/B stages instead of 2 (1x1 clusters where
    128-row groups would pair two experts in a cluster)."""
    from cudnn_moe_jax.kernels.sm90.kernel import kernel_class_for

    problem = GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=4, ab_dtype="float8_e4m3fn",
                                 sf_dtype="float8_e8m0fnu", sf_vec_size=32, a_dtype="bfloat16", m_aligned=m_aligned,
                                 epilogue=Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype="bfloat16"))
    cfg = sm90_config.default_config(problem)
    assert (cfg.epi_stages, cfg.cluster_m) == (1, 2 if m_aligned == 256 else 1)
    kern = kernel_class_for(problem)(problem, cfg)
    assert (kern.epi_stages, kern.ab_stages) == (1, 3)
    assert kernel_class_for(problem)(problem, dataclasses.replace(cfg, epi_stages=2)).ab_stages == 2


E4M3, E8M0 = "float8_e4m3fn", "float8_e8m0fnu"


@pytest.mark.parametrize("cfg", [sm90_config.MXFP8_WGMMA,
                                 sm90_config.Config(tile_n=128, cluster_m=1, mxfp8_wgmma=True),
                                 sm90_config.Config(tile_n=128, cluster_m=2, cluster_n=2, mxfp8_wgmma=True),
                                 sm90_config.Config(tile_n=128, cluster_m=2, mx_n_parts=4, mxfp8_wgmma=True)],
                         ids=["mxfp8-wgmma", "mxfp8-1x1-whole-n", "mxfp8-2x2-whole-n", "mxfp8-4-parts"])
def test_mxfp8_wgmma_configs_compile(cfg):
    """The opt-in FP8-wgmma MXFP8 mainloop (Config.mxfp8_wgmma) with its measured schedule and the others (no
    multicast / A and B multicast, one wgmma pair per block over the whole tile N, four column parts); K = 208: a
    partial last stage (K blocks past K get scale 0) and a half-filled last K block."""
    problem = GroupedGemmProblem(op="glu", m=2048, n=384, k=208, num_groups=4, ab_dtype=E4M3, sf_dtype=E8M0,
                                 sf_vec_size=32, epilogue=Epilogue(act="swiglu", c_dtype="bfloat16",
                                                                   d_dtype=E4M3, generate_sfd=True))
    module = compile_or_skip(problem, cfg)
    tool = cuobjdump()
    if tool is not None:
        check_sass(sass_of(module, tool), True)


# GPT-OSS SwiGLU: not in the default variant set (the GPU bundle takes its modules from the tests/gpu case tables);
# forward with bias and the default options, MXFP8 with FP8 D and options, the backward with options
GPT_OSS = {
    "fwd_bf16_bias": GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=4, ab_dtype="bfloat16",
                                        epilogue=Epilogue(act="gpt_oss_swiglu", has_bias=True, bias_dtype="bfloat16",
                                                          c_dtype="bfloat16", d_dtype="bfloat16", compute_amax=True)),
    "fwd_mxfp8_e4m3d_opts": GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=4, ab_dtype=E4M3,
                                               sf_dtype=E8M0, sf_vec_size=32,
                                               epilogue=Epilogue(act="gpt_oss_swiglu", c_dtype="bfloat16",
                                                                 d_dtype=E4M3, generate_sfd=True, glu_limit=3.0,
                                                                 glu_alpha=1.2)),
    "dglu_opts": GroupedGemmProblem(op="dglu", m=2048, n=512, k=256, num_groups=4, ab_dtype="bfloat16",
                                    epilogue=Epilogue(act="dgpt_oss_swiglu", c_dtype="bfloat16", d_dtype="bfloat16",
                                                      compute_amax=True, dbias_dtype="float32", glu_limit=3.0,
                                                      glu_alpha=1.2)),
}


EXTRA_CASES = {**GPT_OSS, **FP4_OUT, **F16_A}


@pytest.mark.parametrize("name", list(EXTRA_CASES))
def test_extra_cases_compile_without_spills(name):
    """GPT-OSS SwiGLU, and the FP4 outputs (lab/compile_cases.py: FP4_OUT): grouped_gemm_glu_hadamard_quant (NVFP4 D,
    rowwise / colwise Hadamard outputs, user matrix) and the MXFP4 D of quant / srelu / glu over bf16 / fp16,
    dequantized and weight-only inputs; weight-only with an fp16 A (F16_A): bf16 HGMMA not serialized, no local
    memory."""
    problem = EXTRA_CASES[name]
    assert sm90_config.supports(problem) is None
    module = compile_or_skip(problem)
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    sass = sass_of(module, tool)
    check_sass(sass, False, problem)   # block-scaled inputs: dequantized to 16 bits (HGMMA) by default
    if problem.a_dtype == "float16":   # NVFP4 weights: fp16 wgmma, one per k16; others: bf16 hi + lo parts
        hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
        fp16 = problem.ab_dtype == "float4_e2m1fn" and problem.sf_dtype == "float8_e4m3fn"
        assert hgmma and all((".BF16" in line) != fp16 for line in hgmma), name


@pytest.mark.parametrize("name,stages", [
    ("h_nvfp4_swiglu_d4_row4", (4, 1)), ("h_nvfp4_swiglu_d4_col", (4, 1)),   # RHT stage: one buffer, 4th A/B stage
    ("h_nvfp4_swiglu_d4_norht", (4, 2)),                                    # no RHT stage: both fit
    ("h_bf16_geglu_bias_rowbf16", (3, 2)),                                  # bf16 D beside it: 4 do not fit
])
def test_hadamard_stage_count(name, stages):
    """(A/B stages, store buffers) of the Hadamard kernel: the RHT output's 10 KiB stage beside two store buffers
    would leave the NVFP4 mainloop 3 A/B stages instead of 4 (RESULTS runs 61 / 77: small NVFP4 row / col 401 / 398
    -> 446 / 444 TFLOP/s with the 4th)."""
    from cudnn_moe_jax.kernels.sm90.kernel import GroupedGemmSm90

    require_compiler()
    problem = FP4_OUT.get(name)
    if problem is None:    # the NVFP4 case without its RHT output
        base = FP4_OUT["h_nvfp4_swiglu_d4_row4"]
        problem = dataclasses.replace(base, epilogue=dataclasses.replace(base.epilogue, rht=None, rht_dtype=None))
    kernel = GroupedGemmSm90(problem)
    assert (kernel.ab_stages, kernel.epi_stages) == stages


def _instructions(sass: str) -> list:
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*;)", sass)


@pytest.mark.parametrize("op", ["glu", "dglu"])
def test_gpt_oss_swiglu_defaults_compile_to_the_geglu_kernel(op):
    """With its defaults (alpha 1.702, limit 7) GPT-OSS SwiGLU is cuDNN's default GeGLU function: the kernels must
    be instruction for instruction the same (the geglu ones are validated on the GPU)."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    epi = dict(c_dtype="bfloat16", d_dtype="bfloat16", compute_amax=True)
    epi.update(has_bias=True, bias_dtype="float32") if op == "glu" else epi.update(dbias_dtype="float32")
    sass = {}
    for act in ("geglu", "gpt_oss_swiglu"):
        problem = GroupedGemmProblem(op=op, m=2048, n=512, k=256, num_groups=4, ab_dtype="bfloat16",
                                     epilogue=Epilogue(act=act if op == "glu" else "d" + act, **epi))
        sass[act] = _instructions(sass_of(compile_or_skip(problem), tool))
    assert len(sass["geglu"]) > 1000 and sass["geglu"] == sass["gpt_oss_swiglu"]


@pytest.mark.parametrize("op", ["glu", "dglu"])
def test_glu_clamps_propagate_nan(op):
    """GeGLU's clamps (gate <= 7, up in [-7, 7]) are NaN-propagating min / max (FMNMX.NAN), as the reference's
    jnp.minimum / maximum: the plain FMNMX returns the bound for a NaN input, and D was finite where the reference
    has NaN (GPU: mxfp8e5_geglu_f16 with NaN / inf codes, tests/gpu/test_blockscaled_gpu.py). No spills either."""
    act = "geglu" if op == "glu" else "dgeglu"
    problem = GroupedGemmProblem(op=op, m=2048, n=512, k=256, num_groups=4, ab_dtype="bfloat16",
                                 epilogue=Epilogue(act=act, c_dtype="bfloat16", d_dtype="bfloat16"))
    module = compile_or_skip(problem)
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    sass = sass_of(module, tool)
    check_sass(sass, False)
    clamps = re.findall(r"FMNMX\S* R\d+, R\d+, -?7, !?PT", sass)
    assert clamps, "no clamp at +-7 found"
    assert all(".NAN" in c for c in clamps), f"NaN-quiet clamps: {sorted(set(clamps))}"


@pytest.mark.parametrize("tile_n", [256, 128])
def test_fp8_outputs_from_bf16_inputs_compile(tile_n):
    """FP8 C and D (SFD_row / D_col / SFD_col) from bf16 inputs at both tile widths: supported, no spills (GPU:
    the `h16_*` cases of tests/gpu/test_mxfp8_gpu.py)."""
    problem = GroupedGemmProblem(op="glu", m=2048, n=640, k=256, num_groups=4, ab_dtype="bfloat16",
                                 epilogue=Epilogue(act="swiglu", c_dtype=E4M3, d_dtype=E4M3, generate_sfd=True,
                                                   discrete_col_sfd=True))
    assert sm90_config.supports(problem) is None
    module = compile_or_skip(problem, sm90_config.Config(tile_n=tile_n))
    tool = cuobjdump()
    if tool is not None:
        check_sass(sass_of(module, tool), False)


def test_mxfp8_wgmma_k_loop_is_not_serialized():
    """K = 1024 (8 stages: a real k-loop with a back-edge, unlike the 2-stage test shapes, which LLVM unrolls).
    ptxas serialized every wgmma of the first FP8-wgmma MXFP8 kernel for any real k-loop (C7514, a prefetched wgmma
    in flight across the back-edge; RESULTS.md run 8); `check_sass` counts one wait per K block."""
    problem = GroupedGemmProblem(op="glu", m=2048, n=512, k=1024, num_groups=4, ab_dtype=E4M3, sf_dtype=E8M0,
                                 sf_vec_size=32, epilogue=Epilogue(act="swiglu", c_dtype="bfloat16",
                                                                   compute_amax=True))
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    check_sass(sass_of(compile_or_skip(problem, sm90_config.MXFP8_WGMMA), tool), True)


def test_public_mxfp8_op_lowers_to_the_kernel():
    """The public op's argument order (a, b, sfa, sfb, offsets, alpha, [prob], [bias], [norm_const]) reaches the
    MXFP8 kernel's launcher: CUDA lowering through cudnn_moe_jax._runtime, no reference fallback."""
    require_compiler()
    import warnings

    import jax
    import jax.numpy as jnp

    import cudnn_moe_jax as cmj
    from cudnn_moe_jax import formats

    m, n, k, L = 512, 256, 128, 2
    a, sfa = formats.to_block_scaled(jnp.ones((m, k)), formats.E4M3)
    b, sfb = formats.to_block_scaled(jnp.ones((L, n, k)), formats.E4M3)

    def f(a, b, sfa, sfb, offsets, prob, nc):
        r = cmj.grouped_gemm_glu(a, b, sfa, sfb, offsets, prob_tensor=prob, norm_const_tensor=nc, sf_vec_size=32,
                                 d_dtype=E4M3, discrete_col_sfd=True)
        return r.c_tensor, r.d_tensor, r.d_col_tensor, r.sfd_row_tensor, r.sfd_col_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the reference warns
        exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=cmj.export_disabled_checks())(
            a, b, sfa, sfb, jnp.asarray([256, 512], jnp.int32), jnp.ones((m,), jnp.float32),
            jnp.ones((1,), jnp.float32))
    assert "CuteDSLRT_NvJaxCutlassCall" in exp.mlir_module()


def test_supports_reasons():
    ok = GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype="bfloat16")
    assert sm90_config.supports(ok) is None
    # FP8 C / D from half inputs (GPU-validated: RESULTS.md run 24)
    assert sm90_config.supports(GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype="bfloat16",
                                                   epilogue=Epilogue(d_dtype=E4M3, generate_sfd=True))) is None
    assert sm90_config.supports(GroupedGemmProblem(op="glu", m=512, n=256, k=128, num_groups=2, ab_dtype="float16",
                                                   epilogue=Epilogue(act="swiglu", c_dtype=E4M3,
                                                                     d_dtype="float16"))) is None
    bad = [
        GroupedGemmProblem(op="dglu", m=512, n=256, k=128, num_groups=2, ab_dtype="bfloat16",
                           epilogue=Epilogue(act="dswiglu")),
        GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype=E4M3,
                           sf_dtype="float8_e4m3fn", sf_vec_size=16),   # not a block format
        GroupedGemmProblem(op="quant", m=512, n=256, k=136, num_groups=2, ab_dtype=E4M3, sf_dtype=E8M0,
                           sf_vec_size=32),
        GroupedGemmProblem(op="quant", m=512, n=256, k=144, num_groups=2, ab_dtype="float4_e2m1fn",
                           sf_dtype="float8_e4m3fn", sf_vec_size=16),   # packed FP4 rows of 72 bytes
        GroupedGemmProblem(op="wgrad", m=512, n=256, k=128, num_groups=2, ab_dtype="bfloat16",
                           wgrad_dtype="bfloat16", discrete_weights=True),   # wgrad has no per-expert weights
        GroupedGemmProblem(op="quant", m=500, n=256, k=128, num_groups=2, ab_dtype="bfloat16"),
        GroupedGemmProblem(op="quant", m=512, n=256, k=100, num_groups=2, ab_dtype="bfloat16"),
        GroupedGemmProblem(op="glu", m=512, n=96, k=128, num_groups=2, ab_dtype="bfloat16",
                           epilogue=Epilogue(act="swiglu")),
        GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype="bfloat16",
                           epilogue=Epilogue(d_dtype="float8_e4m3fn")),  # FP8 D always comes with SFD
        GroupedGemmProblem(op="quant", m=512, n=200, k=128, num_groups=2, ab_dtype=E4M3, sf_dtype=E8M0,
                           sf_vec_size=32, epilogue=Epilogue(d_dtype=E4M3, generate_sfd=True)),
    ]
    mx = GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype=E4M3, sf_dtype=E8M0,
                            sf_vec_size=32, epilogue=Epilogue(d_dtype=E4M3, generate_sfd=True))
    assert sm90_config.supports(mx) is None
    assert sm90_config.default_config(mx) == sm90_config.Config()   # dequantized: the bf16 schedule
    for sf, vec in (("float8_e4m3fn", 16), (E8M0, 16), (E8M0, 32)):
        assert sm90_config.supports(dataclasses.replace(mx, ab_dtype="float4_e2m1fn", sf_dtype=sf,
                                                        sf_vec_size=vec)) is None
    many = GroupedGemmProblem(op="glu", m=512, n=256, k=128, num_groups=64, ab_dtype="bfloat16",
                              epilogue=Epilogue(act="swiglu", c_dtype="bfloat16"))
    assert sm90_config.default_config(many).epi_stages == 1
    assert sm90_config.default_config(dataclasses.replace(many, num_groups=8)).epi_stages is None
    fp4_glu = dataclasses.replace(many, num_groups=8, ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn",
                                  sf_vec_size=16)
    assert sm90_config.default_config(fp4_glu).epi_stages == 1      # FP4 A and B: a 4th A/B stage
    assert sm90_config.default_config(dataclasses.replace(fp4_glu, a_dtype="bfloat16")).epi_stages is None
    assert sm90_config.config_from_hints(mx, mma_tiler_mn=(256, 128)).tile_n == 128
    for p in bad:
        reason = sm90_config.supports(p)
        assert isinstance(reason, str) and reason, p


def test_default_config_and_variants_are_consistent():
    for p in VARIANTS:
        cfg = sm90_config.default_config(p)
        assert isinstance(cfg, sm90_config.Config) and hash(cfg) is not None
    items = variants.default_variants(("small",))
    # the aot bundle holds what the public ops can request: GLU / sReLU always produce C
    public = [p for p in VARIANTS if not (p.op in ("glu", "srelu") and p.epilogue.c_dtype is None)]
    assert 0 < len(public) < len(VARIANTS) and len(items) == len(public)
    assert all(p.epilogue.c_dtype is not None for p, _, _ in items if p.op in ("glu", "srelu"))
    for p, cfg, avals in items:
        order = [variants.INPUT_NAMES.index(name) for name in avals]
        assert sm90_config.supports(p) is None and order == sorted(order) and list(avals)[:2] == ["a", "b"]
