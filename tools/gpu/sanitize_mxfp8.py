"""Small MXFP8 kernel runs for compute-sanitizer (memcheck); exit status 1 on a wrong result.

    compute-sanitizer --tool memcheck --kernel-name kns=GroupedGemmSm90 python tools/gpu/sanitize_mxfp8.py
"""

from __future__ import annotations

import sys

import _paths  # noqa: F401  (tools/gpu: tests/gpu and tests/ on sys.path)
import harness
import test_mxfp8_gpu as t

CASES = [("mx2_e4m3_geglu_bias_ce4m3_de4m3_lim_seg", "m_gt_valid", 1024, "adversarial"),
         ("mxedge_k208_n384_quant_fp8d", "unsanitized", 1024, "uniform_b"),
         # FP8 C / D from half inputs (256-column tiles, discrete SFD_col)
         ("h16_swiglu_fp8c_e5m2d_seg_n640", "m_gt_valid", 1024, "adversarial")]

if __name__ == "__main__":
    print("runtime:", harness.register(), flush=True)
    bad = 0
    for name, pattern, m, kind in CASES:
        errs = t.run_case(name, pattern, m, kind)
        print(name, pattern, m, kind, "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    sys.exit(1 if bad else 0)
