"""The kernel problems whose SASS the CPU tests check and the restructurings keep byte-identical: every default
forward variant (`kernels.sm90.variants.problems()`) and the backward / operand-major compile cases."""

from __future__ import annotations

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem

BF, F16, F32 = "bfloat16", "float16", "float32"
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
_SHORT = {BF: "bf16", F16: "f16", F32: "f32", E4M3: "e4m3", E5M2: "e5m2"}
_FP4 = {(E4M3, 16): "nvfp4", ("float8_e8m0fnu", 16): "nvfp4e8", ("float8_e8m0fnu", 32): "mxfp4"}


def dgrad(op, act, **epi):
    """A dglu / dsrelu (or N-major, or block-scaled: fmt) problem of the backward compile cases' shape."""
    sf = dict(zip(("ab_dtype", "sf_dtype", "sf_vec_size"), epi.pop("fmt", (epi.pop("ab", BF), None, None))))
    return GroupedGemmProblem(op=op, m=2048, n=512, k=epi.pop("k", 256), num_groups=4,
                              b_major=epi.pop("b_major", "k"), epilogue=Epilogue(act=act, **epi), **sf)


# block-scaled dY / W (the dequantizing mainloop): NVFP4, MXFP4, MXFP8 e4m3 / e5m2
NVFP4, MXFP4 = ("float4_e2m1fn", "float8_e4m3fn", 16), ("float4_e2m1fn", "float8_e8m0fnu", 32)
MXFP8, MXFP8E5 = ("float8_e4m3fn", "float8_e8m0fnu", 32), ("float8_e5m2", "float8_e8m0fnu", 32)


def _wgrad(fmt, **kw):
    """A block-scaled wgrad (W rows m_w: 384 runs 1 x 1 clusters, 512 2 x 1)."""
    sf = dict(zip(("ab_dtype", "sf_dtype", "sf_vec_size"), fmt))
    return GroupedGemmProblem(op="wgrad", m=kw.pop("m", 384), n=320, k=2048, num_groups=5,
                              wgrad_dtype=kw.pop("wgrad_dtype", BF), **sf, **kw)


BACKWARD = {
    "dsrelu_bias_amax": dgrad("dsrelu", "dsrelu", c_dtype=BF, d_dtype=BF, compute_amax=True, dbias_dtype=F32),
    "dsrelu_tanh_f32c": dgrad("dsrelu", "dsrelu", c_dtype=F32, d_dtype=BF, tanh_clamp_scale=2.0, has_prob=False),
    "dswiglu_nmajor": dgrad("dglu", "dswiglu", c_dtype=BF, d_dtype=BF, compute_amax=True, b_major="n"),
    "dgeglu_f32": dgrad("dglu", "dgeglu", ab=F16, c_dtype=F32, d_dtype=F32, glu_limit=3.0, glu_alpha=1.702,
                         dbias_dtype=BF),
    # FP8 D_row with SFD_row / D_col / SFD_col (epilogue_fp8d): dglu quantizes a gate and an up subtile per step
    "dswiglu_e4m3": dgrad("dglu", "dswiglu", c_dtype=BF, d_dtype=E4M3, generate_sfd=True, compute_amax=True,
                           dbias_dtype=F32),
    "dsrelu_e5m2_segsfd": dgrad("dsrelu", "dsrelu", c_dtype=F32, d_dtype=E5M2, generate_sfd=True,
                                 discrete_col_sfd=True, dbias_dtype=BF),
    # FP8 saved C (the forward's e4m3 / e5m2 c_dtype): 8-bit C subtiles by TMA, widened to fp32 in the epilogue
    "dswiglu_e4m3c": dgrad("dglu", "dswiglu", c_dtype=E4M3, d_dtype=BF, compute_amax=True, dbias_dtype=F32),
    "dsrelu_e4m3c_tanh": dgrad("dsrelu", "dsrelu", c_dtype=E4M3, d_dtype=BF, tanh_clamp_scale=2.0,
                                compute_amax=True),   # 2 store buffers + 4 A/B stages (a 16-bit C: 1 + 4)
    "dsrelu_e5m2c_e4m3": dgrad("dsrelu", "dsrelu", c_dtype=E5M2, d_dtype=E4M3, generate_sfd=True,
                                dbias_dtype=F32),
    "dswiglu_nvfp4": dgrad("dglu", "dswiglu", fmt=NVFP4, c_dtype=BF, d_dtype=BF, compute_amax=True,
                            dbias_dtype=F32),
    "dgeglu_mxfp4_k1024": dgrad("dglu", "dgeglu", fmt=MXFP4, k=1024, c_dtype=F32, d_dtype=F32, glu_limit=3.0,
                                 glu_alpha=1.702, dbias_dtype=BF),
    "dsrelu_mxfp8_e4m3d": dgrad("dsrelu", "dsrelu", fmt=MXFP8, c_dtype=E4M3, d_dtype=E4M3, generate_sfd=True,
                                 dbias_dtype=F32),
    "dswiglu_mxfp8e5_e4m3d_seg": dgrad("dglu", "dswiglu", fmt=MXFP8E5, c_dtype=BF, d_dtype=E4M3,
                                        generate_sfd=True, discrete_col_sfd=True, compute_amax=True),
    "quant_nmajor": GroupedGemmProblem(op="quant", m=2048, n=512, k=256, num_groups=4, ab_dtype=BF, b_major="n",
                                       epilogue=Epilogue(d_dtype=BF)),
    "wgrad_kmajor_c1": GroupedGemmProblem(op="wgrad", m=384, n=320, k=2000, num_groups=5, ab_dtype=BF,
                                          wgrad_dtype=BF),
    "wgrad_tokmajor_c2": GroupedGemmProblem(op="wgrad", m=512, n=320, k=2000, num_groups=5, ab_dtype=F16,
                                            wgrad_dtype=F32, a_major="m", b_major="n"),
    # accumulate_on_output (old W read in the epilogue, output aliased to it) with global scales; n_w = 328 leaves
    # a partial 32-column subtile (the old-W loads are predicated per column)
    "wgrad_accum_gs_c1": GroupedGemmProblem(op="wgrad", m=384, n=320, k=2000, num_groups=5, ab_dtype=BF,
                                            wgrad_dtype=BF, accumulate=True, has_global_scales=True),
    "wgrad_accum_f32_tokmajor_c2": GroupedGemmProblem(op="wgrad", m=512, n=328, k=2000, num_groups=5, ab_dtype=F16,
                                                      wgrad_dtype=F32, accumulate=True, a_major="m", b_major="n"),
    # block-scaled A / B with per-expert SF segments (mainloop_dequant_wgrad): A in the consumers' registers
    # (token-contiguous) or converted by the workers like B (token-major FP8, or dequant_a="workers")
    "wgrad_mxfp8_c1": _wgrad(MXFP8),
    "wgrad_mxfp8e5_accum_f32_c2": _wgrad(MXFP8E5, m=512, wgrad_dtype=F32, accumulate=True),
    "wgrad_nvfp4_gs_c1": _wgrad(NVFP4, has_global_scales=True),
    "wgrad_mxfp4_c2": _wgrad(MXFP4, m=512),
    "wgrad_mxfp8_tokmajor_c1": _wgrad(MXFP8, a_major="m", b_major="n"),
    "wgrad_mxfp8e5_tokmajor_accum_gs_c2": _wgrad(MXFP8E5, m=512, accumulate=True, has_global_scales=True,
                                                  a_major="m", b_major="n"),
}


def _fwd(op="glu_hadamard_quant", fmt=(BF, None, None), n=512, k=256, **epi):
    sf = dict(zip(("ab_dtype", "sf_dtype", "sf_vec_size"), fmt))
    return GroupedGemmProblem(op=op, m=2048, n=n, k=k, num_groups=4, a_dtype=epi.pop("a_dtype", None),
                              epilogue=Epilogue(**epi), **sf)


E2M1, MXFP8E4 = "float4_e2m1fn", ("float8_e4m3fn", "float8_e8m0fnu", 32)
_H = dict(c_dtype=BF)
# FP4 outputs: grouped_gemm_glu_hadamard_quant (kernels/sm90/hadamard.py) and the MXFP4 D of the forward ops
# (epilogue_fp4d): every D / Hadamard-output kind over bf16 / fp16, dequantized and weight-only inputs
FP4_OUT = {
    "h_bf16_swiglu_bf16d_amax": _fwd(act="swiglu", d_dtype=BF, compute_amax=True, **_H),
    "h_bf16_geglu_bias_rowbf16": _fwd(act="geglu", has_bias=True, bias_dtype=F32, glu_limit=3.0, d_dtype=BF,
                                      compute_amax=True, rht="rowwise", rht_dtype=BF, **_H),
    "h_bf16_srelu_d4_row4_user": _fwd(act="srelu", n=256, d_dtype=E2M1, rht="rowwise", rht_dtype=E2M1,
                                      has_hadamard=True, **_H),
    "h_f16_swiglu_f32c_d4": _fwd(fmt=(F16, None, None), act="swiglu", d_dtype=E2M1, **dict(_H, c_dtype=F32)),
    "h_nvfp4_swiglu_d4_row4": _fwd(fmt=NVFP4, act="swiglu", d_dtype=E2M1, rht="rowwise", rht_dtype=E2M1, **_H),
    "h_nvfp4_swiglu_d4_col": _fwd(fmt=NVFP4, act="swiglu", d_dtype=E2M1, rht="colwise", rht_dtype=E2M1, **_H),
    "h_mxfp8_gptoss_bf16d_col_user": _fwd(fmt=MXFP8E4, act="gpt_oss_swiglu", d_dtype=BF, compute_amax=True,
                                          rht="colwise", rht_dtype=E2M1, has_hadamard=True, **_H),
    "h_w_nvfp4_srelu_d4_col": _fwd(fmt=NVFP4, a_dtype=BF, act="srelu", n=384, tanh_clamp_scale=2.0, d_dtype=E2M1,
                                   rht="colwise", rht_dtype=E2M1, **_H),
    "quant_bf16_mxfp4d": _fwd("quant", d_dtype=E2M1, generate_sfd=True),
    "glu_bf16_mxfp4d_seg": _fwd("glu", act="swiglu", c_dtype=BF, d_dtype=E2M1, generate_sfd=True,
                                discrete_col_sfd=True),
    "srelu_nvfp4_mxfp4d_n384": _fwd("srelu", fmt=NVFP4, n=384, act="srelu", c_dtype=F32, d_dtype=E2M1,
                                    generate_sfd=True),
    "glu_mxfp8_geglu_mxfp4d_seg": _fwd("glu", fmt=MXFP8E4, act="geglu", has_bias=True, bias_dtype=BF, c_dtype=E4M3,
                                       d_dtype=E2M1, generate_sfd=True, discrete_col_sfd=True),
}


# weight-only quantization with an fp16 A (each value split into two bf16 parts, two wgmmas per k16: the consumers
# hold twice the A fragments): fc1-like SwiGLU, FP8 D (the register-heaviest epilogue), the dgrad
F16_A = {
    "w16_nvfp4_swiglu": _fwd("glu", fmt=NVFP4, a_dtype=F16, act="swiglu", c_dtype=BF, d_dtype=BF, k=1024),
    "w16_mxfp8_quant_e4m3d": _fwd("quant", fmt=MXFP8E4, a_dtype=F16, d_dtype=E4M3, generate_sfd=True),
    "w16_nvfp4_dswiglu": GroupedGemmProblem(op="dglu", m=2048, n=512, k=256, num_groups=4, a_dtype=F16,
                                            ab_dtype=NVFP4[0], sf_dtype=NVFP4[1], sf_vec_size=NVFP4[2],
                                            epilogue=Epilogue(act="dswiglu", c_dtype=BF, d_dtype=BF,
                                                              compute_amax=True, dbias_dtype=F32)),
    "w16_mxfp4_dswiglu": GroupedGemmProblem(op="dglu", m=2048, n=512, k=256, num_groups=4, a_dtype=F16,
                                            ab_dtype=MXFP4[0], sf_dtype=MXFP4[1], sf_vec_size=MXFP4[2],
                                            epilogue=Epilogue(act="dswiglu", c_dtype=BF, d_dtype=BF,
                                                              compute_amax=True, dbias_dtype=F32)),
}


def forward_id(p) -> str:
    e = p.epilogue
    ab = _FP4[(p.sf_dtype, p.sf_vec_size)] if p.ab_dtype == "float4_e2m1fn" else _SHORT[p.ab_dtype]
    parts = [ab, p.op if p.op != "glu" else e.act, "bias" if e.has_bias else "nobias",
             f"c{_SHORT[e.c_dtype] if e.c_dtype else '-'}", f"d{_SHORT[e.d_dtype]}"]
    if e.discrete_col_sfd:
        parts.append("segsfd")
    if e.glu_limit or e.glu_alpha or e.tanh_clamp_scale:
        parts.append("opts")
    return "-".join(parts)


def all_cases() -> dict:
    """{name: problem} of every forward variant and backward case."""
    from cudnn_moe_jax.kernels.sm90 import variants

    out = {}
    for p in variants.problems():
        name = forward_id(p)
        while name in out:
            name += "+"
        out[name] = p
    out.update(BACKWARD)
    out.update(FP4_OUT)
    out.update(F16_A)
    return out
