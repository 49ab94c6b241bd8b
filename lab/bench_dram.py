"""The GPU's DRAM rates as XLA reaches them (CUPTI device span): a write-only fill, a read-only sum and a copy of
1 GiB of fp32 (XLA's 2-byte stores run at half the rate: NOTES.md), each one kernel a program, the median of 5 --
the ceilings the DRAM-byte floors of benchmarks/RESULTS.md divide by (a wgrad with few tokens per expert mostly
writes W). (A program of several such calls would let XLA fuse them into one pass over the input.) Beside them, where
torch sees the GPU, torch's fill, memset (`zero_`) and copy of the same bytes (CUDA events, median of 5): a second
writer, so the write ceiling does not rest on one kernel.

    python -m lab.bench_dram [--gib 1]
"""

from __future__ import annotations

import argparse
import statistics

from lab import device_timer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    timer, why = device_timer.cupti_timer()
    if timer is None:
        raise SystemExit(f"no CUPTI timer: {why}")
    n = int(args.gib * (1 << 30)) // 4
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32)
    s = jnp.asarray(0.5, jnp.float32)
    kinds = {   # name: (one kernel, bytes it moves)
        "fill (write)": (lambda x, s: jnp.full((n,), s, jnp.float32), 4 * n),
        "sum (read)": (lambda x, s: jnp.sum(x), 4 * n),
        "copy (read + write)": (lambda x, s: x + s, 8 * n),
    }
    print(f"{jax.devices()[0].device_kind}: {4 * n / 1e9:.2f} GB arrays")
    for name, (one, nbytes) in kinds.items():
        prog = jax.jit(one)
        run = lambda prog=prog: jax.block_until_ready(prog(x, s))  # noqa: E731
        run()
        secs = statistics.median(timer.time(run, 1).device for _ in range(5))
        print(f"{name:22s} {secs * 1e6:9.1f} us  {nbytes / secs / 1e12:5.2f} TB/s")
    torch_rates(4 * n)


def torch_rates(nbytes: int) -> None:
    """torch's fill, memset and copy of `nbytes` of fp32 (CUDA events, median of 5), where torch sees the GPU."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    t = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    u = torch.empty_like(t)
    kinds = {"torch fill_ (write)": (lambda: t.fill_(0.5), nbytes), "torch zero_ (memset)": (t.zero_, nbytes),
             "torch copy_": (lambda: u.copy_(t), 2 * nbytes)}
    for name, (one, moved) in kinds.items():
        one()
        secs = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one()
            end.record()
            torch.cuda.synchronize()
            secs.append(start.elapsed_time(end) * 1e-3)
        sec = statistics.median(secs)
        print(f"{name:22s} {sec * 1e6:9.1f} us  {moved / sec / 1e12:5.2f} TB/s")


if __name__ == "__main__":
    main()
