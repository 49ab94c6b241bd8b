"""Where does the back-to-back time go? A CUPTI kernel timeline (through torch.profiler, which records every
kernel of the process, JAX's included) of the 20-call jitted program of probe_launch_overhead.py.

    python -m lab.trace_launch_gaps [KERNEL ...]   # checkout root, GPU machine with torch; kernels as for the probe

Prints, for the last profiled program: each kernel's name, start offset, duration and the idle gap before it,
then the medians (GEMM duration, gap between consecutive GEMMs, zeroing-kernel duration) and the wall time per
call, so kernel time, launch gaps and host time can be told apart.
"""

from __future__ import annotations

import statistics
import sys
import time

from lab import probe_launch_overhead as probe


def main(name: str = "small_t256c21") -> None:
    import jax
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    many, sets, flops = probe.setup(name)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(many(*sets))
            wall = (time.perf_counter() - t0) / probe.ITERS
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        print("no CUDA kernel in the trace (CUPTI unavailable?)")
        return
    # The GEMM is the kernel name with the longest median duration (the zeroing kernels are tiny).
    by_name = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    gemm_name = max(by_name, key=lambda n: statistics.median(by_name[n]))
    gemm = [e for e in kernels if e.name == gemm_name]
    last = kernels[-(len(kernels) // 3):]  # the last of the three programs
    t_first = last[0].time_range.start
    prev_end = None
    for e in last:
        gap = "" if prev_end is None else f"gap {e.time_range.start - prev_end:8.1f} us"
        print(f"{e.time_range.start - t_first:10.1f} us  {e.time_range.elapsed_us():8.1f} us  {gap:>16}  "
              f"{e.name[:70]}")
        prev_end = e.time_range.end
    gemm_us = [e.time_range.elapsed_us() for e in gemm]
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(gemm, gemm[1:])]
    others = [e.time_range.elapsed_us() for e in kernels if e not in gemm]
    print(f"{name}: GEMM median {statistics.median(gemm_us):.1f} us ({flops / statistics.median(gemm_us) / 1e6:.0f}"
          f" TFLOP/s), GEMM-to-GEMM idle median {statistics.median(gaps):.1f} us, other kernels "
          f"{len(others)} (median {statistics.median(others) if others else 0:.1f} us), wall {wall * 1e6:.1f} us/call")


if __name__ == "__main__":
    for kernel in sys.argv[1:] or ["small_t256c21"]:
        main(kernel)
