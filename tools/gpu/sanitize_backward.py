"""A few small backward-kernel runs (dgrad: dswiglu with dbias + amax, dsrelu, FP8 D_row with SFD; wgrad: empty
experts, uneven and unaligned token ranges, accumulate_on_output with global scales; block-scaled wgrad: the scale
words' cp.async, token-contiguous MXFP8 / NVFP4 and token-major MXFP8 on unaligned offsets) for compute-sanitizer
(memcheck / racecheck); exit status 1 on a wrong result.

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
_ACCUM = {c[0]: c for c in wgrad_cases.ACCUM_CASES}
# (cases module, case name, offset pattern)
CASES = [(dgrad_cases, "dswiglu_bias_amax", "empty_and_tail"),     # expert 1 empty, rows past valid_m
         (dgrad_cases, "dsrelu_bias_amax", "skewed"),              # 3/4 of the rows in one expert, two empty
         (dgrad_cases, "dswiglu_e4m3_bias_amax", "unsanitized"),   # FP8 D_row + SFD bytes stored from registers
         (dgrad_cases, "dsrelu_e5m2_segsfd_noprob", "empty_and_tail"),  # segmented SFD_col (per-expert offsets)
         (wgrad_cases, "c2_bf16_tokmajor", "empty_and_tail"),      # 2x1 clusters, token-major, 3 empty experts
         (wgrad_cases, "c1_bf16", "unaligned")]                    # ranges ending inside k-tiles, a 33-token one
# accumulate_on_output: the epilogue reads the old W (plain global loads, columns past n_w masked)
ACCUM = [("acc_c1_bf16_gs", "random", 1024)]
# block-scaled wgrad (case, pattern, input mode): scale words by cp.async, token masks and split scale blocks
_BS = {c[0]: c for c in wgrad_cases.BS_CASES}
BLOCK_SCALED = [("bs_mxfp8_c1", "unaligned", "exact"), ("bs_nvfp4_c1_gs", "empty_and_tail", "adversarial"),
                ("bs_mxfp8e5_tok_c1_gs_acc", "a8", "specials")]

def _case(module, name):
    return (_DGRAD if module is dgrad_cases else _WGRAD)[name]


def bundle_items():
    from cudnn_moe_jax import aot

    return ([item for module, name, _ in CASES for item in module.bundle_items_for([_case(module, name)])]
            + aot.lowering_items([_ACCUM[name] for name, _, _ in ACCUM], wgrad_cases.accum_inputs,
                                 wgrad_cases.accum_call)
            + aot.lowering_items([_BS[name] for name, _, _ in BLOCK_SCALED], wgrad_cases.bs_inputs,
                                 wgrad_cases.bs_call))


if __name__ == "__main__":
    import harness

    print("runtime:", harness.register(), flush=True)
    bad = 0
    for module, name, pattern in CASES:
        errs = module.run_case(_case(module, name), pattern)
        print(name, pattern, "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    for name, old, tokens in ACCUM:
        errs = wgrad_cases.run_accum_case(_ACCUM[name], old, tokens)
        print(name, old, tokens, "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    for name, pattern, mode in BLOCK_SCALED:
        errs = wgrad_cases.run_bs_case(_BS[name], pattern, mode)
        print(name, pattern, mode, "OK" if not errs else errs, flush=True)
        bad += bool(errs)
    sys.exit(1 if bad else 0)
