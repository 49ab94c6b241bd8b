"""Where does the routed layer's step go outside the GEMM kernels? A CUPTI timeline (through torch.profiler) of one
jitted step of `benchmarks.bench_moe_layer` (ours, its default alignment), with the idle time between kernels.

    python -m lab.trace_layer [--configs 8e,64e,128e] [--full] [--hlo DIR]   # checkout root, GPU machine, torch

Prints per config: the step's span, the kernels' summed time, the idle time (span - busy), the kernel count; the
largest gaps with the kernels on either side; every non-GEMM kernel of >= 5 us with the JAX source op of its
fusion (from the compiled HLO's metadata); with --full the whole timeline; with --hlo the compiled HLO of each
step as DIR/<config>.hlo.txt.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def _op_names(hlo_text: str) -> dict:
    """fusion / instruction name -> the op_name of its metadata (the JAX source of an XLA kernel)."""
    names = {}
    for m in re.finditer(r"%([\w.\-]+) = [^\n]*?metadata=\{[^}]*op_name=\"([^\"]+)\"", hlo_text):
        names.setdefault(m.group(1), m.group(2))
    return names


def trace(name: str, full: bool, hlo_dir=None) -> None:
    import jax
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import bench_moe_layer as layer

    _, _, _, _, k = layer.CONFIGS[name]
    avals = layer._avals(name)
    x = layer._inputs(avals, 7)
    f = jax.jit(layer.ours_step(k))
    compiled = f.lower(*avals).compile()
    ops = _op_names(compiled.as_text())
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(hlo_dir) / f"{name}.hlo.txt").write_text(compiled.as_text())
    for _ in range(3):
        jax.block_until_ready(f(*x))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        jax.block_until_ready(f(*x))
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not events:
        print(f"{name}: no CUDA events (CUPTI unavailable?)")
        return
    t0 = events[0].time_range.start
    span = max(e.time_range.end for e in events) - t0
    busy, gaps, prev_end, prev_name = 0.0, [], t0, "(start)"
    rows = []
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        gap = max(0.0, start - prev_end)
        busy += max(0.0, end - max(start, prev_end))
        gaps.append((gap, prev_name, e.name))
        rows.append((start - t0, e.time_range.elapsed_us(), gap, e.name))
        if end > prev_end:
            prev_end, prev_name = end, e.name
    gemm = sum(d for _, d, _, n in rows if any(m in n for m in layer.GEMM_KERNEL_MARKS))
    print(f"{name}: span {span:9.1f} us, busy {busy:9.1f} us (GEMM {gemm:9.1f}), idle {span - busy:8.1f} us, "
          f"{len(rows)} device events", flush=True)
    print(f"{name}: largest gaps")
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"    {gap:8.1f} us  after {before[:45]:45s} before {after[:45]}")
    print(f"{name}: non-GEMM kernels >= 5 us (start, duration, gap before, name, source op)")
    for start, dur, gap, kname in rows:
        is_gemm = any(m in kname for m in layer.GEMM_KERNEL_MARKS)
        if full or (dur >= 5 and not is_gemm):
            src = ops.get(kname, ops.get(kname.split(".")[0], ""))
            print(f"    {start:9.1f} {dur:8.1f} {gap:7.1f}  {kname[:40]:40s} {src[:110]}")
    idle_small = sum(g for g, _, _ in gaps if g < 20)
    print(f"{name}: idle in gaps < 20 us {idle_small:.1f} us over {sum(1 for g, _, _ in gaps if 0 < g < 20)} gaps",
          flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="8e,64e,128e")
    ap.add_argument("--full", action="store_true", help="print every device event")
    ap.add_argument("--hlo", default=None, help="write each step's compiled HLO here")
    args = ap.parse_args(argv)
    for name in args.configs.split(","):
        trace(name, args.full, args.hlo)


if __name__ == "__main__":
    main()
