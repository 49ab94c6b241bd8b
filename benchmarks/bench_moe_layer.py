"""The whole routed MoE layer, forward + backward, on real (uneven, unaligned) routing: ours (`nn.moe_layer` with
its default group alignment) and the same pieces at other group alignments (`ours_m<A>`, `--aligns`: m_aligned=1
is padding-free, 256 cuDNN's padded layout) vs the same layer written with `jax.lax.ragged_dot`, with tokamax's
ragged_dot, and with torch `_grouped_mm`.

    python -m benchmarks.bench_moe_layer [--configs 8e,64e,128e,decode] [--aligns 1,64,128] [--out DIR]
                                         [--no-breakdown]

Every implementation has the same routing semantics: router logits x @ Wr (bf16 operands, fp32 sums; ours as
`nn.moe_layer` does it), softmax over the experts, top-k, the k weights renormalized, SwiGLU experts (W1 gate /
up interleaved in 32-row blocks), the k expert outputs of a token weighted and summed. Router weights are random,
so routing is near-uniform but uneven: no expert gets a multiple of 256 rows. One step = value and gradients of
sum(y * dy) with respect to x, the router, W1 and W2.

Useful TFLOP/s = 18 * T * k * H * I / time: only routed rows count (padding is not useful work; the router GEMM
is not counted). JAX is timed on the device (CUPTI span of a jitted program of STEPS steps on rotating inputs,
lab/device_timer.py); torch with CUDA events. Memory: XLA's compiled temp + argument + output bytes of one
step (its buffer assignment's peak; torch: its peak allocated bytes over one step), and its ratio to what the
routed rows need (`routed_floor_bytes`: the arguments, the gradients and, per routed row, the saved x, C, h and y
rows). Our step's device time per kernel and the share of the grouped-GEMM kernels are printed (`--no-breakdown`:
not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import numpy as np

CONFIGS = {  # name -> (T, H, I, experts, top_k)
    "8e": (8192, 7168, 2048, 8, 2),
    "64e": (4096, 2048, 768, 64, 4),
    "128e": (32768, 4096, 1024, 128, 8),
    "decode": (512, 4096, 1024, 128, 8),
}
STEPS, REPS, SETS = 3, 5, 3
GEMM_KERNEL_MARKS = ("GemmSm90", "Gemm_Sm90", "gemm")   # our CuTe DSL kernels' names contain one of these


def useful_flops(t, h, i, k) -> float:
    return 18.0 * t * k * h * i


def _avals(name):
    import jax
    import jax.numpy as jnp

    t, h, i, e, _ = CONFIGS[name]
    sd = jax.ShapeDtypeStruct
    return (sd((t, h), jnp.bfloat16), sd((h, e), jnp.bfloat16), sd((e, 2 * i, h), jnp.bfloat16),
            sd((e, h, i), jnp.bfloat16), sd((t, h), jnp.bfloat16))


def _inputs(avals, seed):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), len(avals))
    return [(jax.random.normal(k, a.shape, jnp.float32) / a.shape[-1] ** (0.5 if i in (2, 3) else 0.25)
             ).astype(a.dtype) for i, (k, a) in enumerate(zip(keys, avals))]


def routed_floor_bytes(name) -> int:
    """What one step needs at the least: its arguments (x, the router, W1, W2, dy), the gradients of the first four
    and, per routed row (T * k), the forward's saved rows (x_perm H, C 2I, h I, y_perm H), all bf16."""
    t, h, i, e, k = CONFIGS[name]
    args = t * h + h * e + e * 2 * i * h + e * h * i + t * h
    grads = t * h + h * e + e * 2 * i * h + e * h * i
    return 2 * (args + grads + t * k * (2 * h + 3 * i))


def ours_step(top_k, m_aligned=None):
    """Our layer's step: `nn.moe_layer` (64-row groups, the kernels reading x and dY through the row map), or with
    m_aligned the pieces of the permuted layout (router, route, permute, moe_mlp, unpermute: x and dY gathered into
    permuted copies by XLA) on that group alignment (64: the layer before the gathered kernels; 1: padding-free;
    256: cuDNN's padded layout, the buffer sized for the worst case)."""
    import jax
    import jax.numpy as jnp

    from cudnn_moe_jax import nn

    def layer(x, router, w1, w2):
        if m_aligned is None:
            return nn.moe_layer(x, router, w1, w2, top_k=top_k)[0]
        gating = nn.apply_router(x, router, nn.RouterConfig(top_k=top_k), compute_dtype=x.dtype.name)
        plan = nn.route(gating.experts, w1.shape[0], m_aligned=m_aligned)
        x_perm, prob = nn.permute(x, gating.weights, plan)
        y_perm = nn.moe_mlp(x_perm, w1, w2, prob, None, plan.padded_offsets, m_aligned=m_aligned)
        return nn.unpermute(y_perm, plan, x.shape[0])

    def loss(x, router, w1, w2, dy):
        return jnp.sum(layer(x, router, w1, w2).astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


def plain_step(top_k, ragged_dot):
    """The same layer with exact (unpadded) expert groups from a sort, through `ragged_dot`; autodiff backward."""
    import jax
    import jax.numpy as jnp

    def layer(x, router, w1, w2):
        t, _ = x.shape
        experts = w1.shape[0]
        logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
        weights, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        flat = chosen.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // top_k
        sizes = jnp.zeros((experts,), jnp.int32).at[flat].add(1)
        c = ragged_dot(x[token], jnp.swapaxes(w1, 1, 2), sizes).astype(jnp.float32)
        blocks = c.reshape(c.shape[0], -1, 2, 32)
        act = (blocks[:, :, 1] * jax.nn.silu(blocks[:, :, 0])).reshape(c.shape[0], -1)
        h = (weights.reshape(-1)[order][:, None] * act).astype(x.dtype)
        y_rows = ragged_dot(h, jnp.swapaxes(w2, 1, 2), sizes).astype(jnp.float32)
        return jnp.zeros((t, x.shape[1]), jnp.float32).at[token].add(y_rows).astype(x.dtype)

    def loss(x, router, w1, w2, dy):
        return jnp.sum(layer(x, router, w1, w2).astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


ALIGNS = (1, 256)   # the alignments timed beside the default one unless --aligns says otherwise


def bundle_items(configs=tuple(CONFIGS), aligns=ALIGNS):
    """Lowerings of our steps (the default alignment and `aligns`) for CUDA at every config (`python -m
    cudnn_moe_jax.aot build --variants benchmarks.bench_moe_layer:bundle_items` records their modules)."""
    import jax

    return [lambda n=n, a=a: jax.jit(ours_step(CONFIGS[n][4], a)).trace(*_avals(n)).lower(
        lowering_platforms=("cuda",)) for n in configs for a in (None,) + tuple(aligns)]


def all_aligns_bundle_items():
    """The alignment study's lowerings (1, 64, 128 beside the default) at every config."""
    return bundle_items(aligns=(1, 64, 128))


def _memory_bytes(step, avals):
    """XLA's compiled temp + argument + output bytes of one step (None where the backend does not say)."""
    import jax

    try:
        ma = jax.jit(step).lower(*avals).compile().memory_analysis()
        return int(ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _jax_runner(step, avals, timer, device_timer):
    import jax

    sets = [_inputs(avals, s) for s in range(SETS)]
    n = len(avals)
    program = jax.jit(lambda *xs: [step(*xs[n * (j % SETS):n * (j % SETS) + n]) for j in range(STEPS)])
    flat = [a for s in sets for a in s]

    def run():
        jax.block_until_ready(program(*flat))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    fallbacks = sorted({str(w.message)[:160] for w in caught if "reference" in str(w.message)})

    def once():
        return timer.time(run, STEPS) if timer is not None else device_timer.host_time(run, STEPS)

    return once, fallbacks


def _torch_runner(name):
    import torch

    from lab.device_timer import Timing

    t, h, i, e, k = CONFIGS[name]
    dev, bf = "cuda", torch.bfloat16
    w1 = (torch.randn(e, h, 2 * i, device=dev, dtype=bf) / h ** 0.5).requires_grad_()
    w2 = (torch.randn(e, i, h, device=dev, dtype=bf) / i ** 0.5).requires_grad_()
    router = (torch.randn(h, e, device=dev, dtype=bf) / h ** 0.5).requires_grad_()

    def make(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return (torch.randn(t, h, device=dev, dtype=bf, generator=g).requires_grad_(),
                torch.randn(t, h, device=dev, dtype=bf, generator=g))

    def step(x, dy):
        logits = (x @ router).float()
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), k)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
        c = torch._grouped_mm(x[token], w1, offs=offs).float()
        blocks = c.view(c.shape[0], -1, 2, 32)
        act = (blocks[:, :, 1] * torch.nn.functional.silu(blocks[:, :, 0])).reshape(c.shape[0], -1)
        hh = (weights.reshape(-1)[order][:, None] * act).to(bf)
        y_rows = torch._grouped_mm(hh, w2, offs=offs).float()
        y = torch.zeros(t, h, device=dev, dtype=torch.float32).index_add(0, token, y_rows).to(bf)
        (y.float() * dy.float()).sum().backward()

    sets = [make(s) for s in range(SETS)]
    for s in sets:
        step(*s)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(*sets[0])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base

    def once():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(STEPS):
            step(*sets[j % SETS])
        end.record()
        torch.cuda.synchronize()
        return Timing(start.elapsed_time(end) / 1e3 / STEPS, None)

    return once, peak


def device_kernel_times(f, args, width=90) -> dict:
    """{kernel name (its first `width` characters): device microseconds} over one profiled call of the jitted f
    (after a warm-up call)."""
    import jax
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    jax.block_until_ready(f(*args))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        jax.block_until_ready(f(*args))
    total = {}
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            total[ev.name[:width]] = total.get(ev.name[:width], 0.0) + ev.time_range.elapsed_us()
    return total


def kernel_share(step, avals, top=10):
    """(GEMM-kernel microseconds, all device microseconds) of one step of ours, printing the largest kernels."""
    import jax

    total = device_kernel_times(jax.jit(step), _inputs(avals, 99))
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us:10.1f} us  {name}", flush=True)
    gemm = sum(us for name, us in total.items() if any(mark in name for mark in GEMM_KERNEL_MARKS))
    return gemm, sum(total.values())


def run(args):
    import jax

    from lab import device_timer

    timer, why = device_timer.cupti_timer()
    print(f"device: {jax.devices()[0].device_kind}; JAX timed "
          f"{'on device (CUPTI)' if timer else 'on host: ' + str(why)}", flush=True)
    results = []
    for name in args.configs.split(","):
        t, h, i, e, k = CONFIGS[name]
        avals = _avals(name)
        impls = {"ours": ours_step(k)}
        impls.update({f"ours_m{a}": ours_step(k, a) for a in args.aligns})
        notes, memory, runners = {}, {}, {}
        # jax.lax.ragged_dot has no grouped kernel on the GPU: XLA runs it dense over the experts
        if e * t * k * max(h, 2 * i) * 2 <= args.dense_limit_gb * 2 ** 30:
            impls["ragged_dot"] = plain_step(k, jax.lax.ragged_dot)
        else:
            notes["ragged_dot"] = "skipped: its dense fallback would not fit"
        try:
            import tokamax

            impls["tokamax"] = plain_step(k, tokamax.ragged_dot)
        except Exception as ex:  # noqa: BLE001 - a peer that does not import is reported, not fatal
            notes["tokamax"] = f"unavailable: {type(ex).__name__}: {str(ex)[:100]}"
        for key, step in impls.items():
            runners[key], fb = _jax_runner(step, avals, timer, device_timer)
            memory[key] = _memory_bytes(step, avals)
            if fb:
                notes[key] = f"reference fallback: {fb}"
        try:
            runners["torch"], memory["torch"] = _torch_runner(name)
        except Exception as ex:  # noqa: BLE001
            notes["torch"] = f"unavailable: {type(ex).__name__}: {str(ex)[:100]}"
        samples = {key: [] for key in runners}
        for _ in range(REPS):
            for key, once in runners.items():
                samples[key].append(once())
        floor = routed_floor_bytes(name)
        row = dict(config=name, T=t, H=h, I=i, experts=e, top_k=k, ms={}, tflops={}, memory_gb={}, notes=notes,
                   routed_floor_gb=floor / 2 ** 30)
        for key, v in samples.items():
            method, secs = device_timer.primary(v)
            med = statistics.median(secs)
            row["ms"][key], row["tflops"][key] = med * 1e3, useful_flops(t, h, i, k) / med / 1e12
            row["memory_gb"][key] = None if memory.get(key) is None else memory[key] / 2 ** 30
            mem = ("" if memory.get(key) is None else
                   f" {memory[key] / 2 ** 30:7.2f} GiB ({memory[key] / floor:4.2f}x the routed rows' floor)")
            print(f"{name:7s} {key:11s} {med * 1e3:9.3f} ms {row['tflops'][key]:7.1f} useful TFLOP/s{mem} ({method})",
                  flush=True)
        if notes:
            print(f"{name:7s} notes: {notes}", flush=True)
        if not args.no_breakdown and timer is not None:
            for key in [k for k in impls if k.startswith("ours")]:
                gemm, total = kernel_share(impls[key], avals)
                row[f"{key}_gemm_share"] = gemm / total if total else None
                print(f"{name:7s} {key}: GEMM kernels {gemm:.0f} us of {total:.0f} us device time "
                      f"({100 * gemm / max(total, 1e-9):.1f}%)", flush=True)
        results.append(row)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe_layer.json").write_text(json.dumps(results, indent=1))
        plot(results, out / "moe_layer.png")
    return results


def plot(results, path: Path):
    from benchmarks.bench_grouped_gemm import plot as bars

    rows = [dict(r, shape=r["config"]) for r in results]
    ours = sorted({k for r in rows for k in r["tflops"] if k.startswith("ours")}, key=lambda k: (k != "ours", k))
    impls = ours + [k for k in ("torch", "tokamax", "ragged_dot") if any(k in r["tflops"] for r in rows)]
    bars(rows, impls, "Routed MoE layer, fwd + bwd, bf16 SwiGLU (useful TFLOP/s), H200", path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--aligns", default=",".join(map(str, ALIGNS)),
                    help="group alignments (m_aligned) timed beside the layer's default, comma-separated")
    ap.add_argument("--no-breakdown", action="store_true", help="ours: no device time per kernel / GEMM share")
    ap.add_argument("--dense-limit-gb", type=float, default=16.0,
                    help="skip jax.lax.ragged_dot where its dense (experts x rows x width) operand exceeds this")
    args = ap.parse_args(argv)
    args.aligns = [int(a) for a in args.aligns.split(",") if a]
    run(args)


if __name__ == "__main__":
    main()
