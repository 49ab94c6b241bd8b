"""GPU: the fused backward epilogues (dglu: dswiglu / dgeglu, dsrelu) against the float64 oracle (tests/np_ops.py),
every output element, outputs poisoned first; repeated calls bit-identical (the reductions use no float atomics).
Also FP8 D_row (codes of D_row / D_col and the SFD_row / SFD_col bytes, both layouts) and an FP8 saved C.

Needs a Hopper GPU and a bundle with the cases' modules (tests/gpu/dgrad_cases.py); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import dgrad_cases as cases  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
import harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("dgrad_cases")


@pytest.mark.parametrize("pattern", list(cases.PATTERNS))
@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_dgrad_kernel_matches_float64(case, pattern):
    errs = cases.run_case(case, pattern)   # every output element vs the float64 oracle, two calls bit-identical
    assert not errs, errs
