"""Block-scaled operands staged in the kernel (`problem.staged`, kernels/sm90/mainloop_staged.py) beside the XLA
route (cudnn_moe_jax._dequant_first), the on-chip dequantizing mainloop and the bf16 kernel alone on the route's
bf16 operands: the format benchmark's calls (lab.bench_kernels.format_problem: SwiGLU with C and D on fc1, plain D
on fc2; SWEEP: fewer rows per expert) and fc2's dgrad (`fc2_dglu`: dY (m, H) by W2^T (I, H), dSwiGLU with the
saved C, bf16 D and amax: the backward op on fc2's FLOPs), every output of each staged kernel timed compared with
the route's (bit for bit where A is staged in a workspace or 16-bit; with A in registers the sums run in the K slot
order: the differing bytes and the largest difference are printed), then each timed on the device (CUPTI span of
CALLS calls on distinct inputs, best of 3 rounds). Staged routes: the library's choice ("staged") and A placed
explicitly in a workspace or in registers (`a_config`).

    python -m lab.bench_staged [--shapes fc1,fc2,fc2_dglu] [--formats nvfp4,...,w16_nvfp4] [--routes ...] [--calls N]
                               [--power]
    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.bench_staged:bundle_items

--power: each route also runs back to back for POWER_SECONDS while nvidia-smi samples the SM clock and the board
power (median of the samples; the card runs at its power limit, so a route's clock says how much power its work
costs). "bf16 kernel alone" is the 16-bit kernel (fp16 beside an fp16 A)."""

from __future__ import annotations

import argparse
import dataclasses

SHAPES = ("fc1", "fc2")
SWEEP = ("fc1_r1024", "fc1_r512", "small_r1024", "small_r512")   # fewer rows per expert: the rule's threshold
FORMATS = ("nvfp4", "mxfp8", "mxfp4", "w_nvfp4", "w_mxfp8", "w16_nvfp4")
A_WHERE = ("workspace", "registers")
ROUTES = ("staged", *(f"staged (A {w})" for w in A_WHERE), "xla route", "on chip", "bf16 kernel alone")
CALLS = 8
POWER_SECONDS = 2.0


def problems(shape: str, fmt: str):
    """(route problem, staged problem, the route's bf16 problem) of a format call (`fc2_dglu`: fc2's dglu)."""
    from cudnn_moe_jax import _dequant_first
    from cudnn_moe_jax._problem import Epilogue
    from lab import bench_kernels

    if shape == "fc2_dglu":
        fc2 = bench_kernels.format_problem("fc2", fmt)
        base = dataclasses.replace(fc2, op="dglu", n=fc2.k, k=fc2.n, epilogue=Epilogue(
            act="dswiglu", c_dtype="bfloat16", d_dtype="bfloat16", compute_amax=True))
    else:
        base = bench_kernels.format_problem(shape, fmt)
    return base, dataclasses.replace(base, staged=True), _dequant_first.half_problem(base)


def bundle_items(shapes=SHAPES, fmts=FORMATS) -> list:
    from cudnn_moe_jax.kernels.sm90.config import default_config
    from lab import forward_cases

    items = []
    for shape in shapes:
        for fmt in fmts:
            base, staged, bf16 = problems(shape, fmt)
            items += [forward_cases.lowering_item(staged), forward_cases.lowering_item(base, default_config(base)),
                      forward_cases.lowering_item(base, fn=forward_cases.dequant_first_fn(base))]
            if base.a_dtype is None:
                items += [forward_cases.lowering_item(staged, a_config(staged, where)) for where in A_WHERE]
        items.append(forward_cases.lowering_item(bf16))   # one bf16 problem per shape
    return items


def a_config(staged, where: str):
    """The staged problem's config with a block-scaled A converted once into a workspace or by the consumers in
    registers (`where`; the default picks by `operands.staged_a_in_registers`)."""
    from cudnn_moe_jax.kernels.sm90.config import default_config

    return dataclasses.replace(default_config(staged), dequant_a=where)


def inputs(problem, seed: int) -> list:
    """The problem's inputs in the operand table's order: N(0, 1) data quantized to its format (B / sqrt(K)),
    equal experts, alpha 1, prob uniform in [0.1, 1); dglu: the saved C N(0, 1) in bf16, beta 1."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cudnn_moe_jax import formats, operands

    key = jax.random.PRNGKey(seed)
    L, m, k = problem.num_groups, problem.m, problem.k
    fmt = (problem.ab_dtype, problem.sf_dtype, problem.sf_vec_size)
    a32 = jax.random.normal(jax.random.fold_in(key, 0), (m, k), jnp.float32)
    b32 = jax.random.normal(jax.random.fold_in(key, 1), (L, problem.n, k), jnp.float32) / np.sqrt(k)
    a, sfa = (a32.astype(problem.a_dtype), None) if problem.a_dtype else formats.to_block_scaled(a32, *fmt)
    b, sfb = formats.to_block_scaled(b32, *fmt)
    arrays = dict(a=a, b=b, sfa=sfa, sfb=sfb, padded_offsets=jnp.asarray(np.arange(1, L + 1) * (m // L), jnp.int32),
                  alpha=jnp.ones((L,), jnp.float32),
                  prob=jax.random.uniform(jax.random.fold_in(key, 2), (m,), jnp.float32, 0.1, 1.0),
                  beta=jnp.ones((L,), jnp.float32))
    if problem.op == "dglu":
        arrays["c"] = jax.random.normal(jax.random.fold_in(key, 3), (m, 2 * problem.n), jnp.bfloat16)
    return [arrays[name] for name in operands.input_specs(problem)]


def clock_and_power(run) -> tuple:
    """(median SM clock in MHz, median board power in W) sampled by nvidia-smi every 50 ms while `run` repeats for
    POWER_SECONDS (the first 0.2 s of samples dropped)."""
    import statistics
    import subprocess
    import time

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start = time.monotonic()
    while time.monotonic() - start < POWER_SECONDS:
        run()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line][4:]
    return statistics.median(float(r[0]) for r in rows), statistics.median(float(r[1]) for r in rows)


def compare(got, want) -> str:
    """Bytes that differ from the route's outputs, and the largest difference of a float output relative to its
    largest magnitude (A converted in registers sums each stage's products in another order)."""
    import numpy as np

    bad = {key: int((np.asarray(got[key]).view(np.uint8) != np.asarray(v).view(np.uint8)).sum())
           for key, v in want.items()}
    if not any(bad.values()):
        return "bit-identical to the route"
    rel = {}
    for key, v in want.items():
        w = np.asarray(v)
        if bad[key] and w.dtype.name in ("float32", "bfloat16", "float16"):
            w64, g64 = w.astype(np.float64), np.asarray(got[key]).astype(np.float64)
            rel[key] = float(np.nanmax(np.abs(g64 - w64)) / max(np.nanmax(np.abs(w64)), 1e-30))
    return f"differs from the route (bytes {bad}; max diff / max |route| {rel})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--routes", default=",".join(ROUTES), help="timed routes (staged and the xla route always run "
                    "once: every staged route timed is compared with the xla route's outputs)")
    ap.add_argument("--power", action="store_true")
    ap.add_argument("--calls", type=int, default=CALLS, help="calls per timed program (distinct inputs each)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cudnn_moe_jax import _dequant_first, operands
    from cudnn_moe_jax.kernels.sm90.config import default_config
    from lab import device_timer, forward_cases, harness

    timer, why = device_timer.cupti_timer()
    print(f"device {jax.devices()[0].device_kind}; {'CUPTI' if timer else 'host: ' + why}", flush=True)
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            base, staged, bf16 = problems(shape, fmt)
            flops = 2.0 * base.m * base.n * base.k
            calls = args.calls
            sets = [inputs(base, s) for s in range(calls)]
            names = list(operands.input_specs(base))
            bf16_names = list(operands.input_specs(bf16))
            bf16_sets = []
            for st in sets:
                d = _dequant_first.dequantized_inputs(base, dict(zip(names, st)))
                bf16_sets.append([d[n] for n in bf16_names])
            with harness.kernels_only():
                fns = {"staged": forward_cases.kernel_fn(staged), "xla route": forward_cases.dequant_first_fn(base),
                       "on chip": forward_cases.kernel_fn(base, default_config(base)),
                       "bf16 kernel alone": forward_cases.kernel_fn(bf16)}
                if base.a_dtype is None:
                    fns.update({f"staged (A {w})": forward_cases.kernel_fn(staged, a_config(staged, w))
                                for w in A_WHERE})
                want = fns["xla route"](*sets[0])
                line = [f"{shape:4s} {fmt:8s}"]
                routes = args.routes.split(",")
                staged_routes = [r for r in ROUTES if r.startswith("staged") and r in fns]
                for label in [r for r in staged_routes if r == "staged" or r in routes]:
                    line.append(f"{label}: " + compare(fns[label](*sets[0]), want))
                for label, fn in fns.items():
                    if label not in routes:
                        continue
                    use = bf16_sets if label.startswith("bf16") else sets
                    prog = jax.jit(lambda *flat, fn=fn, n=len(use[0]): [fn(*flat[i * n:(i + 1) * n])
                                                                      for i in range(calls)])
                    flat = [x for st in use for x in st]
                    run = lambda prog=prog, flat=flat: jax.block_until_ready(prog(*flat))  # noqa: E731
                    run()
                    t = [timer.time(run, calls) if timer else device_timer.host_time(run, calls) for _ in range(3)]
                    sec = min(x.device if x.device is not None else x.host for x in t)
                    line.append(f"{label} {sec * 1e3:.3f} ms {flops / sec / 1e12:.1f} TFLOP/s")
                    if args.power:
                        line[-1] += " ({:.0f} MHz, {:.0f} W)".format(*clock_and_power(run))
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
