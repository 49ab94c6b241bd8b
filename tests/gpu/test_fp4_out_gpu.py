"""GPU: FP4 outputs -- grouped_gemm_glu_hadamard_quant on its kernel (NVFP4 D, rowwise / colwise Hadamard outputs, user
matrix, GLU / sReLU, bias, options, amax) and the MXFP4 D of quant / srelu / glu (packed D, transposed token-packed
D_col, SFD_row / SFD_col, both layouts) -- against the float64 oracle, every output byte, outputs poisoned first, two
calls bit-identical; bit-identical on the exact inputs (lab/fp4_out_cases.py says which case covers what; the inputs
and checks: tests/gpu/fp4_out_checks.py); empty experts, m > valid_m, unsanitized offsets, N tails.
`pytest -m sanitize` selects the compute-sanitizer subset.

Needs a Hopper GPU and a bundle with the cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import fp4_out_checks as checks  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
from lab import fp4_out_cases as cases  # noqa: E402
from lab import harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.fp4_out_cases")

# the compute-sanitizer subset (memcheck / racecheck: the bf16 stage between the epilogue barriers, the per-expert
# segment addresses)
SANITIZE = {"h_srelu_pm1_d4_col-empty_and_tail-exact",              # colwise segments, rows past valid_m
            "h_nvfp4_swiglu_d4_row4-unsanitized-random",            # dequantizing mainloop, rowwise NVFP4
            "h_nvfp4_srelu_user_col_n384-empty_and_tail-random",    # user matrix, an N tail
            "glu_nvfp4_swiglu_mxfp4d_seg-unsanitized-random"}       # MXFP4 D, transposed D_col
# every case in cases.RUNS, and the sanitizer's user-matrix run on empty experts with random inputs
RUNS = [(f"{c[0]}-{p}-{m}", (c, p, m)) for c in cases.CASES for p, m in cases.RUNS]
RUNS += [(f"{c[0]}-empty_and_tail-random", (c, "empty_and_tail", "random")) for c in cases.CASES
         if c[0] == "h_nvfp4_srelu_user_col_n384"]


@pytest.mark.parametrize("case,pattern,mode", harness.sanitize_params(RUNS, SANITIZE))
def test_fp4_outputs_match_float64(case, pattern, mode):
    errs = checks.run_case(case, pattern, mode)
    assert not errs, errs
