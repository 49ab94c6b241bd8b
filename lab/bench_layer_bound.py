"""Where the routed layer's GEMM time goes (issue 21): the expert MLP alone (`nn.moe_mlp` forward + backward on the
permuted rows: FC1 SwiGLU, FC2, the FC2 dgrad (dSwiGLU), the FC1 dgrad, dW2, dW1 -- the layer's six GEMM kernels) at
each config of `benchmarks.bench_moe_layer`, on three row layouts with the same T * k routed rows:

  routed   a random router's routing (`nn.route`, 64-row groups): the rows the layer's kernels compute;
  even     every expert exactly T * k / E rows (a multiple of 128 at every config): no tile holds a padded row;
  pooled   every row one expert's (L = 1): each B tile is reused by every M tile, so the weights stay in L2.

routed / even is the cost of the padded tiles, even / pooled the cost of streaming E experts' weights (each read by
few tiles), pooled / peak the kernels' own rate on the shapes. Device time (CUPTI span of 3 back-to-back steps, per
step), useful TFLOP/s = 18 T k H I / time, and each GEMM kernel's device time in one profiled step.

    python -m lab.bench_layer_bound [--configs 8e,64e,128e]     # checkout root, GPU machine with torch
"""

from __future__ import annotations

CALLS = 3
LAYOUTS = ("routed", "even", "pooled")


def _step():
    import jax
    import jax.numpy as jnp

    from cudnn_moe_jax import nn

    def loss(x_perm, w1, w2, prob, offsets, dy):
        y = nn.moe_mlp(x_perm, w1, w2, prob, None, offsets, m_aligned=nn.routing.M_ALIGNED)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _avals(name, experts):
    """(x_perm, w1, w2, prob, offsets, dy) of the config, with `experts` weight matrices."""
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_moe_layer import CONFIGS
    from cudnn_moe_jax import nn

    t, h, i, e, k = CONFIGS[name]
    m = nn.permuted_rows(t, k, e)
    s = jax.ShapeDtypeStruct
    return (s((m, h), jnp.bfloat16), s((experts, 2 * i, h), jnp.bfloat16), s((experts, h, i), jnp.bfloat16),
            s((m,), jnp.float32), s((experts,), jnp.int32), s((m, h), jnp.bfloat16))


def bundle_items(configs=("8e", "64e", "128e")):
    """The step lowered for CUDA with E experts (routed, even) and one (pooled), at every config."""
    import jax

    from benchmarks.bench_moe_layer import CONFIGS

    return [lambda n=n, l=l: jax.jit(_step()).trace(*_avals(n, l)).lower(lowering_platforms=("cuda",))
            for n in configs for l in (CONFIGS[n][3], 1)]


def _offsets(name, layout):
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_moe_layer import CONFIGS
    from cudnn_moe_jax import nn

    t, _, _, e, k = CONFIGS[name]
    if layout == "pooled":
        return jnp.array([t * k], jnp.int32)
    if layout == "even":
        return jnp.arange(1, e + 1, dtype=jnp.int32) * (t * k // e)
    experts = jax.lax.top_k(jax.random.normal(jax.random.PRNGKey(0), (t, e)), k)[1].astype(jnp.int32)
    return nn.route(experts, e).padded_offsets


def run(name: str, timer) -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_moe_layer import CONFIGS, GEMM_KERNEL_MARKS, device_kernel_times, useful_flops

    t, h, i, e, k = CONFIGS[name]
    flops = useful_flops(t, h, i, k)
    f = jax.jit(_step())
    for layout in LAYOUTS:
        avals = _avals(name, 1 if layout == "pooled" else e)
        keys = jax.random.split(jax.random.PRNGKey(1), 4)
        x = jax.random.normal(keys[0], avals[0].shape, jnp.float32).astype(jnp.bfloat16)
        w1 = (jax.random.normal(keys[1], avals[1].shape, jnp.float32) / h ** 0.5).astype(jnp.bfloat16)
        w2 = (jax.random.normal(keys[2], avals[2].shape, jnp.float32) / i ** 0.5).astype(jnp.bfloat16)
        dy = jax.random.normal(keys[3], avals[5].shape, jnp.float32).astype(jnp.bfloat16)
        prob = jnp.full(avals[3].shape, 0.5, jnp.float32)
        offsets = _offsets(name, layout)
        args = (x, w1, w2, prob, offsets, dy)
        computed = int(offsets[-1])
        jax.block_until_ready(f(*args))
        best = min(timer.time(lambda: jax.block_until_ready([f(*args) for _ in range(CALLS)]), CALLS).device
                   for _ in range(3))
        kernels = {n: us for n, us in device_kernel_times(f, args, 70).items()
                   if any(mark in n for mark in GEMM_KERNEL_MARKS)}
        gemm = sum(kernels.values())
        print(f"{name}: {layout:7s} {best * 1e3:8.3f} ms {flops / best / 1e12:6.1f} useful TFLOP/s  GEMM kernels "
              f"{gemm:8.1f} us ({flops / gemm / 1e6:6.1f} useful TFLOP/s; rows computed {computed} of "
              f"{t * k} routed, {computed / (t * k):.3f}x)", flush=True)
        for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"    {us:9.1f} us  {kname}", flush=True)


def main(argv=None):
    from lab import device_timer

    device_timer.config_main(run, __doc__, "8e,64e,128e", argv)


if __name__ == "__main__":
    main()
