"""CPU side of the GPU tests/benchmarks: compile every case for sm_90a and `jax.export` it to .out/kgpu/.

    python tools/gpu/build_artifacts.py [--only tests|bench|mxfp8|mxfp8_bench] [--out DIR]

Test cases are exported with a symbolic `m` (one module per variant, run at several m); benchmark cases with
their concrete shapes and each candidate Config. Writes `<name>.jaxexp` + `manifest.json` (sections: tests, bench
= bf16/fp16 kernels; mxfp8, mxfp8_bench = block-scaled FP8 inputs, tests/gpu/test_mxfp8_gpu.py). The bench sections
are the lab's: `benchmarks/bench_grouped_gemm.py [--mxfp8] --artifacts` times them beside the public ops, and
benchmarks/profile_one.py / probe_launch_overhead.py run them alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
from _paths import REPO  # noqa: E402  (tools/gpu: puts the checkout on sys.path)

import jax  # noqa: E402

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem  # noqa: E402
from cudnn_moe_jax.shapes import FUSION, SHAPES  # noqa: E402
from cudnn_moe_jax.kernels.sm90 import Config, default_config, variants  # noqa: E402
from cudnn_moe_jax.kernels.sm90.config import MXFP8_WGMMA  # noqa: E402

TEST_SHAPE = (2048, 512, 256, 4)  # m (symbolic when exported), N, K, L

BENCH_CONFIGS = {  # t<tile_n> c<cluster_m><cluster_n> [e<epi_stages>]
    "t256c21": Config(tile_n=256, cluster_m=2),
    "t256c21e1": Config(tile_n=256, cluster_m=2, epi_stages=1),
    "t128c21": Config(tile_n=128, cluster_m=2),
    "t128c21e1": Config(tile_n=128, cluster_m=2, epi_stages=1),
    "t256c22": Config(tile_n=256, cluster_m=2, cluster_n=2),  # 24 co-resident clusters (config.H200_4CTA_CLUSTERS)
}


E4M3, E5M2, E8M0 = "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"
SWIGLU_BF16D = Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype="bfloat16", compute_amax=True)
SWIGLU_FP8D = Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype=E4M3, generate_sfd=True)
WGMMA = MXFP8_WGMMA  # the opt-in FP8-wgmma MXFP8 mainloop (its measured schedule)
MXFP8_BENCH = {  # name -> (bench shape, Epilogue, Config or None = the default: exact dequantization to bf16
    #                 [, lab kernel variant: lab/bench_kernels.py KERNEL_CLASSES])
    "fc1_bf16d": ("fc1", SWIGLU_BF16D, None),
    # before the cluster-split B conversion: both CTAs of the 2x1 cluster convert the whole multicast B stage
    "fc1_bf16d_unsplit": ("fc1", SWIGLU_BF16D, None, "unsplit"),
    "fc1_bf16d_wgmma": ("fc1", SWIGLU_BF16D, WGMMA),
    # the converter split: A converted by the stage workers into a bf16 stage too (SS wgmma; fewer stages)
    "fc1_bf16d_aworkers": ("fc1", SWIGLU_BF16D, Config(dequant_a="workers")),
    "fc1_fp8d": ("fc1", SWIGLU_FP8D, None),
    "fc1_fp8d_wgmma": ("fc1", SWIGLU_FP8D, WGMMA),
    "fc2_bf16d": ("fc2", Epilogue(d_dtype="bfloat16", compute_amax=True), None),
    "fc2_bf16d_wgmma": ("fc2", Epilogue(d_dtype="bfloat16", compute_amax=True), WGMMA),
    "fc2_fp8d": ("fc2", Epilogue(d_dtype=E4M3, generate_sfd=True), None),
    "fc2_fp8d_wgmma": ("fc2", Epilogue(d_dtype=E4M3, generate_sfd=True), WGMMA),
    "small_bf16d": ("small", SWIGLU_BF16D, None),
    "small_bf16d_wgmma": ("small", SWIGLU_BF16D, WGMMA),
    "small_fp8d": ("small", SWIGLU_FP8D, None),
    "small_fp8d_wgmma": ("small", SWIGLU_FP8D, WGMMA),
    # one epilogue buffer, more A/B stages (the bf16 kernel's `small` default)
    "small_bf16d_e1": ("small", SWIGLU_BF16D, Config(epi_stages=1)),
}


def mxfp8_cases():
    """(name, problem, config) of the MXFP8 GPU tests: the default MXFP8 variants plus odd shapes and configs."""
    def mk(op, epi, n=512, k=256, L=4, ab=E4M3):  # MXFP8 inputs; bf16 / fp16 `ab`: no scales (FP8 C / D cases)
        sf = dict(sf_dtype=E8M0, sf_vec_size=32) if ab in (E4M3, E5M2) else {}
        return GroupedGemmProblem(op=op, m=2048, n=n, k=k, num_groups=L, ab_dtype=ab, epilogue=epi, **sf)

    fp8d = dict(generate_sfd=True)
    cases = [(f"mx{i}_{_name(p)}" + ("_seg" if p.epilogue.discrete_col_sfd else ""), p, None)
             for i, p in enumerate(variants.problems(TEST_SHAPE, ab_dtypes=(), mxfp8=True, fp4=False))]
    return cases + [
        ("mxedge_k208_n384_quant_fp8d", mk("quant", Epilogue(d_dtype=E4M3, has_bias=True, bias_dtype="bfloat16",
                                                             **fp8d), n=384, k=208), None),
        ("mxedge_n320_swiglu_fp8d_seg", mk("glu", Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype=E4M3,
                                                           discrete_col_sfd=True, **fp8d), n=320), None),
        ("mxedge_l1_geglu_e5m2", mk("glu", Epilogue(act="geglu", c_dtype=E5M2, d_dtype=E5M2, **fp8d), L=1,
                                    ab=E5M2), None),
        ("mxcfg_c11_l16_quant", mk("quant", Epilogue(d_dtype="bfloat16", compute_amax=True), L=16),
         Config(tile_n=128, cluster_m=1)),
        ("mxcfg_c22_swiglu_fp8d", mk("glu", Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype=E4M3, **fp8d),
                                     n=1024), Config(tile_n=128, cluster_m=2, cluster_n=2)),
        ("mxcfg_c22_k208_n384_quant_fp8d", mk("quant", Epilogue(d_dtype=E4M3, **fp8d), n=384, k=208),
         Config(tile_n=128, cluster_m=2, cluster_n=2)),
        # FP8 C / D from bf16 / fp16 inputs (the oracle checks of test_mxfp8_gpu.py; RESULTS.md run 24)
        ("h16_quant_bias_fp8d_n384", mk("quant", Epilogue(d_dtype=E4M3, has_bias=True, bias_dtype="bfloat16",
                                                          **fp8d), n=384, ab="bfloat16"), None),
        ("h16_swiglu_fp8c_e5m2d_seg_n640", mk("glu", Epilogue(act="swiglu", c_dtype=E4M3, d_dtype=E5M2,
                                                              discrete_col_sfd=True, **fp8d), n=640, ab="float16"),
         None),
        ("h16_srelu_fp8d_t128_k1024", mk("srelu", Epilogue(act="srelu", c_dtype="bfloat16", d_dtype=E4M3, **fp8d),
                                         k=1024, ab="bfloat16"), Config(tile_n=128)),
        ("h16_quant_fp8d_c12_n384", mk("quant", Epilogue(d_dtype=E4M3, **fp8d), n=384, ab="bfloat16"),
         Config(tile_n=128, cluster_m=1, cluster_n=2)),
        ("mxedge_k1024_srelu", mk("srelu", Epilogue(act="srelu", c_dtype="bfloat16", d_dtype="bfloat16",
                                                    compute_amax=True), k=1024), None),
        ("mxcfg_p4_k1024_geglu_fp8d", mk("glu", Epilogue(act="geglu", c_dtype="bfloat16", d_dtype=E4M3,
                                                         **fp8d), k=1024),
         Config(tile_n=128, cluster_m=2, mx_n_parts=4)),
        ("mxcfg_p1_k1024_swiglu_fp8d", mk("glu", Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype=E4M3,
                                                          **fp8d), k=1024),
         Config(tile_n=128, cluster_m=2, mx_n_parts=1)),
        ("mxcfg_p1_k208_quant", mk("quant", Epilogue(d_dtype="bfloat16", compute_amax=True), n=384, k=208),
         Config(tile_n=128, cluster_m=1, mx_n_parts=1)),
    ]


def edge_cases():
    """(name, problem, config) beyond the default variants: odd K/N, one/many groups, other configs."""
    bf = "bfloat16"
    sw = Epilogue(act="swiglu", c_dtype=bf, d_dtype=bf, has_bias=True, bias_dtype=bf, compute_amax=True)
    qt = Epilogue(d_dtype=bf, compute_amax=True, has_bias=True, bias_dtype=bf)
    return [
        ("edge_k200_n384_quant", GroupedGemmProblem(op="quant", m=2048, n=384, k=200, num_groups=4, ab_dtype=bf,
                                                   epilogue=qt), None),
        ("edge_n320_swiglu_t256", GroupedGemmProblem(op="glu", m=2048, n=320, k=256, num_groups=4, ab_dtype=bf,
                                                    epilogue=sw), Config(tile_n=256)),
        ("edge_l1_swiglu", GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=1, ab_dtype=bf,
                                             epilogue=sw), None),
        ("edge_l64_quant", GroupedGemmProblem(op="quant", m=2048, n=256, k=128, num_groups=64, ab_dtype=bf,
                                             epilogue=qt), None),
        # 64 experts: the GLU default has one epilogue buffer (config.default_config)
        ("edge_l64_swiglu", GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=64, ab_dtype=bf,
                                              epilogue=sw), None),
        ("edge_noprob_srelu", GroupedGemmProblem(op="srelu", m=2048, n=512, k=256, num_groups=4, ab_dtype=bf,
                                                epilogue=Epilogue(act="srelu", has_prob=False, c_dtype=bf,
                                                                  d_dtype=bf, compute_amax=True)), None),
        ("cfg_t128c1e1_swiglu", GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=4, ab_dtype=bf,
                                                  epilogue=sw), Config(tile_n=128, cluster_m=1, epi_stages=1)),
        ("cfg_t256c1_geglu", GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=4, ab_dtype=bf,
                                               epilogue=dataclasses.replace(sw, act="geglu")),
         Config(tile_n=256, cluster_m=1)),
        ("cfg_t128c2_quant", GroupedGemmProblem(op="quant", m=2048, n=512, k=256, num_groups=4, ab_dtype=bf,
                                               epilogue=qt), Config(tile_n=128, cluster_m=2)),
        ("cfg_c22_swiglu", GroupedGemmProblem(op="glu", m=2048, n=1024, k=256, num_groups=4, ab_dtype=bf,
                                             epilogue=sw), Config(tile_n=256, cluster_m=2, cluster_n=2)),
        ("cfg_c22_n640_swiglu", GroupedGemmProblem(op="glu", m=2048, n=640, k=320, num_groups=4, ab_dtype=bf,
                                                  epilogue=sw), Config(tile_n=256, cluster_m=2, cluster_n=2)),
        ("cfg_c12_quant", GroupedGemmProblem(op="quant", m=2048, n=512, k=256, num_groups=4, ab_dtype=bf,
                                            epilogue=qt), Config(tile_n=256, cluster_m=1, cluster_n=2)),
        ("cfg_c22_t128_srelu", GroupedGemmProblem(op="srelu", m=2048, n=512, k=256, num_groups=4, ab_dtype=bf,
                                                 epilogue=Epilogue(act="srelu", c_dtype=bf, d_dtype=bf,
                                                                   compute_amax=True)),
         Config(tile_n=128, cluster_m=2, cluster_n=2)),
    ]


SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", None: "none", E4M3: "e4m3", E5M2: "e5m2"}


def _name(p: GroupedGemmProblem) -> str:
    e = p.epilogue
    return "_".join([SHORT[p.ab_dtype], e.act or p.op, "bias" if e.has_bias else "nobias",
                     f"c{SHORT[e.c_dtype]}", f"d{SHORT[e.d_dtype]}",
                     "lim" if e.glu_limit else "", "tanh" if e.tanh_clamp_scale else ""]).rstrip("_")


def mxfp8_bench_problem(name: str) -> GroupedGemmProblem:
    """The problem of MXFP8_BENCH[name] (e4m3 + e8m0 per 32 on its bench shape)."""
    shape_name, epi = MXFP8_BENCH[name][:2]
    m, n, k, L = SHAPES[shape_name]
    return GroupedGemmProblem(op=FUSION[shape_name][0], m=m, n=n, k=k, num_groups=L, ab_dtype=E4M3, sf_dtype=E8M0,
                              sf_vec_size=32, epilogue=epi)


def manifest_entry(problem, config, symbolic_m: bool, variant: str | None = None) -> dict:
    entry = {"problem": dataclasses.asdict(problem),
             "config": dataclasses.asdict(config if config is not None else default_config(problem)),
             "symbolic_m": symbolic_m}
    if variant is not None:
        entry["lab_variant"] = variant   # lab/bench_kernels.py KERNEL_CLASSES
    return entry


def export(problem, config, symbolic_m: bool, kernel_class=None):
    import cutlass

    from cudnn_moe_jax.kernels.sm90.jax_bridge import call_of, make_call

    call = make_call(problem, config) if kernel_class is None else call_of(kernel_class(problem, config))
    named = variants.input_avals(problem)
    if symbolic_m:
        (m,) = jax.export.symbolic_shape("m")
        named = variants.symbolic_avals(problem, m)
    avals = list(named.values())
    return jax.export.export(jax.jit(call), platforms=["cuda"],
                             disabled_checks=cutlass.jax.get_export_disabled_safety_checks())(*avals)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("tests", "bench", "mxfp8", "mxfp8_bench"), default=None)
    ap.add_argument("--out", default=str(REPO / ".out" / "kgpu"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    man_path = out / "manifest.json"
    man = json.loads(man_path.read_text()) if man_path.is_file() else {}
    for key in ("tests", "bench", "mxfp8", "mxfp8_bench"):
        if args.only in (None, key):
            # a rebuilt section replaces the old one (its modules may be stale), other sections are kept
            for name in man.get(key, {}):
                (out / f"{name}.jaxexp").unlink(missing_ok=True)
            man[key] = {}
        man.setdefault(key, {})
    todo = []
    if args.only in (None, "tests"):
        for p in variants.problems(TEST_SHAPE, mxfp8=False, fp4=False):
            todo.append(("tests", "var_" + _name(p), p, None, True))
        for name, p, cfg in edge_cases():
            todo.append(("tests", name, p, cfg, True))
    if args.only in (None, "bench"):
        for shape_name, (m, n, k, L) in SHAPES.items():
            op, act = FUSION[shape_name]
            epi = Epilogue(act=act, c_dtype="bfloat16" if op == "glu" else None, d_dtype="bfloat16",
                           compute_amax=True)
            p = GroupedGemmProblem(op=op, m=m, n=n, k=k, num_groups=L, ab_dtype="bfloat16", epilogue=epi)
            for cfg_name, cfg in BENCH_CONFIGS.items():
                todo.append(("bench", f"bench_{shape_name}_{cfg_name}", p, cfg, False))
    if args.only in (None, "mxfp8"):
        for name, p, cfg in mxfp8_cases():
            todo.append(("mxfp8", name, p, cfg, True))
    if args.only in (None, "mxfp8_bench"):
        for name, (_, _, cfg, *variant) in MXFP8_BENCH.items():
            todo.append(("mxfp8_bench", f"mxbench_{name}", mxfp8_bench_problem(name), cfg, False, *variant))
    failed = 0
    for kind, name, p, cfg, sym, *variant in todo:
        t0 = time.perf_counter()
        variant = variant[0] if variant else None
        try:
            kernel_class = None
            if variant is not None:
                from lab.bench_kernels import KERNEL_CLASSES

                kernel_class = KERNEL_CLASSES[variant](p)
            exp = export(p, cfg, sym, kernel_class)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:500]}", flush=True)
            failed += 1
            continue
        (out / f"{name}.jaxexp").write_bytes(exp.serialize())
        man[kind][name] = manifest_entry(p, cfg, sym, variant)
        print(f"ok   {name:<44} {time.perf_counter() - t0:5.1f} s", flush=True)
    man_path.write_text(json.dumps(man, indent=1, sort_keys=True))
    print(f"{len(todo) - failed}/{len(todo)} artifacts in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
