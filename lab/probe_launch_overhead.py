"""Probe: is the back-to-back JAX gap (kernel ~192 us on ncu vs ~249 us per call in a jitted loop, `small`) XLA's
command buffers (CUDA graphs re-recorded around our FFI custom call) or something else?

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m lab.probe_launch_overhead [KERNEL]   # checkout root

Times a bf16 lab benchmark kernel (lab/bench_kernels.py, e.g. small_t256c21; its module from the bundle) 20 calls
on 20 input sets inside one jit, median of 7, and prints per-call microseconds and TFLOP/s with the XLA_FLAGS it ran
under. Compare two runs (flag on/off).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from cudnn_moe_jax.shapes import GROUP_SIZES

ITERS = 20


def setup(name: str):
    """(jitted program of ITERS calls, its input sets, FLOP per call) for bf16 benchmark kernel `name`."""
    import jax
    import jax.numpy as jnp

    from lab import bench_kernels, harness
    from lab.forward_cases import kernel_fn

    p, config = bench_kernels.case(name)
    m, n, k, L = p.m, p.n, p.k, p.num_groups
    offsets = jnp.asarray(np.cumsum(GROUP_SIZES[name.split("_")[0]]).astype(np.int32))
    keys = jax.random.split(jax.random.PRNGKey(0), 3 * ITERS)
    sets = [(jax.random.normal(keys[3 * i], (m, k)).astype(jnp.bfloat16),
             (jax.random.normal(keys[3 * i + 1], (L, n, k)) / k ** 0.5).astype(jnp.bfloat16), offsets,
             jnp.ones((L,), jnp.float32), jax.random.uniform(keys[3 * i + 2], (m,))) for i in range(ITERS)]
    fn = kernel_fn(p, config)
    many = jax.jit(lambda *s: [fn(*s[i]) for i in range(ITERS)])
    with harness.kernels_only():
        jax.block_until_ready(many(*sets))
    return many, sets, 2.0 * int(offsets[-1]) * n * k


def main(name: str = "small_t256c21") -> None:
    import jax

    many, sets, flops = setup(name)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        jax.block_until_ready(many(*sets))
        times.append((time.perf_counter() - t0) / ITERS)
    t = statistics.median(times)
    print(f"{name}: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: {t * 1e6:.1f} us/call, "
          f"{flops / t / 1e12:.0f} TFLOP/s (spread {100 * (max(times) - min(times)) / t:.0f}%)", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
