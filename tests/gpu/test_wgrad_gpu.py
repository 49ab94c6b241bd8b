"""GPU: the K-grouped weight-gradient kernel against the float64 oracle (tests/np_ops.py), every element, outputs
poisoned first, on unaligned / empty / unsanitized token offsets; repeated calls bit-identical. Also
accumulate_on_output (bf16 / fp32 W, random or NaN old W, empty experts) and global scales at two token counts, on
one module per case.

Needs a Hopper GPU and a bundle with the cases' modules (tests/gpu/wgrad_cases.py); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import harness  # noqa: E402
import wgrad_cases as cases  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("wgrad_cases")


@pytest.mark.parametrize("pattern", list(cases.PATTERNS))
@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_wgrad_kernel_matches_float64(case, pattern):
    errs = cases.run_case(case, pattern)   # every element vs the float64 oracle, two calls bit-identical
    assert not errs, errs


@pytest.mark.parametrize("tokens", cases.T_VALUES)
@pytest.mark.parametrize("old", ["random", "nan"])
@pytest.mark.parametrize("case", cases.ACCUM_CASES, ids=[c[0] for c in cases.ACCUM_CASES])
def test_wgrad_accumulate_and_global_scales_match_float64(case, old, tokens):
    if old == "nan" and not case[6]:
        pytest.skip("no old W without accumulate_on_output")
    errs = cases.run_accum_case(case, old, tokens)
    assert not errs, errs


@pytest.mark.parametrize("case", cases.ACCUM_CASES, ids=[c[0] for c in cases.ACCUM_CASES])
def test_wgrad_one_module_serves_both_token_counts(case):
    keys = cases.module_keys(case)
    assert len(keys) == 1, f"{len(keys)} kernel modules for T in {cases.T_VALUES}"
