"""GPU: discrete per-expert weights (`b_tensors` / `sfb_tensors`) on the kernels, every forward and backward op,
bf16 and block-scaled B: against the float64 oracle (every output element, outputs poisoned first, two calls
bit-identical, exact outputs bit for bit on "exact" inputs) and bit-identical to the same call with stacked
weights; an empty expert, rows past the last group, unsanitized offsets, 300 experts
(tests/gpu/discrete_cases.py).

Needs a Hopper GPU and a bundle with the cases' modules (tests/gpu/discrete_cases.py); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import blockscaled_cases  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
import discrete_cases as cases  # noqa: E402
import harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("discrete_cases")


RUNS = [(case, pattern, mode) for case in cases.CASES for pattern, mode in cases.runs(case)]


@pytest.mark.parametrize("case,pattern,mode", RUNS, ids=[f"{c[0]}-{p}-{m}" for c, p, m in RUNS])
def test_discrete_weights_match_float64_and_stacked(case, pattern, mode):
    errs = blockscaled_cases.run_case(case, pattern, mode, discrete=True)
    errs += cases.stacked_vs_discrete(case, pattern, mode)
    assert not errs, errs
