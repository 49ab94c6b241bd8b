"""CPU: the block-scaled GPU suite's checks (tests/gpu/blockscaled_checks.py) run on the reference backend, for every
case of lab/blockscaled_cases.py (its exact and specials runs) and lab/discrete_cases.py (its first run, per-expert
weights): the harness's inputs, calls and float64 oracle work for each case before a GPU runs it (a case whose
options the oracle's call rejected failed 8 GPU tests in RESULTS run 196), and the reference meets the suite's own
rules -- accumulator-level outputs bit-identical to the oracle on exact inputs, NaN / inf exactly where the oracle's
are, everything else within the suite's tolerance. About 2 minutes.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import blockscaled_checks as checks  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
from lab import blockscaled_cases as cases  # noqa: E402
from lab import discrete_cases  # noqa: E402

CPU_RUNS = (("empty_and_tail", "exact"), ("empty_and_tail", "specials"))
assert set(CPU_RUNS) <= set(cases.RUNS)
if jax.default_backend() != "cpu":   # on a GPU the public ops run the kernels: tests/gpu/ checks those
    pytest.skip("the reference's run of the GPU suite's checks is a CPU test", allow_module_level=True)


@pytest.mark.parametrize("pattern,mode", CPU_RUNS)
@pytest.mark.parametrize("case", cases.ALL_CASES, ids=[c[0] for c in cases.ALL_CASES])
def test_reference_passes_the_gpu_suite_checks(case, pattern, mode):
    errs = checks.run_case(case, pattern, mode)
    assert not errs, errs


@pytest.mark.parametrize("case", discrete_cases.CASES, ids=[c[0] for c in discrete_cases.CASES])
def test_reference_passes_the_discrete_suite_checks(case):
    pattern, mode = discrete_cases.runs(case)[0]
    errs = checks.run_case(case, pattern, mode, discrete=True)
    assert not errs, errs
