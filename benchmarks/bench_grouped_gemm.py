"""Grouped-GEMM benchmark on an H200: the public fused ops (cudnn_moe_jax.grouped_gemm_*) vs peers, one run, same
process.

    python -m benchmarks.bench_grouped_gemm --out DIR       # from the checkout's root, on a Hopper GPU; kernels
                                                            # compile at first use, or come from a bundle
                                                            # (benchmarks/bench_cases.py)

Shapes (cudnn_moe_jax/shapes.py; bf16 in): fc1 = 8 experts x 2048 rows, K 7168, N 4096, SwiGLU fused (C and D
written); fc2 = 8 x 2048, K 2048, N 7168, plain quant epilogue (D = prob*alpha*acc); small = 64 x 256, K 2048,
N 1536, SwiGLU; skewed = fc1 on a skewed routing draw (half the rows in expert 0, two empty experts).
Every op gets prob, alpha and per-group amax (the library's defaults for bf16 D). `ours` is the public op with its
default kernel configuration (benchmarks/bench_cases.py); it must lower to the kernel (a fallback to the reference
stops the run). `--lab` also times the lab's other configurations of the shape (lab/bench_kernels.py, through
the primitive; their modules from the same kind of bundle) as `kernel[LABEL]`.

Peers: jax.lax.ragged_dot + the same epilogue in jnp (jitted), torch._grouped_mm (GEMM only, if importable),
tokamax ragged_dot (if importable). Timing (METHOD.md: device work is timed on the device): warm-up, then REPS
rounds; each round times every implementation once, interleaved (20 back-to-back calls; median over rounds,
spread = (max - min) / median). JAX: the 20 calls on 20 distinct input sets inside one jitted program (identical
calls would be merged by XLA), each round's execution in its own torch.profiler session; time per call = the
CUPTI span of that program (end of its last device event - start of its first, GPU timestamps) / 20, so the
program's host-side dispatch and completion (~1-2 ms per program, RESULTS.md run 8) is not charged to the
kernels (lab/device_timer.py). The host wall time to block_until_ready of the same execution is kept as host_ms.
Without torch or CUPTI, JAX is timed on the host, and the header and the table footnote say so. torch: rotating
3 input sets, CUDA events. TFLOP/s = 2 * valid_m * N * K / t (t = device time where measured).
Writes results.json, table.md and plot.png (MXFP8: mxfp8_*) to --out; RESULTS.md is appended on the CPU machine.
Per row of results.json, by implementation: ms (median, device time where measured), host_ms (JAX), timing ("cupti",
"host" or "cuda_events"), samples_ms / host_samples_ms (per round) and device_events (device events per
program, CUPTI; one value when every round saw the same program).

    python -m benchmarks.bench_grouped_gemm --mxfp8 --out DIR     # MXFP8 inputs (e4m3 + e8m0 per 32)
    python -m benchmarks.bench_grouped_gemm --formats mxfp8,nvfp4,mxfp4 --out DIR   # input formats vs bf16
    python -m benchmarks.bench_grouped_gemm --discrete --out DIR  # per-expert weights (b_tensors) vs stacked
    python -m benchmarks.bench_grouped_gemm --hadamard nvfp4,bf16 --out DIR  # Hadamard op vs plain GLU

MXFP8 mode: the same fc1 / fc2 / small shapes with A, B quantized from N(0,1) data per 32-wide K block
(cudnn_moe_jax.formats.to_block_scaled on the GPU: realistic, non-uniform scales); ours with bf16 D (+ C for
SwiGLU, + amax) and with FP8 D (D, D_col, SFD_row, SFD_col, norm_const), and fc1 once more on B operands whose
scales are equal across N per K block (`uniformB`: a data pattern some kernels special-case; ours does not).
Peers on the same FP8 bytes: torch._scaled_grouped_mm with per-row scales (GEMM only) and jax.lax.ragged_dot on fp8
data (no block scales) + the jnp epilogue.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import numpy as np

from benchmarks import bench_cases
from cudnn_moe_jax import shapes
from lab import device_timer

REPS, ITERS, SETS = 7, 20, 20  # JAX: 20 distinct input sets per program; torch rotates the first 3
JAX_ON_DEVICE = f"JAX timed on device (CUPTI span of the {ITERS}-call program)"


def _jax_runner(f, arg_sets, timer):
    """ITERS calls of `f` inside ONE jitted program (one dispatch; every output kept alive, so none is dropped):
    the measured time is the device's back-to-back time, not JAX's per-call dispatch (which, timed per call,
    spread 12% between two timings of the same function on the H200). `timer`: a device_timer.CuptiTimer
    (each execution profiled on its own: device span + host wall time) or None (host wall time only)."""
    import jax

    nsets = len(arg_sets)
    assert nsets >= ITERS, "every call in the program needs its own inputs (XLA merges identical calls)"

    def calls_in_order(*sets):
        # Call i's inputs pass an optimization barrier with call i-1's outputs (no work at run time): XLA may not
        # hoist every call's temporaries ahead of the first call. Unchained, a route that dequantizes B in XLA
        # held all 20 bf16 copies of B at once (e128_fc1: 42.5 GiB, out of memory on an 80 GB card).
        outs = []
        for i in range(ITERS):
            args = sets[i] if not outs else jax.lax.optimization_barrier((sets[i], outs[-1]))[0]
            outs.append(f(*args))
        return outs

    many = jax.jit(calls_in_order)

    def program():  # returns nothing: the outputs are freed as soon as the device is done with them
        jax.block_until_ready(many(*arg_sets))

    program()  # compile
    if timer is not None:
        # one profiled execution before the rounds: CUPTI's first-time work for this program's modules
        # (and the process's first profiler session) happens here, not in a timed round
        warm = timer.time(program, ITERS)
        if warm.device is None:
            print("CUPTI recorded no device event for a JAX program: it will be host-timed", flush=True)

    def once():
        return timer.time(program, ITERS) if timer is not None else device_timer.host_time(program, ITERS)

    return once


def _torch_runner(fn, arg_sets):
    import torch

    for st in arg_sets:
        fn(*st)
    torch.cuda.synchronize()

    def once():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(ITERS):
            fn(*arg_sets[i % len(arg_sets)])
        end.record()
        torch.cuda.synchronize()
        return device_timer.Timing(start.elapsed_time(end) / 1e3 / ITERS, None)

    return once


def time_interleaved(runners: dict, row: dict) -> dict:
    """{name: (median s, min s, max s)} of the primary time (device_timer.primary: the device clock where every
    round has it, else the host clock): REPS rounds, each timing every runner once (thermal drift spreads over
    all of them instead of favouring whoever runs first). Per-round means go to row["samples_ms"] (primary) and
    row["host_samples_ms"] (JAX), the method to row["timing"], the host median to row["host_ms"]."""
    samples = {k: [] for k in runners}
    for _ in range(REPS):
        for k, once in runners.items():
            samples[k].append(once())
    stats = {}
    for k, v in samples.items():
        method, t = device_timer.primary(v)
        row.setdefault("timing", {})[k] = method
        row.setdefault("samples_ms", {})[k] = [round(x * 1e3, 4) for x in t]
        host = [s.host for s in v if s.host is not None]
        if host:
            row.setdefault("host_samples_ms", {})[k] = [round(x * 1e3, 4) for x in host]
            row.setdefault("host_ms", {})[k] = statistics.median(host) * 1e3
        events = sorted({s.events for s in v if s.events is not None})
        if events:  # a list: two or more values mean the rounds did not all record the same program
            row.setdefault("device_events", {})[k] = events
        stats[k] = (statistics.median(t), min(t), max(t))
    return stats


def _record(row: dict, timed: dict, flops: float, width: int) -> None:
    """Store and print one shape's medians (ms, TFLOP/s, spread; host ms beside the device ms for JAX)."""
    for key, (t, lo, hi) in timed.items():
        row["ms"][key] = t * 1e3
        row["tflops"][key] = flops / t / 1e12
        row.setdefault("spread_pct", {})[key] = 100.0 * (hi - lo) / t
        host = f"  host {row['host_ms'][key]:8.3f} ms" if row["timing"][key] == "cupti" else ""
        print(f"{row['shape']:7s} {key:{width}s} {t * 1e3:8.3f} ms {flops / t / 1e12:7.1f} TFLOP/s "
              f"(spread {100.0 * (hi - lo) / t:4.1f}%, {row['timing'][key]}){host}", flush=True)


BUNDLE_HINT = ("build the benchmark's kernel modules into a bundle: python -m cudnn_moe_jax.aot build --arch sm_90a "
               "--out .bundle --variants benchmarks.bench_cases:bundle_items [lab.bench_kernels:bundle_items: "
               "--lab] (CUDNN_MOE_JAX_BUNDLE=DIR if elsewhere), or install the CuTe DSL compiler "
               "(pip install -e .[cuda])")


def _session():
    """(device, CUPTI timer or None, why not) after printing the run's header line."""
    import jax

    dev = jax.devices()[0]
    timer, why = device_timer.cupti_timer()
    jax_timing = JAX_ON_DEVICE if timer is not None else f"JAX timed on host (no CUPTI: {why})"
    print(f"device: {dev.device_kind}; {jax_timing}", flush=True)
    return dev, timer, why


def public_op(fn, args, what: str):
    """jax.jit(fn), checked to lower to the kernel: the ops fall back to the reference (with a RuntimeWarning) where
    no kernel module is available, which would time XLA instead of the kernel."""
    import jax

    jitted = jax.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        try:
            jitted.lower(*args)
        except RuntimeWarning as w:
            raise SystemExit(f"{what}: {w}\n{BUNDLE_HINT}") from None
    return jitted


def lab_kernels(cases: dict, prefix: str, configs: str) -> dict:
    """--lab: {label: (problem, jitted kernel call)} of lab/bench_kernels.py's cases named prefix + label
    (`configs`: a comma-separated subset of the labels, or all)."""
    from lab.forward_cases import kernel_fn

    wanted = configs.split(",") if configs else None
    return {name[len(prefix):]: (p, kernel_fn(p, cfg)) for name, (p, cfg) in cases.items()
            if name.startswith(prefix) and (wanted is None or name[len(prefix):] in wanted)}


def timing_note(results) -> str:
    """The table footnote's timing sentence, from the methods the rows record (row["timing"])."""
    jax_keys = {m: sorted({k for r in results for k, mm in r.get("timing", {}).items() if mm == m})
                for m in ("cupti", "host")}
    why = next((r["cupti_unavailable"] for r in results if "cupti_unavailable" in r), "")
    if jax_keys["cupti"] and jax_keys["host"]:
        note = f"{JAX_ON_DEVICE}, except {', '.join(jax_keys['host'])}: JAX timed on host (CUPTI recorded no device event)"
    elif jax_keys["host"]:
        note = f"JAX timed on host (wall time of the {ITERS}-call program{': no CUPTI, ' + why if why else ''})"
    else:
        note = JAX_ON_DEVICE
    if any(m == "cuda_events" for r in results for m in r.get("timing", {}).values()):
        note += "; torch timed with CUDA events"
    return note + "."


def jnp_epilogue(problem, acc, offsets, alpha, prob):
    """The fused epilogue in jnp on the fp32 ragged_dot result (rows past the groups are zero already)."""
    import jax.numpy as jnp

    m = acc.shape[0]
    gid = jnp.searchsorted(offsets, jnp.arange(m), side="right")
    al = jnp.take(alpha, jnp.minimum(gid, alpha.shape[0] - 1))[:, None]
    c = al * acc
    if problem["op"] == "quant":
        return (prob[:, None] * c).astype(jnp.bfloat16), None
    blocks = c.reshape(m, -1, 2, 32)
    gate, up = blocks[:, :, 0].reshape(m, -1), blocks[:, :, 1].reshape(m, -1)
    d = prob[:, None] * up * gate * (1.0 / (1.0 + jnp.exp(-gate)))
    return d.astype(jnp.bfloat16), c.astype(jnp.bfloat16)


def run(args):
    import jax
    import jax.numpy as jnp

    dev, timer, why = _session()
    results = []
    for shape_name in args.shapes.split(","):
        if shape_name not in shapes.GROUP_SIZES and shape_name not in shapes.ROUTINGS:
            raise SystemExit(f"--shapes: unknown shape {shape_name!r}; known: "
                             f"{sorted(shapes.GROUP_SIZES) + sorted(shapes.ROUTINGS)}")
        art_shape, sizes = shapes.ROUTINGS.get(shape_name, (shape_name, shapes.GROUP_SIZES.get(shape_name)))
        m, n, k, L = shapes.SHAPES[art_shape]
        p = {"op": shapes.FUSION[art_shape][0]}
        assert sum(sizes) <= m and len(sizes) == L
        offsets_np = np.cumsum(sizes).astype(np.int32)
        valid_m = int(offsets_np[-1])
        flops = 2.0 * valid_m * n * k
        keys = jax.random.split(jax.random.PRNGKey(0), 4 * SETS)
        sets = []
        for s in range(SETS):
            a = jax.random.normal(keys[4 * s], (m, k), jnp.float32).astype(jnp.bfloat16)
            b = (jax.random.normal(keys[4 * s + 1], (L, n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
            prob = jax.random.uniform(keys[4 * s + 2], (m,), jnp.float32)
            alpha = jnp.ones((L,), jnp.float32)
            sets.append((a, b, jnp.asarray(offsets_np), alpha, prob))
        jax.block_until_ready(sets)
        row = {"shape": shape_name, "valid_m": valid_m, "n": n, "k": k, "groups": L, "tflops": {}, "ms": {},
               "check": {}}
        if timer is None:
            row["cupti_unavailable"] = why

        ours = public_op(bench_cases.bf16_call(art_shape), sets[0], f"ours on {shape_name}")
        runners = {"ours": _jax_runner(ours, sets, timer)}
        # ours twice: the difference between the two is the run's noise floor
        runners["ours#2"] = _jax_runner(ours, sets, timer)
        if args.lab:
            from lab import bench_kernels

            for label, (_, fn) in lab_kernels(bench_kernels.bf16_cases([art_shape]), f"{art_shape}_",
                                              args.configs).items():
                checked = public_op(fn, sets[0], f"kernel[{label}] on {shape_name}")
                runners[f"kernel[{label}]"] = _jax_runner(checked, sets, timer)

        def ragged(a, b, offsets, alpha, prob, _p=p):
            bt = jnp.swapaxes(b, 1, 2)  # (L, K, N); layout change counted, as a user would have to do it
            gs = jnp.diff(jnp.concatenate([jnp.zeros((1,), jnp.int32), offsets]))
            acc = jax.lax.ragged_dot(a, bt, gs, preferred_element_type=jnp.float32)
            return jnp_epilogue(_p, acc, offsets, alpha, prob)

        rf = jax.jit(ragged)
        runners["ragged_dot+jnp"] = _jax_runner(rf, sets, timer)
        tsets = None
        try:
            import torch

            if hasattr(torch, "_grouped_mm"):
                tsets = []
                for s_ in range(3):
                    g = torch.Generator(device="cuda").manual_seed(s_)
                    ta = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                    tb = (torch.randn(L, n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5)
                    tsets.append((ta[:valid_m], tb.transpose(-2, -1), torch.tensor(offsets_np, device="cuda")))
                runners["torch._grouped_mm"] = _torch_runner(lambda a, b, o: torch._grouped_mm(a, b, offs=o), tsets)
        except Exception as e:  # noqa: BLE001
            row["torch_error"] = f"{type(e).__name__}: {e}"
            print(f"torch failed: {e}", flush=True)
        try:
            import tokamax  # noqa: F401

            def tk(a, b, offsets, alpha, prob, _p=p):
                gs = jnp.diff(jnp.concatenate([jnp.zeros((1,), jnp.int32), offsets]))
                acc = tokamax.ragged_dot(a, jnp.swapaxes(b, 1, 2), gs, preferred_element_type=jnp.float32)
                return jnp_epilogue(_p, acc, offsets, alpha, prob)

            runners["tokamax+jnp"] = _jax_runner(jax.jit(tk), sets, timer)
        except ImportError:
            row["tokamax"] = "not installed"

        _record(row, time_interleaved(runners, row), flops, 24)

        # correctness spot check of ours against ragged_dot's fp32 result
        ours_out = ours(*sets[0])
        ref_d, ref_c = rf(*sets[0])
        got_d = ours_out[1] if p["op"] == "glu" else ours_out[0]
        rel = float(jnp.linalg.norm((got_d[:valid_m].astype(jnp.float32) - ref_d[:valid_m].astype(jnp.float32)))
                    / jnp.linalg.norm(ref_d[:valid_m].astype(jnp.float32)))
        tail_zero = bool(jnp.all(got_d[valid_m:] == 0))
        row["check"] = {"d_rel_err_vs_ragged": rel, "rows_past_valid_m_zero": tail_zero}
        if p["op"] == "glu":
            relc = float(jnp.linalg.norm(ours_out[0][:valid_m].astype(jnp.float32) - ref_c[:valid_m].astype(
                jnp.float32)) / jnp.linalg.norm(ref_c[:valid_m].astype(jnp.float32)))
            row["check"]["c_rel_err_vs_ragged"] = relc
        print(f"{shape_name:7s} check {row['check']}", flush=True)
        del ours_out, ref_d, ref_c, tsets, runners, ours
        results.append(row)
        del sets
    return results, str(dev.device_kind)


def table(results, device, out: Path, json_name: str, last_header: str, last_cell):
    """Save the raw results and return (implementations, markdown table lines): one row per shape, TFLOP/s per
    implementation, and a last column computed by `last_cell(row)`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / json_name).write_text(json.dumps({"device": device, "results": results}, indent=1))
    impls = []
    for r in results:
        impls += [k for k in r["tflops"] if k not in impls]
    lines = ["| shape | valid_m x N x K (groups) | " + " | ".join(impls) + f" | {last_header} |",
             "|---|---|" + "---|" * len(impls) + "---|"]
    for r in results:
        cells = [f"{r['tflops'][k]:.0f}" if k in r["tflops"] else "-" for k in impls]
        lines.append(f"| {r['shape']} | {r['valid_m']}x{r['n']}x{r['k']} ({r['groups']}) | " + " | ".join(cells)
                     + f" | {last_cell(r)} |")
    return impls, lines


def plot(results, impls, title: str, path: Path):
    """Grouped bars: TFLOP/s per shape and implementation (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        w = 0.8 / len(impls)
        for i, k in enumerate(impls):
            ax.bar([j + i * w for j in range(len(results))], [r["tflops"].get(k, 0) for r in results], w, label=k)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(results))], [r["shape"] for r in results])
        ax.set_ylabel("TFLOP/s")
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    except Exception as e:  # noqa: BLE001
        print(f"no plot: {e}")


def _best_over_torch(r):
    best = max(v for k, v in r["tflops"].items() if k.startswith("ours"))
    return f"{best / r['tflops']['torch._grouped_mm']:.2f}" if "torch._grouped_mm" in r["tflops"] else "-"


def write(results, device, out: Path):
    impls, lines = table(results, device, out, "results.json", "best ours / torch", _best_over_torch)
    lines.append("")
    lines.append(f"TFLOP/s (2*valid_m*N*K / median time). {timing_note(results)} Checks: " + "; ".join(
        f"{r['shape']}: " + ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in r["check"].items()) for r in results))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, impls, f"grouped GEMM, bf16, {device}", out / "plot.png")


def run_mxfp8(args):
    """MXFP8 benchmark rows (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    from cudnn_moe_jax import formats

    dev, timer, why = _session()
    quant = jax.jit(lambda x: formats.to_block_scaled(x, formats.E4M3))
    results = []
    for shape_name in args.shapes.split(","):
        if shape_name not in shapes.GROUP_SIZES:
            continue
        m, n, k, L = shapes.SHAPES[shape_name]
        p = {"op": shapes.FUSION[shape_name][0]}
        sizes = shapes.GROUP_SIZES[shape_name]
        offsets = jnp.asarray(np.cumsum(sizes).astype(np.int32))
        valid_m = int(np.sum(sizes))
        flops = 2.0 * valid_m * n * k
        key = jax.random.PRNGKey(0)
        b_codes, sfb = quant(jax.random.normal(jax.random.fold_in(key, 1), (L, n, k), jnp.float32) / np.sqrt(k))
        nkb = -(-k // 32)
        # B scales equal across N within each K block, varying along K
        s_uni = jnp.broadcast_to((118 + jnp.arange(nkb) % 3).astype(jnp.uint8), (L, n, nkb))
        sfb_uni = formats.pack_sf(s_uni)
        alpha = jnp.ones((L,), jnp.float32)
        prob = jax.random.uniform(jax.random.fold_in(key, 2), (m,), jnp.float32)
        nc = jnp.ones((1,), jnp.float32)
        # distinct A operands (XLA merges identical calls); B is shared
        a_sets = [quant(jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.float32))
                  for i in range(ITERS)]
        jax.block_until_ready(a_sets)
        row = {"shape": shape_name, "valid_m": valid_m, "n": n, "k": k, "groups": L, "tflops": {}, "ms": {}}
        if timer is None:
            row["cupti_unavailable"] = why
        runners = {}
        for label, fp8_d in bench_cases.MXFP8_OUTPUTS.items():
            tail = (nc,) if fp8_d else ()
            sets = [(a, b_codes, sa, sfb, offsets, alpha, prob) + tail for a, sa in a_sets]
            f = public_op(bench_cases.mxfp8_call(shape_name, fp8_d), sets[0], f"ours[{label}] on {shape_name}")
            runners[f"ours[{label}]"] = _jax_runner(f, sets, timer)
            if not fp8_d and shape_name == "fc1":
                runners[f"ours[{label},uniformB]"] = _jax_runner(
                    f, [(a, b_codes, sa, sfb_uni, offsets, alpha, prob) for a, sa in a_sets], timer)
        if args.lab:  # the lab: other configurations of the shape (lab/bench_kernels.py)
            from lab import bench_kernels

            for label, (problem, f) in lab_kernels(bench_kernels.mxfp8_cases(), f"{shape_name}_",
                                                   args.configs).items():
                tail = (nc,) if problem.epilogue.generate_sfd else ()
                sets = [(a, b_codes, sa, sfb, offsets, alpha, prob) + tail for a, sa in a_sets]
                checked = public_op(f, sets[0], f"kernel[{label}] on {shape_name}")
                runners[f"kernel[{label}]"] = _jax_runner(checked, sets, timer)

        def ragged(a, b, offsets, alpha, prob, _p=p):
            gs = jnp.diff(jnp.concatenate([jnp.zeros((1,), jnp.int32), offsets]))
            acc = jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), gs, preferred_element_type=jnp.float32)
            return jnp_epilogue(_p, acc, offsets, alpha, prob)

        try:
            rf = jax.jit(ragged)
            jax.block_until_ready(rf(a_sets[0][0], b_codes, offsets, alpha, prob))
            runners["ragged_dot(fp8)+jnp"] = _jax_runner(
                rf, [(a, b_codes, offsets, alpha, prob) for a, _ in a_sets], timer)
        except Exception as e:  # noqa: BLE001
            row["ragged_dot_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            import torch

            ta = [torch.randn(valid_m, k, device="cuda").to(torch.float8_e4m3fn) for _ in range(3)]
            tb = torch.randn(L, n, k, device="cuda").to(torch.float8_e4m3fn)
            sa_t = torch.ones(valid_m, device="cuda", dtype=torch.float32)
            sb_t = torch.ones(L, n, device="cuda", dtype=torch.float32)
            offs_t = torch.tensor(np.cumsum(sizes).astype(np.int32), device="cuda")
            tsets = [(x, tb.transpose(-2, -1), sa_t, sb_t, offs_t) for x in ta]
            runners["torch._scaled_grouped_mm(fp8,rowwise)"] = _torch_runner(
                lambda a, b, sa, sb, o: torch._scaled_grouped_mm(a, b, sa, sb, offs=o, out_dtype=torch.bfloat16),
                tsets)
        except Exception as e:  # noqa: BLE001
            row["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        _record(row, time_interleaved(runners, row), flops, 40)
        if "ours[bf16d]" in row["ms"] and "ours[fp8d]" in row["ms"]:
            row["fp8d_over_bf16d_pct"] = 100.0 * (row["ms"]["ours[fp8d]"] / row["ms"]["ours[bf16d]"] - 1.0)
        results.append(row)
        del a_sets, runners
    return results, str(dev.device_kind)


def write_mxfp8(results, device, out: Path):
    _, lines = table(results, device, out, "mxfp8_results.json", "FP8-D cost",
                     lambda r: f"{r['fp8d_over_bf16d_pct']:+.1f}%" if "fp8d_over_bf16d_pct" in r else "-")
    errs = [f"{r['shape']}: {k}={r[k]}" for r in results for k in ("torch_error", "ragged_dot_error") if k in r]
    lines += ["", f"TFLOP/s (2*valid_m*N*K / median time), MXFP8 e4m3 inputs. {timing_note(results)} "
              + "; ".join(errs)]
    (out / "mxfp8_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_mxfp8(results, device, out / "mxfp8_plot.png")


def plot_mxfp8(results, device, path: Path):
    """The library's default kernels (bf16 D, FP8 D) beside the peers; config probes and data variants left out."""
    keep = [k for k in ("ours[bf16d]", "ours[fp8d]", "ragged_dot(fp8)+jnp", "torch._scaled_grouped_mm(fp8,rowwise)")
            if any(k in r["tflops"] for r in results)]
    plot(results, keep, f"grouped GEMM, MXFP8 inputs (e4m3 + e8m0 / 32), {device}", path)


def run_formats(args):
    """Format comparison (`--formats`): per shape (bench_cases.FORMAT_SHAPES), the public op on bf16 inputs and on
    each block-scaled format (bench_cases.BLOCK_FORMATS, dequantized exactly to bf16), bf16 D (+ C for
    SwiGLU), operands quantized from N(0, 1) data on the GPU, beside the route the public op does not take
    (bench_cases.other_route), and torch's grouped GEMMs (bf16, rowwise FP8) on the same shape. Rows: TFLOP/s and
    the time ratio bf16 / format."""
    import jax
    import jax.numpy as jnp

    from cudnn_moe_jax import formats

    dev, timer, why = _session()
    wanted = args.formats.split(",")
    results = []
    names = bench_cases.FORMAT_SHAPES if args.shapes in ("", "all") else args.shapes.split(",")
    for shape_name in names:
        (m, n, k, L), _, rows = bench_cases.format_shape(shape_name)
        offsets = jnp.asarray(np.arange(1, L + 1, dtype=np.int32) * rows)
        flops = 2.0 * m * n * k
        key = jax.random.PRNGKey(0)
        alpha, prob = jnp.ones((L,), jnp.float32), jax.random.uniform(jax.random.fold_in(key, 2), (m,))
        row = {"shape": shape_name, "valid_m": m, "n": n, "k": k, "groups": L, "tflops": {}, "ms": {}}
        if timer is None:
            row["cupti_unavailable"] = why
        runners = {}
        for fmt in ["bf16"] + [f for f in bench_cases.FORMAT_LABELS[1:] if f in wanted]:
            half = jax.jit(lambda x: (x.astype(jnp.bfloat16), None))
            quant = half
            if fmt != "bf16":
                data, sf, vec = bench_cases.BLOCK_FORMATS[bench_cases.WEIGHT_ONLY.get(fmt, fmt)]
                quant = jax.jit(lambda x, data=data, sf=sf, vec=vec: formats.to_block_scaled(x, data, sf, vec))
            b, sfb = quant(jax.random.normal(jax.random.fold_in(key, 1), (L, n, k), jnp.float32) / np.sqrt(k))
            quant_a = quant
            if fmt in bench_cases.WEIGHT_ONLY:
                quant_a = jax.jit(lambda x, t=bench_cases.a_half(fmt): (x.astype(t), None))
            a_sets = [quant_a(jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.float32))
                      for i in range(ITERS)]
            sets = [(a, b, sa, sfb, offsets, alpha, prob) for a, sa in a_sets]
            f = public_op(bench_cases.block_call(shape_name, fmt), sets[0], f"ours[{fmt}] on {shape_name}")
            runners[f"ours[{fmt}]"] = _jax_runner(f, sets, timer)
            route = bench_cases.other_route(shape_name, fmt) if fmt != "bf16" else None
            if route is not None:   # the route the public op does not take (on-chip conversion / XLA dequantization)
                label, _, fr = route
                rsets = [tuple(x for x in s if x is not None) for s in sets]
                runners[f"ours[{label}]"] = _jax_runner(public_op(fr, rsets[0], f"ours[{label}]"), rsets, timer)
            if args.lab and fmt != "bf16":  # the lab: other schedules of the format (lab/bench_kernels.py)
                from lab import bench_kernels

                for label, (problem, fk) in lab_kernels(bench_kernels.format_cases(), f"{shape_name}_{fmt}_",
                                                        args.configs).items():
                    ksets = [(a, b, sa, sfb, offsets, alpha, prob) if sa is not None
                             else (a, b, sfb, offsets, alpha, prob) for a, sa in a_sets]
                    checked = public_op(fk, ksets[0], f"kernel[{fmt},{label}] on {shape_name}")
                    runners[f"kernel[{fmt},{label}]"] = _jax_runner(checked, ksets, timer)
        runners.update(_torch_format_runners(row, m, n, k, L, rows))
        _record(row, time_interleaved(runners, row), flops, 16)
        base = row["ms"].get("ours[bf16]")
        row["speedup_over_bf16"] = {key: base / t for key, t in row["ms"].items() if base}
        print(f"{shape_name:9s} time bf16 / format: " + ", ".join(f"{key} {v:.2f}x" for key, v in
                                                             row["speedup_over_bf16"].items()), flush=True)
        results.append(row)
        runners.clear()
    return results, str(dev.device_kind)


def _torch_format_runners(row: dict, m: int, n: int, k: int, L: int, rows: int) -> dict:
    """The format comparison's torch rows on the shape's grouped GEMM alone (no fused epilogue): `_grouped_mm` on
    bf16 and `_scaled_grouped_mm` on e4m3 with rowwise fp32 scales (the coarse-scaling reference point)."""
    try:
        import torch

        offs = torch.tensor(np.arange(1, L + 1, dtype=np.int32) * rows, device="cuda")
        xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(3)]
        w = torch.randn(L, n, k, device="cuda").to(torch.bfloat16)
        x8, w8 = [x.to(torch.float8_e4m3fn) for x in xs], w.to(torch.float8_e4m3fn)
        sa, sb = torch.ones(m, device="cuda"), torch.ones(L, n, device="cuda")
        return {"torch._grouped_mm(bf16)": _torch_runner(lambda a, b, o: torch._grouped_mm(a, b, offs=o),
                                                         [(x, w.transpose(-2, -1), offs) for x in xs]),
                "torch._scaled_grouped_mm(fp8,rowwise)": _torch_runner(
                    lambda a, b, o: torch._scaled_grouped_mm(a, b, sa, sb, offs=o, out_dtype=torch.bfloat16),
                    [(x, w8.transpose(-2, -1), offs) for x in x8])}
    except Exception as e:  # noqa: BLE001
        row["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return {}


def run_discrete(args):
    """Discrete weights (`--discrete`): per shape of bench_cases.DISCRETE_SHAPES, the bf16 fused op with stacked
    weights (one (L, N, K) array) and with the same weights as L arrays (b_tensors: the kernel reads each expert
    through its own TMA descriptor), timed interleaved on the same inputs. Rows: TFLOP/s and the time ratio
    discrete / stacked (target <= 1.03)."""
    import jax
    import jax.numpy as jnp

    dev, timer, why = _session()
    results = []
    for shape_name in bench_cases.DISCRETE_SHAPES:
        m, n, k, L = shapes.SHAPES[shape_name]
        offsets = jnp.asarray(np.cumsum(shapes.GROUP_SIZES[shape_name]).astype(np.int32))
        valid_m = int(offsets[-1])
        flops = 2.0 * valid_m * n * k
        keys = jax.random.split(jax.random.PRNGKey(0), 3 * SETS)
        stacked, discrete = [], []
        for s in range(SETS):
            a = jax.random.normal(keys[3 * s], (m, k), jnp.float32).astype(jnp.bfloat16)
            b = (jax.random.normal(keys[3 * s + 1], (L, n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
            prob = jax.random.uniform(keys[3 * s + 2], (m,), jnp.float32)
            alpha = jnp.ones((L,), jnp.float32)
            stacked.append((a, b, offsets, alpha, prob))
            discrete.append((a, tuple(b[e] for e in range(L)), offsets, alpha, prob))   # L buffers of their own
        jax.block_until_ready((stacked, discrete))
        row = {"shape": shape_name, "valid_m": valid_m, "n": n, "k": k, "groups": L, "tflops": {}, "ms": {}}
        if timer is None:
            row["cupti_unavailable"] = why
        runners = {
            "ours[stacked]": _jax_runner(public_op(bench_cases.bf16_call(shape_name), stacked[0],
                                                  f"ours[stacked] on {shape_name}"), stacked, timer),
            "ours[discrete]": _jax_runner(public_op(bench_cases.discrete_call(shape_name), discrete[0],
                                                   f"ours[discrete] on {shape_name}"), discrete, timer),
        }
        _record(row, time_interleaved(runners, row), flops, 14)
        row["discrete_over_stacked"] = row["ms"]["ours[discrete]"] / row["ms"]["ours[stacked]"]
        print(f"{shape_name:7s} time discrete / stacked: {row['discrete_over_stacked']:.3f}", flush=True)
        results.append(row)
        del stacked, discrete, runners
    return results, str(dev.device_kind)


def write_discrete(results, device, out: Path):
    _, lines = table(results, device, out, "discrete_results.json", "time discrete / stacked",
                     lambda r: f"{r['discrete_over_stacked']:.3f}")
    lines += ["", f"TFLOP/s (2*valid_m*N*K / median time), bf16 SwiGLU (C + D + amax), the same weights stacked "
              f"(b_tensor) or as per-expert arrays (b_tensors). {timing_note(results)}"]
    (out / "discrete_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_formats(results, device, out: Path):
    _, lines = table(results, device, out, "formats_results.json", "time bf16 / format",
                     lambda r: " ".join(f"{k[k.index('[') + 1:-1]} {v:.2f}x" for k, v in
                                        r["speedup_over_bf16"].items() if k.startswith(("ours[", "kernel["))
                                        and k != "ours[bf16]"))
    lines += ["", f"TFLOP/s (2*m*N*K / median time); block-scaled inputs dequantized exactly to bf16: on chip, or "
              f"(from _dequant_first's rows per expert) once before the bf16 mainloop -- staged inside the kernel "
              f"where it implements that, else by XLA (the public op ours[format] takes the lowering's route; "
              f"ours[format:on-chip] / ours[format:xla-dequant] is the other); an fp16 A runs on chip only; the "
              f"torch rows are the grouped GEMM alone (no fused epilogue). {timing_note(results)}"]
    (out / "formats_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    keep = [f"ours[{f}]" for f in bench_cases.FORMAT_LABELS]
    plot(results, [k for k in keep if any(k in r["tflops"] for r in results)],
         f"grouped GEMM by input format, {device}", out / "formats_plot.png")


def run_hadamard(args):
    """The Hadamard op beside the plain GLU (`--hadamard`): per GLU shape (bench_cases.HADAMARD_SHAPES) and input
    format, every call of bench_cases.HADAMARD_VARIANTS (SwiGLU with C; NVFP4 D, rowwise / colwise Hadamard outputs),
    operands quantized from N(0, 1) data on the GPU (bench_cases.hadamard_sets). Rows: TFLOP/s and each call's time
    over the plain GLU's."""
    dev, timer, why = _session()
    results = []
    for shape_name, fmt in ((s, f) for s in bench_cases.HADAMARD_SHAPES for f in args.hadamard.split(",")):
        if args.shapes != "all" and shape_name not in args.shapes.split(","):
            continue
        (m, n, k, L), _, _ = bench_cases.format_shape(shape_name)
        sets = bench_cases.hadamard_sets(shape_name, fmt, ITERS)
        row = {"shape": f"{shape_name}/{fmt}", "valid_m": m, "n": n, "k": k, "groups": L, "tflops": {}, "ms": {}}
        if timer is None:
            row["cupti_unavailable"] = why
        runners = {}
        for variant in bench_cases.HADAMARD_VARIANTS:
            f = public_op(bench_cases.hadamard_call(shape_name, variant, fmt), sets[0], f"{variant} on {row['shape']}")
            runners[f"ours[{variant}]"] = _jax_runner(f, sets, timer)
        _record(row, time_interleaved(runners, row), 2.0 * m * n * k, 16)
        base = row["ms"].get("ours[glu]")
        row["over_glu"] = {key: t / base for key, t in row["ms"].items() if base}
        print(f"{row['shape']:12s} time / glu: " + ", ".join(f"{key} {v:.3f}" for key, v in row["over_glu"].items()),
              flush=True)
        results.append(row)
        runners.clear()
    return results, str(dev.device_kind)


def write_hadamard(results, device, out: Path):
    _, lines = table(results, device, out, "hadamard_results.json", "time / plain glu",
                     lambda r: " ".join(f"{k[5:-1]} {v:.3f}" for k, v in r["over_glu"].items() if k != "ours[glu]"))
    lines += ["", "TFLOP/s (2*m*N*K / median time) of SwiGLU calls with C: glu = grouped_gemm_glu with bf16 D (+ "
              "amax); glu_fp4d = its MXFP4 D (+ D_col, SFD_row, SFD_col); h_* = grouped_gemm_glu_hadamard_quant with "
              "NVFP4 D (+ sfd), and a rowwise NVFP4 / colwise NVFP4 / (bf16 D) rowwise bf16 Hadamard output. Target "
              f"(issue 20): h_d4_row4 / h_d4_col4 <= 1.15 x h_d4 (the same op without the RHT output). "
              f"{timing_note(results)}"]
    (out / "hadamard_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--shapes", default=",".join(list(shapes.SHAPES) + list(shapes.ROUTINGS)))
    ap.add_argument("--lab", action="store_true",
                    help="also time the lab's other configurations of each shape (lab/bench_kernels.py)")
    ap.add_argument("--configs", default="", help="with --lab: comma-separated subset of the lab kernels' labels")
    ap.add_argument("--mxfp8", action="store_true", help="MXFP8 inputs")
    ap.add_argument("--replot", metavar="MXFP8_JSON", help="only redraw the MXFP8 plot of a saved mxfp8_results.json")
    ap.add_argument("--formats", metavar="LIST", help="format comparison: bf16 and these input formats "
                    f"(of {','.join(bench_cases.FORMAT_LABELS[1:])}; w_*: bf16 A, block-scaled weights) on fc1 / "
                    "fc2 / small and the memory-bound shapes "
                    "(--shapes all or a subset of " + ",".join(bench_cases.FORMAT_SHAPES) + ", or of the rows "
                    "sweep " + ",".join(bench_cases.ROWS_SWEEP) + ")")
    ap.add_argument("--discrete", action="store_true", help="discrete weights (b_tensors) vs stacked on " +
                    ",".join(bench_cases.DISCRETE_SHAPES))
    ap.add_argument("--hadamard", metavar="LIST", help="the Hadamard op beside the plain GLU on fc1 / small, inputs "
                    "in these formats (bf16, nvfp4, mxfp8, mxfp4)")
    args = ap.parse_args(argv)
    if args.discrete:
        results, device = run_discrete(args)
        write_discrete(results, device, Path(args.out))
        return
    for mode, run_mode, write_mode in (("hadamard", run_hadamard, write_hadamard),
                                       ("formats", run_formats, write_formats)):
        if getattr(args, mode):
            if args.shapes == ap.get_default("shapes"):   # these modes have their own shape lists
                args.shapes = "all"
            results, device = run_mode(args)
            write_mode(results, device, Path(args.out))
            return
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot_mxfp8(saved["results"], saved["device"], Path(args.out))
        return
    if args.mxfp8:
        results, device = run_mxfp8(args)
        write_mxfp8(results, device, Path(args.out))
        return
    results, device = run(args)
    write(results, device, Path(args.out))


if __name__ == "__main__":
    main()
