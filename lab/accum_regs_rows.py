"""The accumulating wgrad rows ("accum": bf16 and fp32 W) on e128_a128 and `small`, for tree A/B runs."""


def rows():
    import lab.bench_dequant_first  # noqa: F401  (registers e128_a128)
    from benchmarks import bench_moe_ops

    return bench_moe_ops.bundle_items(("e128_a128", "small"), "accum")
