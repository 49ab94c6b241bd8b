"""Where the block-scaled kernels stand on a memory-bound format shape (issue 19's e128_fc1: 128 experts x 128 rows,
H 4096, I 1024, SwiGLU with bf16 C and D), and what bounds them: every case in one interleaved timing (CUPTI device
time, 20 calls a program on distinct inputs, median of 7 rounds), then each case repeated for 2 s while nvidia-smi
samples the SM clock and the board power (the H200 holds 700 W), so energy per call = power x time.

Cases:
  bf16                   the public op on bf16 weights (each expert's 16 MiB of weights streamed from DRAM once);
  bf16 L2 / bf16 L2 fp4  the bf16 kernel with every expert's weights the *same* array (discrete weights, one
                         buffer): no weight traffic from DRAM -- the schedule's rate with the weights free, on N(0, 1)
                         weights and on NVFP4-valued ones (the tensor cores' energy follows the operands' entropy);
  <fmt>                  the public op (the on-chip dequantizing mainloop at 128 rows per expert);
  <fmt> cb<n>            its default schedule with n of B's 32 passes a stage converted by the consumer warps (the
                         default: 24 at 1 x 1 clusters, 16 before session 24; the stage workers take the rest);
  <fmt> branch           16 consumer passes, each behind a per-warp branch: the mainloop before session 24
                         (lab.mainloop_variants.branch_class), the A/B of both changes;
  <fmt> swapped          weight-only, the weights as the RS wgmma's register operand (lab.mainloop_variants);
  <fmt> tn128_cb<n>      its default schedule with 128-column tiles (and n consumer B passes).
`VARIANTS` picks the labels timed (and built) beside the public op (`--variants`, `--formats` narrow a run).
Plus torch's grouped GEMMs on the same shape.

    python -m cudnn_moe_jax.aot build --arch sm_90a --out DIR --variants lab.bench_memory_bound:bundle_items
    CUDNN_MOE_JAX_BUNDLE=DIR python -m lab.bench_memory_bound [--shapes e128_fc1,e128_fc2]   # GPU, checkout root
"""

from __future__ import annotations

SHAPES = ("e128_fc1", "e128_fc2")
FORMATS = ("nvfp4", "mxfp4", "mxfp8", "w_nvfp4", "w_mxfp8")


VARIANTS = ("branch", "cb16", "cb20", "swapped")   # ("swapped": weight-only formats only)


def _config(label: str, problem):
    """The Config of a case label on `problem`: its default with the label's change."""
    import dataclasses

    from cudnn_moe_jax.kernels.sm90.config import default_config

    from . import swapped_weights as sw

    if label == "swapped":
        return sw.config()
    if label == "branch":
        return dataclasses.replace(default_config(problem), consumer_b_passes=16, mx_n_parts=sw.BRANCH_MARK)
    cfg = default_config(problem)
    for part in label.split("_"):   # e.g. "tn128_cb16"
        if part == "pnull":
            cfg = dataclasses.replace(cfg, consumer_b_passes=sw.PNULL_MARK)
        elif part == "oldtest":
            cfg = dataclasses.replace(cfg, consumer_b_passes=sw.OLDTEST_MARK)
        elif part == "foldall":
            cfg = dataclasses.replace(cfg, consumer_b_passes=sw.FOLDALL_MARK)
        elif part in sw.NO_NAN_LABELS:
            cfg = dataclasses.replace(cfg, consumer_b_passes=sw.NO_NAN_LABELS[part])
        elif part in sw.WIDE_LABELS:
            cfg = dataclasses.replace(cfg, consumer_b_passes=sw.WIDE_LABELS[part])
        elif part.startswith("tn"):
            cfg = dataclasses.replace(cfg, tile_n=int(part[2:]))
        else:
            cfg = dataclasses.replace(cfg, consumer_b_passes=int(part[2:]))
    return cfg


def cases(shape: str, formats=FORMATS, variants=VARIANTS):
    """(label, format, config label or None (the public op), problem or None) on `shape`."""
    from . import bench_kernels as bk

    out = [("bf16", "bf16", None, None), ("bf16 L2", "bf16", "l2", None), ("bf16 L2 fp4", "bf16", "l2fp4", None)]
    for fmt in formats:
        p = bk.format_problem(shape, fmt)
        out.append((fmt, fmt, None, None))
        for c in variants:
            if c == "swapped" and not fmt.startswith("w_"):
                continue
            out.append((f"{fmt} {c}", fmt, c, p))
    return out


def l2_call(shape: str):
    """fn(a, b (N, K), padded_offsets, alpha, prob): the bf16 public op with every expert's weights `b`."""
    from benchmarks import bench_cases as bc

    (_, _, _, L), (op, act), rows = bc.format_shape(shape)

    def fn(a, b, padded_offsets, alpha, prob):
        return bc._call(op, act, dict(a_tensor=a, b_tensors=[b] * L, padded_offsets=padded_offsets,
                                      alpha_tensor=alpha, prob_tensor=prob, m_aligned=rows))

    return fn


def fp8_test_items() -> list:
    """The modules of `--formats mxfp8,w_mxfp8 --variants oldtest,foldall,cb32` on e128 (session 28's open A/Bs)."""
    return bundle_items(("mxfp8", "w_mxfp8"), ("oldtest", "foldall", "cb32"))


def bundle_items(formats=FORMATS, variants=VARIANTS) -> list:
    """(a build with lab.swapped_weights.patch applied, which this does) every case's module."""
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks import bench_cases as bc

    from . import swapped_weights as sw
    from .forward_cases import lowering_item

    sw.patch()
    items = bc.format_bundle_items(SHAPES, ("bf16",) + tuple(formats))
    for shape in SHAPES:
        (m, n, k, L), _, _ = bc.format_shape(shape)
        s = jax.ShapeDtypeStruct
        l2 = (s((m, k), jnp.bfloat16), s((n, k), jnp.bfloat16), s((L,), jnp.int32), s((L,), jnp.float32),
              s((m,), jnp.float32))
        items.append(functools.partial(bc._lower_for_cuda, l2_call(shape), l2))
        items += [lowering_item(p, _config(c, p)) for _, _, c, p in cases(shape, formats, variants) if p is not None]
    return items


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    for shape in args.shapes.split(","):
        run(shape, tuple(args.formats.split(",")), tuple(v for v in args.variants.split(",") if v))


def run(shape: str, formats=FORMATS, variants=VARIANTS) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bench_cases as bc
    from benchmarks import bench_grouped_gemm as bg
    from cudnn_moe_jax import formats as fmts

    from .bench_staged import clock_and_power
    from .forward_cases import kernel_fn

    _, timer, _ = bg._session()
    (m, n, k, L), _, rows = bc.format_shape(shape)
    key = jax.random.PRNGKey(0)
    offsets = jnp.asarray(np.arange(1, L + 1, dtype=np.int32) * rows)
    alpha, prob = jnp.ones((L,), jnp.float32), jax.random.uniform(jax.random.fold_in(key, 2), (m,))
    a_f32 = [jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.float32) for i in range(bg.ITERS)]
    w = jax.random.normal(jax.random.fold_in(key, 1), (L, n, k), jnp.float32) / np.sqrt(k)
    runners, quantized = {}, {}
    for label, fmt, cfg, problem in cases(shape, formats, variants):
        data, sf, vec = bc.BLOCK_FORMATS[bc.WEIGHT_ONLY.get(fmt, fmt)] if fmt != "bf16" else (None, None, None)
        if fmt not in quantized:
            quant = (lambda x: (x.astype(jnp.bfloat16), None)) if fmt == "bf16" else \
                (lambda x: fmts.to_block_scaled(x, data, sf, vec))
            quant_a = quant if fmt not in bc.WEIGHT_ONLY and fmt != "bf16" else (lambda x: (x.astype(jnp.bfloat16),
                                                                                             None))
            quantized[fmt] = (jax.jit(quant)(w), [jax.jit(quant_a)(x) for x in a_f32])
        (b, sfb), a_sets = quantized[fmt]
        if cfg in ("l2", "l2fp4"):
            w0 = w[0]
            if cfg == "l2fp4":
                codes, s = fmts.to_block_scaled(w0, "nvfp4")
                w0 = fmts.from_block_scaled(codes, s, "nvfp4")
            sets = [(a, w0.astype(jnp.bfloat16), offsets, alpha, prob) for a, _ in a_sets]
            fn = l2_call(shape)
        else:
            sets = [(a, b, sa, sfb, offsets, alpha, prob) for a, sa in a_sets]
            fn = bc.block_call(shape, fmt)
            if cfg is not None:
                sets = [tuple(x for x in st if x is not None) for st in sets]
                fn = kernel_fn(problem, _config(cfg, problem))
        runners[label] = bg._jax_runner(bg.public_op(fn, sets[0], label), sets, timer)
    row = {}
    runners.update(bg._torch_format_runners(row, m, n, k, L, rows))
    stats = bg.time_interleaved(runners, row)
    flops = 2.0 * m * n * k
    base = stats["bf16"][0]
    print(f"{shape}: m {m}, N {n}, K {k}, {L} experts; TFLOP/s = 2 m N K / median device time")
    print("| case | ms | TFLOP/s | time bf16 / case | SM MHz | board W | energy / call (mJ) |")
    print("|---|---|---|---|---|---|---|")
    for label, (med, lo, hi) in stats.items():
        mhz, watts = clock_and_power(runners[label])
        print(f"| {label} | {med * 1e3:.3f} | {flops / med / 1e12:.1f} | {base / med:.2f}x | {mhz:.0f} | {watts:.0f} "
              f"| {watts * med * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
