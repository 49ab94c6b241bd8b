"""Kernel-level forward cases of the GPU suites: each a (problem, config) pair run through the primitive
(`cudnn_moe_jax._primitive.bind` under jit, the config passed as the lowering's; `kernel_fn`), so a case may pick
any schedule and any epilogue the kernel implements, also ones the public ops never request (no C). Their modules
come from a bundle like every other GPU run's (one module per case serves every m):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.forward_cases:bundle_items

BF16_CASES: every default bf16 / fp16 variant (`var_*`) plus odd K / N, one / many groups and other configs
(tests/gpu/test_grouped_gemm_gpu.py); MXFP8_CASES: the MXFP8 variants plus odd shapes and configs, and FP8 C / D
from bf16 / fp16 inputs (tests/gpu/test_mxfp8_gpu.py). The arrays of a call are in the operand table's order
(`cudnn_moe_jax.operands.input_specs`): a, b, [sfa, sfb], padded_offsets, alpha, [prob], [bias], [norm_const].
"""

from __future__ import annotations

import dataclasses
import functools

from cudnn_moe_jax import operands
from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import Config, variants

TEST_SHAPE = (2048, 512, 256, 4)  # m (the suites run several), N, K, L
BF, E4M3, E5M2, E8M0 = "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"
SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", None: "none", E4M3: "e4m3", E5M2: "e5m2"}


@functools.lru_cache(maxsize=None)
def kernel_fn(problem: GroupedGemmProblem, config: Config | None = None):
    """Jitted fn(*arrays in the operand table's order) -> {output key: array} of the present outputs: `problem`
    at the arrays' m, lowered with `config` (None: the default) -- on CUDA to that kernel module (also where the
    public op would dequantize first), elsewhere to the reference (a fallback on CUDA warns:
    `lab.harness.kernels_only`). One jitted function per (problem, config).
    Scale factors may come in their float8 dtype (as formats.to_block_scaled returns e4m3 scales): they are bound
    as their bytes, as the public ops bind them."""
    from cudnn_moe_jax import _lowering, _primitive

    # an explicit Config: the kernel module itself, never the lowering's dequantize-first route (_dequant_first)
    config = _lowering.resolve_config(problem, config) if config is None else config
    return _jitted_call(problem, lambda p, bound: _primitive.bind(p, bound, config))


def dequant_first_fn(problem: GroupedGemmProblem):
    """`kernel_fn` of the dequantize-first route whatever the rule says: XLA's exact dequantization to bf16, then
    the bf16 problem's kernel (cudnn_moe_jax._primitive.bind_dequantized)."""
    from cudnn_moe_jax import _primitive

    return _jitted_call(problem, _primitive.bind_dequantized)


def _jitted_call(problem: GroupedGemmProblem, run):
    import jax
    import jax.numpy as jnp

    specs = operands.input_specs(problem)

    def stored(x, dtype):
        return jax.lax.bitcast_convert_type(x, jnp.uint8) if dtype == "uint8" and x.dtype != jnp.uint8 else x

    def fn(*arrays):
        p = dataclasses.replace(problem, m=arrays[0].shape[0])
        bound = {name: stored(x, specs[name][1]) for name, x in zip(specs, arrays)}
        return {k: v for k, v in run(p, bound).items() if v is not None}

    return jax.jit(fn)


def lowering_item(problem: GroupedGemmProblem, config: Config | None = None, fn=None):
    """An `aot build` item: the CUDA lowering of `kernel_fn(problem, config)` (or of `fn`, e.g.
    `dequant_first_fn(problem)`) at the problem's shapes."""
    import jax

    fn = kernel_fn(problem, config) if fn is None else fn
    avals = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in operands.input_specs(problem).values())
    return lambda: fn.trace(*avals).lower(lowering_platforms=("cuda",))


def _name(p: GroupedGemmProblem) -> str:
    e = p.epilogue
    return "_".join([SHORT[p.ab_dtype], e.act or p.op, "bias" if e.has_bias else "nobias",
                     f"c{SHORT[e.c_dtype]}", f"d{SHORT[e.d_dtype]}",
                     "lim" if e.glu_limit else "", "tanh" if e.tanh_clamp_scale else ""]).rstrip("_")


def _bf(op, epi, n=512, k=256, L=4):
    return GroupedGemmProblem(op=op, m=TEST_SHAPE[0], n=n, k=k, num_groups=L, ab_dtype=BF, epilogue=epi)


def bf16_cases() -> dict:
    """{name: (problem, config or None)}: the default variants, then odd K / N, one / many groups, other configs."""
    cases = {"var_" + _name(p): (p, None) for p in variants.problems(TEST_SHAPE, mxfp8=False, fp4=False)}
    sw = Epilogue(act="swiglu", c_dtype=BF, d_dtype=BF, has_bias=True, bias_dtype=BF, compute_amax=True)
    qt = Epilogue(d_dtype=BF, compute_amax=True, has_bias=True, bias_dtype=BF)
    sr = Epilogue(act="srelu", c_dtype=BF, d_dtype=BF, compute_amax=True)
    cases.update({
        "edge_k200_n384_quant": (_bf("quant", qt, n=384, k=200), None),
        "edge_n320_swiglu_t256": (_bf("glu", sw, n=320), Config(tile_n=256)),
        "edge_l1_swiglu": (_bf("glu", sw, L=1), None),
        "edge_l64_quant": (_bf("quant", qt, n=256, k=128, L=64), None),
        # 64 experts: the GLU default has one epilogue buffer (config.default_config)
        "edge_l64_swiglu": (_bf("glu", sw, L=64), None),
        "edge_noprob_srelu": (_bf("srelu", dataclasses.replace(sr, has_prob=False)), None),
        "cfg_t128c1e1_swiglu": (_bf("glu", sw), Config(tile_n=128, cluster_m=1, epi_stages=1)),
        "cfg_t256c1_geglu": (_bf("glu", dataclasses.replace(sw, act="geglu")), Config(tile_n=256, cluster_m=1)),
        "cfg_t128c2_quant": (_bf("quant", qt), Config(tile_n=128, cluster_m=2)),
        "cfg_c22_swiglu": (_bf("glu", sw, n=1024), Config(tile_n=256, cluster_m=2, cluster_n=2)),
        "cfg_c22_n640_swiglu": (_bf("glu", sw, n=640, k=320), Config(tile_n=256, cluster_m=2, cluster_n=2)),
        "cfg_c12_quant": (_bf("quant", qt), Config(tile_n=256, cluster_m=1, cluster_n=2)),
        "cfg_c22_t128_srelu": (_bf("srelu", sr), Config(tile_n=128, cluster_m=2, cluster_n=2)),
    })
    return cases


def mxfp8_cases() -> dict:
    """{name: (problem, config or None)}: the default MXFP8 variants plus odd shapes and configs, and FP8 C / D from
    bf16 / fp16 inputs (`h16_*`)."""
    def mk(op, epi, n=512, k=256, L=4, ab=E4M3):  # MXFP8 inputs; bf16 / fp16 `ab`: no scales (FP8 C / D cases)
        sf = dict(sf_dtype=E8M0, sf_vec_size=32) if ab in (E4M3, E5M2) else {}
        return GroupedGemmProblem(op=op, m=TEST_SHAPE[0], n=n, k=k, num_groups=L, ab_dtype=ab, epilogue=epi, **sf)

    fp8d = dict(generate_sfd=True)
    swiglu_fp8d = Epilogue(act="swiglu", c_dtype=BF, d_dtype=E4M3, **fp8d)
    quant_fp8d = Epilogue(d_dtype=E4M3, **fp8d)
    cases = {f"mx{i}_{_name(p)}" + ("_seg" if p.epilogue.discrete_col_sfd else ""): (p, None)
             for i, p in enumerate(variants.problems(TEST_SHAPE, ab_dtypes=(), mxfp8=True, fp4=False))}
    cases.update({
        "mxedge_k208_n384_quant_fp8d": (mk("quant", Epilogue(d_dtype=E4M3, has_bias=True, bias_dtype=BF, **fp8d),
                                           n=384, k=208), None),
        "mxedge_n320_swiglu_fp8d_seg": (mk("glu", dataclasses.replace(swiglu_fp8d, discrete_col_sfd=True), n=320),
                                        None),
        "mxedge_l1_geglu_e5m2": (mk("glu", Epilogue(act="geglu", c_dtype=E5M2, d_dtype=E5M2, **fp8d), L=1, ab=E5M2),
                                 None),
        "mxcfg_c11_l16_quant": (mk("quant", Epilogue(d_dtype=BF, compute_amax=True), L=16),
                                Config(tile_n=128, cluster_m=1)),
        "mxcfg_c22_swiglu_fp8d": (mk("glu", swiglu_fp8d, n=1024), Config(tile_n=128, cluster_m=2, cluster_n=2)),
        "mxcfg_c22_k208_n384_quant_fp8d": (mk("quant", quant_fp8d, n=384, k=208),
                                           Config(tile_n=128, cluster_m=2, cluster_n=2)),
        # FP8 C / D from bf16 / fp16 inputs (the same checks; tests/gpu/mxfp8_checks.py)
        "h16_quant_bias_fp8d_n384": (mk("quant", Epilogue(d_dtype=E4M3, has_bias=True, bias_dtype=BF, **fp8d),
                                        n=384, ab=BF), None),
        "h16_swiglu_fp8c_e5m2d_seg_n640": (mk("glu", Epilogue(act="swiglu", c_dtype=E4M3, d_dtype=E5M2,
                                                              discrete_col_sfd=True, **fp8d), n=640, ab="float16"),
                                           None),
        "h16_srelu_fp8d_t128_k1024": (mk("srelu", Epilogue(act="srelu", c_dtype=BF, d_dtype=E4M3, **fp8d), k=1024,
                                         ab=BF), Config(tile_n=128)),
        "h16_quant_fp8d_c12_n384": (mk("quant", quant_fp8d, n=384, ab=BF), Config(tile_n=128, cluster_m=1,
                                                                                   cluster_n=2)),
        "mxedge_k1024_srelu": (mk("srelu", Epilogue(act="srelu", c_dtype=BF, d_dtype=BF, compute_amax=True), k=1024),
                               None),
        "mxcfg_p4_k1024_geglu_fp8d": (mk("glu", Epilogue(act="geglu", c_dtype=BF, d_dtype=E4M3, **fp8d), k=1024),
                                      Config(tile_n=128, cluster_m=2, mx_n_parts=4)),
        "mxcfg_p1_k1024_swiglu_fp8d": (mk("glu", swiglu_fp8d, k=1024), Config(tile_n=128, cluster_m=2, mx_n_parts=1)),
        "mxcfg_p1_k208_quant": (mk("quant", Epilogue(d_dtype=BF, compute_amax=True), n=384, k=208),
                                Config(tile_n=128, cluster_m=1, mx_n_parts=1)),
    })
    return cases


def bundle_items() -> list:
    """Every case of both suites, lowered for CUDA (aot records the module each asks for)."""
    return [lowering_item(p, cfg) for p, cfg in {**bf16_cases(), **mxfp8_cases()}.values()]
