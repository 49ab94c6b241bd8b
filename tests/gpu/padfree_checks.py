"""The run and checks of the padding-free GPU suite (tests/gpu/test_padfree_gpu.py; the CPU self-test:
tests/test_padfree_gpu_checks.py): `run_case` poisons the whole output (XLA's allocator handed a NaN block), runs the
jitted op twice (bit-identical), and checks every element of every output against the float64 oracle
(tests/np_ops.py, the op's `m_aligned`): rows of neighbouring experts would differ from their own expert's values,
rows outside every group must be exactly 0. The cases, inputs and calls: lab/padfree_cases.py.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import np_ops
import numpy as np
from mxfp8_checks import check_fp8_outputs

from lab import harness
from lab import padfree_cases as cases
from lab.padfree_cases import BF, E4M3, F16, F32, FORWARD, L, PATTERNS


def _oracle(item, x):
    (name, op, options, _), pattern = item
    options = dict(options)
    m_aligned = PATTERNS[pattern][1]
    h = {k: np.asarray(v.astype(jnp.float32)) if v.dtype != jnp.int32 else np.asarray(v) for k, v in x.items()}
    if op == "wgrad":
        return np_ops.grouped_gemm_wgrad(h["a"], h["b"], h["offsets"], ab_dtype=BF, wgrad_dtype=F32)
    d_dtype = options.pop("d_dtype", BF)
    kw = dict(ab_dtype=BF, d_dtype=d_dtype, m_aligned=m_aligned,
              compute_amax=options.pop("compute_amax", d_dtype in (BF, F16)))   # the ops' default amax
    if d_dtype == E4M3:
        kw["norm_const"] = h["norm_const"]
    if op in FORWARD:
        bias = h["bias"] if options.pop("bias", False) else None
        if op == "glu":
            kw.update(act_func=options.pop("act_func"), glu_limit=options.pop("glu_limit", None),
                      glu_alpha=options.pop("glu_alpha", None))
        if op != "quant":
            kw["c_dtype"] = options.pop("c_dtype")
            if "tanh_clamp_scale" in options:
                kw["tanh_clamp_scale"] = options.pop("tanh_clamp_scale")
        fn = getattr(np_ops, f"grouped_gemm_{op}")
        return fn(h["a"], h["b"], None, None, h["offsets"], h["alpha"], h["prob"], bias, **kw)
    options.pop("generate_dbias", None)
    options.pop("c_dtype", None)
    kw.update(c_dtype=str(x["c"].dtype), dbias_dtype=options.pop("dbias_dtype", None), **options)
    fn = np_ops.grouped_gemm_dglu if op == "dglu" else np_ops.grouped_gemm_dsrelu
    return fn(h["a"], h["b"], h["c"], None, None, h["offsets"], h["alpha"], h["beta"], h["prob"], **kw)


PRE_KEY = {"c_tensor": "c", "d_tensor": "d", "d_row_tensor": "d", "dprob_tensor": "dprob", "dbias_tensor": "dbias",
           "wgrad_tensor": "wgrad"}
FP8_KEYS = {"d_tensor": "d", "d_row_tensor": "d", "d_col_tensor": "d_col", "sfd_row_tensor": "sfd_row",
            "sfd_col_tensor": "sfd_col"}


def _value_errors(key, values, want) -> list[str]:
    """One float output against the oracle: amax within 2^-7 relative; the rest within one rounding to its dtype
    plus the fp32 summation error (bounded by the magnitude sum). Rows outside every group have the oracle's 0
    (pre = mag = 0): exactly 0 up to the subnormal step."""
    got = np.asarray(values.astype(jnp.float32)).astype(np.float64)
    if not np.all(np.isfinite(got)):
        return [f"{key}: {int((~np.isfinite(got)).sum())} non-finite values (poison left in an output?)"]
    if key == "amax_tensor":
        ref = np.asarray(want[key], np.float64)
        ok = np.abs(got - ref) <= 2 ** -7 * np.abs(ref)
        return [] if ok.all() else [f"{key}: {got.ravel().tolist()} vs {ref.ravel().tolist()}"]
    pre, mag = want["_pre"][PRE_KEY[key]], want["_mag"][PRE_KEY[key]]
    dtype = str(values.dtype)
    excess = np.abs(got - pre) / (harness.ULP[dtype] * np.abs(pre) + 1e-5 * mag + harness.SUBNORMAL_STEP[dtype])
    if excess.max() <= 1:
        return []
    return [f"{key}: {int((excess > 1).sum())}/{excess.size} out of bounds, worst {excess.max():.2f} x the bound, "
            f"e.g. at {np.argwhere(excess > 1)[:3].tolist()}"]


def run_case(item) -> list[str]:
    """Run one (case, pattern) on the GPU (outputs poisoned first, twice) and check every element of every output
    against the float64 oracle; the problems found ([] = ok)."""
    (name, op, options, _), pattern = item
    x = cases.inputs(item, seed=zlib.crc32(f"{name}/{pattern}".encode()) % 1000)
    got, again = harness.run_twice(jax.jit(functools.partial(cases.call, item)), x)   # cases.call: patchable
    want = _oracle(item, x)
    fp8 = options.get("d_dtype") == E4M3
    errs = harness.repeat_differences(got, again)
    for key, values in got.items():
        if values is None:
            continue
        if not (fp8 and key in FP8_KEYS):   # FP8 codes and SF bytes: _check_fp8
            errs += _value_errors(key, values, want)
    if op != "wgrad":
        valid = want["_groups"][-1][1] if want["_groups"] else 0
        for key in ("c_tensor", "d_tensor", "d_row_tensor", "dprob_tensor"):
            if got.get(key) is not None and np.any(np.asarray(got[key].astype(jnp.float32))[valid:]):
                errs.append(f"{key}: rows past valid_m={valid} must be zero")
    if fp8:
        errs += _check_fp8(item, x, got, want)
    return errs


def _check_fp8(item, x, got, want) -> list[str]:
    """FP8 D (D_row): codes of D / D_col and the SFD_row / SFD_col bytes against the oracle's pre-quantization values
    (mxfp8_checks.check_fp8_outputs; its NORM_CONST is lab.padfree_cases')."""
    (_, op, options, _), pattern = item
    m, m_aligned, _ = PATTERNS[pattern]
    d_key = "d_tensor" if op in FORWARD else "d_row_tensor"
    p = {"num_groups": L, "m_aligned": m_aligned,
         "epilogue": {"d_dtype": options["d_dtype"], "discrete_col_sfd": False}}
    outs = {"d": np.asarray(got[d_key]), "d_col": np.asarray(got["d_col_tensor"]),
            "sfd_row": np.asarray(got["sfd_row_tensor"]).view(np.uint8),
            "sfd_col": np.asarray(got["sfd_col_tensor"]).view(np.uint8)}
    pre, mag = want["_pre"]["d"], want["_mag"]["d"]
    err = 1e-5 * mag + 2.0 ** -20 * np.abs(pre) + 1e-30
    return check_fp8_outputs(p, outs, {"d": pre}, err, np.asarray(x["offsets"]), m)
