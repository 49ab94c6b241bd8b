"""nn.moe_layer_ep (expert parallelism) against the single-device nn.moe_layer, on virtual CPU devices.

The multi-device runs happen in subprocesses (tests/ep_worker.py) so this session keeps its own device count:
one group of cases per process (4 virtual devices each), a two-process `jax.distributed` run (2 devices each,
local coordinator, gloo collectives) and examples/moe_expert_parallel.py on 4 devices. All of them start together
when the first test here needs them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_moe_jax import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = ("-m", "tests.ep_worker")                 # run from the checkout's root, as the scripts are
EXAMPLE = ("-m", "examples.moe_expert_parallel")
EXAMPLE_ARGS = ("--tokens-per-device", "64", "--hidden", "64", "--intermediate", "64", "--steps", "1",
                "--time-exchange", "--bias")
GROUPS = ("d2,d4_skew_empty,d4_overflow,d4_options", "d2x2_data_explicit_batched,errors,modules,d4_gating_overflow")
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _collect(procs):
    """{case: values} from the JSON lines of every process; a failed process fails with its stderr tail."""
    results, failures = {}, []
    for name, proc in procs:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"{name}: timed out after {TIMEOUT_S} s\n{err[-3000:]}")
            continue
        if proc.returncode:
            failures.append(f"{name}: exit {proc.returncode}\n{err[-3000:]}")
        if name == "example":
            results["example"] = {"returncode": proc.returncode, "stdout": out, "stderr": err[-3000:]}
            continue
        for line in out.splitlines():
            if line.startswith("{"):
                value = json.loads(line)
                key = value["case"] if value["case"] != "process" else f"process{value['process']}"
                results[key] = value
    return results, failures


@pytest.fixture(scope="module")
def runs():
    env = dict(os.environ, JAX_PLATFORMS="cpu")   # the worker appends its device count to XLA_FLAGS (last wins)
    start = lambda *args, env=env: subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    port = str(_free_port())
    procs = [(f"cases {g}", start(*WORKER, "cases", g)) for g in GROUPS]
    procs += [(f"process {i}", start(*WORKER, "process", str(i), port)) for i in range(2)]
    flags = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    procs.append(("example", start(*EXAMPLE, *EXAMPLE_ARGS, env=dict(env, XLA_FLAGS=flags))))
    results, failures = _collect(procs)
    return results, failures


def _case(runs, name):
    results, failures = runs
    if name not in results:
        pytest.fail(f"case {name!r} produced no result:\n" + "\n".join(failures))
    return results[name]


def _assert_close(case, y_tol, grad_tol):
    assert case["y_err"] <= y_tol, case["y_err"]
    for name, err in case["grad_err"].items():
        assert err <= grad_tol, (name, err)
        assert case["grad_norm"][name] > 0, name                    # random data: no vacuous zero gradients


# Expert axis only and top_k 2: every row meets the same arithmetic as on one device (measured 0 for y, at most a
# few fp32-order bf16 flips in the weight gradients).
@pytest.mark.parametrize("name", ["d2", "d4_skew_empty"])
def test_matches_single_device(runs, name):
    case = _case(runs, name)
    _assert_close(case, 1e-5, 1e-4)
    assert case["dropped"] == 0 and case["load"] == case["load_ref"]
    assert case["y_spec"] == "P('expert',)" and case["y_shape"] == [256, 64]


def test_skewed_routing_and_an_empty_expert(runs):
    case = _case(runs, "d4_skew_empty")
    assert case["load"][0] >= 0.9 * 256 and case["load"][-1] == 0        # every token's first pick: expert 0
    assert case["capacity"] == 64 * 2                                    # no-drop maximum: T/S * min(k, L/D)


def test_data_axis_explicit_mesh_batched_top3(runs):
    case = _case(runs, "d2x2_data_explicit_batched")
    # top_k 3: the combine adds three bf16 outputs in choice order where moe_layer's scatter-add goes in row order
    # (<= 1 bf16 ulp, 2^-8, per element); weight gradients are psummed over the data axis from bf16 partial sums
    # (one more bf16 rounding than the single-device fp32 sum). Measured y 2.3e-3, dw 2.9e-3.
    _assert_close(case, 8e-3, 8e-3)
    assert case["grad_err"]["router"] <= 1e-5
    assert case["dropped"] == 0 and case["load"] == case["load_ref"]
    assert case["y_shape"] == [4, 64, 64] and case["y_spec"] == "P(('data', 'expert'), None, None)"


def test_capacity_overflow_drops_as_documented(runs):
    case = _case(runs, "d4_overflow")
    assert case["capacity"] == 32                                        # ceil(1.0 * 64 tokens * 2 / 4 devices)
    assert case["dropped"] == case["dropped_ref"] > 0                    # the policy simulated in numpy
    # Against moe_layer's math with the dropped copies' gate weights zeroed: outputs and every gradient.
    _assert_close(case, 1e-5, 1e-4)
    assert case["all_dropped_tokens"] > 0 and case["all_dropped_max_abs"] == 0.0


@pytest.mark.parametrize("name", ["d4_options", "d4_gating_overflow"])
def test_router_options_block_pieces_and_master_weights(runs, name):
    """Sigmoid / group-limited / selection-bias routing, FC2 bias, gated shared expert, (E, in, out) gate / up
    halves and float32 master weights on 4 devices: the single-device layer's outputs and gradients (float32), the
    same routing; with a precomputed gating and capacity 1.0, drops as simulated, each dropped copy without its
    FC2 bias."""
    case = _case(runs, name)
    _assert_close(case, 1e-5, 1e-4)
    assert case["experts_equal"] and case["y_dtype"] == "bfloat16"
    assert set(case["grad_dtypes"].values()) == {"float32"}
    assert case["grad_norm"]["router_bias"] == 0.0                        # selection only: no gradient
    assert case["has_logits"] == (name == "d4_options")
    assert case["dropped"] == case["dropped_ref"] and (case["dropped"] > 0) == (name == "d4_gating_overflow")


@pytest.mark.parametrize("name, kind, words", [
    ("experts_not_divisible", "ValueError", ["num_experts=6", "divisible", "'expert' axis size 4"]),
    ("tokens_not_divisible", "ValueError", ["token count 62", "token shards 4"]),
    ("unknown_axis", "ValueError", ["'ep'", "not in the mesh axes"]),
    ("bad_capacity", "ValueError", ["capacity_factor=0", "> 0"]),
    ("bad_top_k", "ValueError", ["top_k=5"]),
    ("not_a_mesh", "TypeError", ["mesh must be a jax.sharding.Mesh"]),
    ("router_vs_w1", "ValueError", ["router_weight must have shape (H, L) = (64, 6)", "L from w1", "(64, 4)"]),
    ("router_not_2d", "ValueError", ["router_weight must have shape (H, L)", "got (1, 64, 4)"]),
    ("same_axes", "ValueError", ["distinct mesh axes"]),
])
def test_bad_layouts_raise(runs, name, kind, words):
    got_kind, message = _case(runs, "errors")["errors"][name]
    assert got_kind == kind, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("framework", ["flax", "equinox"])
def test_modules_with_a_mesh(runs, framework):
    case = _case(runs, "modules")[framework]
    without, with_mesh = case["values"]
    assert abs(with_mesh - without) <= 1e-5 * abs(without)
    assert case["w1_spec"] == "P('expert',)"                             # parameters created sharded
    assert len(case["grad_err"]) >= 3 and max(case["grad_err"]) <= 1e-4


def test_two_processes_span_one_mesh(runs):
    procs = [_case(runs, f"process{i}") for i in range(2)]
    assert [p["processes"] for p in procs] == [2, 2] and [p["devices"] for p in procs] == [4, 4]
    assert [p["local_devices"] for p in procs] == [2, 2]
    assert sorted(procs[0]["rows"] + procs[1]["rows"]) == [0, 64, 128, 192]   # each process holds its rows
    for p in procs:
        for name, err in p["errs"].items():
            assert err <= 1e-4, (p["process"], name, err)
        assert abs(p["loss"] - p["loss_ref"]) <= 1e-4 * abs(p["loss_ref"])
        assert p["module_w1_spec"] == "P('expert',)" and p["module_w1_shards"] == 2
    assert procs[0]["loss"] == procs[1]["loss"]


def test_ep_capacity_rule():
    assert nn.ep_capacity(64, 2, 8, 4) == 128                       # None: T/S * min(k, L/D)
    assert nn.ep_capacity(64, 4, 8, 4) == 128                       # at most L/D = 2 copies of a token per device
    assert nn.ep_capacity(64, 2, 8, 4, 1.0) == 32                   # ceil(f * T/S * k / D)
    assert nn.ep_capacity(64, 2, 8, 4, 1.25) == 40
    assert nn.ep_capacity(64, 2, 8, 4, 100.0) == 128                # capped at the no-drop maximum
    assert nn.ep_capacity(3, 1, 8, 8, 0.01) == 1                    # at least one slot
    assert nn.ep_capacity(64, 2, 8, 4, np.float32(1.0)) == 32
    for bad in (0, -1.0, float("inf"), float("nan"), "1", True):
        with pytest.raises(ValueError, match="capacity_factor"):
            nn.ep_capacity(64, 2, 8, 4, bad)


def test_example_runs_on_four_cpu_devices(runs):
    run = _case(runs, "example")
    assert run["returncode"] == 0, run["stderr"]
    out = run["stdout"]
    for expected in ("mesh {'data': 1, 'expert': 4}", "loss ", "dropped 0 of 512", "grad w1", "grad x",
                     "forward+backward step", "exchange alone"):
        assert expected in out, out


def _row_scatters(jaxpr, hidden):
    """Scatter equations (any nesting: shard_map, custom_vjp, pjit bodies) whose output rows are H wide."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("scatter") and any(
                getattr(v.aval, "shape", ())[-1:] == (hidden,) for v in eqn.outvars):
            found.append(eqn.primitive.name)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found += _row_scatters(inner, hidden)
    return found


def test_layers_move_rows_by_gathers_only():
    """moe_layer and moe_layer_ep (on a one-device mesh here) move token rows by gathers in the forward and the
    backward: a scatter-add of rows with colliding indices (a token's k copies, empty slots) runs on atomics on
    the GPU, slowly and, for k > 2, order-dependently."""
    tokens, hidden, inter, experts = 64, 48, 64, 4
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    router = jax.random.normal(keys[1], (hidden, experts))
    w1 = (jax.random.normal(keys[2], (experts, 2 * inter, hidden)) / 8).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[3], (experts, hidden, inter)) / 8).astype(jnp.bfloat16)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    pieces = dict(b2=jnp.zeros((experts, hidden)), shared=nn.SharedExpert(w1[0], w2[0], None, router[:, 0]))
    layers = {"moe_layer": lambda *a: nn.moe_layer(*a)[0],
              "moe_layer_ep": lambda *a: nn.moe_layer_ep(*a, mesh=mesh, capacity_factor=1.25)[0],
              "moe_layer with b2 and a shared expert": lambda *a: nn.moe_layer(*a, **pieces)[0],
              "moe_layer_ep with b2 and a shared expert": lambda *a: nn.moe_layer_ep(
                  *a, mesh=mesh, capacity_factor=1.25, **pieces)[0]}
    for name, layer in layers.items():
        loss = lambda x, r, w1, w2, layer=layer: jnp.sum(layer(x, r, w1, w2).astype(jnp.float32) ** 2)
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, router, w1, w2).jaxpr
        assert _row_scatters(jaxpr, hidden) == [], name


def test_float32_reference_path_runs_expert_parallel():
    """dtype=float32 (the jnp reference path) inside the shard_map: moe_layer's float32 result on a 1-device mesh."""
    tokens, hidden, inter, experts = 32, 64, 64, 4
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    x = jax.random.normal(keys[0], (tokens, hidden))
    router = jax.random.normal(keys[1], (hidden, experts)) / 8
    w1 = jax.random.normal(keys[2], (experts, 2 * inter, hidden)) / 8
    w2 = jax.random.normal(keys[3], (experts, hidden, inter)) / 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("expert",))
    y_ep, aux = nn.moe_layer_ep(x, router, w1, w2, mesh=mesh, b2=jnp.ones((experts, hidden)))
    y, _ = nn.moe_layer(x, router, w1, w2, b2=jnp.ones((experts, hidden)))
    assert y_ep.dtype == jnp.float32 and int(aux["dropped"]) == 0
    np.testing.assert_allclose(np.asarray(y_ep), np.asarray(y), rtol=1e-5, atol=1e-6)
