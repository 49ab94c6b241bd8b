"""One MoE expert-MLP training step (forward + backward, 6 GEMMs, bf16, permuted layout) on the GPU:
ours (`nn.moe_mlp`, custom_vjp over the fused ops) vs `jax.lax.ragged_dot` + `jax.vjp` vs tokamax ragged_dot +
`jax.vjp` (when importable) vs torch `_grouped_mm` + autograd (when importable), same shapes, same run.

    python -m benchmarks.bench_moe_step [--out DIR] [--shapes fc,small,skewed] [--act swiglu]   # checkout root

JAX is timed on the device (CUPTI span of one jitted program of STEPS steps, each on its own inputs;
lab/device_timer.py); torch with CUDA events around STEPS steps. TFLOP/s = 18 * valid_m * H * I / time
(fc1 2*m*H*2I, fc2 2*m*I*H, each backward GEMM pair twice that). Kernel modules come from a bundle recorded on
the CPU machine (`bundle_items`); a step whose module is missing falls back to the reference with a warning,
which this script prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import numpy as np

SHAPES = {  # name -> (group sizes, H, I)
    "fc": ([2048] * 8, 7168, 2048),
    "small": ([256] * 64, 2048, 768),
    "skewed": ([8192, 2048, 2048, 0, 1024, 1024, 0, 2048], 7168, 2048),
}
STEPS, REPS, SETS = 4, 5, 4
# group alignment (cuDNN's m_aligned) of a shape's expert segments where not 256; bench_moe_ops passes it to the ops
ALIGN = {}


def align(name) -> int:
    return ALIGN.get(name, 256)


def flops(sizes, h, i):
    return 18.0 * sum(sizes) * h * i


def _problem(name, act, dtype="bfloat16"):
    import jax
    import jax.numpy as jnp

    sizes, h, i = SHAPES[name]
    a = align(name)
    m = sum(-(-s // a) * a for s in sizes) or a
    n1 = i if act == "srelu" else 2 * i
    offsets = np.cumsum([-(-s // a) * a for s in sizes]).astype(np.int32)
    sd = jax.ShapeDtypeStruct
    avals = (sd((m, h), dtype), sd((len(sizes), n1, h), dtype), sd((len(sizes), h, i), dtype), sd((m,), jnp.float32),
             sd((m, h), dtype))
    return m, offsets, avals


def ours_step(offsets, act):
    import jax

    from cudnn_moe_jax import nn

    off = np.asarray(offsets)

    def step(x, w1, w2, prob, dy):
        y, vjp = jax.vjp(lambda x, w1, w2, prob: nn.moe_mlp(x, w1, w2, prob, None, jax.numpy.asarray(off), act),
                         x, w1, w2, prob)
        return y, vjp(dy)

    return step


def plain_step(offsets, act, ragged_dot):
    """The same MLP written with a ragged_dot (jax.lax's or tokamax's), differentiated by jax.vjp."""
    import jax
    import jax.numpy as jnp

    sizes = jnp.asarray(np.diff(np.concatenate([[0], offsets])).astype(np.int32))

    def mlp(x, w1, w2, prob):
        c = ragged_dot(x, jnp.swapaxes(w1, 1, 2), sizes).astype(jnp.float32)
        if act == "srelu":
            h = jnp.square(jnp.maximum(c, 0.0))
        else:
            blocks = c.reshape(c.shape[0], -1, 2, 32)
            gate, up = blocks[:, :, 0], blocks[:, :, 1]
            h = (up * gate * jax.nn.sigmoid(gate)).reshape(c.shape[0], -1)
        h = (prob[:, None] * h).astype(x.dtype)
        return ragged_dot(h, jnp.swapaxes(w2, 1, 2), sizes).astype(x.dtype)

    def step(x, w1, w2, prob, dy):
        y, vjp = jax.vjp(mlp, x, w1, w2, prob)
        return y, vjp(dy)

    return step


def bundle_items(shapes=tuple(SHAPES), acts=("swiglu",)):
    """Lowerings of our step for CUDA at every benchmark shape (`python -m cudnn_moe_jax.aot build --variants
    benchmarks.bench_moe_step:bundle_items` records their modules)."""
    import jax

    items = []
    for name in shapes:
        for act in acts:
            _, offsets, avals = _problem(name, act)
            step = ours_step(offsets, act)
            items.append(lambda step=step, avals=avals: jax.jit(step).trace(*avals).lower(
                lowering_platforms=("cuda",)))
    return items


def _inputs(avals, seed):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), len(avals))
    out = []
    for k, a in zip(keys, avals):
        if a.dtype == jnp.float32:
            out.append(jax.random.uniform(k, a.shape, jnp.float32, 0.1, 1.0))
        else:
            fan = a.shape[-1]
            out.append((jax.random.normal(k, a.shape, jnp.float32) / (fan ** 0.25)).astype(a.dtype))
    return out


def _jax_runner(step, avals, timer, device_timer):
    import jax

    sets = [_inputs(avals, s) for s in range(SETS)]
    program = jax.jit(lambda *xs: [step(*xs[5 * (j % SETS):5 * (j % SETS) + 5]) for j in range(STEPS)])
    flat = [a for s in sets for a in s]

    def run():
        jax.block_until_ready(program(*flat))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    fallbacks = sorted({str(w.message)[:160] for w in caught if "reference" in str(w.message)})
    if timer is not None:
        timer.time(run, STEPS)

    def once():
        return timer.time(run, STEPS) if timer is not None else device_timer.host_time(run, STEPS)

    return once, fallbacks


def _torch_runner(sizes, h, i, act):
    import torch

    L = len(sizes)
    m = sum(sizes)
    offs = torch.tensor(np.cumsum(sizes).astype(np.int32), device="cuda")
    n1 = i if act == "srelu" else 2 * i

    def make(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        prob = torch.rand(m, device="cuda", generator=g).requires_grad_()
        dy = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
        return x, prob, dy

    w1 = (torch.randn(L, h, n1, device="cuda", dtype=torch.bfloat16) / h ** 0.5).requires_grad_()
    w2 = (torch.randn(L, i, h, device="cuda", dtype=torch.bfloat16) / i ** 0.5).requires_grad_()
    sets = [make(s) for s in range(SETS)]

    def step(x, prob, dy):
        c = torch._grouped_mm(x, w1, offs=offs)
        if act == "srelu":
            hh = torch.relu(c.float()) ** 2
        else:
            blocks = c.float().view(m, -1, 2, 32)
            hh = (blocks[:, :, 1] * torch.nn.functional.silu(blocks[:, :, 0])).reshape(m, -1)
        hh = (prob[:, None] * hh).to(torch.bfloat16)
        y = torch._grouped_mm(hh, w2, offs=offs)
        y.backward(dy)

    for s in sets:
        step(*s)
    torch.cuda.synchronize()

    def once():
        from lab.device_timer import Timing

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(STEPS):
            step(*sets[j % SETS])
        end.record()
        torch.cuda.synchronize()
        return Timing(start.elapsed_time(end) / 1e3 / STEPS, None)

    return once


def kernel_breakdown(step, avals, top=12):
    """Device time per kernel name of one step of ours (CUPTI through torch.profiler), printed, largest first."""
    import jax
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    x = _inputs(avals, 99)
    f = jax.jit(step)
    jax.block_until_ready(f(*x))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        jax.block_until_ready(f(*x))
    total = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            total[e.name[:90]] = total.get(e.name[:90], 0.0) + e.time_range.elapsed_us()
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    for name, us in ranked:
        print(f"    {us:10.1f} us  {name}", flush=True)
    return dict(ranked)


def transposes(step, avals):
    """transpose / copy instructions on >= 1M-element arrays in the compiled (optimized) HLO of one step."""
    import re

    import jax

    text = jax.jit(step).lower(*avals).compile().as_text()
    found = []
    for line in text.splitlines():
        m = re.search(r"= (\w+)\[([\d,]+)\]\{[^}]*\} (transpose|copy)\(", line)
        if m and np.prod([int(d) for d in m.group(2).split(",")]) >= 1 << 20:
            found.append(f"{m.group(3)} {m.group(1)}[{m.group(2)}]")
    return found


def run(args):
    import jax

    from lab import device_timer

    timer, why = device_timer.cupti_timer()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; JAX timed {'on device (CUPTI)' if timer else 'on host: ' + str(why)}",
          flush=True)
    results = []
    for name in args.shapes.split(","):
        sizes, h, i = SHAPES[name]
        m, offsets, avals = _problem(name, args.act)
        runners, notes = {}, {}
        runners["ours"], notes["ours"] = _jax_runner(ours_step(offsets, args.act), avals, timer, device_timer)
        # bf16 results (fp32 accumulation inside): tokamax's vjp takes no f32 cotangent of a bf16 product
        runners["ragged_dot+vjp"], _ = _jax_runner(plain_step(offsets, args.act, jax.lax.ragged_dot), avals, timer,
                                                   device_timer)
        try:
            import tokamax

            runners["tokamax+vjp"], _ = _jax_runner(plain_step(offsets, args.act, tokamax.ragged_dot), avals, timer,
                                                    device_timer)
        except Exception as e:  # noqa: BLE001 - a peer that does not import is reported, not fatal
            notes["tokamax"] = f"unavailable: {type(e).__name__}: {str(e)[:100]}"
        try:
            runners["torch._grouped_mm+autograd"] = _torch_runner(sizes, h, i, args.act)
        except Exception as e:  # noqa: BLE001
            notes["torch"] = f"unavailable: {type(e).__name__}: {str(e)[:100]}"
        samples = {k: [] for k in runners}
        for _ in range(REPS):
            for k, once in runners.items():
                samples[k].append(once())
        row = dict(shape=name, sizes=sizes, H=h, I=i, act=args.act, notes=notes, ms={}, tflops={})
        for k, v in samples.items():
            method, t = device_timer.primary(v)
            med = statistics.median(t)
            row["ms"][k], row["tflops"][k] = med * 1e3, flops(sizes, h, i) / med / 1e12
            print(f"{name:7s} {k:28s} {med * 1e3:9.3f} ms {row['tflops'][k]:7.1f} TFLOP/s ({method})", flush=True)
        if notes:
            print(f"{name:7s} notes: {notes}", flush=True)
        if args.breakdown:
            row["ours_kernels_us"] = kernel_breakdown(ours_step(offsets, args.act), avals)
            row["ours_transposes"] = transposes(ours_step(offsets, args.act), avals)
            print(f"{name:7s} ours: optimized HLO transposes/copies of >= 1M elements: {row['ours_transposes']}")
        results.append(row)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe_step.json").write_text(json.dumps(results, indent=1))
        plot(results, out / "moe_step.png")
    return results


def plot(results, path: Path):
    """The step's TFLOP/s per shape and implementation (benchmarks/bench_grouped_gemm.plot's bars)."""
    from benchmarks.bench_grouped_gemm import plot as bars

    impls = [k for k in ("ours", "torch._grouped_mm+autograd", "tokamax+vjp", "ragged_dot+vjp")
             if any(k in r["tflops"] for r in results)]
    bars(results, impls, "MoE expert-MLP training step (fwd + bwd, bf16 SwiGLU), H200", path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--act", default="swiglu", choices=("swiglu", "srelu"))
    ap.add_argument("--breakdown", action="store_true", help="ours: per-kernel device time and HLO transposes")
    ap.add_argument("--replot", default=None, help="redraw moe_step.png beside a saved moe_step.json, then exit")
    args = ap.parse_args(argv)
    if args.replot:
        saved = Path(args.replot)
        plot(json.loads(saved.read_text()), saved.with_suffix(".png"))
        return
    run(args)


if __name__ == "__main__":
    main()
