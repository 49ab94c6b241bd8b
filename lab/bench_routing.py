"""The routed layer's selection and grouping glue, written two ways each, at the layer configs' shapes, device-timed
(CUPTI span): top-k of the router key (`jax.lax.top_k`, which XLA:GPU runs as a sort of each row, vs k fused row
reductions: `nn.router.top_k_indices`), the grouping order of the T*k expert ids (a stable two-operand argsort vs
one sort of unique int32 keys expert << s | pair), and each pair's rank in its group (through that argsort, as
`nn.route` did, vs `nn.routing.rank_in_group`'s one-hot cumsum).

    python -m lab.bench_routing [--configs 8e,64e,128e,decode]   # checkout root, GPU machine with torch

Prints microseconds per call and whether each candidate equals the current one.
"""

from __future__ import annotations

CALLS = 10


def order_by_unique_keys(flat_expert):
    """(order, sorted ids) of jnp.argsort(flat_expert, stable=True): one sort of expert << s | pair (unique)."""
    import jax.numpy as jnp

    pairs = flat_expert.shape[0]
    shift = max(1, (pairs - 1).bit_length())
    keys = jnp.sort((flat_expert << shift) | jnp.arange(pairs, dtype=jnp.int32))
    return keys & ((1 << shift) - 1), keys >> shift


def run(name, timer):
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_moe_layer import CONFIGS
    from cudnn_moe_jax.nn.router import top_k_indices
    from cudnn_moe_jax.nn.routing import rank_by_sort, rank_in_group

    t, _, _, e, k = CONFIGS[name]
    # distinct inputs per call: XLA would merge identical calls into one
    keys = [jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(j), (t, e), jnp.float32), axis=-1)
            for j in range(CALLS)]
    experts = [jax.lax.top_k(x, k)[1].astype(jnp.int32).reshape(-1) for x in keys]

    def timed(fn, args):
        f = jax.jit(lambda xs: [fn(x) for x in xs])
        out = f(args)
        jax.block_until_ready(out)
        best = min(timer.time(lambda: jax.block_until_ready(f(args)), CALLS).device for _ in range(3))
        return out[0], best

    cases = {
        "top_k": (keys, {"lax.top_k": lambda x: jax.lax.top_k(x, k)[1],
                        "reductions": lambda x: top_k_indices(x, k)}),
        "group order": (experts, {"argsort stable": lambda f: (lambda o: (o, f[o]))(
                                      jnp.argsort(f, stable=True).astype(jnp.int32)),
                                  "unique keys": order_by_unique_keys}),
        "group rank": (experts, {"argsort stable": lambda f: rank_by_sort(f, e),
                                 "counting": lambda f: rank_in_group(f, e)}),
    }
    for what, (arg, variants) in cases.items():
        ref = None
        for vname, fn in variants.items():
            out, s = timed(fn, arg)
            ref = out if ref is None else ref
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
            print(f"{name}: {what:12s} {vname:15s} {s * 1e6:8.1f} us  same={same}", flush=True)


def main(argv=None):
    from lab import device_timer

    device_timer.config_main(run, __doc__, "8e,64e,128e,decode", argv)


if __name__ == "__main__":
    main()
