"""Weak scaling of the expert-parallel MoE layer (nn.moe_layer_ep), timed on the device: the same per-GPU expert
load on 1, 2, ... GPUs; step time, the exchange alone, expert-MLP TFLOP/s per GPU, efficiency t(1) / t(d).

    python -m benchmarks.bench_ep [--devices 1,2] [--out DIR]          # from the checkout's root; default: 8
                                                                        # experts x 2048 rows per GPU, H 7168,
                                                                        # I 2048, top-2, bf16 SwiGLU
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.bench_ep --devices 1,2 \\
        --experts-per-device 2 --rows-per-expert 128 --hidden 64 --intermediate 64     # CPU, host-timed

For each device count d the problem is built by examples/moe_expert_parallel.py's own functions (parse_args,
build_mesh, init, make_step, make_exchange, single_device_step), so the benchmark measures exactly the example's
programs: tokens per GPU = rows_per_expert * experts_per_device / top_k, experts = experts_per_device * d,
capacity from `nn.ep_capacity` (default factor 1.25, the example's GPU benchmark line; `--capacity-factor none`:
the no-drop worst case). Rows of the table:
  (a) moe_layer_ep, d GPUs: the jitted forward + backward step (router, dispatch all_to_all, fused expert MLP,
      combine all_to_all, MSE loss, gradients of the parameters and of x);
  (b) the exchange alone on the same mesh and inputs (make_exchange: router + dispatch + combine with identity
      experts, forward + backward = 4 all_to_alls); shown beside (a) as "exchange ms" and its share of the step;
  (c) d = 1 only: the plain single-device nn.moe_layer step on one GPU's load (no shard_map, no exchange).
TFLOP/s per GPU = 18 * rows * H * I / step time (12 for srelu: fc1 has I, not 2I, outputs), rows = the (token,
choice) assignments computed per GPU (all of them, minus those dropped for capacity): the expert MLP's useful
work over the whole step's time. Efficiency = t_ep(1) / t_ep(d) (the same program on one GPU; 1.0 is perfect
weak scaling) and, beside it, t_moe_layer / t_ep(d).

Timing: JAX is timed on the device (lab/device_timer.py): each round is one execution of the jitted program
in its own CUPTI session, and its time is the span from the first device event to the last. CUPTI puts every GPU's
events on one process-wide clock, so for d GPUs the span runs from the first kernel on any GPU of the mesh to the
last kernel on any of them: the NCCL all_to_all kernels, waits inside them for the slower GPU, and the launch skew
between the GPUs are inside it; host dispatch before the first kernel and the host's wait after the last are not.
The "GPUs in span" column is the fewest GPUs that showed events in any round (it must equal d). Median of --reps
rounds after a compile run and a profiler warm-up round. Without torch / CUDA / CUPTI the table header says so and
every row is host wall time (dispatch to block_until_ready), labelled "host" (this is what the CPU run gives).

Kernel bundle (GPU machine without the CuTe DSL compiler): `bundle_items()` lowers for CUDA the 1-device EP step
and the 1-device moe_layer step at the default shape (`python -m cudnn_moe_jax.aot build --arch sm_90a --out DIR
--variants benchmarks.bench_ep:bundle_items`). The same modules serve 2 (or more) GPUs: the per-device kernel
problems are the same (L/d = 8 local experts, H, I, dtypes; only m, the received-buffer rows, differs, and a
module is compiled for a symbolic m). This was checked on the CPU machine by lowering the 2-device step for CUDA
on 2 virtual CPU devices (`two_device_items`) against a bundle built from `bundle_items` only, with compiling
disabled (`python -m tools.gpu.check_bundle`: no fallback; with an empty bundle the same check lists all six
misses), and by recording the modules each lowering asks for: the 2-device EP step and the 1-device EP step ask
for the same six (op, fingerprint, avals key) at the default shape (by hand) and, in tests/test_bench_ep.py, at a
small shape of the same structure; the moe_layer step asks for its own six (it reads dY, and up to 1024 rows per
expert x, through the routing's row map: the gathered modules).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import warnings
from pathlib import Path

from examples import moe_expert_parallel as example

from cudnn_moe_jax import activations  # noqa: E402

FALLBACK = "no GPU kernel"  # the reference-fallback warning's text (tools/gpu/run_all.sh greps for it too)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default=None, help="device counts, e.g. 1,2 (default: 1..visible)")
    ap.add_argument("--experts-per-device", type=int, default=8)
    ap.add_argument("--rows-per-expert", type=int, default=2048, help="mean routed rows per expert")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--act", choices=tuple(activations.TABLE), default="swiglu")
    ap.add_argument("--capacity-factor", default="1.25", help="per device-pair slot factor, or 'none' (no drops)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per program (median reported)")
    ap.add_argument("--no-single", action="store_true", help="skip the single-device nn.moe_layer row")
    ap.add_argument("--out", default=None, help="folder for bench_ep.json")
    return ap.parse_args(argv)


def example_args(args, devices: int):
    """The example's argument namespace for one device count (its own parser: same derived tokens/device)."""
    argv = ["--devices", str(devices), "--experts-per-device", str(args.experts_per_device),
            "--rows-per-expert", str(args.rows_per_expert), "--top-k", str(args.top_k), "--hidden", str(args.hidden),
            "--intermediate", str(args.intermediate), "--dtype", args.dtype, "--act", args.act]
    if args.capacity_factor.lower() != "none":
        argv += ["--capacity-factor", args.capacity_factor]
    return example.parse_args(argv)


def flops_per_row(args) -> float:
    """Expert-MLP FLOPs of one routed row, forward + backward: fc1 2*H*N1, fc2 2*I*H, backward twice both."""
    n1 = activations.TABLE[args.act].input_width(args.intermediate)
    return 3.0 * (2 * args.hidden * n1 + 2 * args.intermediate * args.hidden)


def time_program(fn, inputs, timer, reps):
    """(first result, median seconds, method, fewest GPUs seen in a span or None, fallback warnings)."""
    import jax

    from lab import device_timer

    def run():
        return jax.block_until_ready(fn(*inputs))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()  # compile + first run, where a missing kernel module warns
    fallbacks = sorted({str(w.message)[:220] for w in caught if FALLBACK in str(w.message)})
    if timer is not None:
        timer.time(run, 1)  # the first profiler session pays CUPTI's setup: not a sample
    samples = [timer.time(run, 1) if timer is not None else device_timer.host_time(run, 1) for _ in range(reps)]
    method, seconds = device_timer.primary(samples)
    seen = [s.devices for s in samples if s.devices is not None]
    return result, statistics.median(seconds), method, (min(seen) if seen else None), fallbacks


def bench_devices(args, d, timer, single):
    """Rows for one device count: the EP step (with its exchange time) and, if `single`, the moe_layer step."""
    import numpy as np

    from cudnn_moe_jax import nn

    ex = example_args(args, d)
    mesh = example.build_mesh(ex)
    experts = ex.experts_per_device * d
    capacity = nn.ep_capacity(ex.tokens_per_device, ex.top_k, experts, d, ex.capacity_factor)
    params, x, target = example.init(ex, mesh)
    assignments = ex.tokens_per_device * d * ex.top_k
    ((loss, aux), _), t_step, method, seen, fb_step = time_program(example.make_step(ex, mesh),
                                                                   (params, x, target), timer, args.reps)
    if not np.isfinite(float(loss)):
        raise SystemExit(f"non-finite loss {float(loss)} on {d} device(s)")
    dropped = int(aux["dropped"])
    _, t_ex, method_ex, seen_ex, fb_ex = time_program(example.make_exchange(ex, mesh, capacity),
                                                      (x, params["router"]), timer, args.reps)
    rows_per_gpu = (assignments - dropped) / d
    rows = [dict(layer="moe_layer_ep", devices=d, step_ms=t_step * 1e3, exchange_ms=t_ex * 1e3,
                 exchange_pct=100 * t_ex / t_step, tflops_per_gpu=flops_per_row(ex) * rows_per_gpu / t_step / 1e12,
                 rows_per_gpu=rows_per_gpu, dropped=dropped, assignments=assignments, capacity=capacity,
                 received_rows=d * capacity, tokens_per_device=ex.tokens_per_device,
                 timing=method if method == method_ex else f"{method}/{method_ex}",
                 gpus_in_span=min((s for s in (seen, seen_ex) if s is not None), default=None),
                 loss=float(loss), fallbacks=fb_step + fb_ex)]
    del params, x, target
    if single:
        step, inputs = example.single_device_step(ex)
        _, t_one, method_one, seen_one, fb_one = time_program(step, inputs, timer, args.reps)
        rows_one = ex.tokens_per_device * ex.top_k
        rows.append(dict(layer="moe_layer", devices=1, step_ms=t_one * 1e3, exchange_ms=None, exchange_pct=None,
                         tflops_per_gpu=flops_per_row(ex) * rows_one / t_one / 1e12, rows_per_gpu=rows_one,
                         dropped=0, assignments=rows_one, capacity=None, received_rows=None,
                         tokens_per_device=ex.tokens_per_device, timing=method_one, gpus_in_span=seen_one,
                         loss=None, fallbacks=fb_one))
    return rows


def add_efficiency(rows):
    """t_ep(1) / t_ep(d) and t_moe_layer / t_ep(d) on the EP rows (None where the 1-device row is absent)."""
    ep1 = next((r["step_ms"] for r in rows if r["layer"] == "moe_layer_ep" and r["devices"] == 1), None)
    one = next((r["step_ms"] for r in rows if r["layer"] == "moe_layer"), None)
    for r in rows:
        r["efficiency"] = ep1 / r["step_ms"] if ep1 and r["layer"] == "moe_layer_ep" else None
        r["efficiency_vs_moe_layer"] = one / r["step_ms"] if one and r["layer"] == "moe_layer_ep" else None


def table(rows, header) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [header, "",
             "| devices | layer | step ms | exchange ms | exchange % | expert-MLP TFLOP/s per GPU | efficiency "
             "t(1)/t(d) | vs moe_layer | dropped | GPUs in span | timing |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['devices']} | {r['layer']} | {r['step_ms']:.3f} | {f(r['exchange_ms'], '.3f')} | "
                     f"{f(r['exchange_pct'], '.1f')} | {r['tflops_per_gpu']:.4g} | {f(r['efficiency'], '.3f')} | "
                     f"{f(r['efficiency_vs_moe_layer'], '.3f')} | {r['dropped']}/{r['assignments']} | "
                     f"{f(r['gpus_in_span'], 'd')} | {r['timing']} |")
    return "\n".join(lines)


def run(args):
    import jax

    from lab import device_timer

    visible = jax.device_count()
    counts = list(range(1, visible + 1)) if args.devices is None else [int(c) for c in args.devices.split(",")]
    if not counts or any(c < 1 for c in counts):
        raise SystemExit(f"--devices {args.devices}: each count must be >= 1")
    if max(counts) > visible:
        raise SystemExit(f"--devices {args.devices}: {example.too_few_devices(max(counts))}")
    timer, why = device_timer.cupti_timer()
    header = ("JAX timed on the device: CUPTI span of one execution, first kernel on any GPU of the mesh to the "
              "last on any" if timer is not None else
              f"JAX timed on the HOST (wall clock, dispatch to block_until_ready): CUPTI unavailable ({why})")
    cfg = example_args(args, 1)
    shape = (f"{args.experts_per_device} experts x {args.rows_per_expert} rows per device, H {args.hidden}, "
             f"I {args.intermediate}, top-{args.top_k}, {args.dtype} {args.act}, capacity_factor "
             f"{cfg.capacity_factor}, {cfg.tokens_per_device} tokens/device")
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {visible} visible; {shape}", flush=True)
    rows = []
    for d in counts:
        rows += bench_devices(args, d, timer, single=(d == 1 and not args.no_single))
    add_efficiency(rows)
    for r in rows:
        for msg in r["fallbacks"]:
            print(f"fallback ({r['layer']}, {r['devices']} device(s)): {msg}", flush=True)
        if r["gpus_in_span"] is not None and r["gpus_in_span"] < r["devices"]:
            print(f"WARNING: {r['layer']} on {r['devices']} GPUs: a span saw only {r['gpus_in_span']} GPU(s)")
    text = table(rows, f"{header}; {shape}; median of {args.reps}")
    print(text, flush=True)
    result = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "timing": header,
              "cupti": timer is not None, "config": {k: v for k, v in vars(args).items() if k != "out"},
              "capacity_factor": cfg.capacity_factor, "tokens_per_device": cfg.tokens_per_device,
              "flops_per_row": flops_per_row(cfg), "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_ep.json").write_text(json.dumps(result, indent=1))
        (out / "bench_ep.md").write_text(text + "\n")
    return result


def _lower_single(ex):
    step, inputs = example.single_device_step(ex)
    return step.trace(*inputs).lower(lowering_platforms=("cuda",))


def bundle_items(devices: int = 1, argv=()):
    """CUDA lowerings of the programs the GPU run needs kernels for, at the default shape (or `argv`'s): the EP
    step on `devices` devices (the build machine's CPU devices stand in for GPUs) and, for 1, the moe_layer step.
    The exchange alone calls no kernel (identity experts), so it has no item."""
    ex = example_args(parse_args(list(argv)), devices)
    items = [lambda: example.lower_step_for(ex)]
    if devices == 1:
        items.append(lambda: _lower_single(ex))
    return items


def two_device_items(argv=()):
    """The 2-device EP step lowered for CUDA (needs 2 visible devices: XLA_FLAGS=
    --xla_force_host_platform_device_count=2 on the CPU machine): to check that bundle_items' modules serve it."""
    return bundle_items(2, argv)


def main(argv=None):
    args = parse_args(argv)
    if args.reps < 1 or (args.capacity_factor.lower() != "none" and not math.isfinite(float(args.capacity_factor))):
        raise SystemExit("--reps must be >= 1 and --capacity-factor a number or 'none'")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
