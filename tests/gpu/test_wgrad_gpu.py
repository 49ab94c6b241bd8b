"""GPU: the K-grouped weight-gradient kernel against the float64 oracle (tests/np_ops.py), every element, outputs
poisoned first, on unaligned / empty / unsanitized token offsets; repeated calls bit-identical. Also
accumulate_on_output (bf16 / fp32 W, random or NaN old W, empty experts) and global scales at two token counts, on
one module per case. Block-scaled A / B (the dequantizing K-grouped kernel): exact, adversarial and NaN / inf inputs,
tails, empty experts, unaligned offsets, accumulation and global scales (BS_CASES). The cases are
lab/wgrad_cases.py's (the public op); `pytest -m sanitize` selects the compute-sanitizer subset.

Needs a Hopper GPU and a bundle with the cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import functools
import re
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import np_ops  # noqa: E402
import wgrad_checks  # noqa: E402
from cudnn_moe_jax.limits import values_per_byte  # noqa: E402
from lab import harness  # noqa: E402
from lab import wgrad_cases as cases  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.wgrad_cases")

# the compute-sanitizer subset (memcheck / racecheck)
SANITIZE = {"c2_bf16_tokmajor-empty_and_tail",   # 2x1 clusters, token-major, 3 empty experts
            "c1_bf16-unaligned",                 # ranges ending inside k-tiles, a 33-token one
            "acc_c2_f32_tokmajor-nan-1024",      # an fp32 W accumulated into: from registers, 2x1 clusters
            "acc_c1_bf16_gs-random-1024",        # accumulate_on_output: the epilogue reads the old W (columns
                                                 # past n_w masked), global scales
            # block-scaled: scale boxes by TMA, token masks and split scale blocks
            "bs_mxfp8_c1-unaligned-exact", "bs_nvfp4_c1_gs-empty_and_tail-adversarial",
            "bs_mxfp8e5_tok_c1_gs_acc-a8-specials",
            # 2x1 clusters: B converted half per CTA and bulk-copied to the other (the cluster split)
            "bs_mxfp8e5_c2_f32_acc-unaligned-exact", "bs_mxfp4_c2-empty_and_tail-adversarial",
            "bs_mxfp8_tok_c2-unaligned-exact",
            # staged: the converters' funnel-shifted groups (unaligned starts, odd ones for FP4), flags, padding
            "staged-bs_mxfp8_c1-unaligned-exact", "staged-bs_mxfp4_c2-unaligned-exact",
            "staged-bs_nvfp4_c1_gs-empty_and_tail-adversarial", "staged-bs_mxfp8_tok_c2-unaligned-exact"}


def _run_twice(fn, x):
    """W of two jitted calls (lab.harness.run_twice): (the first W as numpy, ["two calls differ"] unless both are
    bit-identical)."""
    got, again = (np.asarray(r.wgrad_tensor) for r in harness.run_twice(jax.jit(fn), x))
    return got, ([] if np.array_equal(got.view(np.uint8), again.view(np.uint8)) else ["two calls differ"])


def run_case(case, pattern: str) -> list[str]:
    """Run one case on the GPU (W poisoned first, twice) and check every element against the float64 oracle
    (tests/np_ops.py); the problems found ([] = ok)."""
    x = cases.inputs(case, pattern, seed=zlib.crc32(f"{case[0]}/{pattern}".encode()) % 1000)
    got, errs = _run_twice(functools.partial(cases.call, case), x)
    a, b = (np.asarray(v.astype(jnp.float32)) for v in cases.operands(case, x))
    want = np_ops.grouped_gemm_wgrad(a, b, np.asarray(x["offsets"]), ab_dtype=case[1], wgrad_dtype=case[2])
    gv = got.astype(np.float32).astype(np.float64)
    if not np.all(np.isfinite(gv)):
        return errs + ["non-finite output (poison left in W?)"]
    pre, mag = want["_pre"]["wgrad"], want["_mag"]["wgrad"]
    bound = harness.ULP[case[2]] * np.abs(pre) + 1e-5 * mag + 1e-30
    err = np.abs(gv - pre)
    if not np.all(err <= bound):
        errs.append(f"worst {np.max(err / bound):.2f} x the bound")
    for e, (s, t) in enumerate(want["_groups"]):
        if t <= s and gv[e].any():
            errs.append(f"expert {e} has no token: W[e] must be zero")
    return errs


def _empty_experts(offsets, tokens):
    ends = np.maximum.accumulate(np.clip(np.asarray(offsets), 0, tokens))
    starts = np.concatenate([[0], ends[:-1]])
    return [e for e in range(len(ends)) if ends[e] <= starts[e]]


def run_accum_case(case, old: str, tokens: int) -> list[str]:
    """One ACCUM_CASES case on the GPU at `tokens` tokens (module recorded at T = 2000), twice (allocator poisoned
    first): W_out = W + gsa[e] gsb[e] A B^T (fp32 add, one rounding) vs the float64 oracle, every element; experts
    without tokens keep their W bit for bit (or are zero without accumulation); a NaN old W must come out NaN
    everywhere (the add reads every element; none is replaced by the fresh gradient). The problems ([] = ok)."""
    _, ab, wd, _, _, _, acc = case
    pattern = "empty_and_tail" if tokens == cases.T else "unaligned"
    x = cases.accum_inputs(case, pattern, tokens, old, seed=zlib.crc32(f"{case[0]}/{old}/{tokens}".encode()) % 1000)
    got, errs = _run_twice(functools.partial(cases.accum_call, case), x)
    gv = got.astype(np.float32).astype(np.float64)
    if old == "nan":
        lost = int(np.sum(~np.isnan(gv)))
        return errs + ([f"{lost} elements lost the old W's NaN"] if lost else [])
    a, b = (np.asarray(v.astype(jnp.float32)) for v in cases.operands(case, x))
    w_old = np.asarray(x["w"].astype(jnp.float32)) if acc else None
    want = np_ops.grouped_gemm_wgrad(a, b, np.asarray(x["offsets"]), global_scale_a=x.get("gsa"),
                                     global_scale_b=x.get("gsb"), wgrad_tensor=w_old, ab_dtype=ab, wgrad_dtype=wd)
    if not np.all(np.isfinite(gv)):
        return errs + ["non-finite output"]
    pre, mag = want["_pre"]["wgrad"], want["_mag"]["wgrad"]
    bound = harness.ULP[wd] * np.abs(pre) + 1e-5 * mag + 1e-30
    err = np.abs(gv - pre)
    if not np.all(err <= bound):
        errs.append(f"worst {np.max(err / bound):.2f} x the bound")
    empty = _empty_experts(x["offsets"], tokens)
    if not empty:
        errs.append("the pattern must leave an expert without tokens")
    for e in empty:
        if acc and not np.array_equal(got[e].view(np.uint8), np.asarray(x["w"])[e].view(np.uint8)):
            errs.append(f"expert {e} has no token: its W must be unchanged")   # old + (+-0.0) is old
        if not acc and gv[e].any():
            errs.append(f"expert {e} has no token: W[e] must be zero")
    return errs


def run_bs_case(case, pattern: str, mode: str, tokens: int = None, x: dict = None) -> list[str]:
    """One block-scaled case on the GPU (W poisoned first, twice): every element against the float64 oracle
    (NaN / inf exactly where the oracle has them; "exact" inputs: bit for bit), experts without tokens zero (or their
    old W unchanged), two calls bit-identical. `tokens`: run at another token count (the offsets clip to it) on the
    module recorded at T; `x`: these inputs instead of the pattern's. The problems ([] = ok)."""
    name, fmt, wd, mw, token_major, gs, acc = case
    data, sf, vec = cases.BS_FORMATS[fmt]
    x = cases.bs_run_inputs(case, pattern, mode, tokens) if x is None else x
    got, errs = _run_twice(functools.partial(cases.bs_call, case), x)
    a, b = (np.asarray(v) for v in cases.operands(case, x))
    n_tok = a.shape[1] * values_per_byte(data)
    w_old = np.asarray(x["w"].astype(jnp.float32)) if acc else None
    with np.errstate(invalid="ignore"):   # NaN / inf inputs
        want = np_ops.grouped_gemm_wgrad(a, b, np.asarray(x["offsets"]), np.asarray(x["sfa"]).view(np.uint8),
                                         np.asarray(x["sfb"]).view(np.uint8), global_scale_a=x.get("gsa"),
                                         global_scale_b=x.get("gsb"), wgrad_tensor=w_old, ab_dtype=data,
                                         sf_dtype=sf, sf_vec_size=vec, wgrad_dtype=wd)
    gv = got.astype(np.float32).astype(np.float64)
    pre, mag = want["_pre"]["wgrad"], want["_mag"]["wgrad"]
    special = ~np.isfinite(pre)
    if not np.array_equal(np.isnan(gv), np.isnan(pre)) or not np.array_equal(gv[np.isinf(pre)], pre[np.isinf(pre)]):
        errs.append(f"NaN at {int(np.isnan(gv).sum())} elements, the oracle at {int(np.isnan(pre).sum())}; inf "
                    f"{int(np.isinf(gv).sum())} / {int(np.isinf(pre).sum())}")
    if mode == "specials" and not special.any():
        errs.append("the specials reached no output")
    if mode == "exact":   # bit for bit; the sums of 2^-127-scaled products only (SF bytes past the buffer): tiny
        bad = wgrad_checks.exact_mismatches(got, np.asarray(want["wgrad_tensor"]), pre)
        if bad:
            errs.append(f"not bit-identical to the exact result ({bad} elements differ)")
    with np.errstate(invalid="ignore"):
        bound = harness.ULP[wd] * np.abs(pre) + (n_tok * 2.0 ** -24 + 2.0 ** -20) * mag + 2.0 ** -126
        err = np.where(special, 0.0, np.abs(gv - pre))
    if not np.all(err <= np.where(special, 1.0, bound)):
        errs.append(f"worst {np.nanmax(err / bound):.2f} x the bound")
    for e in _empty_experts(x["offsets"], n_tok):
        if acc and not np.array_equal(got[e].view(np.uint8), np.asarray(x["w"])[e].view(np.uint8)):
            errs.append(f"expert {e} has no token: its W must be unchanged")
        if not acc and gv[e].any():
            errs.append(f"expert {e} has no token: W[e] must be zero")
    return errs


def module_keys(case) -> set:
    """The kernel module keys the case's lowerings at every T of T_VALUES ask for (one module serves them all)."""
    keys = set()
    for tokens in cases.T_VALUES:
        with harness.kernels_only():
            text = jax.jit(functools.partial(cases.accum_call, case)).lower(
                cases.accum_inputs(case, tokens=tokens)).as_text()
        calls = [line for line in text.splitlines() if "CuteDSLRT_NvJaxCutlassCall" in line]
        keys |= {re.search(r'key = "((?:[^"\\]|\\.)*)"', c).group(1) for c in calls}
    return keys


@pytest.mark.parametrize("case,pattern", harness.sanitize_params(
    [(f"{c[0]}-{p}", (c, p)) for c in cases.CASES for p in cases.PATTERNS], SANITIZE))
def test_wgrad_kernel_matches_float64(case, pattern):
    errs = run_case(case, pattern)   # every element vs the float64 oracle, two calls bit-identical
    assert not errs, errs


@pytest.mark.parametrize("case,old,tokens", harness.sanitize_params(
    [(f"{c[0]}-{old}-{t}", (c, old, t)) for c in cases.ACCUM_CASES for old in ("random", "nan")
     for t in cases.T_VALUES], SANITIZE))
def test_wgrad_accumulate_and_global_scales_match_float64(case, old, tokens):
    if old == "nan" and not case[6]:
        pytest.skip("no old W without accumulate_on_output")
    errs = run_accum_case(case, old, tokens)
    assert not errs, errs


@pytest.mark.parametrize("case", cases.ACCUM_CASES, ids=[c[0] for c in cases.ACCUM_CASES])
def test_wgrad_one_module_serves_both_token_counts(case):
    keys = module_keys(case)
    assert len(keys) == 1, f"{len(keys)} kernel modules for T in {cases.T_VALUES}"


@pytest.mark.parametrize("case,pattern,mode", harness.sanitize_params(
    [(f"{c[0]}-{p}-{m}", (c, p, m)) for c in cases.BS_CASES for p, m in cases.BS_RUNS], SANITIZE))
def test_blockscaled_wgrad_matches_float64(case, pattern, mode):
    """Block-scaled A / B (MXFP8 e4m3 / e5m2, MXFP4, NVFP4 with e4m3 or e8m0 scales; token-contiguous or token-major
    FP8) with per-expert SF segments on the dequantizing kernel (pinned: the lowering's rule would dequantize these
    token counts first): every element vs the float64 oracle, bit-identical on exact inputs."""
    with harness.block_scaled_route("on-chip"):
        errs = run_bs_case(case, pattern, mode)
    assert not errs, errs


@pytest.mark.parametrize("case,pattern,mode", [(c, p, m) for c in cases.BS_CASES
                                               for p, m in (("unaligned", "exact"), ("a8", "specials"))],
                         ids=lambda v: v if isinstance(v, str) else v[0])
def test_blockscaled_wgrad_dequantized_first_matches_float64(case, pattern, mode):
    """The wgrad's dequantize-first route (XLA's exact conversion, then the bf16 K-grouped kernel; forced here
    whatever `_dequant_first.dequantize_first` picks for the shape): the same checks as on chip."""
    with harness.block_scaled_route("xla-dequant"):
        errs = run_bs_case(case, pattern, mode)
    assert not errs, errs


@pytest.mark.parametrize("case,pattern,mode", harness.sanitize_params(
    [(f"staged-{c[0]}-{p}-{m}", (c, p, m)) for c in cases.BS_CASES for p, m in cases.BS_RUNS], SANITIZE))
def test_blockscaled_wgrad_staged_matches_float64(case, pattern, mode):
    """The staged wgrad (kernels/sm90/mainloop_staged_wgrad.py: A and B converted once in the kernel into padded
    bf16 workspaces, token-major FP8 too; token-major FP4 goes XLA's way): the same checks as on chip, on every
    routing -- unaligned and odd expert starts (nibble-shifted FP4 groups), empty experts, tokens in no expert,
    unsanitized offsets."""
    with harness.block_scaled_route("staged"):
        errs = run_bs_case(case, pattern, mode)
    assert not errs, errs


@pytest.mark.parametrize("case", [cases.BS_CASES[0], cases.BS_CASES[4]], ids=lambda c: c[0])
def test_blockscaled_wgrad_module_serves_another_token_count(case):
    """The kernel's module recorded at T runs T = 1024 (A / B and the SF segment buffers shorter): no fallback."""
    with harness.block_scaled_route("on-chip"):
        errs = run_bs_case(case, "unaligned", "exact", tokens=1024)
    assert not errs, errs


@pytest.mark.parametrize("case", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_wgrad_specials_stay_in_their_expert(case):
    """NaN / inf in A's and B's tokens stay in their own expert's W, as in the reference (which masks both
    operands): "unaligned" ranges share k-tiles (expert 0 [0, 300), expert 1 [300, 333), expert 2 [333, 1024)), so
    the kernel loads expert 1's tokens in expert 0's and 2's first / last k-tiles, where its masker must zero B's
    columns as well as A's (0 x NaN is NaN)."""
    x = cases.inputs(case, "unaligned", seed=7)
    a, b = (np.array(v.astype(jnp.float32)) for v in cases.operands(case, x))
    b[5, 310], b[6, 331], a[7, 301] = np.nan, np.inf, -np.inf      # tokens of expert 1
    a, b = jnp.asarray(a, case[1]), jnp.asarray(b, case[1])
    x = dict(a_tok=a.T, b_tok=b.T, offsets=x["offsets"]) if case[4] else dict(a=a, b=b, offsets=x["offsets"])
    got, errs = _run_twice(functools.partial(cases.call, case), x)
    want = np_ops.grouped_gemm_wgrad(np.asarray(a, np.float32), np.asarray(b, np.float32), np.asarray(x["offsets"]),
                                     ab_dtype=case[1], wgrad_dtype=case[2])
    pre, mag = want["_pre"]["wgrad"], want["_mag"]["wgrad"]
    gv = got.astype(np.float32).astype(np.float64)
    assert np.array_equal(np.isnan(gv), np.isnan(pre)), (int(np.isnan(gv).sum()), int(np.isnan(pre).sum()))
    assert np.array_equal(np.isinf(gv), np.isinf(pre)) and np.array_equal(gv[np.isinf(gv)], pre[np.isinf(pre)])
    finite = np.isfinite(pre)
    bound = harness.ULP[case[2]] * np.abs(pre[finite]) + 1e-5 * np.nan_to_num(mag[finite]) + 1e-30
    assert np.all(np.abs(gv[finite] - pre[finite]) <= bound) and not errs, errs
    assert np.isnan(pre[1]).any() and not np.isnan(pre[0]).any() and not np.isnan(pre[2]).any()


def test_staged_fp4_wgrad_with_its_converters_held():
    """The staged NVFP4 wgrad where its converters' lead (one 512-token chunk) is short of the chunks (8): most
    conversion jobs wait for the GEMM's frontier. Exact inputs: W bit-identical to the exact result, no deadlock."""
    with harness.block_scaled_route("staged"):
        errs = run_bs_case(cases.HELD_CASE, None, "exact", x=cases.held_inputs())
    assert not errs, errs
