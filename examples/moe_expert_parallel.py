"""Expert-parallel MoE layer (nn.moe_layer_ep) forward + backward on every visible device.

Experts are sharded over the mesh axis "expert" (optionally tokens also over a "data" axis); tokens reach their
experts' devices through jax.lax.all_to_all. Sizes are per device, so runs on different device counts carry the
same per-device expert load. Prints the mesh, the loss, gradient norms and a timing line; `--time-exchange` also
times the exchange alone (dispatch + combine with identity experts, forward + backward), `--compare-single` the
plain single-device nn.moe_layer with one device's share of experts and tokens.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/moe_expert_parallel.py   # 4 CPU devices
    python examples/moe_expert_parallel.py --experts-per-device 8 --rows-per-expert 2048 --hidden 7168 \\
        --intermediate 2048 --capacity-factor 1.25 --time-exchange --compare-single            # GPU benchmark
These timings are host wall clock; benchmarks/bench_ep.py times the same programs (make_step, make_exchange,
single_device_step) on the device (CUPTI) for 1..N GPUs and reports the weak-scaling efficiency.
Several hosts: the same command on each, with --coordinator HOST:PORT --num-processes N --process-id I.

On a GPU machine without the CuTe DSL compiler the kernels come from a bundle: `bundle_items` lowers for CUDA the
step this script runs with `--devices 1` at the default sizes (`python -m cudnn_moe_jax.aot build --arch sm_90a
--out .bundle --variants examples.moe_expert_parallel:bundle_items`).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from cudnn_moe_jax import activations, nn


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=None, help="devices to use (default: all visible)")
    parser.add_argument("--data-parallel", type=int, default=1,
                        help="size of the 'data' mesh axis (tokens only; experts replicated over it) (default 1)")
    parser.add_argument("--experts-per-device", type=int, default=4, help="experts per expert shard (default 4)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--tokens-per-device", type=int, default=None, help="tokens per device (default 256)")
    load.add_argument("--rows-per-expert", type=int, default=None,
                      help="mean routed rows per expert instead: tokens per device = rows * experts/device / k")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--hidden", type=int, default=256, help="model width H (default 256)")
    parser.add_argument("--intermediate", type=int, default=256, help="expert width I, multiple of 32 (default 256)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--act", choices=tuple(activations.TABLE), default="swiglu")
    parser.add_argument("--bias", action="store_true", help="give FC1 a per-expert bias")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="per device-pair slots = ceil(f * tokens/device * k / devices); default: no drops")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first (default 3)")
    parser.add_argument("--time-exchange", action="store_true", help="also time the exchange alone")
    parser.add_argument("--compare-single", action="store_true",
                        help="also time nn.moe_layer on one device with one device's experts and tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--coordinator", default=None, help="jax.distributed coordinator HOST:PORT (multi-host)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    args = parser.parse_args(argv)
    if args.tokens_per_device is None:
        args.tokens_per_device = (256 if args.rows_per_expert is None
                                  else args.rows_per_expert * args.experts_per_device // args.top_k)
    return args


def too_few_devices(asked: int) -> str:
    """The error for asking more devices than are visible; on a CPU machine, how to get more (virtual) ones."""
    visible, platform = jax.device_count(), jax.default_backend()
    why = f"{asked} devices asked for, {visible} visible ({platform})"
    if platform != "cpu":
        return why
    return (f"{why}. A CPU machine shows one device unless XLA is told otherwise before Python starts: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={asked} python ...")


def build_mesh(args):
    if args.devices and args.devices > jax.device_count():
        raise SystemExit(too_few_devices(args.devices))
    devices = jax.devices()[:args.devices] if args.devices else jax.devices()
    if len(devices) % args.data_parallel:
        raise SystemExit(f"--data-parallel {args.data_parallel} does not divide the {len(devices)} devices")
    shape = (args.data_parallel, len(devices) // args.data_parallel)
    return jax.make_mesh(shape, ("data", "expert"), axis_types=(AxisType.Auto,) * 2, devices=devices)


def init(args, mesh):
    """Parameters and tokens created directly in their shards (jit with out_shardings: fine on many hosts)."""
    d_expert = mesh.shape["expert"]
    experts, tokens = args.experts_per_device * d_expert, args.tokens_per_device * mesh.size
    fc1_out = activations.TABLE[args.act].input_width(args.intermediate)
    shard = nn.expert_parallel_shardings(mesh, "expert", "data")
    dtype = jnp.dtype(args.dtype)
    keys = iter(jax.random.split(jax.random.PRNGKey(args.seed), 6))

    def normal(shape, scale, sharding, out_dtype=dtype):
        make = jax.jit(lambda k: (jax.random.normal(k, shape) * scale).astype(out_dtype), out_shardings=sharding)
        return make(next(keys))

    params = {"router": normal((args.hidden, experts), args.hidden ** -0.5, shard["router_weight"], jnp.float32),
              "w1": normal((experts, fc1_out, args.hidden), args.hidden ** -0.5, shard["w1"]),
              "w2": normal((experts, args.hidden, args.intermediate), args.intermediate ** -0.5, shard["w2"])}
    if args.bias:
        params["b1"] = normal((experts, fc1_out), 0.1, shard["b1"])
    x = normal((tokens, args.hidden), 1.0, shard["x"])
    target = normal((tokens, args.hidden), 1.0, shard["x"], jnp.float32)
    return params, x, target


def make_step(args, mesh):
    def loss_fn(params, x, target):
        y, aux = nn.moe_layer_ep(x, params["router"], params["w1"], params["w2"], params.get("b1"), mesh=mesh,
                                 expert_axis="expert", data_axes="data", top_k=args.top_k, act=args.act,
                                 capacity_factor=args.capacity_factor)
        return jnp.mean((y.astype(jnp.float32) - target) ** 2), aux

    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))


def make_exchange(args, mesh, capacity):
    """Forward + backward of dispatch -> identity experts (gate-weighted rows) -> combine: the exchange alone."""
    num_local = args.experts_per_device

    def body(x, router):
        experts, weights = nn.top_k_gating(jnp.dot(x.astype(jnp.float32), router), args.top_k)
        dispatch = nn.ep_dispatch(x, experts, weights, axis_name="expert", num_local_experts=num_local,
                                  capacity=capacity)
        y = (dispatch.x.astype(jnp.float32) * dispatch.prob[:, None]).astype(x.dtype)
        return nn.ep_combine(y, dispatch, axis_name="expert")

    tokens = P(("data", "expert"))
    layer = jax.shard_map(body, mesh=mesh, in_specs=(tokens, P()), out_specs=tokens, check_vma=False)
    return jax.jit(jax.grad(lambda x, router: jnp.sum(layer(x, router).astype(jnp.float32)), argnums=(0, 1)))


def lower_step_for(args, platform: str = "cuda"):
    """Lower the step `main` runs for `platform` without running it (on a CPU machine: the bundle build). The mesh
    is this machine's devices, so lower with as many (`args.devices`) as the run will use."""
    mesh = build_mesh(args)
    params, x, target = init(args, mesh)
    return make_step(args, mesh).trace(params, x, target).lower(lowering_platforms=(platform,))


def bundle_items(argv=("--devices", "1")):
    """The one-device run at the default sizes (`--devices 1`: one GPU; the build machine's one CPU device)."""
    args = parse_args(list(argv))
    return [lambda: lower_step_for(args)]


def best_time(fn, *args, steps):
    """(result of the first call, its time incl. compile, best of `steps` later calls) in seconds."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return result, first, (min(times) if times else float("nan"))


def single_device_step(args):
    """(jitted nn.moe_layer forward + backward, its inputs) on one device: experts_per_device experts,
    tokens_per_device tokens (one device's share of the EP run; benchmarks/bench_ep.py times it on the device)."""
    sub = argparse.Namespace(**{**vars(args), "devices": 1, "data_parallel": 1})
    device = jax.local_devices()[0]
    mesh = jax.make_mesh((1, 1), ("data", "expert"), axis_types=(AxisType.Auto,) * 2, devices=[device])
    params, x, target = jax.device_put(init(sub, mesh), device)

    def loss_fn(params, x):
        y, _ = nn.moe_layer(x, params["router"], params["w1"], params["w2"], params.get("b1"), top_k=args.top_k,
                            act=args.act)
        return jnp.mean((y.astype(jnp.float32) - target) ** 2)

    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))), (params, x)


def single_device_baseline(args):
    """Step time of nn.moe_layer on one device: experts_per_device experts, tokens_per_device tokens."""
    step, inputs = single_device_step(args)
    return best_time(step, *inputs, steps=args.steps)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.coordinator:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    mesh = build_mesh(args)
    d_expert, shards = mesh.shape["expert"], mesh.size
    experts = args.experts_per_device * d_expert
    capacity = nn.ep_capacity(args.tokens_per_device, args.top_k, experts, d_expert, args.capacity_factor)
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    say(f"backend={jax.default_backend()} processes={jax.process_count()} devices={len(jax.devices())}")
    say(f"mesh {dict(mesh.shape)} devices {mesh.devices.ravel().tolist()}")
    say(f"experts {experts} ({args.experts_per_device}/device) tokens {args.tokens_per_device * shards} "
        f"({args.tokens_per_device}/device) top_k {args.top_k} hidden {args.hidden} intermediate "
        f"{args.intermediate} act {args.act} dtype {args.dtype} bias {args.bias}")
    say(f"capacity {capacity} rows per device pair (capacity_factor {args.capacity_factor}); received buffer "
        f"{d_expert * capacity} rows/device")

    params, x, target = init(args, mesh)
    step = make_step(args, mesh)
    ((loss, aux), (grads, dx)), first, best = best_time(step, params, x, target, steps=args.steps)
    load = np.asarray(aux["expert_load"])
    say(f"loss {float(loss):.6f}; dropped {int(aux['dropped'])} of {args.tokens_per_device * shards * args.top_k} "
        f"assignments; expert load min {load.min()} mean {load.mean():.1f} max {load.max()}")
    norms = {name: float(jnp.linalg.norm(g.astype(jnp.float32))) for name, g in sorted(grads.items())}
    norms["x"] = float(jnp.linalg.norm(dx.astype(jnp.float32)))
    for name, g in [*sorted(grads.items()), ("x", dx)]:
        say(f"grad {name:7s} {str(g.shape):20s} norm {norms[name]:.6e}")
    if not all(np.isfinite([float(loss), *norms.values()])):
        print("non-finite loss or gradient", file=sys.stderr)
        return 1
    say(f"timing: first call (compile + run) {first:.2f} s; forward+backward step {best * 1e3:.2f} ms "
        f"(best of {args.steps}) on {shards} {jax.default_backend()} device(s)")
    if args.time_exchange:
        _, _, exchange = best_time(make_exchange(args, mesh, capacity), x, params["router"], steps=args.steps)
        moved = 4 * d_expert * capacity * args.hidden * jnp.dtype(args.dtype).itemsize * (d_expert - 1) / d_expert
        say(f"timing: exchange alone (dispatch + combine, forward + backward: 4 all_to_alls of "
            f"{d_expert * capacity} x {args.hidden} rows) {exchange * 1e3:.2f} ms; "
            f"{moved / 2 ** 20:.1f} MiB sent off each device")
    if args.compare_single:
        _, _, single = single_device_baseline(args)
        say(f"timing: single-device nn.moe_layer ({args.experts_per_device} experts, {args.tokens_per_device} "
            f"tokens) {single * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
