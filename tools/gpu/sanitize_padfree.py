"""A few padding-free kernel runs (tests/gpu/padfree_cases.py: tiles clipped at group ends by row-predicated stores,
1-row and empty experts, the last zero tile clipped at m, 2-CTA blocks over two experts without B multicast, a
masked last tile) for compute-sanitizer (memcheck / racecheck); exit status 1 on a wrong result.

    compute-sanitizer --tool memcheck --kernel-name kns=GroupedGemmSm90 python tools/gpu/sanitize_padfree.py

The checks are the GPU test's (padfree_cases.run_case); the modules come from the bundle (padfree_cases'
bundle_items record them).
"""

from __future__ import annotations

import sys

import _paths  # noqa: F401  (tools/gpu: tests/gpu and tests/ on sys.path)
import harness
import padfree_cases as cases

# (case name, pattern)
CASES = [("swiglu_bias_amax", "straddle"), ("swiglu_bias_amax", "odd_tiles_128"), ("quant_f32d", "tail"),
         ("dswiglu_dbias_amax", "tail"), ("dsrelu_dbias_amax", "unsanitized"), ("wgrad_tokens", "straddle")]

if __name__ == "__main__":
    print("runtime:", harness.register(), flush=True)
    items = {(case[0], pattern): (case, pattern) for case, pattern in cases.ITEMS}
    bad = 0
    for key in CASES:
        errs = cases.run_case(items[key])
        print(*key, "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    sys.exit(1 if bad else 0)
