"""How fast does XLA move token rows? The routed layer's permutation gathers (x[row_token], zero rows for padding)
and gather-sums (out[t] = sum_j y[dest_row[t, j]], fp32 adds) at the layer configs' shapes, written several ways,
on real routing (`nn.route` of random top-k choices), device-timed (CUPTI span), beside a plain copy of the same
bytes.

    python -m lab.bench_row_gather [--configs 8e,64e,128e]     # checkout root, GPU machine with torch

Prints per config and variant: microseconds per call, GB/s (bytes read + written once), and whether the result
equals the current `nn.routing` version bit for bit.
"""

from __future__ import annotations

CALLS = 4


def _u32(x):
    """(r, H) bf16 -> (r, H/2) uint32 (free: a bitcast)."""
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(x.reshape(x.shape[0], -1, 2), jnp.uint32)


def _bf16(w, like_cols):
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(w, jnp.bfloat16).reshape(w.shape[:-1] + (like_cols,))


def gather_variants():
    """name -> fn(x, idx): the layer's row gather (`bf16_fill`, nn.routing's own) and candidates."""
    import jax.numpy as jnp

    from cudnn_moe_jax.nn import routing

    def u32_fill(x, idx):
        return _bf16(jnp.take(_u32(x), idx, axis=0, mode="fill", fill_value=0), x.shape[1])

    def u32_clip_where(x, idx):
        t = x.shape[0]
        rows = jnp.take(_u32(x), jnp.minimum(idx, t - 1), axis=0, mode="clip")
        return _bf16(jnp.where((idx < t)[:, None], rows, 0), x.shape[1])

    def bf16_clip_no_pad(x, idx):   # lower bound: no zero rows (not the layer's semantics)
        return jnp.take(x, jnp.minimum(idx, x.shape[0] - 1), axis=0, mode="clip")

    return dict(bf16_fill=routing.take_rows, u32_fill=u32_fill, u32_clip_where=u32_clip_where,
                bf16_clip_no_pad=bf16_clip_no_pad)


def sum_variants():
    """name -> fn(y, dest): the layer's gather-sum (`bf16_fill`, nn.routing's own) and a candidate."""
    import jax
    import jax.numpy as jnp

    from cudnn_moe_jax.nn import routing

    def u32_fill(y, dest):
        w = jnp.take(_u32(y), dest, axis=0, mode="fill", fill_value=0)             # (T, k, H/2) uint32
        picked = jax.lax.bitcast_convert_type(w, jnp.bfloat16).astype(jnp.float32)   # (T, k, H/2, 2)
        out = picked[:, 0]
        for j in range(1, picked.shape[1]):
            out = out + picked[:, j]
        return out.astype(y.dtype).reshape(dest.shape[0], y.shape[1])

    return dict(bf16_fill=routing.sum_rows, u32_fill=u32_fill)


def run(name: str, timer) -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_moe_layer import CONFIGS
    from cudnn_moe_jax import nn

    t, h, _, e, k = CONFIGS[name]
    key = jax.random.PRNGKey(0)
    experts = jax.lax.top_k(jax.random.normal(key, (t, e)), k)[1].astype(jnp.int32)
    plan = nn.route(experts, e)
    m = plan.row_token.shape[0]
    # distinct inputs per call: XLA would merge identical calls into one
    xs = [jax.random.normal(jax.random.PRNGKey(j), (t, h), jnp.float32).astype(jnp.bfloat16) for j in range(CALLS)]
    ys = [jax.random.normal(jax.random.PRNGKey(j), (m, h), jnp.float32).astype(jnp.bfloat16) for j in range(CALLS)]

    def timed(fn, arrays, *args):
        f = jax.jit(lambda arrs, *a: [fn(x, *a) for x in arrs])
        out = f(arrays, *args)
        jax.block_until_ready(out)
        best = min(timer.time(lambda: jax.block_until_ready(f(arrays, *args)), CALLS).device for _ in range(3))
        return out[0], best

    y = ys[0]
    copy_out, copy_s = timed(lambda a: a + jnp.bfloat16(1), ys)
    print(f"{name}: copy of ({m}, {h}) bf16: {copy_s * 1e6:8.1f} us  {2 * y.nbytes / copy_s / 1e9:7.0f} GB/s",
          flush=True)
    moved = {"gather": 2 * m * h * 2, "sum": (t * k * h + t * h) * 2}   # bytes read + written once
    for kind, variants, args in (("gather", gather_variants(), (xs, plan.row_token)),
                                 ("sum", sum_variants(), (ys, plan.dest_row))):
        ref = None
        for vname, fn in variants.items():
            out, s = timed(fn, *args)
            ref = out if ref is None else ref
            same = "-" if vname.endswith("no_pad") else bool(jnp.array_equal(out, ref))
            print(f"{name}: {kind:7s} {vname:18s} {s * 1e6:8.1f} us  {moved[kind] / s / 1e9:7.0f} GB/s  "
                  f"same={same}", flush=True)


def main(argv=None):
    from lab import device_timer

    device_timer.config_main(run, __doc__, "8e,64e,128e", argv)


if __name__ == "__main__":
    main()
