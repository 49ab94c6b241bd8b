"""GPU: FP4 outputs -- grouped_gemm_glu_hadamard_quant on its kernel (NVFP4 D, rowwise / colwise Hadamard outputs, user
matrix, GLU / sReLU, bias, options, amax) and the MXFP4 D of quant / srelu / glu (packed D, transposed token-packed
D_col, SFD_row / SFD_col, both layouts) -- against the float64 oracle, every output byte, outputs poisoned first, two
calls bit-identical; bit-identical on the exact inputs (tests/gpu/fp4_out_cases.py says which case covers what);
empty experts, m > valid_m, unsanitized offsets, N tails.

Needs a Hopper GPU and a bundle with the cases' modules (tests/gpu/fp4_out_cases.py); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import fp4_out_cases as cases  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
import harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("fp4_out_cases")


@pytest.mark.parametrize("pattern,mode", cases.RUNS)
@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_fp4_outputs_match_float64(case, pattern, mode):
    errs = cases.run_case(case, pattern, mode)
    assert not errs, errs
