"""A few small kernel runs for compute-sanitizer (memcheck / racecheck); exit status 1 on a wrong result.

    compute-sanitizer --tool memcheck --kernel-name kns=GroupedGemmSm90 python tests/gpu/sanitize_cases.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import test_grouped_gemm_gpu as t  # noqa: E402

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
