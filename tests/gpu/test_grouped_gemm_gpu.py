"""GPU tests of the sm90 grouped-GEMM kernels against the float64 numpy oracle (tests/np_ops.py).

Every exported test artifact (each op x dtype x epilogue variant, odd shapes, other configs) runs on every group
pattern: uniform, empty experts, one expert, first expert only, skewed, m > valid_m, unsanitized offsets, and a
second m (one module serves every m). Every element of every output is compared; rows outside every group must be
exactly zero (outputs are allocated uninitialised by XLA, and the allocator is first handed a NaN-filled block of
the same size, so unwritten rows would show); amax per group; two runs must agree bit for bit.

Needs a Hopper GPU and the artifacts of tools/gpu/build_artifacts.py (skipped otherwise).
"""

from __future__ import annotations

import hashlib

import harness
import np_ops
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

MAN = harness.manifest()
CASES = sorted(MAN["tests"]) if MAN else []
PATTERNS = [(p, 2048) for p in harness.PATTERNS] + [("uniform", 4096)]


@pytest.fixture(scope="module")
def runtime():
    return harness.runtime_or_skip("tests")


def make_inputs(problem: dict, m: int, offsets, seed: int):
    import jax
    import jax.numpy as jnp

    n, k, L = problem["n"], problem["k"], problem["num_groups"]
    epi = problem["epilogue"]
    ab = jnp.dtype(problem["ab_dtype"])
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    a = jax.random.normal(keys[0], (m, k), jnp.float32).astype(ab)
    b = (jax.random.normal(keys[1], (L, n, k), jnp.float32) / np.sqrt(k)).astype(ab)
    alpha = jnp.asarray(np.resize([1.0, -2.0, 0.5, 1.5], L), jnp.float32)
    args = [a, b, jnp.asarray(offsets, jnp.int32), alpha]
    prob = bias = None
    if epi["has_prob"]:
        prob = jax.random.uniform(keys[2], (m,), jnp.float32)
        prob = jnp.where(jnp.arange(m) % 7 == 3, 0.0, prob)
        args.append(prob)
    if epi["has_bias"]:
        bias = jax.random.normal(keys[3], (L, n), jnp.float32).astype(jnp.dtype(epi["bias_dtype"]))
        args.append(bias)
    return args, prob, bias


def _poison(nbytes: int):
    import jax.numpy as jnp

    x = jnp.full((nbytes // 4 + 1024,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


def run_case(name: str, pattern: str, m: int):
    import jax

    info = MAN["tests"][name]
    p = info["problem"]
    L = p["num_groups"]
    offsets = harness.offsets_for(pattern, m, L)
    seed = int(hashlib.sha256(f"{name}/{pattern}/{m}".encode()).hexdigest()[:8], 16)
    args, prob, bias = make_inputs(p, m, offsets, seed)
    exp = harness.load(name)
    f = jax.jit(exp.call)
    epi = p["epilogue"]
    out_bytes = m * p["n"] * 4 * 2
    _poison(out_bytes)
    outs = jax.block_until_ready(f(*args))
    _poison(out_bytes)
    outs2 = jax.block_until_ready(f(*args))
    host = [np.asarray(x) for x in args]
    ref = np_ops.np_forward_oracle(p, host[0], host[1], offsets, host[3], None if prob is None else np.asarray(prob),
                                   None if bias is None else np.asarray(bias))
    valid = np_ops.np_group_of_rows(offsets, m) < L
    names = (["c"] if epi["c_dtype"] is not None and p["op"] != "quant" else []) + ["d"] + \
        (["amax"] if epi["compute_amax"] else [])
    assert len(outs) == len(names)
    errs = []
    for key, got, again in zip(names, outs, outs2):
        got, again = np.asarray(got), np.asarray(again)
        if not np.array_equal(got.view(np.uint8), again.view(np.uint8)):
            errs.append(f"{key}: two runs differ")
        if key == "amax":  # fp32 before conversion; approximations (bf16 D: tanh.approx) bounded by D's rounding
            errs += harness.compare("amax", got, ref["amax"], epi["d_dtype"])
        else:
            dtype = epi["c_dtype"] if key == "c" else epi["d_dtype"]
            errs += harness.compare(key, got, ref[key], dtype, valid_rows=valid)
    return errs


@pytest.mark.parametrize("pattern,m", PATTERNS, ids=[f"{p}-m{m}" for p, m in PATTERNS])
@pytest.mark.parametrize("name", CASES or ["no-artifacts"])
def test_kernel_matches_oracle(runtime, name, pattern, m):
    if name == "no-artifacts":
        pytest.skip("no artifacts")
    errs = run_case(name, pattern, m)
    assert not errs, "\n".join(errs)
