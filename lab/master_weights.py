"""float32 master weights: the wgrads producing an fp32 W (stored from registers) and the layer step with float32
W1 / W2, in a tree against another (RESULTS run 177: the fp32 W from registers +10-16% on the accumulating W2 row).

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_m --variants lab.master_weights:rows \
        lab.master_weights:layer_items
    python -c "import lab.bench_dequant_first; from benchmarks import bench_moe_ops; \
        bench_moe_ops.main(['--shape', 'e128_a128', '--only', 'f32'])"          # in each tree, alternated
    python -c "from lab import master_weights; master_weights.layer_main(['64e', '128e'])"
"""

CONFIGS = ("8e", "64e", "128e")


def rows():
    """bench_moe_ops' fp32-W wgrad rows on e128_a128 and `small`."""
    import lab.bench_dequant_first  # noqa: F401  (registers e128_a128)
    from benchmarks import bench_moe_ops

    return bench_moe_ops.bundle_items(("e128_a128", "small"), "f32")


def _avals(name):
    """bench_moe_layer's step arguments with W1 / W2 in float32 (cast to bf16 inside the layer)."""
    import jax
    import jax.numpy as jnp

    from benchmarks import bench_moe_layer as bml

    avals = list(bml._avals(name))
    for j in (2, 3):
        avals[j] = jax.ShapeDtypeStruct(avals[j].shape, jnp.float32)
    return avals


def layer_items(configs=CONFIGS):
    """CUDA lowerings of the float32-master layer step (`nn.moe_layer`, bench_moe_layer's step) per config."""
    import jax

    from benchmarks import bench_moe_layer as bml

    return [lambda name=name: jax.jit(bml.ours_step(bml.CONFIGS[name][4])).trace(*_avals(name)).lower(
        lowering_platforms=("cuda",)) for name in configs]


def layer_main(configs=CONFIGS) -> None:
    """Median device time of the float32-master layer step per config (bench_moe_layer's REPS samples)."""
    import statistics

    from benchmarks import bench_moe_layer as bml
    from lab import device_timer

    timer, why = device_timer.cupti_timer()
    if timer is None:
        raise SystemExit(f"no CUPTI timer: {why}")
    for name in configs:
        t, h, i, _, k = bml.CONFIGS[name]
        once, fallbacks = bml._jax_runner(bml.ours_step(k), _avals(name), timer, device_timer)
        if fallbacks:
            raise SystemExit(f"{name}: reference fallback: {fallbacks}")
        ms = statistics.median(device_timer.primary([once() for _ in range(bml.REPS)])[1]) * 1e3
        print(f"{name:5s} f32 masters {ms:9.3f} ms {bml.useful_flops(t, h, i, k) / ms / 1e9:7.1f} useful TFLOP/s",
              flush=True)
