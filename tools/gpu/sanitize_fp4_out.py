"""A few FP4-output kernel runs (the Hadamard op: NVFP4 D with rowwise / colwise Hadamard outputs and direct global
stores, a user matrix; the MXFP4 D of glu with segmented SFD_col) for compute-sanitizer (memcheck / racecheck: the
bf16 stage between the epilogue barriers, the per-expert segment addresses); exit status 1 on a wrong result.

    compute-sanitizer --tool memcheck --kernel-name kns=GroupedGemmSm90 python tools/gpu/sanitize_fp4_out.py

The checks are the GPU test's (tests/gpu/fp4_out_cases.run_case); the modules are the cases' own (its bundle items).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    import _paths  # noqa: F401  (tools/gpu: tests/gpu and tests/ on sys.path)
    import fp4_out_cases as cases

    _CASES = {c[0]: c for c in cases.CASES}
    RUNS = [("h_srelu_pm1_d4_col", "empty_and_tail", "exact"),          # colwise segments, rows past valid_m
            ("h_nvfp4_swiglu_d4_row4", "unsanitized", "random"),        # dequantizing mainloop, rowwise NVFP4
            ("h_nvfp4_srelu_user_col_n384", "empty_and_tail", "random"),  # user matrix, an N tail
            ("glu_nvfp4_swiglu_mxfp4d_seg", "unsanitized", "random")]   # MXFP4 D, transposed D_col
    import harness

    print("runtime:", harness.register(), flush=True)
    bad = 0
    for name, pattern, mode in RUNS:
        errs = cases.run_case(_CASES[name], pattern, mode)
        print(name, pattern, mode, "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    sys.exit(1 if bad else 0)
