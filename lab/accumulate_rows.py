"""bench_moe_ops' accumulating wgrad rows ("wgrad w2 accum f32 / bf16": accumulate_on_output into an fp32 or bf16
W) on e128_a128 and `small`, for tree A/B runs (RESULTS runs 181-183):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_a --variants lab.accumulate_rows:rows
    python -c "import lab.bench_dequant_first; from benchmarks import bench_moe_ops as b; \
        [b.main(['--shape', s, '--only', 'accum']) for s in ('e128_a128', 'small')]"     # in each tree, alternated
"""


def rows():
    import lab.bench_dequant_first  # noqa: F401  (registers e128_a128)
    from benchmarks import bench_moe_ops

    return bench_moe_ops.bundle_items(("e128_a128", "small"), "accum")
