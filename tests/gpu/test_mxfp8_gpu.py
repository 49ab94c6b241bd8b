"""GPU tests of the MXFP8 (block-scaled FP8) sm90 kernels, and of FP8 C / D from bf16 / fp16 inputs, against a
float64 oracle, every output element checked (tests/gpu/mxfp8_checks.py: the inputs, the oracle, the per-element
error bounds, the SF-byte and FP8-code rules; self-tested on the CPU reference by tests/test_mxfp8_gpu_checks.py).

Each case of lab/forward_cases.py's MXFP8_CASES runs through the primitive with its config and its module from the
bundle, on five (routing pattern, m, data kind) runs; outputs poisoned first, two runs bit-identical, a fallback to
the reference fails the case. `pytest -m sanitize` selects the compute-sanitizer subset (memcheck).

Needs a Hopper GPU and a bundle with lab.forward_cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import mxfp8_checks as checks  # noqa: E402  (tests/conftest.py puts tests/gpu/ on sys.path)
from lab import forward_cases, harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.forward_cases")

CASES = forward_cases.mxfp8_cases()
RUNS = [("uniform", 2048, "adversarial"), ("uniform", 2048, "uniform_b"), ("empty_experts", 2048, "adversarial"),
        ("m_gt_valid", 2048, "uniform_b"), ("unsanitized", 4096, "adversarial")]
# the compute-sanitizer subset (memcheck): block-scaled and half inputs, FP8 D with both SFD_col layouts, small m
SANITIZE = [("mx2_e4m3_geglu_bias_ce4m3_de4m3_lim_seg", "m_gt_valid", 1024, "adversarial"),
            ("mxedge_k208_n384_quant_fp8d", "unsanitized", 1024, "uniform_b"),
            ("h16_swiglu_fp8c_e5m2d_seg_n640", "m_gt_valid", 1024, "adversarial")]
assert {n for n, *_ in SANITIZE} <= set(CASES)


def _run(name, pattern, m, kind):
    problem, config = CASES[name]
    errs = checks.run_case(name, problem, pattern, m, kind, forward_cases.kernel_fn(problem, config))
    assert not errs, "\n".join(errs)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("pattern,m,kind", RUNS, ids=[f"{p}-m{m}-{k}" for p, m, k in RUNS])
def test_mxfp8_matches_oracle(name, pattern, m, kind):
    _run(name, pattern, m, kind)


@pytest.mark.sanitize
@pytest.mark.parametrize("name,pattern,m,kind", SANITIZE, ids=[f"{n}-{p}-m{m}-{k}" for n, p, m, k in SANITIZE])
def test_sanitizer_subset_matches_oracle(name, pattern, m, kind):
    _run(name, pattern, m, kind)


def test_mxfp8_error_bound_report():
    """Not a check: prints the worst |err| / bound per output seen so far (how much slack the bound has)."""
    print("MXFP8 worst |err|/bound:", {k: round(v, 4) for k, v in sorted(checks.STATS.items())})
