"""GPU: the K-grouped weight-gradient kernel against the float64 oracle (tests/np_ops.py), every element, outputs
poisoned first, on unaligned / empty / unsanitized token offsets; repeated calls bit-identical. Also
accumulate_on_output (bf16 / fp32 W, random or NaN old W, empty experts) and global scales at two token counts, on
one module per case. Block-scaled A / B (the dequantizing K-grouped kernel): exact, adversarial and NaN / inf inputs,
tails, empty experts, unaligned offsets, accumulation and global scales (tests/gpu/wgrad_cases.py: BS_CASES).

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


@pytest.mark.parametrize("pattern,mode", cases.BS_RUNS)
@pytest.mark.parametrize("case", cases.BS_CASES, ids=[c[0] for c in cases.BS_CASES])
def test_blockscaled_wgrad_matches_float64(case, pattern, mode):
    """Block-scaled A / B (MXFP8 e4m3 / e5m2, MXFP4, NVFP4 with e4m3 or e8m0 scales; token-contiguous or token-major
    FP8) with per-expert SF segments: every element vs the float64 oracle, bit-identical on exact inputs."""
    errs = cases.run_bs_case(case, pattern, mode)
    assert not errs, errs


@pytest.mark.parametrize("case", [cases.BS_CASES[0], cases.BS_CASES[4]], ids=lambda c: c[0])
def test_blockscaled_wgrad_module_serves_another_token_count(case):
    """The module recorded at T runs T = 1024 (A / B and the SF segment buffers shorter): no fallback."""
    errs = cases.run_bs_case(case, "unaligned", "exact", tokens=1024)
    assert not errs, errs
