"""Bundle items and the GPU check of the lab experiment `lab.mainloop_variants.SwappedWeightsMainloop` (the
weights as the register operand of the weight-only forward; its docstring says what it measures). Importable
without the CuTe DSL (the GPU machine has none): the kernel module is imported only by `patch()`, in a build.

    python -m lab.swapped_weights          # on the GPU, with a bundle of `bundle_items` (patched build)
"""

from __future__ import annotations

MARK = 31          # Config.consumer_b_passes value that selects the swapped mainloop in a patched build
PNULL_MARK = 18    # ... and the null-groups variant (mainloop_variants.null_groups_class; label "pnull")
NO_NAN_LABELS = {"nonan": 19, "pmin": 17}   # ... and the no-NaN-test variants (mainloop_variants.no_nan_class)
NO_NAN_MARKS = {v: k for k, v in NO_NAN_LABELS.items()}
OLDTEST_MARK = 13  # ... and the NaN test before session 28 (mainloop_variants.old_nan_test_class; label "oldtest")
FOLDALL_MARK = 12  # ... and every FP8 group folded (mainloop_variants.fold_all_class; label "foldall")
BRANCH_MARK = 4    # Config.mx_n_parts value (which only the opt-in FP8-wgmma mainloop reads) that selects the
#                    per-pass branch variant (mainloop_variants.branch_class)
# Config.consumer_b_passes values that select the wide-row variants (mainloop_variants.wide_class) by label
WIDE_LABELS = {"wide": 30, "wfast": 28, "wnulla": 27, "wnullb": 26, "wnullab": 25, "wfastp": 24,
               "wnullabp": 23}
WIDE_MARKS = {v: k for k, v in WIDE_LABELS.items()}


def patch():
    """In a bundle build: weight-only problems with Config.consumer_b_passes == MARK (and tile 128 x 128, 1 x 1)
    get the swapped mainloop, dequantizing ones with Config.mx_n_parts == BRANCH_MARK the per-pass branch variant."""
    from cudnn_moe_jax.kernels.sm90 import mainloop_dequant as md

    from .mainloop_variants import (branch_class, fold_all_class, no_nan_class, null_groups_class, old_nan_test_class,
                                    swapped_class, wide_class)

    orig = md.mainloop_class

    def mainloop_class(problem, config):
        cls = orig(problem, config)
        if config.consumer_b_passes == MARK:
            assert cls.FORMAT.a_plain and not cls.FORMAT.a_split and config.tile_n == 128 and config.cluster_m == 1
            return swapped_class(cls)
        if config.consumer_b_passes in WIDE_MARKS:
            return wide_class(cls, WIDE_MARKS[config.consumer_b_passes])
        if config.consumer_b_passes == PNULL_MARK:
            return null_groups_class(cls)
        if config.consumer_b_passes in NO_NAN_MARKS:
            return no_nan_class(cls, NO_NAN_MARKS[config.consumer_b_passes])
        if config.consumer_b_passes == OLDTEST_MARK:
            return old_nan_test_class(cls)
        if config.consumer_b_passes == FOLDALL_MARK:
            return fold_all_class(cls)
        if config.mx_n_parts == BRANCH_MARK and not config.mxfp8_wgmma:
            return branch_class(cls)
        return cls

    md.mainloop_class = mainloop_class




# ------------------------------------------------------------------------------------------------ bundle and check
SWAPPED = dict(tile_n=128, cluster_m=1, consumer_b_passes=MARK)
CHECK_FORMATS = {"w_nvfp4": ("float4_e2m1fn", "float8_e4m3fn", 16),
                 "w_mxfp8": ("float8_e4m3fn", "float8_e8m0fnu", 32),
                 "w_mxfp4": ("float4_e2m1fn", "float8_e8m0fnu", 32)}


def check_problem(fmt: str):
    from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem

    data, sf, vec = CHECK_FORMATS[fmt]
    return GroupedGemmProblem(op="quant", m=512, n=256, k=512, num_groups=4, ab_dtype=data, sf_dtype=sf,
                              sf_vec_size=vec, a_dtype="bfloat16", epilogue=Epilogue(d_dtype="float32"),
                              m_aligned=128)


def config(**kw):
    from cudnn_moe_jax.kernels.sm90 import Config

    return Config(**{**SWAPPED, **kw})


def bench_configs() -> dict:
    """label -> Config (None: the default) timed on e128_fc1: the swapped mainloop with 1 x 1 and 1 x 2 clusters
    (x multicast along N), the default mainloop with 1 x 2 clusters and with more consumer B passes."""
    from cudnn_moe_jax.kernels.sm90 import Config

    return {"default": None, "c12": Config(cluster_m=1, cluster_n=2),
            "cb24": Config(cluster_m=1, consumer_b_passes=24), "cb32": Config(cluster_m=1, consumer_b_passes=32),
            "swapped": config(), "swapped_c12": config(cluster_n=2)}


def bench_problem(shape: str, fmt: str):
    """The format comparison's problem (lab.bench_kernels.format_problem), bf16 inputs included."""
    import dataclasses

    from . import bench_kernels as bk

    if fmt != "bf16":
        return bk.format_problem(shape, fmt)
    p = bk.format_problem(shape, "w_nvfp4")
    return dataclasses.replace(p, ab_dtype="bfloat16", sf_dtype=None, sf_vec_size=None, a_dtype=None)


BENCH_FORMATS = ("bf16", "w_nvfp4", "w_mxfp8")


def bench_cases(shape: str = "e128_fc1"):
    for fmt in BENCH_FORMATS:
        for label, cfg in bench_configs().items():
            if fmt == "bf16" and (label.startswith("swapped") or label.startswith("cb")):
                continue
            yield fmt, label, bench_problem(shape, fmt), cfg


def bench(shape: str = "e128_fc1") -> None:
    """Every bench case in one interleaved timing (benchmarks.bench_grouped_gemm's runners: CUPTI device time, 20
    calls a program on distinct inputs, median of 7 rounds): TFLOP/s and time bf16 / case."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_cases as bc
    from benchmarks import bench_grouped_gemm as bg
    from cudnn_moe_jax import formats

    from .forward_cases import kernel_fn

    _, timer, _ = bg._session()
    (m, n, k, L), _, rows = bc.format_shape(shape)
    key = jax.random.PRNGKey(0)
    offsets = jnp.asarray(np.arange(1, L + 1, dtype=np.int32) * rows)
    alpha, prob = jnp.ones((L,), jnp.float32), jax.random.uniform(jax.random.fold_in(key, 2), (m,))
    a_sets = [jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.float32).astype(jnp.bfloat16)
              for i in range(bg.ITERS)]
    w = jax.random.normal(jax.random.fold_in(key, 1), (L, n, k), jnp.float32) / np.sqrt(k)
    runners, weights = {}, {}
    for fmt, label, problem, cfg in bench_cases(shape):
        if fmt not in weights:
            if fmt == "bf16":
                weights[fmt] = (w.astype(jnp.bfloat16),)
            else:
                data, sf, vec = bc.BLOCK_FORMATS[bc.WEIGHT_ONLY[fmt]]
                weights[fmt] = tuple(jax.jit(lambda x: formats.to_block_scaled(x, data, sf, vec))(w))
        sets = [(a,) + weights[fmt] + (offsets, alpha, prob) for a in a_sets]
        fn = bg.public_op(kernel_fn(problem, cfg), sets[0], f"{fmt},{label}")
        runners[f"{fmt},{label}"] = bg._jax_runner(fn, sets, timer)
    row = {}
    stats = bg.time_interleaved(runners, row)
    flops = 2.0 * m * n * k
    base = stats["bf16,default"][0]
    for name, (med, lo, hi) in stats.items():
        print(f"{shape} {name:22s} {med * 1e3:7.3f} ms {flops / med / 1e12:7.1f} TFLOP/s  spread "
              f"{100 * (hi - lo) / med:4.1f}%  time bf16 / case {base / med:5.2f}x", flush=True)


def bundle_items() -> list:
    """(patched build) the check problems (swapped and default) and the e128_fc1 weight-only rows: swapped, the
    public op, bf16."""
    from .forward_cases import lowering_item

    patch()
    out = []
    for fmt in CHECK_FORMATS:
        out += [lowering_item(check_problem(fmt), config()), lowering_item(check_problem(fmt), None)]
    return out + [lowering_item(p, cfg) for _, _, p, cfg in bench_cases()]


def check() -> int:
    """On the GPU: the swapped kernel's D equals the default kernel's D transposed per 128 x 128 tile (every
    element, bit for bit up to summation order: compared exactly and by max relative error)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .forward_cases import kernel_fn

    bad = 0
    for fmt in CHECK_FORMATS:
        p = check_problem(fmt)
        rng = np.random.default_rng(0)
        x = {"a": jnp.asarray(rng.standard_normal((p.m, p.k)), jnp.bfloat16),
             "b": jnp.asarray(rng.integers(0, 256, (p.num_groups, p.n, p.k // (2 if "fp4" in fmt else 1)),
                                           dtype=np.uint8)),
             "sfb": None, "padded_offsets": jnp.arange(1, 5, dtype=jnp.int32) * 128,
             "alpha": jnp.ones((4,), jnp.float32), "prob": jnp.ones((p.m,), jnp.float32)}
        from cudnn_moe_jax import operands

        shape = operands.input_specs(p)["sfb"][0]
        lo, hi = (0x30, 0x40) if p.sf_dtype == "float8_e4m3fn" else (120, 130)
        x["sfb"] = jnp.asarray(rng.integers(lo, hi, shape, dtype=np.uint8))
        if "mxfp8" in fmt:   # no NaN codes (a NaN would make the comparison of NaN rows vacuous)
            x["b"] = jax.lax.bitcast_convert_type(jnp.where((x["b"] & 0x7F) == 0x7F, jnp.uint8(0x7E), x["b"]),
                                                  jnp.float8_e4m3fn)
        args = [x[n] for n in operands.input_specs(p)]
        ref_out = jax.block_until_ready(kernel_fn(p, None)(*args))
        key = next(k for k in ref_out if k.startswith("d"))
        ref = np.asarray(ref_out[key])
        got = np.asarray(jax.block_until_ready(kernel_fn(p, config())(*args))[key])
        want = ref.reshape(4, 128, 2, 128).transpose(0, 3, 2, 1).reshape(p.m, p.n)
        err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
        same = np.mean(got == want)
        print(f"{fmt}: max |swapped - default^T| / max|D| = {err:.2e}, identical elements {same:.4f}", flush=True)
        bad += not (err < 1e-5 and np.all(np.isfinite(got)))
    return bad


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["bench"]:
        bench()
    else:
        raise SystemExit(check())
