"""GPU: value and gradients (`jax.value_and_grad`) of nn.moe_mlp and nn.moe_layer on the kernels against a plain-jnp
float32 layer written in tests/gpu/nn_grads_checks.py (dense over experts, on the CPU), for every activation of ACTS
with and without b1, on random data with skewed groups, an empty expert and (moe_mlp) rows past the last group;
no op may fall back to the reference. The tolerance (bf16 stores of the fused layer) is derived in nn_grads_checks.

Needs a Hopper GPU and a bundle with the cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import functools

import pytest

jax = pytest.importorskip("jax")

from lab import harness  # noqa: E402
import nn_grads_checks as checks  # noqa: E402  (tests/conftest.py puts tests/gpu/ on sys.path)
from lab import nn_grads_cases as cases  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.nn_grads_cases")


@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_nn_grads_on_kernels_match_plain_layer(case):
    x = cases.inputs(case)
    fn = jax.jit(functools.partial(cases.call, case))
    with harness.kernels_only():   # a fallback to the reference warns at lowering: an error here
        harness.poison_allocator()
        got = jax.block_until_ready(fn(x))
    want = checks.reference(case, x)
    print(case[0], "worst |err| / bound:", checks.worst_ratio(got, want))
    assert not checks.compare(case, got, want)
    if case[1] == "moe_layer" and case[0] not in cases.OPTIONS:   # the data gives skewed groups, an empty expert
        load = [int(v) for v in got[1]["expert_load"]]
        assert load[cases.EMPTY_EXPERT] == 0 and load[cases.BIG_EXPERT] == max(load), load
