"""The checks of the MXFP8 (block-scaled FP8) GPU suite (tests/gpu/test_mxfp8_gpu.py), every output element against a
float64 oracle; also the FP8-D checks of the dgrad suite and, on the CPU reference, their self-test
(tests/test_mxfp8_gpu_checks.py).

Inputs are real MXFP8 operands: fp32 data with per-32-block magnitudes 2^U(-20, 20) (plus all-zero blocks)
quantized by the independent numpy quantizer (tests/np_formats.py: e8m0 RCEIL, vec 32) -- so the e8m0 scales of A
and B span ~2^-21..2^20 across blocks (the issue's 2^-20..2^20) -- or, for the "uniform_b" kind, B scales equal across N within each K block,
varying along K. e4m3 and e5m2 operands per case.

The oracle dequantizes exactly in float64, runs the grouped GEMM and the fused epilogue of the CPU tests' oracle
(tests/np_ops.py, `np_forward_from_acc`). What the kernel may differ by is bounded per
element: the FP8 wgmma partial sums (K blocks of 32 products, each scaled exactly) may lose low-order bits, so
|acc - acc64| <= E_acc = 2^-10 * sum_k |a_k b_k| + 2^-20 |acc64|; E_acc is pushed through the epilogue by finite
differences (gate and up separately for GLU), plus 2^-20 relative for the epilogue's fp32 / approximate math.
Then:
  * bf16 / fp16 / fp32 / FP8 C and D: |got - ref| <= E + half an ulp of the output format at ref (saturating
    formats clip ref first) -- i.e. the correctly rounded value, or its neighbour only when ref is within E of the
    rounding midpoint;
  * FP8 D with SFD (docs/formats.md#quantization, norm_const): every e8m0 byte of SFD_row / SFD_col equals RCEIL of
    pv = amax * rcp_limit * norm_const unless a power-of-two boundary lies within the block's error interval
    (then the neighbouring byte is accepted), and every D / D_col code is the RNE-satfinite code of ref * scale
    (scale from the kernel's own byte) up to the same midpoint rule; the packed layouts (contiguous or
    discrete_col_sfd segments) are compared byte for byte, padding and rows outside every group included (0x00);
  * amax per group within the max E of the group; rows outside every group exactly zero; two runs bit-identical.
The same checks take problems with bf16 / fp16 inputs (no sf_dtype): A / B with per-(row, 32-block) magnitudes
2^U(-3, 3), E_acc = max(K, 32) * 2^-23 * sum_k |a_k b_k| (exact products, fp32 sums) -- for FP8 C / D from
half-precision inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib

import np_formats as nf
import np_ops
import numpy as np

from lab import harness

E4M3, E5M2, E8M0 = "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"
FMT = {  # mantissa bits, smallest normal exponent, largest finite (saturating formats) / None (inf)
    "bfloat16": (7, -126, None), "float16": (10, -14, None), "float32": (23, -126, None),
    E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0),
}
# non-saturating formats: |x| rounds to inf from (largest finite + half its ulp) on
OVERFLOW_AT = {f: 2.0 ** (e + 1) - 2.0 ** (e - FMT[f][0] - 1) for f, e in (("float16", 15), ("bfloat16", 127),
                                                                         ("float32", 127))}
RCP = {E4M3: float(np.float32(1) / np.float32(448)), E5M2: float(np.float32(1) / np.float32(57344))}
NORM_CONST = float(np.float32(0.01))  # what the kernel sees (fp32)
STATS = {}  # name -> worst |err| / E seen (printed at the end of the session: how tight the bound is)


# ------------------------------------------------------------------------------------------- inputs


def _blocks(rng, rows, k, lo, hi, zero_frac):
    """N(0,1) data with per-(row, 32-block) magnitudes 2^U(lo, hi) and all-zero blocks."""
    nkb = -(-k // 32)
    x = rng.standard_normal((rows, k))
    e = rng.integers(lo, hi + 1, size=(rows, nkb))
    x *= np.repeat(np.exp2(e), 32, axis=1)[:, :k]
    zero = np.repeat(rng.random((rows, nkb)) < zero_frac, 32, axis=1)[:, :k]
    x[zero] = 0.0
    return x.astype(np.float32)


def _deq(codes, s_logical):
    """Exact float64 dequantization: val(code) * 2^(s - 127)."""
    v = np.asarray(codes).astype(np.float64)
    k = v.shape[-1]
    return v * np.repeat(np.exp2(s_logical.astype(np.float64) - 127.0), 32, axis=-1)[..., :k]


def _mx_operands(p: dict, m: int, kind: str, rng):
    """MXFP8 A, B, SFA, SFB (device, launcher order), their exact float64 values and alpha."""
    import jax.numpy as jnp

    n, k, L, ab = p["n"], p["k"], p["num_groups"], p["ab_dtype"]
    nkb = -(-k // 32)
    a_codes, sa = nf.np_quantize_rows(_blocks(rng, m, k, -14, 27, 0.1), ab)
    b_codes, sb = [], []
    for g in range(L):
        if kind == "uniform_b":  # B scales equal across N in every K block
            x = rng.standard_normal((n, k)).astype(np.float32) * np.float32(64.0)
            codes = nf.np_fp8_encode(x, ab)
            s = np.broadcast_to(110 + (np.arange(nkb) * 7 + 3 * g) % 21, (n, nkb)).astype(np.uint8)
        else:
            codes, s = nf.np_quantize_rows(_blocks(rng, n, k, -14, 27, 0.1), ab)
        b_codes.append(codes)
        sb.append(s)
    b_codes, sb = np.stack(b_codes), np.stack(sb)
    # bring typical |C| to O(1..100): the largest products are ~2^40 x (448 / 2^8)^2
    alpha = np.resize([2.0 ** -38, -(2.0 ** -37), 2.0 ** -39, 1.5 * 2.0 ** -38], L).astype(np.float32)
    kb_n = -(-nkb // 4)
    sfa = nf.np_pack_sf(sa[None]).reshape(1, m // 128, kb_n, 32, 4, 4)
    sfb = nf.np_pack_sf(sb).reshape(L, -(-n // 128), kb_n, 32, 4, 4)
    args = [jnp.asarray(a_codes), jnp.asarray(b_codes), jnp.asarray(sfa), jnp.asarray(sfb)]
    return args, _deq(a_codes, sa), _deq(b_codes, sb), alpha


def _half_operands(p: dict, m: int, kind: str, rng):
    """bf16 / fp16 A, B (the FP8 epilogue's other inputs): per-(row, 32-block) magnitudes 2^U(-3, 3) and zero
    blocks ("uniform_b": plain N(0,1) B), their exact float64 values and alpha."""
    import jax.numpy as jnp

    n, k, L, ab = p["n"], p["k"], p["num_groups"], p["ab_dtype"]
    a = jnp.asarray(_blocks(rng, m, k, -3, 3, 0.1)).astype(ab)
    if kind == "uniform_b":
        b = jnp.asarray(rng.standard_normal((L, n, k)).astype(np.float32)).astype(ab)
    else:
        b = jnp.asarray(np.stack([_blocks(rng, n, k, -3, 3, 0.1) for _ in range(L)])).astype(ab)
    alpha = np.resize([2.0 ** -4, -(2.0 ** -3), 2.0 ** -5, 1.5 * 2.0 ** -4], L).astype(np.float32)
    f64 = lambda x: np.asarray(x.astype(jnp.float32)).astype(np.float64)  # noqa: E731
    return [a, b], f64(a), f64(b), alpha


def make_inputs(p: dict, m: int, offsets, kind: str, seed: int):
    """(device args in launcher order, host dict) for one problem: MXFP8 inputs, or bf16 / fp16 inputs when the
    problem has no scale-factor dtype."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    epi = p["epilogue"]
    operands = _mx_operands if p["sf_dtype"] is not None else _half_operands
    args, a64, b64, alpha = operands(p, m, kind, rng)
    args += [jnp.asarray(offsets, jnp.int32), jnp.asarray(alpha)]
    host = dict(a64=a64, b64=b64, alpha=alpha, prob=None, bias=None)
    if epi["has_prob"]:
        prob = rng.random(m).astype(np.float32)
        prob[np.arange(m) % 7 == 3] = 0.0
        host["prob"] = prob
        args.append(jnp.asarray(prob))
    if epi["has_bias"]:
        bias = rng.standard_normal((p["num_groups"], p["n"])).astype(np.float32)
        bias = np.asarray(jnp.asarray(bias).astype(epi["bias_dtype"]).astype(jnp.float32))
        host["bias"] = bias
        args.append(jnp.asarray(bias).astype(epi["bias_dtype"]))
    if epi["generate_sfd"]:
        args.append(jnp.asarray([NORM_CONST], jnp.float32))
    return args, host


# ------------------------------------------------------------------------------------------- oracle + bounds


def oracle_from_acc(p, acc, offsets, host, sigmoid=np_ops.np_sigmoid):
    """The float64 forward oracle (np_ops) on a given float64 accumulator."""
    return np_ops.np_forward_from_acc(p, acc, offsets, host["alpha"], host["prob"], host["bias"], sigmoid)


def references(p, offsets, host):
    """float64 C, D, amax plus per-element error bounds E_c, E_d."""
    m, L = host["a64"].shape[0], p["num_groups"]
    g_of = np_ops.np_group_of_rows(offsets, m)
    n = host["b64"].shape[1]
    acc = np.zeros((m, n))
    mag = np.zeros((m, n))
    for g in range(L):
        rows = g_of == g
        if rows.any():
            acc[rows] = host["a64"][rows] @ host["b64"][g].T
            mag[rows] = np.abs(host["a64"][rows]) @ np.abs(host["b64"][g]).T
    # FP8 wgmma partial sums may drop low-order bits (2^-10); bf16 / fp16 products are exact and summed in fp32
    rel = 2.0 ** -10 if p["sf_dtype"] is not None else max(p["k"], 32) * 2.0 ** -23
    e_acc = rel * mag + 2.0 ** -20 * np.abs(acc)
    ref = oracle_from_acc(p, acc, offsets, host)
    # the kernel's sigmoid is rcp.approx(1 + ex2(-x log2 e)) in fp32: 0 where the true value is below FLT_MIN
    # (x < ~-87; the float64 oracle keeps ~1e-38..1e-44 there): allow that band
    sig = np_ops.np_sigmoid
    ref_ftz = oracle_from_acc(p, acc, offsets, host, sigmoid=lambda x: np.where(sig(x) < 2.0 ** -125, 0.0, sig(x)))
    if p["op"] == "glu":
        gate = (np.arange(n) // 32) % 2 == 0
        parts = [np.where(gate, e_acc, 0.0), np.where(gate, 0.0, e_acc)]
    else:
        parts = [e_acc]
    e_d = 2.0 ** -20 * np.abs(ref["d"]) + 1e-30 + np.abs(ref["d"] - ref_ftz["d"])
    for part in parts:
        dev = np.maximum(np.abs(oracle_from_acc(p, acc + part, offsets, host)["d"] - ref["d"]),
                         np.abs(oracle_from_acc(p, acc - part, offsets, host)["d"] - ref["d"]))
        e_d = e_d + dev
    al = np.abs(host["alpha"].astype(np.float64))[np.minimum(g_of, L - 1)][:, None]
    e_c = al * e_acc + 2.0 ** -22 * np.abs(ref["c"]) + 1e-30 if ref["c"] is not None else None
    return ref, e_c, e_d, g_of


def _ulp(x, fmt):
    mb, emin, _ = FMT[fmt]
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.abs(x)))
    e = np.maximum(np.where(np.isfinite(e), e, emin), emin)
    return np.exp2(e - mb)


def _clip(x, fmt):
    qmax = FMT[fmt][2]
    return np.clip(x, -qmax, qmax) if qmax is not None else x


def check_values(name, got, ref, err, fmt, valid_rows):
    """|got - clip(ref)| <= err + ulp/2 (correct rounding up to a midpoint within err); zero rows outside groups."""
    got = np.asarray(got).astype(np.float64)
    errs = []
    if got.shape != ref.shape:
        return [f"{name}: shape {got.shape} != {ref.shape}"]
    if np.any(got[~valid_rows] != 0):
        errs.append(f"{name}: {int((got[~valid_rows] != 0).sum())} nonzero values in rows outside every group")
    r = _clip(ref, fmt)
    tol = err + 0.5 * _ulp(r, fmt) * (1 + 2.0 ** -20)
    ok_inf = np.isinf(got) & np.isinf(r) & (np.sign(got) == np.sign(r))
    if fmt in OVERFLOW_AT:
        # non-saturating output: round-to-nearest gives +-inf from the overflow threshold on; within err of it
        # either outcome is right (adversarial scales put outputs past fp16's range)
        with np.errstate(invalid="ignore"):
            r = np.where(np.abs(r) - err > OVERFLOW_AT[fmt], np.copysign(np.inf, r), r)
            ok_inf |= np.isinf(got) & (np.sign(got) == np.sign(r)) & (np.abs(r) + err >= OVERFLOW_AT[fmt])
    with np.errstate(invalid="ignore"):  # inf - inf where ok_inf
        diff = np.where(ok_inf, 0.0, np.abs(got - r))
    bad = ~(diff <= tol)
    STATS[name] = max(STATS.get(name, 0.0), float(np.max(np.where(ok_inf, 0, diff / tol))))
    if bad.any():
        idx = np.argwhere(bad)[:3].tolist()
        errs.append(f"{name}: {int(bad.sum())}/{bad.size} out of bound, e.g. at {idx}: got "
                    f"{[got[tuple(i)] for i in idx]} ref {[ref[tuple(i)] for i in idx]} "
                    f"tol {[tol[tuple(i)] for i in idx]}")
    return errs


def check_block_quant(name, codes, sf_logical, ref, err, d_dtype, valid_rows):
    """Row-direction (docs/formats.md#row-quantization) check of FP8 codes (R, C) + e8m0 bytes (R, cdiv(C, 32)) against
    float64 ref (R, C)."""
    errs = []
    R, C = ref.shape
    nb = -(-C // 32)
    pad = nb * 32 - C
    refp = np.pad(np.abs(ref), ((0, 0), (0, pad))).reshape(R, nb, 32)
    errp = np.pad(err, ((0, 0), (0, pad))).reshape(R, nb, 32)
    amax = refp.max(axis=2)
    e_amax = errp.max(axis=2)
    f = RCP[d_dtype] * NORM_CONST
    lo = np.maximum(amax - e_amax, 0.0) * f * (1 - 2.0 ** -21)
    hi = (amax + e_amax) * f * (1 + 2.0 ** -21)
    s = sf_logical.astype(np.int64)
    # byte s is right iff 2^(s-128) < pv <= 2^(s-127) for some pv in [lo, hi] (pv <= 2^-127 -> 0)
    upper = np.exp2(s - 127.0)
    lower = np.where(s == 0, -1.0, np.exp2(s - 128.0))
    ok_sf = (lo <= upper) & (hi > lower) & (s < 255)
    ok_sf &= np.where(valid_rows[:, None], True, s == 0)
    if not ok_sf.all():
        idx = np.argwhere(~ok_sf)[:3].tolist()
        errs.append(f"{name} SF: {int((~ok_sf).sum())}/{ok_sf.size} bytes wrong, e.g. at {idx}: got "
                    f"{[int(s[tuple(i)]) for i in idx]} pv in {[(lo[tuple(i)], hi[tuple(i)]) for i in idx]}")
    scale = np.minimum(NORM_CONST * np.exp2(127.0 - s), float(np.finfo(np.float32).max))
    scale_el = np.repeat(scale, 32, axis=1)[:, :C]
    vals = np.asarray(codes).astype(np.float64)
    errs += check_values(f"{name} codes", vals, ref * scale_el, err * scale_el, d_dtype, valid_rows)
    return errs


def check_fp8_outputs(p, outs, ref, e_d, offsets, m):
    """D, D_col, SFD_row, SFD_col of an FP8-D problem (physical layouts byte for byte)."""
    epi = p["epilogue"]
    d_dtype, n_out = epi["d_dtype"], ref["d"].shape[1]
    L = p["num_groups"]
    align = p.get("m_aligned", 256)   # the problem's group alignment (docs/offsets.md#group-alignment)
    valid = np_ops.np_group_of_rows(offsets, m, align) < L
    d, d_col, sfd_row, sfd_col = outs["d"], outs["d_col"], outs["sfd_row"], outs["sfd_col"]
    errs = []
    s_row = nf.np_unpack_sf(sfd_row, m, -(-n_out // 32))[0]
    errs += check_block_quant("D", d, s_row, ref["d"], e_d, d_dtype, valid)
    if not np.array_equal(nf.np_pack_sf(s_row[None]), np.asarray(sfd_row).reshape(-1)):
        errs.append("SFD_row: nonzero padding bytes")
    ends = np_ops.np_sanitized_ends(offsets, m, align)
    if epi["discrete_col_sfd"]:
        s_col = nf.np_unpack_sf_segments(sfd_col, n_out, ends, m, 32)
        packed = nf.np_pack_sf_segments(s_col, ends, 32)
    else:
        s_col = nf.np_unpack_sf(sfd_col, n_out, m // 32)[0]
        packed = nf.np_pack_sf(s_col[None])
    if not np.array_equal(packed, np.asarray(sfd_col).reshape(-1)):
        errs.append("SFD_col: bytes outside the logical scales (padding / past the last segment) are not 0x00")
    valid_blocks = valid.reshape(-1, 32)[:, 0]
    errs += [e.replace("D codes", "D_col codes").replace("D SF", "SFD_col")
             for e in check_block_quant("D", np.asarray(d_col).astype(np.float64).T, s_col, ref["d"].T, e_d.T,
                                        d_dtype, np.ones(n_out, bool))]
    if np.any(np.asarray(d_col).astype(np.float64)[~valid] != 0) or np.any(s_col[:, ~valid_blocks] != 0):
        errs.append("D_col/SFD_col: nonzero data in rows outside every group")
    return errs


# ------------------------------------------------------------------------------------------- run


OUTPUT_NAMES = {"c_tensor": "c", "d_tensor": "d", "d_col_tensor": "d_col", "amax_tensor": "amax",
                "sfd_row_tensor": "sfd_row", "sfd_col_tensor": "sfd_col"}


def run_case(name: str, problem, pattern: str, m: int, kind: str, fn) -> list:
    """Errors (strings) of one case: `fn` (lab.forward_cases.kernel_fn of `problem`: the kernel on the GPU, the
    reference on the CPU, or a stand-in returning {output key: array}) on one routing pattern and data kind, run
    twice (the allocator poisoned with NaN first each time)."""
    import jax

    p = dataclasses.asdict(problem)
    epi = p["epilogue"]
    offsets = harness.offsets_for(pattern, m, p["num_groups"])
    seed = int(hashlib.sha256(f"{name}/{pattern}/{m}/{kind}".encode()).hexdigest()[:8], 16)
    args, host = make_inputs(p, m, offsets, kind, seed)
    runs = []
    with harness.kernels_only():   # on the GPU, a fallback to the reference is an error
        for _ in range(2):
            if jax.default_backend() == "gpu":
                harness.poison_allocator()
            runs.append({OUTPUT_NAMES[k]: np.asarray(x) for k, x in jax.block_until_ready(fn(*args)).items()})
    outs, outs2 = runs
    keys = (["c"] if epi["c_dtype"] is not None and p["op"] != "quant" else []) + ["d"]
    keys += ["d_col"] if epi["generate_sfd"] else []
    keys += ["amax"] if epi["compute_amax"] else []
    keys += ["sfd_row", "sfd_col"] if epi["generate_sfd"] else []
    assert sorted(outs) == sorted(keys), (list(outs), keys)
    named = {k: (x.view(np.uint8) if k.startswith("sfd") else x) for k, x in outs.items()}
    errs = [f"{k}: two runs differ" for k in keys if not np.array_equal(outs[k].view(np.uint8),
                                                                         outs2[k].view(np.uint8))]
    ref, e_c, e_d, g_of = references(p, offsets, host)
    valid = g_of < p["num_groups"]
    if "c" in named:
        errs += check_values("C", named["c"].astype(np.float64), ref["c"], e_c, epi["c_dtype"], valid)
    if epi["generate_sfd"]:
        errs += check_fp8_outputs(p, named, ref, e_d, offsets, m)
    else:
        errs += check_values("D", named["d"].astype(np.float64), ref["d"], e_d, epi["d_dtype"], valid)
    if "amax" in named:
        L = p["num_groups"]
        tol = np.array([e_d[g_of == g].max() if (g_of == g).any() else 0.0 for g in range(L)])[:, None]
        bad = np.abs(named["amax"].astype(np.float64) - ref["amax"]) > tol + 2.0 ** -22 * ref["amax"]
        if bad.any():
            errs.append(f"amax: groups {np.argwhere(bad)[:, 0].tolist()} got {named['amax'][bad].tolist()} ref "
                        f"{ref['amax'][bad].tolist()}")
    return errs
