"""A few small kernel runs for compute-sanitizer (memcheck / racecheck); exit status 1 on a wrong result.

    compute-sanitizer --tool memcheck --kernel-name kns=GroupedGemmSm90 python tools/gpu/sanitize_cases.py
"""

from __future__ import annotations

import sys

import _paths  # noqa: F401  (tools/gpu: tests/gpu and tests/ on sys.path)
import harness
import test_grouped_gemm_gpu as t

CASES = [("var_bf16_swiglu_bias_cbf16_dbf16", "unsanitized", 1024),
         ("cfg_c22_n640_swiglu", "skewed", 2048),
         ("var_bf16_quant_bias_cnone_dbf16", "m_gt_valid", 1024),
         ("var_f16_srelu_nobias_cf32_df16__tanh", "empty_experts", 1024)]

if __name__ == "__main__":
    print("runtime:", harness.register(), flush=True)
    bad = 0
    for name, pattern, m in CASES:
        errs = t.run_case(name, pattern, m)
        print(name, pattern, m, "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    sys.exit(1 if bad else 0)
