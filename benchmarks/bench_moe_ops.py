"""The six GEMMs of one MoE training step, each timed alone (the calls `nn.moe_mlp` makes, same keywords), the
squared-ReLU step's FC2 dgrad (dsrelu), the dgrad with an FP8 D, the wgrads accumulating into an fp32 and a bf16 W,
the one producing an fp32 W (float32 master weights) and the weight gradients with block-scaled (MXFP8 / MXFP4 /
NVFP4) operands (`BS_WGRAD`, beside the bf16 "wgrad w1 / w2"), beside torch's `_grouped_mm` on the same problem
where it has one.

    python -m benchmarks.bench_moe_ops [--shape fc] [--only wgrad]      # from the checkout's root

JAX on the device (CUPTI span of one jitted program of REPS calls on distinct inputs), torch with CUDA events;
then each backward row over its forward row (`backward_ratios`; the backward ops' target is >= 0.9x).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from benchmarks import bench_moe_step as step

REPS = 5


def _ops(shape: str):
    """(m, {name: (fn over (x, w1, w2, prob, dy, c, hh, dc, w2f), flops)}, valid rows, H, I) of `shape`: the six
    GEMMs of the SwiGLU step, plus the squared-ReLU step's FC2 dgrad (dsrelu, C = the (m, I) pre-activation), the
    FC2 dgrad with an FP8 D, the W2 gradient accumulated into an fp32 W (w2f) and into the bf16 W2, and the W1
    gradient in fp32."""
    import jax.numpy as jnp

    import cudnn_moe_jax as cmj

    sizes, h, i = step.SHAPES[shape]
    m, offsets, _ = step._problem(shape, "swiglu")
    off = jnp.asarray(offsets)
    valid = sum(sizes)
    sw = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731
    nmaj = dict(a_major="m", b_major="n")
    al = _aligned(shape)
    ops = {
        "fc1 glu (fwd)": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_glu(
            x, w1, padded_offsets=off, prob_tensor=p, act_func="swiglu", c_dtype="bfloat16", d_dtype="bfloat16",
            compute_amax=False, **al).d_tensor, 2 * valid * h * 2 * i),
        "fc2 quant (fwd)": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_quant(
            hh, w2, padded_offsets=off, d_dtype="bfloat16", compute_amax=False, **al).d_tensor,
            2 * valid * i * h),
        "dglu (fc2 dgrad)": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_dglu(
            dy, sw(w2), c, padded_offsets=off, prob_tensor=p, act_func="dswiglu", d_dtype="bfloat16",
            compute_amax=False, b_major="n", **al).d_row_tensor, 2 * valid * h * i),
        "dsrelu (fc2 dgrad)": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_dsrelu(
            dy, sw(w2), hh, padded_offsets=off, prob_tensor=p, d_dtype="bfloat16", compute_amax=False,
            b_major="n", **al).d_row_tensor, 2 * valid * h * i),
        # the same dgrad with FP8 D_row (e4m3 + SFD_row, D_col, SFD_col), as an FP8 training recipe asks for
        "dglu e4m3 D (+SFD)": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_dglu(
            dy, sw(w2), c, padded_offsets=off, prob_tensor=p, act_func="dswiglu", d_dtype="float8_e4m3fn",
            norm_const_tensor=jnp.ones((1,), jnp.float32), b_major="n", **al).d_row_tensor,
            2 * valid * h * i),
        "fc1 dgrad quant": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_quant(
            dc, sw(w1), padded_offsets=off, d_dtype="bfloat16", b_major="n", compute_amax=False, **al).d_tensor,
            2 * valid * 2 * i * h),
        "wgrad w2": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_wgrad(
            dy.T, hh.T, off, wgrad_dtype="bfloat16", **nmaj).wgrad_tensor, 2 * valid * h * i),
        "wgrad w1": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_wgrad(
            dc.T, x.T, off, wgrad_dtype="bfloat16", **nmaj).wgrad_tensor, 2 * valid * 2 * i * h),
        # gradient accumulation into an fp32 W (micro-batches): the epilogue also reads the old W
        "wgrad w2 accum f32": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_wgrad(
            dy.T, hh.T, off, wgrad_tensor=w2f, accumulate_on_output=True,
            **nmaj).wgrad_tensor, 2 * valid * h * i),
        # ... and into the bf16 W2
        "wgrad w2 accum bf16": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_wgrad(
            dy.T, hh.T, off, wgrad_tensor=w2, accumulate_on_output=True,
            **nmaj).wgrad_tensor, 2 * valid * h * i),
        # float32 master weights (nn.moe_layer with float32 W1 / W2): the W1 gradient in float32
        "wgrad w1 f32": (lambda x, w1, w2, p, dy, c, hh, dc, w2f: cmj.grouped_gemm_wgrad(
            dc.T, x.T, off, wgrad_dtype="float32", **nmaj).wgrad_tensor, 2 * valid * 2 * i * h),
    }
    return m, ops, sizes, h, i


def bf16_inputs(shape: str, seed: int) -> tuple:
    """The bf16 rows' inputs (x, w1, w2, prob, dy, c, hh, dc, w2f) of one set: the step's, the saved C, the FC1
    output h and its gradient dC, and W2 in fp32 (the accumulated wgrad's old W)."""
    import jax
    import jax.numpy as jnp

    m, _, avals = step._problem(shape, "swiglu")
    i = step.SHAPES[shape][2]
    x, w1, w2, p, dy = step._inputs(avals, seed)
    k = jax.random.PRNGKey(100 + seed)
    return (x, w1, w2, p, dy, jax.random.normal(k, (m, 2 * i)).astype(jnp.bfloat16),
            jax.random.normal(k, (m, i)).astype(jnp.bfloat16), jax.random.normal(k, (m, 2 * i)).astype(jnp.bfloat16),
            w2.astype(jnp.float32))


def _aligned(shape: str) -> dict:
    """The M-grouped ops' `m_aligned` keyword: the shape's group alignment (bench_moe_step.align)."""
    return {"m_aligned": step.align(shape)}


def _avals(shape: str):
    import jax
    import jax.numpy as jnp

    m, _, _, _, i = _ops(shape)
    _, _, avals = step._problem(shape, "swiglu")
    sd = jax.ShapeDtypeStruct
    return avals + (sd((m, 2 * i), jnp.bfloat16), sd((m, i), jnp.bfloat16), sd((m, 2 * i), jnp.bfloat16),
                    sd(avals[2].shape, jnp.float32))


# The weight gradients with block-scaled A / B (the dequantizing K-grouped kernel; SF in per-expert segments along
# the tokens): name -> (format, weight, token-major operands). "tok": dY / h / dC / x as a step stores them (T, rows)
# with a_major="m", b_major="n" (FP8 only); otherwise token-contiguous (rows, T), cuDNN's layout.
BS_WGRAD = {"wgrad w2 mxfp8 tok": ("mxfp8", "w2", True), "wgrad w2 mxfp8": ("mxfp8", "w2", False),
            "wgrad w2 mxfp4": ("mxfp4", "w2", False), "wgrad w2 nvfp4": ("nvfp4", "w2", False),
            "wgrad w1 mxfp8 tok": ("mxfp8", "w1", True), "wgrad w1 nvfp4": ("nvfp4", "w1", False)}


def _bs_wgrad(shape: str, name: str):
    """(fn(a, b, sfa, sfb, gs), avals, flops, inputs(seed)) of a block-scaled wgrad row: W2 = dY^T h (A (H, T),
    B (I, T)) or W1 = dC^T x (A (2I, T), B (H, T)); codes uniform over the finite ones, scales in {1, 2}."""
    import jax
    import jax.numpy as jnp

    import cudnn_moe_jax as cmj
    from cudnn_moe_jax.formats import BLOCK_FORMATS, sf_segment_bytes
    from cudnn_moe_jax.limits import values_per_byte

    fmt, weight, token_major = BS_WGRAD[name]
    data, sf, vec = BLOCK_FORMATS[fmt]
    sizes, h, i = step.SHAPES[shape]
    m, offsets, _ = step._problem(shape, "swiglu")
    off = jnp.asarray(offsets)
    rows = (h, i) if weight == "w2" else (2 * i, h)
    fp4 = data == "float4_e2m1fn"
    sd = jax.ShapeDtypeStruct
    shapes = [(m, r) if token_major else (r, m // values_per_byte(data)) for r in rows]
    dtype = jnp.uint8 if fp4 else jnp.dtype(data)
    sf_dtype = jnp.float8_e4m3fn if sf == "float8_e4m3fn" else jnp.uint8
    avals = ([sd(s, dtype) for s in shapes] + [sd((sf_segment_bytes(r, m, vec),), sf_dtype) for r in rows]
             + [sd((len(sizes),), jnp.float32)])
    majors = dict(a_major="m", b_major="n") if token_major else {}

    def fn(a, b, sfa, sfb, gs):
        if token_major:
            a, b = a.T, b.T
        nvfp4 = sf == "float8_e4m3fn"
        return cmj.grouped_gemm_wgrad(a, b, off, sfa, sfb, gs if nvfp4 else None, gs if nvfp4 else None,
                                      wgrad_dtype="bfloat16", sf_vec_size=vec, **majors).wgrad_tensor

    def inputs(seed):
        keys = jax.random.split(jax.random.PRNGKey(1000 + seed), 4)
        out = []
        for k, a in zip(keys, avals[:2]):
            bits = jax.random.bits(k, a.shape, jnp.uint8)
            if not fp4:   # no NaN code
                bits = jnp.where((bits & 0x7F) == 0x7F, bits & 0x3F, bits)
            out.append(bits if fp4 else jax.lax.bitcast_convert_type(bits, dtype))
        one, two = (0x38, 0x40) if sf == "float8_e4m3fn" else (127, 128)
        for k, a in zip(keys[2:], avals[2:4]):
            s = jnp.where(jax.random.bernoulli(k, 0.5, a.shape), one, two).astype(jnp.uint8)
            out.append(jax.lax.bitcast_convert_type(s, sf_dtype) if sf_dtype != jnp.uint8 else s)
        return out + [jnp.ones((len(sizes),), jnp.float32)]

    return fn, tuple(avals), 2.0 * sum(sizes) * rows[0] * rows[1], inputs


# The forward and dgrad GEMMs with block-scaled inputs (the dequantizing kernel), beside their bf16 rows: name ->
# (format, GEMM): fc1 glu x (m, H) by W1 (2I, H), fc2 quant h (m, I) by W2 (H, I), the fc2 dgrad dglu dY (m, H)
# by W2^T (I, H) (block-scaled weights are K-major: a quantized W2^T)
BS_OPS = {f"{gemm} {fmt}": (fmt, gemm) for fmt in ("mxfp8", "nvfp4") for gemm in ("fc1 glu", "fc2 quant", "dglu")}


def _bs_op(shape: str, name: str):
    """(fn(a, b, sfa, sfb, c, prob), flops, inputs(seed)) of a BS_OPS row; operands quantized from N(0, 1)."""
    import jax
    import jax.numpy as jnp

    import cudnn_moe_jax as cmj
    from cudnn_moe_jax import formats

    fmt, gemm = BS_OPS[name]
    data, sf, vec = formats.BLOCK_FORMATS[fmt]
    sizes, h, i = step.SHAPES[shape]
    m, offsets, _ = step._problem(shape, "swiglu")
    off = jnp.asarray(offsets)
    valid = sum(sizes)
    (k, n) = {"fc1 glu": (h, 2 * i), "fc2 quant": (i, h), "dglu": (h, i)}[gemm]
    kw = dict(padded_offsets=off, sf_vec_size=vec, **_aligned(shape))

    def fn(a, b, sfa, sfb, c, prob):
        if gemm == "fc1 glu":
            return cmj.grouped_gemm_glu(a, b, sfa_tensor=sfa, sfb_tensor=sfb, prob_tensor=prob, act_func="swiglu",
                                        c_dtype="bfloat16", d_dtype="bfloat16", compute_amax=False, **kw).d_tensor
        if gemm == "fc2 quant":
            return cmj.grouped_gemm_quant(a, b, sfa_tensor=sfa, sfb_tensor=sfb, d_dtype="bfloat16",
                                          compute_amax=False, **kw).d_tensor
        return cmj.grouped_gemm_dglu(a, b, c, sfa_tensor=sfa, sfb_tensor=sfb, prob_tensor=prob, act_func="dswiglu",
                                     d_dtype="bfloat16", compute_amax=False, **kw).d_row_tensor

    quant = jax.jit(lambda x: formats.to_block_scaled(x, data, sf, vec))

    def inputs(seed):
        keys = jax.random.split(jax.random.PRNGKey(2000 + seed), 4)
        a, sfa = quant(jax.random.normal(keys[0], (m, k), jnp.float32))
        b, sfb = quant(jax.random.normal(keys[1], (len(sizes), n, k), jnp.float32) / np.sqrt(k))
        c = jax.random.normal(keys[2], (m, 2 * i), jnp.float32).astype(jnp.bfloat16)
        return [a, b, sfa, sfb, c, jax.random.uniform(keys[3], (m,), jnp.float32, 0.1, 1.0)]

    return fn, 2.0 * valid * n * k, inputs


def _bs_op_avals(shape: str, name: str):
    import jax

    _, _, inputs = _bs_op(shape, name)
    return tuple(jax.eval_shape(lambda: inputs(0)))


def bundle_items(shapes=("fc",), only: str = ""):
    """Lowerings for CUDA of every op this benchmark times (`python -m cudnn_moe_jax.aot build --variants
    benchmarks.bench_moe_ops:bundle_items` records their modules); `only`: the rows whose name contains it."""
    import jax

    items = []
    for shape in shapes:
        avals = _avals(shape)
        for name, (fn, _) in _ops(shape)[1].items():
            if only in name:
                items.append(lambda fn=fn, avals=avals: jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)))
        for name in BS_WGRAD:
            if only not in name:
                continue
            fn, bs_avals, _, _ = _bs_wgrad(shape, name)
            items.append(lambda fn=fn, avals=bs_avals: jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)))
        for name in BS_OPS:
            if only not in name:
                continue
            fn, _, _ = _bs_op(shape, name)
            items.append(lambda fn=fn, shape=shape, name=name: jax.jit(fn).trace(*_bs_op_avals(shape, name)).lower(
                lowering_platforms=("cuda",)))
    return items


def forward_row(name: str):
    """The forward row a backward row is measured against (the backward ops' target: >= 0.9x of the forward's
    TFLOP/s): the same FLOPs and input format -- dglu / dsrelu / wgrad W2 against fc2 quant, the fc1 dgrad and wgrad
    W1 against fc1 glu; None for a forward row."""
    if name.startswith(("fc1 glu", "fc2 quant")):
        return None
    fmt = next((f for f in ("mxfp8", "mxfp4", "nvfp4") if f in name.split()), None)
    forward = "fc1 glu" if name.startswith("fc1 dgrad") or " w1" in name else "fc2 quant"
    return f"{forward} {fmt}" if fmt else f"{forward} (fwd)"


def backward_ratios(rates: dict) -> list:
    """(backward row, its forward row, TFLOP/s ratio) of every backward row in `rates` (name -> TFLOP/s) whose
    forward row was timed too."""
    pairs = [(name, forward_row(name)) for name in rates]
    return [(name, fwd, rates[name] / rates[fwd]) for name, fwd in pairs if fwd in rates]


def _kernel_seconds(run, calls: int):
    """Device time per call of our GEMM kernels alone (CUPTI events through torch.profiler), or None."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    us = sum(e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == DeviceType.CUDA and "GroupedGemmSm90" in e.name)
    return us * 1e-6 / calls if us else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="fc", choices=tuple(step.SHAPES))
    ap.add_argument("--only", default="", help="time only the rows whose name contains this (e.g. wgrad)")
    args = ap.parse_args(argv)
    import jax

    from lab import device_timer

    _, ops, sizes, h, i = _ops(args.shape)
    timer, why = device_timer.cupti_timer()
    sets = [bf16_inputs(args.shape, s) for s in range(REPS)]
    print(f"shape {args.shape}: groups {sizes}, H {h}, I {i}; JAX {'CUPTI' if timer else 'host: ' + str(why)}")
    rows = [(name, fn, fl, lambda: sets) for name, (fn, fl) in ops.items()]
    for name in BS_WGRAD:   # beside "wgrad w1" / "wgrad w2" (bf16, token-major)
        fn, _, fl, make = _bs_wgrad(args.shape, name)
        rows.append((name, fn, fl, lambda make=make: [make(s) for s in range(REPS)]))
    for name in BS_OPS:     # beside "fc1 glu (fwd)" / "fc2 quant (fwd)" / "dglu (fc2 dgrad)"
        fn, fl, make = _bs_op(args.shape, name)
        rows.append((name, fn, fl, lambda make=make: [make(s) for s in range(REPS)]))
    rates = {}
    for name, fn, fl, make_sets in rows:
        if args.only not in name:
            continue
        row_sets = make_sets()
        n_in = len(row_sets[0])
        prog = jax.jit(lambda *a, fn=fn, n_in=n_in: [fn(*a[n_in * r:n_in * (r + 1)]) for r in range(REPS)])
        flat = [t for st in row_sets for t in st]
        run = lambda: jax.block_until_ready(prog(*flat))  # noqa: E731
        run()
        t = [(timer.time(run, REPS) if timer else device_timer.host_time(run, REPS)) for _ in range(3)]
        _, secs = device_timer.primary(t)
        med = statistics.median(secs)
        # the GEMM kernel alone: the span also holds XLA's work around it (the accumulate case copies its
        # non-donated input W before the kernel updates it in place)
        kern = _kernel_seconds(run, REPS) if timer else None
        extra = f"   kernel {kern * 1e3:7.3f} ms {fl / kern / 1e12:7.1f} TFLOP/s" if kern else ""
        if name.startswith("wgrad"):   # mostly a W writer with few tokens per expert: the rate W leaves at
            w = jax.eval_shape(fn, *row_sets[0])
            extra += f"   W at {w.size * w.dtype.itemsize / med / 1e12:5.2f} TB/s"
        print(f"  {name:18s} {med * 1e3:8.3f} ms {fl / med / 1e12:7.1f} TFLOP/s{extra}", flush=True)
        rates[name] = fl / med / 1e12
    for name, fwd, ratio in backward_ratios(rates):
        print(f"  {name:18s} / {fwd:18s} {ratio:5.2f}x")
    torch_rows(sizes, h, i, args.only)


def torch_rows(sizes, h: int, i: int, only: str = "") -> None:
    """torch on the same problems (CUDA events, mean of 10 calls after 3): `_grouped_mm` fc1 / fc2 forward and the
    W2 / W1 gradients (2d x 2d, groups along the tokens: the same W bytes as ours), cuBLAS's batched GEMM on the W2
    gradient where the experts are equal (`bmm`), and a fill of W2's bytes -- the write ceiling of a wgrad that is
    mostly its W store (few tokens per expert): each wgrad row also prints the rate W reaches DRAM at."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    L, T = len(sizes), sum(sizes)
    offs = torch.tensor(np.cumsum(sizes).astype(np.int32), device="cuda")
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    x, dy, hh, dc = rnd(T, h), rnd(T, h), rnd(T, i), rnd(T, 2 * i)
    w2_bytes, w1_bytes = 2 * L * h * i, 2 * L * 2 * i * h
    rows = {"fc1 (fwd)": (lambda a=x, b=rnd(L, h, 2 * i): torch._grouped_mm(a, b, offs=offs), 2 * T * h * 2 * i, 0),
            "fc2 (fwd)": (lambda a=hh, b=rnd(L, i, h): torch._grouped_mm(a, b, offs=offs), 2 * T * i * h, 0),
            "wgrad w2": (lambda: torch._grouped_mm(dy.t(), hh, offs=offs), 2 * T * h * i, w2_bytes),
            "wgrad w1": (lambda: torch._grouped_mm(dc.t(), x, offs=offs), 2 * T * 2 * i * h, w1_bytes)}
    if len(set(sizes)) == 1:
        t = sizes[0]
        rows["bmm wgrad w2"] = (lambda: torch.bmm(dy.view(L, t, h).transpose(1, 2), hh.view(L, t, i)), 2 * T * h * i,
                                w2_bytes)
    w2 = torch.empty(L, h, i, device="cuda", dtype=torch.bfloat16)
    rows["fill of W2's bytes"] = (lambda: w2.fill_(1.0), 0, w2_bytes)
    for name, (fn, fl, nbytes) in rows.items():
        if only not in name and not name.startswith("fill"):
            continue
        try:
            for _ in range(3):
                fn()
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            for _ in range(10):
                fn()
            en.record()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"  torch {name}: {type(e).__name__}: {str(e)[:120]}")
            continue
        ms = st.elapsed_time(en) / 10
        rate = f" {fl / ms / 1e9:7.1f} TFLOP/s" if fl else " " * 15
        wrote = f"   W at {nbytes / ms / 1e9:5.2f} TB/s" if nbytes else ""
        print(f"  torch {name:18s} {ms:8.3f} ms{rate}{wrote}", flush=True)


if __name__ == "__main__":
    main()
