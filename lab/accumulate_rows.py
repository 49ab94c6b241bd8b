"""bench_moe_ops' wgrad rows with an fp32 or accumulated-into W on e128_a128 and `small`, for tree A/B runs:
`rows` the accumulating ones ("wgrad w2 accum f32 / bf16"; RESULTS runs 181-184), `fp32_rows` the fp32-W ones
("wgrad w2 accum f32", "wgrad w1 f32": float32 master weights; runs 178-180, then `lab.master_weights:rows`).

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_a --variants lab.accumulate_rows:rows
    python -c "import lab.bench_dequant_first; from benchmarks import bench_moe_ops as b; \
        [b.main(['--shape', s, '--only', 'accum']) for s in ('e128_a128', 'small')]"     # in each tree, alternated
                                                                                         # (fp32_rows: --only f32)
"""

SHAPES = ("e128_a128", "small")


def _rows(only: str):
    import lab.bench_dequant_first  # noqa: F401  (registers e128_a128)
    from benchmarks import bench_moe_ops

    return bench_moe_ops.bundle_items(SHAPES, only)


def rows():
    return _rows("accum")


def fp32_rows():
    return _rows("f32")
