"""The wgrads producing an fp32 W -- accumulated into (`accumulate_on_output`, gradient accumulation) and not
(float32 master weights) -- in one tree against another: RESULTS runs 177-178 (an fp32 W accumulated into is stored
from registers: +10-16% on the H100; one not accumulated into ran as fast by TMA and stays there).

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_m --variants lab.master_weights:rows
    python -c "import lab.bench_dequant_first; from benchmarks import bench_moe_ops as b; \
        [b.main(['--shape', s, '--only', 'f32']) for s in ('e128_a128', 'small')]"     # in each tree, alternated
"""


def rows():
    """bench_moe_ops' fp32-W wgrad rows ("wgrad w2 accum f32", "wgrad w1 f32") on e128_a128 and `small`."""
    import lab.bench_dequant_first  # noqa: F401  (registers e128_a128)
    from benchmarks import bench_moe_ops

    return bench_moe_ops.bundle_items(("e128_a128", "small"), "f32")
