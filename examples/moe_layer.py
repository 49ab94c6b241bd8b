"""Main job: one MoE FFN layer, forward + backward under jax.jit, on the default backend.

On a machine without a GPU every op runs on the pure-jnp reference; on a Hopper GPU the ops lower to the fused
kernels where one covers the call. Prints shapes, the loss, gradient norms and a timing line.

    python examples/moe_layer.py --tokens 512 --experts 8 --hidden 256 --intermediate 256 --dtype bfloat16
    python examples/moe_layer.py --batch 4 --tokens 128 --gate-up-halves   # (B, S, H) input; checkpoint layout

--gate-up-halves starts from W1 / b1 stored as a checkpoint usually stores them ([gate; up] halves, e.g. a fused
gate_up_proj), converts them once with nn.interleave_glu_weights to the fused ops' 32-block interleave, and
converts the W1 / b1 gradients back with nn.deinterleave_glu_weights (the checkpoint's layout).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from cudnn_moe_jax import activations, nn


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="tokens T per sequence (default 512)")
    parser.add_argument("--batch", type=int, default=0,
                        help="sequences B: x is (B, T, H) instead of (T, H) (default 0: unbatched)")
    parser.add_argument("--experts", type=int, default=8, help="number of experts L (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--hidden", type=int, default=256, help="model width H (default 256)")
    parser.add_argument("--intermediate", type=int, default=256,
                        help="expert width I (GLU: FC1 has 2I outputs; multiple of 32) (default 256)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                        help="activation/weight dtype (default bfloat16)")
    parser.add_argument("--act", choices=tuple(activations.TABLE), default="swiglu",
                        help="expert activation (default swiglu)")
    parser.add_argument("--bias", action="store_true", help="give FC1 a per-expert bias")
    parser.add_argument("--gate-up-halves", action="store_true",
                        help="GLU: start from [gate; up] halves (checkpoint layout) and convert (see above)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def init_params(key, args):
    dtype = jnp.dtype(args.dtype)
    k_router, k_w1, k_w2, k_b1 = jax.random.split(key, 4)
    fc1_out = activations.TABLE[args.act].input_width(args.intermediate)
    params = {
        "router": jax.random.normal(k_router, (args.hidden, args.experts), jnp.float32) / args.hidden ** 0.5,
        "w1": (jax.random.normal(k_w1, (args.experts, fc1_out, args.hidden)) / args.hidden ** 0.5).astype(dtype),
        "w2": (jax.random.normal(k_w2, (args.experts, args.hidden, args.intermediate))
               / args.intermediate ** 0.5).astype(dtype),
    }
    if args.bias:
        params["b1"] = (0.1 * jax.random.normal(k_b1, (args.experts, fc1_out))).astype(dtype)
    if args.gate_up_halves:
        # what a checkpoint holds: rows [0, I) of each expert's W1 (and b1) are the gate, rows [I, 2I) the up half
        checkpoint = {k: params[k] for k in ("w1", "b1") if k in params}
        params.update({k: nn.interleave_glu_weights(v, axis=1) for k, v in checkpoint.items()})
    return params


def make_step(args):
    """(jitted forward+backward step, params, x): loss = mean((moe_layer(x) - target)^2), grads w.r.t. params, x."""
    key = jax.random.PRNGKey(args.seed)
    k_params, k_x, k_t = jax.random.split(key, 3)
    params = init_params(k_params, args)
    batch = (args.batch,) if args.batch else ()
    x = jax.random.normal(k_x, batch + (args.tokens, args.hidden), jnp.float32).astype(args.dtype)
    target = jax.random.normal(k_t, x.shape, jnp.float32)

    def loss_fn(params, x):
        y, aux = nn.moe_layer(x, params["router"], params["w1"], params["w2"], params.get("b1"),
                              top_k=args.top_k, act=args.act)
        loss = jnp.mean((y.astype(jnp.float32) - target) ** 2)
        return loss, (y, aux)

    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)), params, x


def lower_step_for(args, platform: str = "cuda"):
    """Lower the step for `platform` without running it (used to prebuild the kernel bundle on a CPU machine)."""
    step, params, x = make_step(args)
    return step.trace(params, x).lower(lowering_platforms=(platform,))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.gate_up_halves and not activations.TABLE[args.act].glu:
        print(f"--gate-up-halves applies to the GLU activations ({args.act} has no gate)", file=sys.stderr)
        return 2
    step, params, x = make_step(args)
    print(f"backend={jax.default_backend()} devices={jax.devices()}")
    print(f"batch={args.batch or None} tokens={args.tokens} experts={args.experts} top_k={args.top_k} hidden={args.hidden} "
          f"intermediate={args.intermediate} act={args.act} dtype={args.dtype} bias={args.bias}")
    start = time.perf_counter()
    (loss, (y, aux)), (grads, dx) = step(params, x)
    jax.block_until_ready(grads)
    first = time.perf_counter() - start
    if args.gate_up_halves:  # the gradients in the checkpoint's [gate; up] layout, ready to apply or save there
        grads.update({k: nn.deinterleave_glu_weights(grads[k], axis=1) for k in ("w1", "b1") if k in grads})
    print(f"x {x.shape} {x.dtype} -> y {y.shape} {y.dtype}; permuted rows "
          f"{nn.permuted_rows(x.size // args.hidden, args.top_k, args.experts)}; padded_offsets "
          f"{list(map(int, aux['padded_offsets']))}; expert load {list(map(int, aux['expert_load']))}")
    print(f"loss {float(loss):.6f}")
    for name, g in sorted(grads.items()):
        print(f"grad {name:7s} {str(g.shape):18s} norm {float(jnp.linalg.norm(g.astype(jnp.float32))):.6e}")
    print(f"grad x       {str(dx.shape):18s} norm {float(jnp.linalg.norm(dx.astype(jnp.float32))):.6e}")
    finite = all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in jax.tree_util.tree_leaves(grads))
    if not (finite and bool(jnp.isfinite(loss))):
        print("non-finite loss or gradient", file=sys.stderr)
        return 1
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(step(params, x))
        times.append(time.perf_counter() - start)
    best = min(times) if times else float("nan")
    print(f"timing: first call (compile + run) {first:.2f} s; forward+backward step {best * 1e3:.2f} ms "
          f"(best of {args.steps}) on {jax.default_backend()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
