"""Subprocess side of tests/test_expert_parallel.py: runs with its own CPU device count, prints JSON lines.

    python -m tests.ep_worker cases [NAME,...]       # from the checkout's root; 4 virtual CPU devices; one line
                                                     # per case (default all)
    python -m tests.ep_worker process ID PORT        # one of 2 processes (2 virtual devices each) of a
                                                     # jax.distributed run with a local coordinator

The device count has to be fixed before jax is imported, hence a separate process (the pytest session keeps its
own). Every line is `{"case": name, ...measured values}`; the tests assert on them.
"""

from __future__ import annotations

import functools
import json
import os
import sys

_MODE = sys.argv[1] if len(sys.argv) > 1 else "cases"
_DEVICES = 4 if _MODE == "cases" else 2
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={_DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if _MODE == "process":
    # Cross-process collectives on the CPU backend go through gloo (jax's default here; set for clarity).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{sys.argv[3]}", num_processes=2,
                               process_id=int(sys.argv[2]), initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from cudnn_moe_jax import nn  # noqa: E402
from cudnn_moe_jax.nn import expert_parallel as ep  # noqa: E402

NAMES = ("x", "router", "w1", "w2", "b1")


def emit(case, **values):
    print(json.dumps({"case": case, **values}), flush=True)


def problem(tokens, hidden, inter, experts, act, bias, skew, seed):
    """Random bf16 tokens and weights. skew: logits pushed toward expert 0 and away from the last expert (every
    token carries a shared component that the router's first / last columns amplify)."""
    rng = np.random.default_rng(seed)  # numpy, not jax.random: each new jax.random shape compiles (~1 s on CPU)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    fc1 = inter if act == "srelu" else 2 * inter
    x, router = normal(tokens, hidden), normal(hidden, experts) / 8
    if skew:
        x = x + 0.5
        router[:, 0] += 0.3
        router[:, -1] -= 0.3
    w1 = jnp.asarray(normal(experts, fc1, hidden) / 8, jnp.bfloat16)
    w2 = jnp.asarray(normal(experts, hidden, inter) / 8, jnp.bfloat16)
    b1 = jnp.asarray(0.1 * normal(experts, fc1), jnp.bfloat16) if bias else None
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(router), w1, w2, b1, jnp.asarray(normal(tokens, hidden))


def masked_reference(keep, x, router, w1, w2, b1=None, *, top_k, act):
    """Single-device nn.moe_layer on the router's own decision with the gate weight of every dropped assignment
    (keep (T, k) False) set to 0: what the overflow policy promises (a dropped copy contributes nothing and
    receives no gradient)."""
    g = nn.apply_router(x, router, nn.RouterConfig(top_k=top_k))
    return nn.moe_layer(x, None, w1, w2, b1, gating=(g.experts, g.weights * keep), act=act)


def chosen_experts(x, router, top_k):
    return np.asarray(nn.apply_router(x, router, nn.RouterConfig(top_k=top_k)).experts)


def simulate_keep(experts, shards, devices, num_local, capacity):
    """The documented policy, written independently: per source shard, slots per destination device are taken by
    choice 0 of every token in order, then choice 1, ...; a copy finding its destination's C slots full drops."""
    tokens, top_k = experts.shape
    per = tokens // shards
    keep = np.zeros(experts.shape, bool)
    for s in range(shards):
        used = np.zeros(devices, int)
        for j in range(top_k):
            for t in range(s * per, (s + 1) * per):
                d = experts[t, j] // num_local
                if used[d] < capacity:
                    keep[t, j], used[d] = True, used[d] + 1
    return keep


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a = a.reshape(b.shape)                                 # a batched (B, S, H) x against the (T, H) reference
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def grads_of(layer, args, cot, extra=()):
    """(y, aux, gradients of sum(y * cot) w.r.t. `args`: x, router, w1, w2, b1) under one jit; `extra` are
    non-differentiated leading arguments of `layer`."""
    return _step(layer, len(args))(args, extra, cot)


@functools.cache  # one compile per layer function (the reference is shared by the cases of one shape)
def _step(layer, count):
    def loss(args, extra, cot):
        y, aux = layer(*extra, *args)
        return jnp.sum(y.reshape(cot.shape).astype(jnp.float32) * cot), (y, aux)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))

    def run(args, extra, cot):
        (_, (y, aux)), grads = grad(args, extra, cot)
        return y, aux, grads
    return run


@functools.cache
def _reference(top_k, act, masked):
    if masked:
        return functools.partial(masked_reference, top_k=top_k, act=act)
    return functools.partial(nn.moe_layer, top_k=top_k, act=act)


def compare(case, mesh, *, tokens=256, experts=8, act="swiglu", bias=True, skew=False, top_k=2, data_axes=(),
            capacity_factor=None, batch=None, seed=0):
    x, router, w1, w2, b1, cot = problem(tokens, 64, 64, experts, act, bias, skew, seed)
    args = (x, router, w1, w2) + ((b1,) if bias else ())
    ep_x = x if batch is None else x.reshape(batch, -1, x.shape[-1])
    devices = mesh.shape["expert"]
    shards = devices * int(np.prod([mesh.shape[a] for a in ((data_axes,) if isinstance(data_axes, str)
                                                            else data_axes)]))
    capacity = ep.ep_capacity(tokens // shards, top_k, experts, devices, capacity_factor)
    chosen = chosen_experts(x, router, top_k)
    keep = None
    if capacity_factor is not None:
        keep = simulate_keep(chosen, shards, devices, experts // devices, capacity)

    layer = functools.partial(ep.moe_layer_ep, mesh=mesh, top_k=top_k, act=act, data_axes=data_axes,
                              capacity_factor=capacity_factor)
    y, aux, got = grads_of(layer, (ep_x,) + args[1:], cot)
    if keep is None:   # no drop possible: the single-device nn.moe_layer itself
        y_ref, _, want = grads_of(_reference(top_k, act, False), args, cot)
    else:
        y_ref, _, want = grads_of(_reference(top_k, act, True), args, cot, (jnp.asarray(keep, jnp.float32),))
    load_ref = np.bincount(chosen.ravel(), minlength=experts)
    out = {"y_err": rel_err(y.reshape(y_ref.shape), y_ref), "y_shape": list(y.shape),
           "y_spec": str(y.sharding.spec), "grad_err": {n: rel_err(g, w) for n, g, w in zip(NAMES, got, want)},
           "grad_norm": {n: float(np.linalg.norm(np.asarray(g, np.float64))) for n, g in zip(NAMES, got)},
           "load": np.asarray(aux["expert_load"]).tolist(), "load_ref": load_ref.tolist(),
           "dropped": int(aux["dropped"]), "capacity": capacity}
    if keep is not None:
        out["dropped_ref"] = int(np.sum(~keep))
        all_dropped = ~keep.any(axis=1)
        out["all_dropped_tokens"] = int(all_dropped.sum())
        out["all_dropped_max_abs"] = float(np.abs(np.asarray(y, np.float32).reshape(tokens, -1)[all_dropped]).max()
                                           if all_dropped.any() else 0.0)
    emit(case, **out)


OPTIONS_CONFIG = nn.RouterConfig(top_k=2, score="sigmoid", bias="selection", n_groups=4, topk_groups=2,
                                 scaling=2.0)


def options_params(tokens, experts, hidden=64, inter=64, shared_inter=96, seed=3):
    """float32 master weights of a DeepSeek-style block in the (E, in, out) layout with separate gate / up halves,
    a selection bias, an FC2 bias and a gated shared expert; bf16 tokens."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape, s=1.0: jnp.asarray(s * rng.standard_normal(shape, np.float32))  # noqa: E731
    return {"x": normal(tokens, hidden).astype(jnp.bfloat16), "router": normal(hidden, experts, s=1 / 8),
            "router_bias": normal(experts, s=0.1), "w_gate": normal(experts, hidden, inter, s=1 / 8),
            "w_up": normal(experts, hidden, inter, s=1 / 8), "w2": normal(experts, inter, hidden, s=1 / 8),
            "b2": normal(experts, hidden, s=0.1), "s_gate": normal(hidden, shared_inter, s=1 / 8),
            "s_up": normal(hidden, shared_inter, s=1 / 8), "s_w2": normal(shared_inter, hidden, s=1 / 8),
            "s_g": normal(hidden, s=1 / 8)}


def options_layer(p, *, gating=None, **parallel):
    """The block through nn.moe_layer_ep (with `parallel` = mesh, capacity_factor) or nn.moe_layer (without)."""
    shared = nn.SharedExpert((p["s_gate"], p["s_up"]), p["s_w2"], None, p["s_g"])
    router = dict(router_config=OPTIONS_CONFIG, router_bias=p["router_bias"]) if gating is None else {}
    layer = functools.partial(ep.moe_layer_ep, **parallel) if parallel else nn.moe_layer
    return layer(p["x"], None if gating is not None else p["router"], (p["w_gate"], p["w_up"]), p["w2"],
                 gating=gating, b2=p["b2"], shared=shared, weight_layout="in_out", **router)


def compare_options(case, mesh, *, capacity_factor=None, precomputed=False):
    """Router options, FC2 bias, shared expert, layouts and float32 master weights on the EP layer against the
    single-device layer: outputs, aux and every gradient. precomputed: gating=(experts, weights) from the router
    outside the layer (differentiable, so the router still gets its gradient); with a capacity factor the
    reference zeroes the dropped copies' gate weights (their expert output and FC2 bias both vanish)."""
    tokens, experts = 256, 8
    p = options_params(tokens, experts)
    cot = jnp.asarray(np.random.default_rng(4).standard_normal((tokens, 64), np.float32))
    devices = mesh.shape["expert"]
    capacity = ep.ep_capacity(tokens // devices, 2, experts, devices, capacity_factor)
    routed = nn.apply_router(p["x"], p["router"], OPTIONS_CONFIG, p["router_bias"])
    keep = simulate_keep(np.asarray(routed.experts), devices, devices, experts // devices, capacity)

    def loss(p, keep, reference):
        gating = None
        if precomputed or reference:
            g = nn.apply_router(p["x"], p["router"], OPTIONS_CONFIG, p["router_bias"])
            gating = (g.experts, g.weights * keep)
        y, aux = options_layer(p, gating=gating) if reference else options_layer(
            p, gating=gating if precomputed else None, mesh=mesh, capacity_factor=capacity_factor)
        return jnp.sum(y.astype(jnp.float32) * cot), (y, aux)

    step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)
    (_, (y, aux)), got = step(p, jnp.ones_like(routed.weights), False)
    (_, (y_ref, aux_ref)), want = step(p, jnp.asarray(keep, jnp.float32), True)
    emit(case, y_err=rel_err(y, y_ref), dropped=int(aux["dropped"]), dropped_ref=int(np.sum(~keep)),
         experts_equal=bool(np.array_equal(np.asarray(aux["experts"]), np.asarray(routed.experts))),
         has_logits="logits" in aux, y_dtype=str(y.dtype),
         grad_dtypes={n: str(g.dtype) for n, g in got.items() if n != "x"},
         grad_err={n: rel_err(got[n], want[n]) for n in got if n != "router_bias"},
         grad_norm={n: float(np.linalg.norm(np.asarray(got[n], np.float64))) for n in got})


def mesh_of(shape, names, explicit=False):
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=types, devices=jax.devices()[:int(np.prod(shape))])


def errors():
    """Bad layouts and options: (exception type, message) of each, without compiling anything."""
    mesh4 = mesh_of((4,), ("expert",))
    x, router, w1, w2, _, _ = problem(64, 64, 64, 6, "swiglu", False, False, 0)
    calls = {
        "experts_not_divisible": lambda: ep.moe_layer_ep(x, router, w1, w2, mesh=mesh4),
        "tokens_not_divisible": lambda: ep.moe_layer_ep(x[:62], router[:, :4], w1[:4], w2[:4], mesh=mesh4),
        "unknown_axis": lambda: ep.moe_layer_ep(x, router[:, :4], w1[:4], w2[:4], mesh=mesh4, expert_axis="ep"),
        "bad_capacity": lambda: ep.moe_layer_ep(x, router[:, :4], w1[:4], w2[:4], mesh=mesh4, capacity_factor=0),
        "bad_top_k": lambda: ep.moe_layer_ep(x, router[:, :4], w1[:4], w2[:4], mesh=mesh4, top_k=5),
        "not_a_mesh": lambda: ep.moe_layer_ep(x, router[:, :4], w1[:4], w2[:4], mesh=jax.devices()),
        "router_vs_w1": lambda: ep.moe_layer_ep(x, router[:, :4], w1, w2, mesh=mesh4),
        "router_not_2d": lambda: ep.moe_layer_ep(x, router[None, :, :4], w1[:4], w2[:4], mesh=mesh4),
        "same_axes": lambda: ep.moe_layer_ep(x, router[:, :4], w1[:4], w2[:4], mesh=mesh4, data_axes="expert"),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = ["no error", ""]
        except Exception as exc:  # noqa: BLE001 -- the test checks the type
            found[name] = [type(exc).__name__, str(exc)]
    emit("errors", errors=found)


def modules():
    """FlaxMoE / EquinoxMoE with a mesh: same initial parameters, same loss and gradients as without one."""
    mesh = mesh_of((2,), ("expert",))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((128, 64), np.float32), jnp.bfloat16)
    loss = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)
    out = {}
    from flax import nnx
    values, leaves, placed = [], [], None
    for kw in ({}, {"mesh": mesh}):
        model = nn.FlaxMoE(64, 64, 4, rngs=nnx.Rngs(0), bias=True, **kw)
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        values.append(float(value))
        leaves.append(jax.tree_util.tree_leaves(nnx.state(grads)))
        placed = str(model.w1[...].sharding.spec) if kw else placed
    out["flax"] = {"values": values, "w1_spec": placed,
                   "grad_err": [rel_err(a, b) for a, b in zip(leaves[1], leaves[0])]}
    import equinox as eqx
    values, leaves = [], []
    for kw in ({}, {"mesh": mesh}):
        model = nn.EquinoxMoE(64, 64, 4, key=jax.random.PRNGKey(0), act="srelu", **kw)
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)
        values.append(float(value))
        leaves.append(jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array)))
    out["equinox"] = {"values": values, "w1_spec": str(model.w1.sharding.spec),
                      "grad_err": [rel_err(a, b) for a, b in zip(leaves[1], leaves[0])]}
    emit("modules", **out)


CASES = {
    "d2": lambda: compare("d2", mesh_of((2,), ("expert",))),
    "d4_skew_empty": lambda: compare("d4_skew_empty", mesh_of((4,), ("expert",)), skew=True),
    "d4_overflow": lambda: compare("d4_overflow", mesh_of((4,), ("expert",)), skew=True, capacity_factor=1.0),
    "d2x2_data_explicit_batched": lambda: _explicit_case(),
    "errors": lambda: errors(),
    "modules": lambda: modules(),
    "d4_options": lambda: compare_options("d4_options", mesh_of((4,), ("expert",))),
    "d4_gating_overflow": lambda: compare_options("d4_gating_overflow", mesh_of((4,), ("expert",)),
                                                  capacity_factor=1.0, precomputed=True),
}


def _explicit_case():
    # A (data 2, expert 2) mesh with Explicit axes (jax.make_mesh's default), entered with jax.set_mesh as JAX
    # requires; x batched (4, 64, H); top_k 3 > 2 (three copies per token, up to two on one device).
    mesh = mesh_of((2, 2), ("data", "expert"), explicit=True)
    with jax.set_mesh(mesh):
        compare("d2x2_data_explicit_batched", mesh, act="geglu", bias=False, top_k=3, data_axes="data", batch=4)


def process():
    """One of two processes: the layer on a 4-device global mesh (2 devices here, 2 in the other process); every
    process checks its own output rows and gradient shards against a single-device run on its first device."""
    x, router, w1, w2, b1, cot = problem(256, 64, 64, 8, "swiglu", True, False, 1)
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(AxisType.Auto,))
    specs = ep.expert_parallel_shardings(mesh)
    host = dict(zip(NAMES, map(np.asarray, (x, router, w1, w2, b1))))
    # Global arrays from the same host data in every process (each process fills its addressable shards).
    specs["router"] = specs["router_weight"]
    glob = [jax.make_array_from_callback(a.shape, specs[n], lambda idx, a=a: a[idx]) for n, a in host.items()]
    cot_glob = jax.make_array_from_callback(cot.shape, specs["x"], lambda idx: np.asarray(cot)[idx])

    def loss(x, router, w1, w2, b1, cot):
        y, aux = ep.moe_layer_ep(x, router, w1, w2, b1, mesh=mesh)
        return jnp.sum(y.astype(jnp.float32) * cot), (y, aux)

    (value, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        *glob, cot_glob)
    local = jax.local_devices()[0]
    args = [jax.device_put(a, local) for a in (x, router, w1, w2, b1)]
    cot_local = jax.device_put(cot, local)
    y_ref, _, want = grads_of(lambda *a: nn.moe_layer(*a), args, cot_local)
    errs = {"y": max(rel_err(s.data, np.asarray(y_ref)[s.index]) for s in y.addressable_shards)}
    for name, g, w in zip(NAMES, grads, want):
        errs[name] = max(rel_err(s.data, np.asarray(w)[s.index]) for s in g.addressable_shards)
    # The modules place their parameters on a mesh that spans both processes.
    module = nn.EquinoxMoE(64, 64, 8, key=jax.random.PRNGKey(0), mesh=mesh)
    emit("process", process=jax.process_index(), processes=jax.process_count(), devices=len(jax.devices()),
         local_devices=len(jax.local_devices()), loss=float(value), dropped=int(aux["dropped"]), errs=errs,
         loss_ref=float(jnp.sum(y_ref.astype(jnp.float32) * cot_local)), module_w1_spec=str(module.w1.sharding.spec),
         module_w1_shards=len(module.w1.addressable_shards),
         rows=sorted(int(s.index[0].start) for s in y.addressable_shards))
    jax.distributed.shutdown()


if __name__ == "__main__":
    if _MODE == "process":
        process()
    else:
        for name in (sys.argv[2].split(",") if len(sys.argv) > 2 else CASES):
            CASES[name]()
