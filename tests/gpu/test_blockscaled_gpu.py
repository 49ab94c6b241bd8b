"""GPU: forward and backward (dglu / dsrelu) ops with block-scaled inputs (NVFP4, MXFP4, NVFP4 with e8m0 scales, MXFP8 e4m3 / e5m2) on the
dequantizing kernel, against the float64 oracle (tests/np_ops.py), every output element, outputs poisoned first,
two calls bit-identical; on "exact" inputs the accumulator-level outputs bit-identical to the exact result (issue 19
item 6); adversarial scales, zero blocks, NaN / inf codes and scales, empty experts, m > valid_m, K and N tails
(lab/blockscaled_cases.py says which case covers what; the inputs and checks: tests/gpu/blockscaled_checks.py).

Needs a Hopper GPU and a bundle with the cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import blockscaled_checks as checks  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
from lab import blockscaled_cases as cases  # noqa: E402
from lab import harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.blockscaled_cases")


@pytest.mark.parametrize("pattern,mode", cases.RUNS)
@pytest.mark.parametrize("case", cases.ALL_CASES, ids=[c[0] for c in cases.ALL_CASES])
def test_blockscaled_op_matches_float64(case, pattern, mode):
    errs = checks.run_case(case, pattern, mode)
    assert not errs, errs


@pytest.mark.parametrize("pattern,mode", cases.STAGED_RUNS)
@pytest.mark.parametrize("case", cases.STAGED_CASES, ids=[c[0] for c in cases.STAGED_CASES])
def test_staged_op_matches_float64(case, pattern, mode):
    """The forward and dgrad cases with their operands staged in the kernel (kernels/sm90/mainloop_staged.py: B
    converted once into a bf16 workspace beside the GEMM, a block-scaled A in the consumers' registers or, with a
    K tail, in a workspace too) on routings with an empty expert, unsanitized offsets and m > valid_m."""
    with harness.block_scaled_route("staged"):
        errs = checks.run_case(case, pattern, mode)
    assert not errs, errs
