"""GPU tests of the sm90 grouped-GEMM kernels against the float64 numpy oracle (tests/np_ops.py).

Every kernel-level bf16 / fp16 case (lab/forward_cases.py: each op x dtype x epilogue variant, odd shapes, other
configs), run through the primitive with its config and its module from the bundle, on every group pattern:
uniform, empty experts, one expert, first expert only, skewed, m > valid_m, unsanitized offsets, and a second m
(one module serves every m). Every element of every output is compared; rows outside every group must be exactly
zero (outputs are allocated uninitialised by XLA, and the allocator is first handed a NaN-filled block of the same
size, so unwritten rows would show); amax per group; two runs must agree bit for bit; a fallback to the reference
fails the case. `pytest -m sanitize` selects the compute-sanitizer subset (small m).

Needs a Hopper GPU and a bundle with lab.forward_cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import np_ops  # noqa: E402
from lab import forward_cases, harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.forward_cases")

CASES = forward_cases.bf16_cases()
PATTERNS = [(p, 2048) for p in harness.PATTERNS] + [("uniform", 4096)]
# the compute-sanitizer subset (memcheck / racecheck): one case per op family, small m
SANITIZE = [("var_bf16_swiglu_bias_cbf16_dbf16", "unsanitized", 1024), ("cfg_c22_n640_swiglu", "skewed", 2048),
            ("var_bf16_quant_bias_cnone_dbf16", "m_gt_valid", 1024),
            ("var_f16_srelu_nobias_cf32_df16__tanh", "empty_experts", 1024)]
assert {n for n, _, _ in SANITIZE} <= set(CASES)
OUTPUT_NAMES = {"c_tensor": "c", "d_tensor": "d", "amax_tensor": "amax"}


def make_inputs(problem: dict, m: int, offsets, seed: int):
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


def run_case(name: str, pattern: str, m: int):
    problem, config = CASES[name]
    p = dataclasses.asdict(problem)
    L = p["num_groups"]
    offsets = harness.offsets_for(pattern, m, L)
    seed = int(hashlib.sha256(f"{name}/{pattern}/{m}".encode()).hexdigest()[:8], 16)
    args, prob, bias = make_inputs(p, m, offsets, seed)
    f = forward_cases.kernel_fn(problem, config)
    epi = p["epilogue"]
    out_bytes = m * p["n"] * 4 * 2 + 4096
    with harness.kernels_only():
        harness.poison_allocator(out_bytes)
        outs = jax.block_until_ready(f(*args))
        harness.poison_allocator(out_bytes)
        outs2 = jax.block_until_ready(f(*args))
    host = [np.asarray(x) for x in args]
    ref = np_ops.np_forward_oracle(p, host[0], host[1], offsets, host[3], None if prob is None else np.asarray(prob),
                                   None if bias is None else np.asarray(bias))
    valid = np_ops.np_group_of_rows(offsets, m) < L
    names = (["c"] if epi["c_dtype"] is not None and p["op"] != "quant" else []) + ["d"] + \
        (["amax"] if epi["compute_amax"] else [])
    assert sorted(OUTPUT_NAMES[k] for k in outs) == sorted(names), list(outs)
    errs = []
    for key_out, got in outs.items():
        key = OUTPUT_NAMES[key_out]
        got, again = np.asarray(got), np.asarray(outs2[key_out])
        if not np.array_equal(got.view(np.uint8), again.view(np.uint8)):
            errs.append(f"{key}: two runs differ")
        if key == "amax":  # fp32 before conversion; approximations (bf16 D: tanh.approx) bounded by D's rounding
            errs += harness.compare("amax", got, ref["amax"], epi["d_dtype"])
        else:
            dtype = epi["c_dtype"] if key == "c" else epi["d_dtype"]
            errs += harness.compare(key, got, ref[key], dtype, valid_rows=valid)
    return errs


@pytest.mark.parametrize("pattern,m", PATTERNS, ids=[f"{p}-m{m}" for p, m in PATTERNS])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_oracle(name, pattern, m):
    errs = run_case(name, pattern, m)
    assert not errs, "\n".join(errs)


@pytest.mark.sanitize
@pytest.mark.parametrize("name,pattern,m", SANITIZE, ids=[f"{n}-{p}-m{m}" for n, p, m in SANITIZE])
def test_sanitizer_subset_matches_oracle(name, pattern, m):
    errs = run_case(name, pattern, m)
    assert not errs, "\n".join(errs)
