"""CPU checks of the staged kernels (kernels/sm90/mainloop_staged.py: block-scaled operands converted once inside the
bf16 kernel): each format and epilogue kind, forward and dgrad, compiles for sm_90a with the bf16 kernel's wgmma not
serialized, TMA loads and stores and no local memory; the converters' job counter (ATOMG), their release adds
(REDG), the producer's acquire loads and the async-proxy fence on global memory are in the SASS. Skipped without
the CuTe DSL compiler. ~9 variants x ~5 s.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from lab.sass import check_sass, compile_or_skip, cuobjdump, sass_of

E4M3, E8M0, FP4, BF = "float8_e4m3fn", "float8_e8m0fnu", "float4_e2m1fn", "bfloat16"
FORMATS = {"nvfp4": (FP4, E4M3, 16), "mxfp4": (FP4, E8M0, 32), "mxfp8": (E4M3, E8M0, 32)}
CASES = {   # name: (op, format, 16-bit A (None: block-scaled), epilogue)
    "nvfp4_swiglu": ("glu", "nvfp4", None, Epilogue(act="swiglu", c_dtype=BF, d_dtype=BF)),
    "mxfp8_quant_fp8d": ("quant", "mxfp8", None, Epilogue(d_dtype=E4M3, generate_sfd=True)),
    "mxfp4_srelu": ("srelu", "mxfp4", None, Epilogue(act="srelu", d_dtype=BF)),
    "w_nvfp4_swiglu": ("glu", "nvfp4", BF, Epilogue(act="swiglu", c_dtype=BF, d_dtype=BF)),
    "w_mxfp8_quant": ("quant", "mxfp8", BF, Epilogue(d_dtype=BF)),
    "w16_nvfp4_quant": ("quant", "nvfp4", "float16", Epilogue(d_dtype="float16")),   # B converted to fp16
    # dgrad: block-scaled dY and W^T staged, the dgrad epilogue on the bf16 accumulators
    "nvfp4_dswiglu_bias_amax": ("dglu", "nvfp4", None, Epilogue(act="dswiglu", c_dtype=BF, d_dtype=BF,
                                                                 compute_amax=True, dbias_dtype="float32")),
    "mxfp8_dsrelu_fp8d": ("dsrelu", "mxfp8", None, Epilogue(act="dsrelu", c_dtype=BF, d_dtype=E4M3,
                                                            generate_sfd=True)),
    "w_mxfp4_dswiglu": ("dglu", "mxfp4", BF, Epilogue(act="dswiglu", c_dtype=BF, d_dtype=BF)),
}


def problem(name: str) -> GroupedGemmProblem:
    op, fmt, a_dtype, epi = CASES[name]
    data, sf, vec = FORMATS[fmt]
    return GroupedGemmProblem(op=op, m=4096, n=512, k=1024, num_groups=4, ab_dtype=data, sf_dtype=sf,
                              sf_vec_size=vec, a_dtype=a_dtype, epilogue=epi, staged=True)


@pytest.mark.parametrize("name", list(CASES))
def test_staged_kernel_compiles_with_its_converters(name):
    module = compile_or_skip(problem(name))
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    sass = sass_of(module, tool)
    check_sass(sass, False)
    for op in ("ATOMG.E.ADD", "REDG.E.ADD.STRONG.GPU", "LDG.E.STRONG.GPU", "FENCE.VIEW.ASYNC.G"):
        assert op in sass, op
    assert "QGMMA" not in sass   # the converted operands go through the 16-bit wgmma
    hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
    assert hgmma and all((".BF16" in line) == (CASES[name][2] != "float16") for line in hgmma)   # fp16 A: fp16
    # a block-scaled A (K % 64 == 0) is converted into the RS wgmma's register operand; a 16-bit A is read by TMA
    register_a = CASES[name][2] is None
    assert all(bool(re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", line)) == register_a for line in hgmma), hgmma[0]


def test_staged_a_where_the_config_says():
    """A block-scaled A stays in the consumers' registers (B staged in the K slot order) where K % 64 == 0; a K
    tail, a 16-bit A or Config(dequant_a='workspace') take the workspace mainloop (A staged like B)."""
    from cudnn_moe_jax.kernels.sm90 import config, mainloop_staged

    p = problem("mxfp8_quant_fp8d")
    cfg = config.default_config(p)
    assert cfg.dequant_a == "registers"
    assert issubclass(mainloop_staged.mainloop_class(p, cfg), mainloop_staged.StagedBMainloop)
    ws = dataclasses.replace(cfg, dequant_a="workspace")
    assert mainloop_staged.mainloop_class(p, ws) is mainloop_staged.StagedMainloop
    tail = dataclasses.replace(p, k=992)
    assert config.default_config(tail).dequant_a == "workspace"
    with pytest.raises(NotImplementedError, match="K % 64 == 0"):
        mainloop_staged.mainloop_class(tail, cfg)
    w = problem("w_nvfp4_swiglu")
    assert mainloop_staged.mainloop_class(w, config.default_config(w)) is mainloop_staged.StagedMainloop
    with pytest.raises(NotImplementedError, match="registers"):
        mainloop_staged.mainloop_class(p, dataclasses.replace(cfg, dequant_a="workers"))


def test_staged_problem_keeps_its_inputs():
    """Staging changes how the kernel runs, not what it is bound to: the same inputs as the block-scaled call."""
    from cudnn_moe_jax import operands

    p = problem("nvfp4_swiglu")
    assert operands.input_specs(p) == operands.input_specs(dataclasses.replace(p, staged=False))


def test_staged_a_in_a_workspace_compiles():
    """Config(dequant_a='workspace'): A staged like B, both read by TMA (SS wgmma), no local memory."""
    from cudnn_moe_jax.kernels.sm90 import config

    p = problem("mxfp8_quant_fp8d")
    module = compile_or_skip(p, dataclasses.replace(config.default_config(p), dequant_a="workspace"))
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    sass = sass_of(module, tool)
    check_sass(sass, False)
    hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
    assert hgmma and all(re.search(r"HGMMA\.\S+ R\d+, gdesc", line) for line in hgmma), hgmma[0]


def wgrad_problem(fmt: str, k: int = 2048, token_major: bool = False) -> GroupedGemmProblem:
    data, sf, vec = FORMATS[fmt]
    majors = dict(a_major="m", b_major="n") if token_major else {}
    return GroupedGemmProblem(op="wgrad", m=512, n=320, k=k, num_groups=5, ab_dtype=data, sf_dtype=sf,
                              sf_vec_size=vec, wgrad_dtype=BF, staged=True, **majors)


@pytest.mark.parametrize("fmt,token_major", [(f, False) for f in FORMATS] + [("mxfp8", True)])
def test_staged_wgrad_compiles_with_its_converters(fmt, token_major):
    """The staged wgrad (mainloop_staged_wgrad): the bf16 K-grouped kernel over the padded workspaces (SS HGMMA,
    no masker; token-major: MN-major stages), the converters' job counter, release adds, acquire loads, async-proxy
    fence and (token-contiguous) the funnel shifts of unaligned groups and the read slabs dropped from L2
    (`discard.global.L2`); no local memory."""
    sass = sass_of(compile_or_skip(wgrad_problem(fmt, token_major=token_major)),
                   cuobjdump() or pytest.skip("cuobjdump not found"))
    check_sass(sass, False)
    for op in ("ATOMG.E.ADD", "REDG.E.ADD.STRONG.GPU", "LDG.E.STRONG.GPU", "FENCE.VIEW.ASYNC.G"):
        assert op in sass, op
    assert token_major or "SHF.R.U32" in sass
    assert ("CCTL.E.RML2" in sass) != token_major
    hgmma = [line for line in sass.splitlines() if "HGMMA" in line]
    assert hgmma and all(re.search(r"HGMMA\.\S+ R\d+, gdesc", line) for line in hgmma), hgmma[0]
    assert all((".tnspA.tnspB" in line) == token_major for line in hgmma), hgmma[0]


def test_staged_wgrad_workspaces_follow_the_token_count():
    """A (m_w, T + 64 L) and B (n_w, T + 64 L) in bf16 (every expert's tokens from a 64-token boundary), one flag
    per 128-row block of A and B and 512-token chunk after the header (the job counter, the GEMM's frontier, the
    tiles-read word per expert), all dynamic in T (one module serves every T); no A flags column.
    Supported token-contiguous and ungathered only."""
    from cudnn_moe_jax import operands
    from cudnn_moe_jax.kernels.sm90 import config, jax_bridge

    p = wgrad_problem("mxfp8", k=2000)
    out = {b.name: b for b in operands.launch_outputs(p, config.default_config(p))}
    assert out["staged_a"].shape == (512, 2000 + 64 * 5) and out["staged_b"].shape == (320, 2000 + 64 * 5)
    assert out["staged_b_flags"].shape == (2 + 5 + (4 + 3) * 5,) and "staged_a_flags" not in out
    assert {out[n].dtype for n in ("staged_a", "staged_b")} == {"bfloat16"}
    specs = dict(zip([b.name for b in operands.launch_outputs(p, config.default_config(p))],
                     jax_bridge.tensor_specs(p, config.default_config(p))[1]))
    assert not specs["staged_a"].static and not specs["staged_b_flags"].static
    assert config.supports(p) is None
    assert config.supports(dataclasses.replace(p, a_major="m", b_major="n")) is None   # FP8 token-major
    assert "token-major" in config.supports(dataclasses.replace(wgrad_problem("nvfp4"), a_major="m", b_major="n"))
    assert "token-major" in config.supports(dataclasses.replace(p, a_major="m"))
