"""What do gathered A rows (`a_index`, kernels/sm90/mainloop_gather.py) cost the routed layer's M-grouped GEMMs? On
real routing (`nn.route` of random top-k choices, 64-row groups) at the layer benchmark's configs, device-timed
(CUPTI span): FC1 (SwiGLU with C), the FC2 dgrad (dSwiGLU with dprob) and the two weight gradients (dW2 = dY^T h
with A gathered, dW1 = dC^T x with B gathered; fp32 W) on the permuted rows (`x_perm` / `dy_perm`, which XLA
gathers first: timed alone), and the same ops reading the token rows through `a_index` / `b_index`.

    python -m lab.bench_gather [--configs 8e,64e,128e]     # checkout root, GPU machine with torch

Prints per config and op: microseconds per call and TFLOP/s of the rows the kernel computes (2 m N K), and whether
the gathered op's outputs equal the pre-gathered op's bit for bit.
"""

from __future__ import annotations

CALLS = 3


def bundle_items(configs=("8e", "64e", "128e")):
    """The calls of every config, lowered for CUDA at the configs' shapes."""
    import jax

    items = []
    for name in configs:
        shapes = _shapes(name)
        for label, fn in _calls(name).items():
            if label == "gather":   # XLA only
                continue
            items.append(lambda fn=fn, shapes=shapes: jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)))
    return items


def _dims(name):
    from benchmarks.bench_moe_layer import CONFIGS
    from cudnn_moe_jax import nn

    t, h, i, e, k = CONFIGS[name]
    return t, h, i, e, k, nn.permuted_rows(t, k, e)


def _shapes(name):
    """ShapeDtypeStructs of (x, dy, x_perm, dy_perm, w1, w2t, c, prob, offsets, row_token, h) of the config."""
    import jax
    import jax.numpy as jnp

    t, h, i, e, k, m = _dims(name)
    s = jax.ShapeDtypeStruct
    return (s((t, h), jnp.bfloat16), s((t, h), jnp.bfloat16), s((m, h), jnp.bfloat16), s((m, h), jnp.bfloat16),
            s((e, 2 * i, h), jnp.bfloat16), s((e, i, h), jnp.bfloat16), s((m, 2 * i), jnp.bfloat16),
            s((m,), jnp.float32), s((e,), jnp.int32), s((m,), jnp.int32), s((m, i), jnp.bfloat16))


def _calls(name):
    """label -> fn(*_shapes): the row gather, FC1 and the FC2 dgrad on the permuted rows and gathered."""
    import cudnn_moe_jax as cmj
    from cudnn_moe_jax.nn import routing

    common = dict(m_aligned=routing.M_ALIGNED, compute_amax=False)

    def fc1(a, w1, prob, offsets, index=None):
        out = cmj.grouped_gemm_glu(a, w1, padded_offsets=offsets, prob_tensor=prob, act_func="swiglu",
                                   c_dtype="bfloat16", d_dtype="bfloat16", a_index=index, **common)
        return out["c_tensor"], out["d_tensor"]

    def dglu(a, w2t, c, prob, offsets, index=None):
        out = cmj.grouped_gemm_dglu(a, w2t, c, padded_offsets=offsets, prob_tensor=prob, act_func="dswiglu",
                                    d_dtype="bfloat16", a_index=index, **common)
        return out["d_row_tensor"], out["dprob_tensor"]

    def wgrad(a, b, offsets, **index):   # token-major operands, as the layer's dW2 = dY^T h, dW1 = dC^T x
        return cmj.grouped_gemm_wgrad(a.T, b.T, offsets, wgrad_dtype="float32", a_major="m", b_major="n",
                                      **index)["wgrad_tensor"],

    return {
        "gather": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: routing.take_rows(x, rt),
        "dw2 on dy_perm": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: wgrad(dyp, hh, off),
        "dw2 gathered": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: wgrad(dy, hh, off, a_index=rt),
        "dw1 on x_perm": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: wgrad(c, xp, off),
        "dw1 gathered": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: wgrad(c, x, off, b_index=rt),
        "fc1 on x_perm": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: fc1(xp, w1, prob, off),
        "fc1 gathered": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: fc1(x, w1, prob, off, rt),
        "dglu on dy_perm": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: dglu(dyp, w2t, c, prob, off),
        "dglu gathered": lambda x, dy, xp, dyp, w1, w2t, c, prob, off, rt, hh: dglu(dy, w2t, c, prob, off, rt),
    }


def run(name: str, timer) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cudnn_moe_jax import nn

    t, h, i, e, k, m = _dims(name)
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    experts = jax.lax.top_k(jax.random.normal(keys[0], (t, e)), k)[1].astype(jnp.int32)
    plan = nn.route(experts, e)
    x = jax.random.normal(keys[1], (t, h), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (t, h), jnp.float32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(keys[3], (e, 2 * i, h), jnp.float32) / 64).astype(jnp.bfloat16)
    w2t = (jax.random.normal(keys[4], (e, i, h), jnp.float32) / 64).astype(jnp.bfloat16)
    c = jax.random.normal(keys[5], (m, 2 * i), jnp.float32).astype(jnp.bfloat16)
    prob = jax.random.uniform(keys[6], (m,), minval=0.1, maxval=1.0)
    from cudnn_moe_jax.nn import routing

    x_perm, dy_perm = routing.take_rows(x, plan.row_token), routing.take_rows(dy, plan.row_token)
    h_act = c[:, :i] * 0.5   # FC1's output h (m, I) as the dW2 operand
    args = (x, dy, x_perm, dy_perm, w1, w2t, c, prob, plan.padded_offsets, plan.row_token, h_act)
    rows = int(plan.padded_offsets[-1])
    flops = {"fc1": 2.0 * rows * 2 * i * h, "dglu": 2.0 * rows * i * h, "dw2": 2.0 * rows * i * h,
             "dw1": 2.0 * rows * 2 * i * h}
    outs = {}
    for label, fn in _calls(name).items():
        f = jax.jit(fn)
        outs[label] = jax.block_until_ready(f(*args))
        best = min(timer.time(lambda: jax.block_until_ready([f(*args) for _ in range(CALLS)]), CALLS).device
                   for _ in range(3))
        op = label.split()[0]
        rate = f"{flops[op] / best / 1e12:6.0f} TFLOP/s" if op in flops else f"{2 * m * h * 2 / best / 1e9:6.0f} GB/s"
        same = ""
        if label.endswith(" gathered"):
            ref = outs[f"{op} on {'x' if op in ('fc1', 'dw1') else 'dy'}_perm"]
            same = "  same=" + str(all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                                      for a, b in zip(outs[label], ref)))
        print(f"{name}: {label:18s} {best * 1e6:9.1f} us  {rate}{same}", flush=True)


def main(argv=None):
    from lab import device_timer

    device_timer.config_main(run, __doc__, "8e,64e,128e", argv)


if __name__ == "__main__":
    main()
