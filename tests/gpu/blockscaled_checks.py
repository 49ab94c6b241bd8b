"""The inputs and checks of the block-scaled GPU suite (tests/gpu/test_blockscaled_gpu.py; the cases, calls and
bundle items: lab/blockscaled_cases.py): operands quantized by the independent numpy quantizer (tests/np_formats.py),
the float64 oracle (tests/np_ops.py), every output element, outputs poisoned first, two calls bit-identical.

Input modes (`inputs`):
  "exact"        codes on a coarse grid (FP4: any code; e4m3: k/8, e5m2: k/4, |v| <= 2) with scales in {1, 2},
                 alpha in {1/2, 1, 2}, prob k/8, bias k/8 (cuDNN's generators are such inputs): every product and
                 every partial sum is exact in fp32, in any order, so the accumulator-level outputs (all of quant's,
                 C of srelu / glu) must equal the oracle's correctly rounded values bit for bit: codes, SF bytes,
                 bf16 / fp32 / FP8 values, amax (issue 19 item 6). Activation outputs: within the tolerance below.
  "adversarial"  N(0, 1) data with per-(row, block) magnitudes 2^U(-20, 20) (MXFP: e8m0 scales over that range;
                 NVFP4: 2^U(-6, 10), e4m3 scales over their whole range, subnormal scale codes included) and 5%
                 all-zero blocks (scale code 0x00 = 2^-127 for e8m0), quantized by the independent numpy quantizer;
                 e4m3 / e2m1 subnormal codes occur in every block.
  "specials"     adversarial plus a NaN code in one A row (FP4 has none: a NaN scale of one A block), a NaN scale of
                 one B block, and for e5m2 +inf / -inf codes in B: NaN / inf must land exactly where the oracle's do.
Tolerance (non-exact outputs): the accumulator may differ from the float64 value by fp32 summation order,
(K 2^-24 + 2^-20) sum|a b|, pushed through the epilogue by the oracle's first-order magnitudes, plus half an output
ulp (tests/gpu/mxfp8_checks.py: check_values / check_fp8_outputs).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import np_formats as nf
import np_ops
import numpy as np
from mxfp8_checks import check_fp8_outputs, check_values

from lab import harness
from lab.blockscaled_cases import (BF, DGRAD_OPS, E2M1, E4M3, E5M2, EXACT_KEYS, F16, F32, FORMATS, FP8, HALF,
                                   L, M, NORM_CONST, PATTERNS, WEIGHT_ONLY, a_half, call, expert_lists)


# ------------------------------------------------------------------------------------------------ inputs


def _exact_operand(rng, rows, k, fmt):
    """Codes on a coarse grid and scales in {1, 2} (logical (rows, nkb))."""
    data, sf, vec = FORMATS[fmt]
    nkb = -(-k // vec)
    s = np.where(rng.random((rows, nkb)) < 0.5, *((0x38, 0x40) if sf == E4M3 else (127, 128))).astype(np.uint8)
    if data == E2M1:
        return nf.np_pack_fp4(rng.integers(0, 16, (rows, k)).astype(np.uint8)), s
    step = 8 if data == E4M3 else 4
    vals = rng.integers(-2 * step, 2 * step + 1, (rows, k)) / step
    return vals.astype(ml_dtypes.float8_e4m3fn if data == E4M3 else ml_dtypes.float8_e5m2), s


def _half_operand(rng, rows, k, mode, dtype=ml_dtypes.bfloat16):
    """Weight-only A (or HALF's A and B): bf16, coarse (k/8 in [-2, 2], "exact") or N(0, 1) with per-32-block
    magnitudes 2^U(-20, 20). fp16 (`dtype`): 11-bit values (k/1024 in [-2, 2]: the kernel's low bf16 part is
    nonzero) or magnitudes 2^U(-12, 4) (inside fp16's range, some subnormals)."""
    if dtype == np.float16:
        if mode == "exact":
            return (rng.integers(-2048, 2049, (rows, k)) / 1024).astype(np.float16), None
        mag = np.exp2(rng.integers(-12, 5, (rows, -(-k // 32))))
        return (rng.standard_normal((rows, k)) * np.repeat(mag, 32, axis=1)[:, :k]).astype(np.float16), None
    if mode == "exact":
        return (rng.integers(-16, 17, (rows, k)) / 8).astype(dtype), None
    mag = np.exp2(rng.integers(-20, 21, (rows, -(-k // 32))))
    return (rng.standard_normal((rows, k)) * np.repeat(mag, 32, axis=1)[:, :k]).astype(dtype), None


def _random_operand(rng, rows, k, fmt):
    """N(0, 1) data, per-(row, block) magnitudes over the format's scale range, 5% zero blocks, quantized."""
    data, sf, vec = FORMATS[fmt]
    nkb = -(-k // vec)
    lo, hi = (-6, 10) if sf == E4M3 else (-20, 20)
    mag = np.exp2(rng.integers(lo, hi + 1, (rows, nkb))) * (rng.random((rows, nkb)) >= 0.05)
    x = rng.standard_normal((rows, k)) * np.repeat(mag, vec, axis=1)[:, :k]
    return nf.np_quantize_rows(x.astype(np.float32), data, sf, vec)


def _inject_specials(fmt, a, sa, b, sb):
    """A NaN code in A row 3 (FP4: a NaN scale of its block 0), a NaN scale of B expert 0, column 7, block 1,
    e5m2: +inf / -inf codes in B expert 2 (the last where there are fewer; columns 100 / 101). Rows 3 / columns 7
    of group 0 turn NaN."""
    data, sf, _ = FORMATS[fmt]
    nan_sf = 0x7F if sf == E4M3 else 0xFF
    if fmt in WEIGHT_ONLY:
        a[3, 5] = np.nan
        if a.dtype == np.float16:
            a[4, 6] = np.inf     # its low bf16 part must not turn inf * b into NaN
    elif data == E2M1:
        sa[3, 0] = nan_sf
    else:
        a.view(np.uint8)[3, 5] = 0x7F
    sb[0, 7, 1] = nan_sf
    if data == E5M2:   # (expert 2 where there is one: the last otherwise)
        e = min(2, b.shape[0] - 1)
        b.view(np.uint8)[e, 100, 3] = 0x7C
        b.view(np.uint8)[e, 101, 9] = 0xFC


def inputs(case, pattern: str = "empty_and_tail", mode: str = "adversarial", seed: int = 0):
    _, op, fmt, k, n, options = case
    data, sf, vec = FORMATS[fmt]
    L = len(PATTERNS[pattern])   # experts
    rng = np.random.default_rng(seed)
    make = _exact_operand if mode == "exact" else _random_operand
    if fmt == HALF:
        make = lambda rng, rows, k, fmt: _half_operand(rng, rows, k, mode)  # noqa: E731
    a, sa = (_half_operand(rng, M, k, mode, np.dtype(a_half(fmt))) if fmt in WEIGHT_ONLY
             else make(rng, M, k, fmt))
    bs = [make(rng, n, k, fmt) for _ in range(L)]
    b, sb = np.stack([x for x, _ in bs]), None if fmt == HALF else np.stack([s for _, s in bs])
    if mode == "specials":
        _inject_specials(fmt, a, sa, b, sb)
    sf_np = ml_dtypes.float8_e4m3fn if sf == E4M3 else np.uint8     # e4m3 scales travel typed (docs/formats.md)
    phys = lambda s: nf.np_pack_sf(s).reshape(s.shape[0] if s.ndim == 3 else 1, -(-s.shape[-2] // 128),  # noqa: E731
                                              -(-s.shape[-1] // 4), 32, 4, 4).view(sf_np)
    if mode == "exact":
        alpha = rng.choice([0.5, 1.0, 2.0], L)
        prob = rng.integers(1, 9, M) / 8
        bias = rng.integers(-16, 17, (L, n)) / 8
    else:
        alpha = rng.uniform(0.5, 2.0, L)
        prob = rng.uniform(0.1, 1.0, M)
        bias = rng.standard_normal((L, n))
    x = dict(a=a, b=b, sfa=None if sa is None else phys(sa), sfb=None if sb is None else phys(sb),
             alpha=alpha.astype(np.float32), prob=prob.astype(np.float32),
             offsets=np.asarray(PATTERNS[pattern], np.int32), norm_const=np.asarray([NORM_CONST], np.float32),
             bias=bias.astype(options.get("bias") or F32))
    if op in DGRAD_OPS:   # the saved forward C (m, 2N) / (m, N) and its dequant scale beta
        width = 2 * n if op == "dglu" else n
        x["c"] = (2.0 * rng.standard_normal((M, width))).astype(np.float32).astype(
            ml_dtypes.float8_e4m3fn if options["c_dtype"] == E4M3 else options["c_dtype"])
        x["beta"] = rng.uniform(0.5, 1.5, L).astype(np.float32)
    return {key: None if v is None else jnp.asarray(v) for key, v in x.items()}


# ------------------------------------------------------------------------------------------------ GPU run + checks


def case_inputs(case, pattern: str, mode: str, discrete: bool = False):
    """The inputs of one run of a case (seeded by case, pattern and mode)."""
    x = inputs(case, pattern, mode, seed=zlib.crc32(f"{case[0]}/{pattern}/{mode}".encode()) % 1000)
    return expert_lists(x) if discrete else x


def _run_checked(case, pattern: str, mode: str, discrete: bool = False):
    """Run one case (outputs poisoned first, twice): (inputs, outputs, the oracle's, rows inside groups, ["two calls
    differ" per output that is not bit-identical])."""
    x = case_inputs(case, pattern, mode, discrete)
    got, again = harness.run_twice(jax.jit(functools.partial(call, case, discrete=discrete)), x)
    want = _oracle(case, x)
    valid = np.zeros(M, bool)
    for s, e in want["_groups"]:
        valid[s:e] = True
    errs = harness.repeat_differences(got, again)
    return x, got, want, valid, errs


def _oracle(case, x):
    _, op, fmt, _, _, options = case
    data, sf, vec = FORMATS[fmt]
    options = dict(options)
    options.pop("b_major", None)   # a memory-order hint: the same math
    if op in DGRAD_OPS:
        return _dgrad_oracle(case, x)
    has_bias = options.pop("bias", None) is not None
    no_prob = options.pop("no_prob", False)
    d_dtype = options.pop("d_dtype")
    h = {key: None if v is None else np.asarray(v) for key, v in x.items()}
    kw = dict(ab_dtype=data, sf_dtype=sf, sf_vec_size=vec, d_dtype=d_dtype,
              compute_amax=d_dtype in (BF, F16), **options)   # the ops' default: amax for a 16-bit D
    if op == "glu":
        kw["act_func"] = options.get("act_func", "swiglu")
    fn = {"quant": np_ops.grouped_gemm_quant, "srelu": np_ops.grouped_gemm_srelu, "glu": np_ops.grouped_gemm_glu}[op]
    return fn(h["a"], h["b"], _sf_bytes(h["sfa"]), _sf_bytes(h["sfb"]), h["offsets"], h["alpha"],
              None if no_prob else h["prob"], h["bias"].astype(np.float64) if has_bias else None,
              h["norm_const"] if d_dtype in FP8 else None, **kw)


def _dgrad_oracle(case, x):
    _, op, fmt, _, _, options = case
    data, sf, vec = FORMATS[fmt]
    options = dict(options)
    options.pop("b_major", None)
    no_prob = options.pop("no_prob", False)
    options.pop("generate_dbias", None)
    d_dtype = options.pop("d_dtype")
    h = {key: None if v is None else np.asarray(v) for key, v in x.items()}
    kw = dict(ab_dtype=data, sf_dtype=sf, sf_vec_size=vec, d_dtype=d_dtype, compute_amax=d_dtype in (BF, F16),
              **options)
    fn = np_ops.grouped_gemm_dglu if op == "dglu" else np_ops.grouped_gemm_dsrelu
    return fn(h["a"], h["b"], h["c"].astype(np.float32), _sf_bytes(h["sfa"]), _sf_bytes(h["sfb"]),
              h["offsets"], h["alpha"], h["beta"], None if no_prob else h["prob"],
              h["norm_const"] if d_dtype in FP8 else None, **kw)


def run_dgrad_case(case, pattern: str, mode: str, discrete: bool = False) -> list[str]:
    """A backward case: D_row (FP8: codes and SF bytes), dprob, dbias, amax vs the float64 oracle."""
    name, op, fmt, k, _, options = case
    x, got, want, valid, errs = _run_checked(case, pattern, mode, discrete)
    fp8_d = options.get("d_dtype") in FP8
    for key, out, rows in (("d_row_tensor", "d", valid), ("dprob_tensor", "dprob", valid),
                           ("dbias_tensor", "dbias", np.ones(len(PATTERNS[pattern]), bool))):
        if got.get(key) is None or (fp8_d and out == "d"):
            continue
        pre, err = want["_pre"][out], _error_bound(want, out, k)
        gv = np.asarray(got[key].astype(jnp.float32)).astype(np.float64)
        nan = np.isnan(pre)
        if not np.array_equal(np.isnan(gv), nan):
            errs.append(f"{key}: NaN at {int(np.isnan(gv).sum())} elements, the oracle at {int(nan.sum())}")
        errs += check_values(f"{name} {key}", np.where(nan, 0.0, gv), np.where(nan, 0.0, pre),
                             np.where(nan, 0.0, err), str(got[key].dtype), rows)
    if fp8_d and mode != "specials":
        p = {"num_groups": len(PATTERNS[pattern]), "epilogue": {"d_dtype": options["d_dtype"],
                                           "discrete_col_sfd": options.get("discrete_col_sfd", False)}}
        outs = {"d": np.asarray(got["d_row_tensor"]), "d_col": np.asarray(got["d_col_tensor"]),
                "sfd_row": np.asarray(got["sfd_row_tensor"]).view(np.uint8),
                "sfd_col": np.asarray(got["sfd_col_tensor"]).view(np.uint8)}
        errs += check_fp8_outputs(p, outs, {"d": want["_pre"]["d"]}, _error_bound(want, "d", k),
                                  np.asarray(x["offsets"]), M)
    if got.get("amax_tensor") is not None and mode != "specials":
        ref, gv = np.asarray(want["amax_tensor"], np.float64), np.asarray(got["amax_tensor"], np.float64)
        if not np.all(np.abs(gv - ref) <= 2.0 ** -7 * np.abs(ref) + 2.0 ** -126):
            errs.append(f"amax_tensor: {gv.ravel().tolist()} vs {ref.ravel().tolist()}")
    return errs


def _sf_bytes(sf):
    return None if sf is None else sf.view(np.uint8)


def _bits(v):
    v = np.asarray(v)
    return v.view(np.uint8) if v.dtype.itemsize == 1 else np.asarray(v, np.float64)


def _same_bits(got, want) -> bool:
    """Equal values (bytes for 1-byte types), NaN where the oracle has NaN."""
    g, w = _bits(got), _bits(want)
    if g.dtype == np.uint8 or w.dtype == np.uint8:
        return g.shape == w.shape and np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8))
    return g.shape == w.shape and np.array_equal(g, w, equal_nan=True)


def _error_bound(want, out: str, k: int, act=None):
    """What an output may differ from the float64 value by before its rounding: fp32 summation order of exact
    products, (K 2^-24 + 2^-20) sum|a b| pushed through the epilogue (the oracle's first-order magnitudes), the
    epilogue's fp32 math 2^-20 relative, and 2^-126: values below fp32's normal range are not part of the contract
    (docs/numerics.md#subnormals). Where a NaN input meets an op that maps it to a number (relu, clamps) the
    magnitude is NaN: no allowance there."""
    pre, mag = want["_pre"][out], want["_mag"][out]
    with np.errstate(invalid="ignore"):
        err = (k * 2.0 ** -24 + 2.0 ** -20) * mag + 2.0 ** -20 * np.abs(pre) + 2.0 ** -126
        if out == "d" and act in ("swiglu", "geglu"):
            # the kernel's sigmoid is 0 where the true value is below FLT_MIN (docs/numerics.md): D may be 0 there
            c = want["_pre"]["c"]
            for j, gs, _ in np_ops.np_glu_pairs(c):
                arg = c[:, gs] * (1.702 if act == "geglu" else 1.0)
                d = err[:, 32 * j: 32 * j + 32]
                d += np.where(arg < -87.0, np.abs(pre[:, 32 * j: 32 * j + 32]), 0.0)
    return np.nan_to_num(err, nan=0.0, posinf=np.inf)


# critical points (in k x) of h(x) = x sigmoid(k x): h' has its extrema at k x = +-H1_EXTREMA, h its minimum at
# k x = H_MINIMUM (roots of y (2 sigmoid(y) - 1) = 2 and 1 + y (1 - sigmoid(y)) = 0)
H1_EXTREMA, H_MINIMUM = 2.3993572805154684, -1.2784645427610737


def _reach(x, lo, hi):
    """How far from x the interval [lo, hi] reaches."""
    return np.maximum(hi - x, x - lo)


def _activation_bound(case, x, want, k: int):
    """What D of srelu / glu may differ from the oracle's by, given C's error bound e_C (`_error_bound` of C):
    |scale prob| times the supremum of |act'| over [C - e_C, C + e_C] (glu: over the gate / up box, sup |d act / d
    gate| e_gate + sup |d act / d up| e_up). The first-order magnitudes take the derivative at the oracle's C only:
    where cancellation makes e_C large next to C, the interval crosses the relu kink or the sigmoid's knee and the
    derivative there is 0 (an oracle gate of -15201 with e_C 8e7: silu(gate) * up may be 3e15, nvfp4e8_swiglu_n320;
    an oracle C of -56 with e_C 5e5: srelu(C) may be 4, mxfp4_srelu_tanh_k224). None for other ops."""
    _, op, _, _, _, options = case
    if op not in ("srelu", "glu"):
        return None
    c, e = want["_pre"]["c"], _error_bound(want, "c", k)
    prob = np.ones(c.shape[0]) if options.get("no_prob") else np.abs(np.asarray(x["prob"], np.float64))
    with np.errstate(invalid="ignore", over="ignore"):
        lo, hi = c - e, c + e
        if op == "srelu":
            s = options.get("tanh_clamp_scale")
            lo, hi = np.maximum(lo, 0.0), np.maximum(hi, 0.0)    # relu: the interval after it
            if s is None:     # (relu x)' = 2 x: increasing
                sup = 2.0 * hi
            else:             # 2 s t (1 - t^2), t = tanh(x / s): one maximum, at t = 1/sqrt(3)
                sup = np_ops.np_srelu_derivative(np.clip(s * np.arctanh(3 ** -0.5), lo, hi), s)
            return np.nan_to_num(prob[:, None] * sup * _reach(np.maximum(c, 0.0), lo, hi), nan=0.0, posinf=np.inf)
        g = np_ops.np_glu(options.get("act_func", "swiglu"), glu_limit=options.get("glu_limit"),
                          glu_alpha=options.get("glu_alpha"))
        glo, ghi, ulo, uhi = g.bounds
        h = lambda t: t * np_ops.np_sigmoid(g.k * t)                                       # noqa: E731
        dh = lambda t: np_ops.np_sigmoid(g.k * t) * (1.0 + g.k * t * (1.0 - np_ops.np_sigmoid(g.k * t)))  # noqa: E731
        out = np.zeros((c.shape[0], c.shape[1] // 2))
        for j, gs, us in np_ops.np_glu_pairs(c):
            # the intervals after the clamps (outside the bounds act does not change)
            a, b = np.clip(lo[:, gs], glo, ghi), np.clip(hi[:, gs], glo, ghi)
            ua, ub = np.clip(lo[:, us], ulo, uhi), np.clip(hi[:, us], ulo, uhi)
            e_g, e_u = _reach(np.clip(c[:, gs], glo, ghi), a, b), _reach(np.clip(c[:, us], ulo, uhi), ua, ub)
            sup_dh = np.maximum.reduce([np.abs(dh(t)) for t in (a, b, np.clip(H1_EXTREMA / g.k, a, b),
                                                                  np.clip(-H1_EXTREMA / g.k, a, b))])
            sup_h = np.maximum.reduce([np.abs(h(t)) for t in (a, b, np.clip(H_MINIMUM / g.k, a, b))])
            sup_lin = np.maximum(np.abs(ua + g.offset), np.abs(ub + g.offset)) + abs(g.offset)
            out[:, 32 * j: 32 * j + 32] = prob[:, None] * (sup_lin * sup_dh * e_g + sup_h * e_u)
        return np.nan_to_num(abs(g.scale) * out, nan=0.0, posinf=np.inf)


def _d_error_bound(case, x, want, k: int):
    """D's bound: the first-order one (`_error_bound`) or, where larger, `_activation_bound` plus D's own
    rounding terms."""
    act = case[5].get("act_func")
    err = _error_bound(want, "d", k, act)
    extra = _activation_bound(case, x, want, k)
    if extra is None:
        return err
    with np.errstate(invalid="ignore"):
        own = np.nan_to_num(2.0 ** -20 * np.abs(want["_pre"]["d"]), nan=0.0) + 2.0 ** -126
    return np.maximum(err, extra + own)


def run_case(case, pattern: str, mode: str, discrete: bool = False) -> list[str]:
    """Run one case (outputs poisoned first, twice) and check every output element against the float64 oracle;
    the problems found ([] = ok). `discrete`: the weights passed as per-expert arrays (b_tensors / sfb_tensors)."""
    name, op, fmt, k, _, options = case
    if op in DGRAD_OPS:
        return run_dgrad_case(case, pattern, mode, discrete)
    x, got, want, valid, errs = _run_checked(case, pattern, mode, discrete)
    groups = want["_groups"]
    if mode == "exact":
        for key in EXACT_KEYS[op]:
            if got[key] is not None and not _same_bits(got[key], want[key]):
                errs.append(f"{key}: not bit-identical to the exact result")
    fp8_d = options.get("d_dtype") in FP8
    for key, out in (("c_tensor", "c"), ("d_tensor", "d")):
        if got.get(key) is None or (fp8_d and out == "d"):
            continue
        pre = want["_pre"][out]
        err = _d_error_bound(case, x, want, k) if out == "d" else _error_bound(want, out, k)
        gv = np.asarray(got[key].astype(jnp.float32)).astype(np.float64)
        nan = np.isnan(pre)
        if not np.array_equal(np.isnan(gv), nan):
            errs.append(f"{key}: NaN at {int(np.isnan(gv).sum())} elements, the oracle at {int(nan.sum())}")
        errs += check_values(f"{name} {key}", np.where(nan, 0.0, gv), np.where(nan, 0.0, pre), np.where(nan, 0.0, err),
                             str(got[key].dtype), valid)
    if fp8_d and mode != "specials":
        pre, err = want["_pre"]["d"], _d_error_bound(case, x, want, k)
        p = {"num_groups": len(PATTERNS[pattern]), "epilogue": {"d_dtype": options["d_dtype"],
                                           "discrete_col_sfd": options.get("discrete_col_sfd", False)}}
        outs = {"d": np.asarray(got["d_tensor"]), "d_col": np.asarray(got["d_col_tensor"]),
                "sfd_row": np.asarray(got["sfd_row_tensor"]).view(np.uint8),
                "sfd_col": np.asarray(got["sfd_col_tensor"]).view(np.uint8)}
        errs += check_fp8_outputs(p, outs, {"d": pre}, err, np.asarray(x["offsets"]), M)
    if got.get("amax_tensor") is not None and mode != "exact":
        ref = np.asarray(want["amax_tensor"], np.float64)
        gv = np.asarray(got["amax_tensor"], np.float64)
        bound = _d_error_bound(case, x, want, k)
        e_max = np.array([[bound[s:e].max() if e > s else 0.0] for s, e in groups])
        if not np.all((np.abs(gv - ref) <= e_max + 2.0 ** -20 * np.abs(ref)) | (np.isnan(gv) & np.isnan(ref))):
            errs.append(f"amax_tensor: {gv.ravel().tolist()} vs {ref.ravel().tolist()}")
    return errs
