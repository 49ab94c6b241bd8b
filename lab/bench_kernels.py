"""The lab's benchmark kernels: other schedules (Config) of the benchmark's problems, timed beside the public ops'
defaults (`python -m benchmarks.bench_grouped_gemm --lab [--mxfp8]`) and run alone for ncu / the launch-gap probes
(lab.profile_one, lab.probe_launch_overhead, lab.trace_launch_gaps). Each runs through the primitive with its
config (lab.forward_cases.kernel_fn); the modules come from a bundle like every other GPU run's:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.bench_kernels:bundle_items

Names: bf16 `<shape>_<config label>` (e.g. fc1_t256c21: BENCH_CONFIGS on each named shape, the shape's fusion,
bf16 D + amax, C for GLU); MXFP8 `<shape>_<variant>` (MXFP8_BENCH: e4m3 + e8m0 per 32, bf16 or FP8 D). The
arrays of a call are the benchmark's: bf16 (a, b, padded_offsets, alpha, prob); MXFP8 (a, b, sfa, sfb,
padded_offsets, alpha, prob[, norm_const]).
"""

from __future__ import annotations

from cudnn_moe_jax import shapes
from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import Config
from cudnn_moe_jax.kernels.sm90.config import MXFP8_WGMMA

from .forward_cases import lowering_item

BENCH_CONFIGS = {  # t<tile_n> c<cluster_m><cluster_n> [e<epi_stages>]
    "t256c21": Config(tile_n=256, cluster_m=2),
    "t256c21e1": Config(tile_n=256, cluster_m=2, epi_stages=1),
    "t128c21": Config(tile_n=128, cluster_m=2),
    "t128c21e1": Config(tile_n=128, cluster_m=2, epi_stages=1),
    "t256c22": Config(tile_n=256, cluster_m=2, cluster_n=2),  # 24 co-resident clusters (config.H200_4CTA_CLUSTERS)
}

E4M3, E8M0 = "float8_e4m3fn", "float8_e8m0fnu"
SWIGLU_BF16D = Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype="bfloat16", compute_amax=True)
SWIGLU_FP8D = Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype=E4M3, generate_sfd=True)
FC2_FP8D = Epilogue(d_dtype=E4M3, generate_sfd=True)
FC2_BF16D = Epilogue(d_dtype="bfloat16", compute_amax=True)
WGMMA = MXFP8_WGMMA  # the opt-in FP8-wgmma MXFP8 mainloop (its measured schedule)
MXFP8_BENCH = {  # name -> (bench shape, Epilogue, Config or None = the default: exact dequantization to bf16)
    "fc1_bf16d": ("fc1", SWIGLU_BF16D, None),
    "fc1_bf16d_wgmma": ("fc1", SWIGLU_BF16D, WGMMA),
    # the converter split: A converted by the stage workers into a bf16 stage too (SS wgmma; fewer stages)
    "fc1_bf16d_aworkers": ("fc1", SWIGLU_BF16D, Config(dequant_a="workers")),
    "fc1_fp8d": ("fc1", SWIGLU_FP8D, None),
    "fc1_fp8d_wgmma": ("fc1", SWIGLU_FP8D, WGMMA),
    "fc2_bf16d": ("fc2", FC2_BF16D, None),
    "fc2_bf16d_wgmma": ("fc2", FC2_BF16D, WGMMA),
    "fc2_fp8d": ("fc2", FC2_FP8D, None),
    "fc2_fp8d_wgmma": ("fc2", FC2_FP8D, WGMMA),
    "small_bf16d": ("small", SWIGLU_BF16D, None),
    "small_bf16d_wgmma": ("small", SWIGLU_BF16D, WGMMA),
    "small_fp8d": ("small", SWIGLU_FP8D, None),
    "small_fp8d_wgmma": ("small", SWIGLU_FP8D, WGMMA),
    # one epilogue buffer, more A/B stages (the bf16 kernel's `small` default)
    "small_bf16d_e1": ("small", SWIGLU_BF16D, Config(epi_stages=1)),
}


# Block-scaled schedules (`--formats ... --lab`): label -> Config (None: the default), timed per format on
# FORMAT_LAB_SHAPES beside the public op; "e1": one epilogue buffer (more A/B stages); "c<n>": the consumer warps
# convert n of a stage's 16 B passes (mainloop_dequant; the default takes 8); "c1e1": one epilogue buffer with 1x1
# clusters (the default of 128-row groups, e128_fc1, is 1x1 with two buffers)
FORMAT_CONFIGS = {"default": None, "e1": Config(epi_stages=1), "c10": Config(consumer_b_passes=10),
                  "c12": Config(consumer_b_passes=12), "c12e1": Config(consumer_b_passes=12, epi_stages=1),
                  "c1e1": Config(cluster_m=1, epi_stages=1)}
FORMAT_LAB_SHAPES = ("fc1", "small", "e128_fc1")
FORMAT_LAB_FORMATS = ("mxfp8", "nvfp4", "mxfp4", "w_nvfp4", "w_mxfp8")


def bf16_problem(shape: str) -> GroupedGemmProblem:
    """The benchmark's bf16 problem of a named shape (its fusion; bf16 D + amax, C for GLU)."""
    m, n, k, groups = shapes.SHAPES[shape]
    op, act = shapes.FUSION[shape]
    epi = Epilogue(act=act, c_dtype="bfloat16" if op == "glu" else None, d_dtype="bfloat16", compute_amax=True)
    return GroupedGemmProblem(op=op, m=m, n=n, k=k, num_groups=groups, ab_dtype="bfloat16", epilogue=epi)


def mxfp8_problem(name: str) -> GroupedGemmProblem:
    """The problem of MXFP8_BENCH[name] (e4m3 + e8m0 per 32 on its bench shape)."""
    shape, epi, _ = MXFP8_BENCH[name]
    m, n, k, groups = shapes.SHAPES[shape]
    return GroupedGemmProblem(op=shapes.FUSION[shape][0], m=m, n=n, k=k, num_groups=groups, ab_dtype=E4M3,
                              sf_dtype=E8M0, sf_vec_size=32, epilogue=epi)


def format_problem(shape: str, fmt: str) -> GroupedGemmProblem:
    """The format comparison's problem of a shape (benchmarks.bench_cases.block_call: SwiGLU with bf16 C + D, or
    bf16 D) on inputs of format `fmt` (bench_cases.BLOCK_FORMATS / WEIGHT_ONLY), D with amax."""
    import jax.numpy as jnp

    from benchmarks import bench_cases

    (m, n, k, groups), (op, act), rows = bench_cases.format_shape(shape)
    data, sf, vec = bench_cases.BLOCK_FORMATS[bench_cases.WEIGHT_ONLY.get(fmt, fmt)]
    epi = Epilogue(act=act, c_dtype="bfloat16" if op == "glu" else None, d_dtype="bfloat16", compute_amax=True)
    a_dtype = jnp.dtype(bench_cases.a_half(fmt)).name if fmt in bench_cases.WEIGHT_ONLY else None
    return GroupedGemmProblem(op=op, m=m, n=n, k=k, num_groups=groups, ab_dtype=data, sf_dtype=sf, sf_vec_size=vec,
                              a_dtype=a_dtype, epilogue=epi, m_aligned=rows if rows % 256 else 256)


def format_cases() -> dict:
    """{"<shape>_<format>_<label>": (problem, config)}: FORMAT_CONFIGS on FORMAT_LAB_SHAPES x FORMAT_LAB_FORMATS."""
    from cudnn_moe_jax.kernels.sm90.config import default_config

    out = {}
    for s in FORMAT_LAB_SHAPES:
        for f in FORMAT_LAB_FORMATS:
            p = format_problem(s, f)
            for label, cfg in FORMAT_CONFIGS.items():
                if cfg is None or cfg != default_config(p):   # (a label equal to the default is left out)
                    out[f"{s}_{f}_{label}"] = (p, cfg)
    return out


def bf16_cases(shape_names=None) -> dict:
    """{"<shape>_<label>": (problem, config)}: every BENCH_CONFIGS entry on each named shape (default: all)."""
    return {f"{s}_{label}": (bf16_problem(s), cfg) for s in (shape_names or shapes.SHAPES)
            for label, cfg in BENCH_CONFIGS.items()}


def mxfp8_cases() -> dict:
    """{name: (problem, config)} of MXFP8_BENCH."""
    return {name: (mxfp8_problem(name), cfg) for name, (_, _, cfg) in MXFP8_BENCH.items()}


def case(name: str):
    """(problem, config) of a bf16 or MXFP8 benchmark kernel by name."""
    found = {**bf16_cases(), **mxfp8_cases(), **format_cases()}
    if name not in found:
        raise SystemExit(f"unknown lab kernel {name!r}; known: {sorted(found)}")
    return found[name]


def bundle_items() -> list:
    """Every lab benchmark kernel (format_bundle_items: the format schedules with the public calls they are timed
    beside)."""
    return [lowering_item(p, cfg) for p, cfg in {**bf16_cases(), **mxfp8_cases(), **format_cases()}.values()]


def format_bundle_items() -> list:
    """The block-scaled schedules (`--formats ... --lab`, lab.profile_one fmt ...) and the public calls they are
    timed beside (`--formats ... --lab --shapes fc1,small`)."""
    return format_lab_items() + format_public_items()


def format_lab_items() -> list:
    return [lowering_item(p, cfg) for p, cfg in format_cases().values()]


def format_public_items() -> list:
    from benchmarks import bench_cases

    return bench_cases.format_bundle_items(FORMAT_LAB_SHAPES, ("bf16",) + FORMAT_LAB_FORMATS)
