"""GPU: the fused backward epilogues (dglu: dswiglu / dgeglu, dsrelu) against the float64 oracle (tests/np_ops.py),
every output element, outputs poisoned first; repeated calls bit-identical (the reductions use no float atomics).
Also FP8 D_row (codes of D_row / D_col and the SFD_row / SFD_col bytes, both layouts) and an FP8 saved C. The cases
are lab/dgrad_cases.py's (the public ops); `pytest -m sanitize` selects the compute-sanitizer subset.

Needs a Hopper GPU and a bundle with the cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import np_ops  # noqa: E402
from mxfp8_checks import check_fp8_outputs  # noqa: E402  (its NORM_CONST is lab.dgrad_cases')
from lab import dgrad_cases as cases  # noqa: E402
from lab import harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.dgrad_cases")

FP8 = cases.FP8
FP8_KEYS = {"d_row_tensor": "d", "d_col_tensor": "d_col", "sfd_row_tensor": "sfd_row", "sfd_col_tensor": "sfd_col"}
# the compute-sanitizer subset (memcheck / racecheck)
SANITIZE = {"dswiglu_bias_amax-empty_and_tail",      # expert 1 empty, rows past valid_m
            "dsrelu_bias_amax-skewed",               # 3/4 of the rows in one expert, two empty
            "dswiglu_e4m3_bias_amax-unsanitized",    # FP8 D_row + SFD bytes stored from registers
            "dsrelu_e5m2_segsfd_noprob-empty_and_tail"}  # segmented SFD_col (per-expert offsets)


def _oracle(case, x):
    _, op, act, options, ab, c_dtype = case
    options = dict(options)
    options.pop("clamp_edges", None)
    no_prob = options.pop("no_prob", False)
    h = {k: np.asarray(v.astype(jnp.float32)) if v.dtype != jnp.int32 else np.asarray(v) for k, v in x.items()}
    d_dtype = options.pop("d_dtype", "bfloat16")
    kw = dict(ab_dtype=ab, d_dtype=d_dtype, c_dtype=c_dtype, dbias_dtype=options.pop("dbias_dtype", None),
              # the ops' default: amax for a 16-bit D
              compute_amax=options.pop("compute_amax", d_dtype in ("bfloat16", "float16")))
    options.pop("generate_dbias", None)
    fn = np_ops.grouped_gemm_dglu if op == "dglu" else np_ops.grouped_gemm_dsrelu
    if op == "dglu":
        kw["act_func"] = act
    if d_dtype in FP8:
        kw["norm_const"] = h["norm_const"]
    return fn(h["a"], h["b"], h["c"], None, None, h["offsets"], h["alpha"], h["beta"],
              None if no_prob else h["prob"], **kw, **options)


def run_case(case, pattern: str) -> list[str]:
    """Run one case on the GPU (outputs poisoned first, twice) and check every output element against the float64
    oracle (tests/np_ops.py); the problems found ([] = ok)."""
    x = cases.inputs(case, pattern, seed=zlib.crc32(f"{case[0]}/{pattern}".encode()) % 1000)
    got, again = harness.run_twice(jax.jit(functools.partial(cases.call, case)), x)
    want = _oracle(case, x)
    valid = want["_groups"][-1][1]
    fp8 = case[3].get("d_dtype") in FP8
    errs = harness.repeat_differences(got, again)
    for key, g in got.items():
        if g is None:
            continue
        if fp8 and key in FP8_KEYS:   # codes and SF bytes: _check_fp8 below
            continue
        gv = np.asarray(g.astype(jnp.float32))
        if not np.all(np.isfinite(gv)):
            errs.append(f"{key}: non-finite (poison left in an output?)")
            continue
        if key == "amax_tensor":
            ref = np.asarray(want[key], np.float32)
            if not np.all(np.abs(gv - ref) <= 2 ** -7 * np.abs(ref)):
                errs.append(f"{key}: {gv.ravel().tolist()} vs {ref.ravel().tolist()}")
            continue
        name = {"d_row_tensor": "d", "dprob_tensor": "dprob", "dbias_tensor": "dbias"}[key]
        pre, mag = want["_pre"][name], want["_mag"][name]
        out_dtype = str(g.dtype)
        # one rounding to the output dtype + fp32 accumulation error (K = H terms, bounded by the magnitude sum)
        bound = harness.ULP[out_dtype] * np.abs(pre) + 1e-5 * mag + harness.SUBNORMAL_STEP[out_dtype]
        err = np.abs(gv.astype(np.float64) - pre)
        if not np.all(err <= bound):
            errs.append(f"{key}: worst {np.max(err / bound):.2f} x the bound")
        if key in ("d_row_tensor", "dprob_tensor") and np.any(gv[valid:]):
            errs.append(f"{key}: rows past valid_m must be zero")
    if fp8:
        missing = [k for k in FP8_KEYS if got[k] is None]
        errs += [f"{k}: missing" for k in missing] or _check_fp8(case, x, got, want)
    return errs


def _check_fp8(case, x, got, want) -> list[str]:
    """D_row, D_col codes and the SFD_row / SFD_col bytes of an FP8-D case against the float64 oracle's
    pre-quantization values (mxfp8_checks.check_fp8_outputs: each SF byte equals the oracle's, or its neighbour
    where a power of two lies inside the value's error interval; codes likewise)."""
    options = case[3]
    p = {"num_groups": cases.L, "epilogue": {"d_dtype": options["d_dtype"],
                                             "discrete_col_sfd": options.get("discrete_col_sfd", False)}}
    outs = {FP8_KEYS[k]: np.asarray(got[k]) for k in FP8_KEYS}
    outs["sfd_row"], outs["sfd_col"] = (outs[k].view(np.uint8) for k in ("sfd_row", "sfd_col"))
    pre, mag = want["_pre"]["d"], want["_mag"]["d"]
    err = 1e-5 * mag + 2.0 ** -20 * np.abs(pre) + 1e-30
    return check_fp8_outputs(p, outs, {"d": pre}, err, np.asarray(x["offsets"]), pre.shape[0])


@pytest.mark.parametrize("case,pattern", harness.sanitize_params(
    [(f"{c[0]}-{p}", (c, p)) for c in cases.CASES for p in cases.PATTERNS], SANITIZE))
def test_dgrad_kernel_matches_float64(case, pattern):
    errs = run_case(case, pattern)   # every output element vs the float64 oracle, two calls bit-identical
    assert not errs, errs
