"""GPU: discrete per-expert weights (`b_tensors` / `sfb_tensors`) on the kernels, every forward and backward op,
bf16 and block-scaled B: against the float64 oracle (every output element, outputs poisoned first, two calls
bit-identical, exact outputs bit for bit on "exact" inputs; tests/gpu/blockscaled_checks.py) and bit-identical to
the same call with stacked weights; an empty expert, rows past the last group, unsanitized offsets, 300 experts
(lab/discrete_cases.py). `pytest -m sanitize` selects the compute-sanitizer subset (the descriptor-table kernel and
the GEMM that loads through its descriptors: `--kernel-name kns=kernelssm90` matches both).

Needs a Hopper GPU and a bundle with the cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import blockscaled_checks as checks  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
from lab import blockscaled_cases as bc  # noqa: E402
from lab import discrete_cases as cases  # noqa: E402
from lab import harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.discrete_cases")

# the compute-sanitizer subset (memcheck / racecheck)
SANITIZE = {"bf16_swiglu_bias_n384-empty_and_tail-exact", "nvfp4_dswiglu_bias_amax-empty_and_tail-exact"}
RUNS = [(f"{c[0]}-{p}-{m}", (c, p, m)) for c in cases.CASES for p, m in cases.runs(c)]


def stacked_vs_discrete(case, pattern: str, mode: str) -> list[str]:
    """The same call with stacked and with per-expert weights (outputs poisoned first): identical bytes in every
    output ([] = ok)."""
    x = checks.case_inputs(case, pattern, mode, discrete=True)
    got = {}
    for discrete in (False, True):
        got[discrete], _ = harness.run_twice(jax.jit(functools.partial(bc.call, case, discrete=discrete)), x)
    errs = []
    for key, stacked in got[False].items():
        if stacked is None:
            continue
        a, b = np.asarray(stacked), np.asarray(got[True][key])
        if a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            errs.append(f"{key}: discrete weights differ from stacked")
    return errs


@pytest.mark.parametrize("case,pattern,mode", harness.sanitize_params(RUNS, SANITIZE))
def test_discrete_weights_match_float64_and_stacked(case, pattern, mode):
    errs = checks.run_case(case, pattern, mode, discrete=True)
    errs += stacked_vs_discrete(case, pattern, mode)
    assert not errs, errs
