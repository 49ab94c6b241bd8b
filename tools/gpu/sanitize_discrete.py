"""compute-sanitizer (memcheck / racecheck) runs of discrete-weights calls (tests/gpu/discrete_cases.py): the
descriptor-table kernel and the GEMM that loads through its descriptors; exit status 1 on a wrong result.

    compute-sanitizer --tool memcheck --kernel-name kns=kernelssm90 python tools/gpu/sanitize_discrete.py

(`kernelssm90` is in the names of both kernels of the custom call; the kernels come from the bundle of
tests/gpu/discrete_cases.py.)
"""

from __future__ import annotations

import sys

import _paths  # noqa: F401  (tools/gpu: tests/gpu and tests/ on sys.path)
import blockscaled_cases as bc
import discrete_cases as dc

CASES = ("bf16_swiglu_bias_n384", "nvfp4_dswiglu_bias_amax")

if __name__ == "__main__":
    bad = 0
    for case in (c for c in dc.CASES if c[0] in CASES):
        errs = bc.run_case(case, "empty_and_tail", "exact", discrete=True)
        print(case[0], "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    sys.exit(1 if bad else 0)
