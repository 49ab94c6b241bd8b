"""A few small backward-kernel runs (dgrad: dswiglu with dbias + amax, dsrelu; wgrad: empty experts, uneven and
unaligned token ranges) for compute-sanitizer (memcheck / racecheck); exit status 1 on a wrong result.

    compute-sanitizer --tool memcheck --kernel-name kns=GroupedGemmSm90 python tools/gpu/sanitize_backward.py

The checks are the GPU tests' (tests/gpu/dgrad_cases.run_case, wgrad_cases.run_case); the modules come from the
bundle (`bundle_items`: python -m cudnn_moe_jax.aot build ... --variants tools.gpu.sanitize_backward:bundle_items,
also recorded by the two cases modules' own items).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    import _paths  # noqa: F401  (tools/gpu: tests/gpu and tests/ on sys.path)
    import dgrad_cases
    import wgrad_cases
else:  # imported by `aot build` from the checkout root
    from tests.gpu import dgrad_cases, wgrad_cases

_DGRAD = {c[0]: c for c in dgrad_cases.CASES}
_WGRAD = {c[0]: c for c in wgrad_cases.CASES}
# (cases module, case name, offset pattern)
CASES = [(dgrad_cases, "dswiglu_bias_amax", "empty_and_tail"),     # expert 1 empty, rows past valid_m
         (dgrad_cases, "dsrelu_bias_amax", "skewed"),              # 3/4 of the rows in one expert, two empty
         (wgrad_cases, "c2_bf16_tokmajor", "empty_and_tail"),      # 2x1 clusters, token-major, 3 empty experts
         (wgrad_cases, "c1_bf16", "unaligned")]                    # ranges ending inside k-tiles, a 33-token one


def _case(module, name):
    return (_DGRAD if module is dgrad_cases else _WGRAD)[name]


def bundle_items():
    return [item for module, name, _ in CASES for item in module.bundle_items_for([_case(module, name)])]


if __name__ == "__main__":
    import harness

    print("runtime:", harness.register(), flush=True)
    bad = 0
    for module, name, pattern in CASES:
        errs = module.run_case(_case(module, name), pattern)
        print(name, pattern, "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    sys.exit(1 if bad else 0)
