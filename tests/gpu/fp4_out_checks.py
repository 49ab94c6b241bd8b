"""FP4 outputs on the GPU through the public ops: `grouped_gemm_glu_hadamard_quant` (kernels/sm90/hadamard.py: GLU
or sReLU, bf16 or NVFP4 D, rowwise / colwise Hadamard outputs, user matrix, amax) and the MXFP4 D of quant / srelu /
glu (kernels/sm90/epilogue_fp4d.py: D packed, D_col transposed and packed along the tokens, SFD_row / SFD_col in both
layouts), against the float64 oracle (tests/np_ops.py), every output byte, outputs poisoned first, two calls
bit-identical: the inputs and checks of tests/gpu/test_fp4_out_gpu.py (the cases, calls and bundle items:
lab/fp4_out_cases.py).

Input modes (`inputs`):
  "exact"   issue 19 item 6's inputs (tests/gpu/blockscaled_checks.py: codes on a coarse grid, scales in {1, 2},
            bf16 k/8; alpha in {1/2, 1, 2}, prob k/8, bias k/8): the accumulator is exact, so outputs computed from it without
            a transcendental are the oracle's correctly rounded values bit for bit -- all of quant's (FP4 D, D_col,
            SFD_row, SFD_col) and C. Cases marked "pm1" take A, B in {-1, 0, 1}, K = 16, alpha 1/4, prob in
            {1/2, 1}, act sReLU: then D = prob * relu(C)^2 has <= 8 significant bits (exact in bf16) and every
            16-term Hadamard sum is exact in fp32 in any order, so *every* output -- D (bf16 or NVFP4 codes and e4m3
            scale bytes), the rowwise / colwise Hadamard output and its scale bytes, amax -- must be bit-identical.
  "random"  N(0, 1)-scale data (block-scaled: quantized by the numpy quantizer), alpha U(0.5, 2), prob U(0.1, 1).
Quantized outputs are compared byte for byte against the oracle's quantization of its float64 values, except where
that value lies within the error bound of a rounding boundary (the oracle's quantization of the value shrunk and
grown by the bound differs there: a "near tie", excluded; at most 1% of a tensor). The bound: the accumulator's fp32
summation order and the epilogue's fp32 / approximate math (blockscaled_checks._error_bound); the Hadamard output's
input is the kernel's own bf16 D (with NVFP4 D: a second call of the same op with bf16 D, which computes the same fp32
D), plus the fp32 error of a 16-term sum. Floating outputs (C, bf16 D / RHT, amax) as blockscaled_checks.
"""

from __future__ import annotations

import functools
import zlib

import blockscaled_checks as bcc
import jax
import jax.numpy as jnp
import ml_dtypes
import np_formats as nf
import np_ops
import numpy as np
from mxfp8_checks import check_values

from lab import blockscaled_cases as bc
from lab import harness
from lab.fp4_out_cases import BF, E2M1, E4M3, F32, MAX_TIES, NC, PATTERNS, RHT_NC, L, M, call, companion


# ------------------------------------------------------------------------------------------------ inputs


def _user_matrix(rng):
    """A random orthogonal-ish 16 x 16 matrix (bf16-exact entries): (H16 / 4) with random signs per row and a
    random column permutation."""
    h = np_ops.np_hadamard16()
    return (h[:, rng.permutation(16)] * rng.choice([-1.0, 1.0], (16, 1))).astype(np.float32)


def _operand(v, fmt, bf16=False):
    """(data, physical scales) of float64 values in format `fmt` ("bf16", or lab.blockscaled_cases.FORMATS): bf16, or
    quantized by the numpy quantizer per row block (e4m3 scales travel typed)."""
    if fmt == "bf16" or bf16:
        return v.astype(np.float32).astype(ml_dtypes.bfloat16), None
    data, sf, vec = bc.FORMATS[fmt]
    vs = v if v.ndim == 3 else v[None]
    pairs = [nf.np_quantize_rows(vi.astype(np.float32), data, sf, vec) for vi in vs]
    codes, s = np.stack([c for c, _ in pairs]), np.stack([si for _, si in pairs])
    phys = nf.np_pack_sf(s).reshape(s.shape[0], -(-s.shape[1] // 128), -(-s.shape[2] // 4), 32, 4, 4)
    phys = phys.view(ml_dtypes.float8_e4m3fn) if sf == E4M3 else phys
    return (codes if v.ndim == 3 else codes[0]), phys


def inputs(case, pattern: str = "empty_and_tail", mode: str = "random", seed: int = 0):
    """Device inputs of a case: a, b, sfa, sfb, offsets, alpha, prob, bias, norm_const, rht_norm_const, hadamard."""
    _, op, fmt, k, n, options = case
    rng = np.random.default_rng(seed)
    if options.get("pm1"):       # see the module docstring: every output exact
        a = rng.integers(-1, 2, (M, k)).astype(ml_dtypes.bfloat16)
        b = rng.integers(-1, 2, (L, n, k)).astype(ml_dtypes.bfloat16)
        x = dict(a=a, b=b, sfa=None, sfb=None, alpha=np.full(L, 0.25, np.float32),
                 prob=rng.choice([0.5, 1.0], M).astype(np.float32), bias=np.zeros((L, n), np.float32))
    elif mode == "exact":        # issue 19 item 6's operands (blockscaled_cases)
        if fmt == "bf16":
            x = dict(a=bcc._half_operand(rng, M, k, "exact")[0], sfa=None, sfb=None,
                     b=np.stack([bcc._half_operand(rng, n, k, "exact")[0] for _ in range(L)]))
        else:
            full = bcc.inputs((None, "glu", fmt, k, n, {}), pattern, "exact", seed)
            x = {key: (None if full[key] is None else np.asarray(full[key])) for key in ("a", "b", "sfa", "sfb")}
    else:                        # N(0, 1) data (A scaled so that C is O(1)), quantized with norm_const 1
        x = dict(a=_operand(rng.standard_normal((M, k)) * (2.0 / np.sqrt(k)), fmt, fmt in bc.WEIGHT_ONLY),
                 b=_operand(rng.standard_normal((L, n, k)), fmt))
        x["a"], x["sfa"] = x["a"]
        x["b"], x["sfb"] = x["b"]
    if "alpha" not in x:
        if mode == "exact":
            x.update(alpha=rng.choice([0.5, 1.0, 2.0], L), prob=rng.integers(1, 9, M) / 8,
                     bias=rng.integers(-16, 17, (L, n)) / 8)
        else:
            x.update(alpha=rng.uniform(0.5, 2.0, L), prob=rng.uniform(0.1, 1.0, M), bias=rng.standard_normal((L, n)))
    x.update(offsets=np.asarray(PATTERNS[pattern], np.int32), norm_const=np.asarray([NC], np.float32),
             rht_norm_const=np.asarray([RHT_NC], np.float32), hadamard=_user_matrix(rng))
    x["alpha"], x["prob"] = x["alpha"].astype(np.float32), x["prob"].astype(np.float32)
    x["bias"] = x["bias"].astype(options.get("bias") or F32)
    return {key: None if v is None else jnp.asarray(v) for key, v in x.items()}


# ------------------------------------------------------------------------------------------------ oracle + checks


def _host(x):
    return {key: None if v is None else np.asarray(v) for key, v in x.items()}


def oracle(case, x, d_bf16=None):
    _, op, fmt, _, _, options = case
    h = _host(x)
    data, sf, vec = bc.FORMATS[fmt] if fmt != "bf16" else ("bfloat16", None, None)
    opts = {key: v for key, v in options.items() if key not in ("pm1", "bias", "no_prob", "user_matrix")}
    prob = None if options.get("no_prob") else h["prob"]
    bias = h["bias"].astype(np.float64) if options.get("bias") else None
    sfa, sfb = bcc._sf_bytes(h["sfa"]), bcc._sf_bytes(h["sfb"])
    d_dtype = opts.pop("d_dtype")
    kw = dict(ab_dtype=data, sf_dtype=sf, sf_vec_size=vec, d_dtype=d_dtype)
    if op == "hadamard":
        rht = opts.pop("rht_mode", None)
        rht_dtype = opts.pop("rht_dtype", None if rht is None else (E2M1 if rht == "colwise" else BF))
        amax = opts.pop("compute_amax", d_dtype == BF)
        return np_ops.grouped_gemm_glu_hadamard_quant(
            h["a"], h["b"], sfa, sfb, h["offsets"], h["alpha"], prob, bias, NC, RHT_NC,
            h["hadamard"] if options.get("user_matrix") else None, rht=rht, rht_dtype=rht_dtype,
            compute_amax=amax, d_bf16=d_bf16, **kw, **opts)
    fn = {"quant": np_ops.grouped_gemm_quant, "srelu": np_ops.grouped_gemm_srelu, "glu": np_ops.grouped_gemm_glu}[op]
    return fn(h["a"], h["b"], sfa, sfb, h["offsets"], h["alpha"], prob, bias, NC,
              compute_amax=d_dtype == BF, **kw, **opts)


def _nibbles(a):
    return nf.np_unpack_fp4(np.asarray(a).view(np.uint8)).astype(np.int64)


def check_quantized(name, got: dict, pre, err, quantize) -> list:
    """got {key: array}; quantize(x64) -> {key: array} (FP4 packed data compared by nibble, SF by byte): equal to
    quantize(pre) except where quantize(pre - err) and quantize(pre + err) differ (near ties; |pre| < err: either
    sign, so even a zero's sign)."""
    err = np.where(pre == 0, 0.0, err)      # exact zeros (rows outside groups, zero products) stay zero
    want = quantize(pre)
    lo = quantize(pre - err)
    hi = quantize(pre + err)
    errs = []
    for key, g in got.items():
        nib = key.startswith("d") or key.startswith("rht")
        conv = _nibbles if nib else (lambda a: np.asarray(a).view(np.uint8).reshape(-1).astype(np.int64))
        gv, wv, lv, hv = conv(g), conv(want[key]), conv(lo[key]), conv(hi[key])
        if gv.shape != wv.shape:
            errs.append(f"{name} {key}: shape {gv.shape} != {wv.shape}")
            continue
        tie, same = lv != hv, gv == wv
        if nib:  # the sign of a zero code is not compared (an exactly cancelling sum's sign depends on its order)
            same |= ((gv & 7) == 0) & ((wv & 7) == 0)
            tie &= ((lv & 7) != 0) | ((hv & 7) != 0)
        bad = ~same & ~tie
        if bad.any():
            idx = np.argwhere(bad)[:4].tolist()
            errs.append(f"{name} {key}: {int(bad.sum())}/{bad.size} wrong outside near ties, e.g. at {idx}: got "
                        f"{gv[bad][:4].tolist()} want {wv[bad][:4].tolist()}")
        if tie.mean() > MAX_TIES:
            errs.append(f"{name} {key}: {int(tie.sum())}/{tie.size} near ties (the error bound is too loose?)")
    return errs


def _d_bound(want, k, options):
    """blockscaled_cases._error_bound of D, with the GLUs' sigmoid underflow for every GLU of the table: where the
    sigmoid's argument k * clamp(gate) is below -87 the kernel's sigmoid is 0 (docs/numerics.md), D may be 0."""
    err = bcc._error_bound(want, "d", k)
    act = options.get("act_func")
    if act in np_ops.NP_GLU:
        glu = np_ops.np_glu(act, glu_limit=options.get("glu_limit"), glu_alpha=options.get("glu_alpha"))
        c, pre = want["_pre"]["c"], want["_pre"]["d"]
        for j, gs, us in np_ops.np_glu_pairs(c):
            gate, _ = np_ops._clipped(glu, c[:, gs], c[:, us])
            blk = slice(32 * j, 32 * j + 32)
            err[:, blk] += np.where(glu.k * gate < -87.0, np.abs(pre[:, blk]), 0.0)
    return err


def _rht_bound(want):
    """fp32 error of a 16-term sum of exact products (any order) on top of the exact transform of bf16 D."""
    return 16 * 2.0 ** -24 * want["_mag"]["rht"] + 2.0 ** -126


def run_case(case, pattern: str, mode: str) -> list[str]:
    """One case, outputs poisoned first, twice; every output against the oracle ([] = ok)."""
    name, op, fmt, k, _, options = case
    x = inputs(case, pattern, mode, seed=zlib.crc32(f"{name}/{pattern}/{mode}".encode()) % 1000)
    got, again = harness.run_twice(jax.jit(functools.partial(call, case)), x)
    errs = harness.repeat_differences(got, again)
    exact = options.get("pm1") or (mode == "exact" and op == "quant")
    d_bf16 = None
    if op == "hadamard" and options.get("rht_mode") is not None:
        src = got if options["d_dtype"] == BF else harness.run_twice(
            jax.jit(functools.partial(call, companion(case))), x)[0]
        d_bf16 = np.asarray(src["d_tensor"])
    want = oracle(case, x, d_bf16)
    valid = np.zeros(M, bool)
    for s, e in want["_groups"]:
        valid[s:e] = True
    err_d = 0.0 if exact else _d_bound(want, k, options)
    if op != "quant" and got.get("c_tensor") is not None:
        errs += _check_float(name, "c_tensor", got, want, "c", 0.0 if mode == "exact" else
                             bcc._error_bound(want, "c", k), valid)
    if options["d_dtype"] == E2M1 and op == "hadamard":
        errs += check_quantized(name, {"d_tensor": got["d_tensor"], "sfd": got["sfd_tensor"]}, want["_pre"]["d"],
                                err_d, lambda v: _nvfp4_d(v))
    elif options["d_dtype"] == E2M1:
        errs += check_quantized(
            name, {"d_tensor": got["d_tensor"], "d_col": got["d_col_tensor"], "sfd_row": got["sfd_row_tensor"],
                   "sfd_col": got["sfd_col_tensor"]}, want["_pre"]["d"], err_d,
            lambda v: _mxfp4_d(v, want["_groups"], options.get("discrete_col_sfd", False)))
    else:
        errs += _check_float(name, "d_tensor", got, want, "d", err_d, valid)
    if got.get("amax_tensor") is not None:
        ref, gv = np.asarray(want["amax_tensor"], np.float64), np.asarray(got["amax_tensor"], np.float64)
        e_max = np.array([[np.max(np.broadcast_to(err_d, want["_pre"]["d"].shape)[s:e]) if e > s else 0.0]
                          for s, e in want["_groups"]])
        if not np.all(np.abs(gv - ref) <= e_max + 2.0 ** -20 * np.abs(ref)):
            errs.append(f"amax_tensor: {gv.ravel().tolist()} vs {ref.ravel().tolist()}")
    if d_bf16 is not None:
        errs += _check_rht(name, case, got, want, 0.0 if options.get("pm1") else _rht_bound(want), valid)
    return errs


def _check_float(name, key, got, want, out, err, valid):
    gv = np.asarray(got[key].astype(jnp.float32)).astype(np.float64)
    pre = want["_pre"][out]
    return check_values(f"{name} {key}", gv, pre, np.broadcast_to(err, pre.shape), str(got[key].dtype), valid)


def _nvfp4_d(v):
    codes, s = np_ops.np_nvfp4(v, NC)
    return {"d_tensor": codes, "sfd": np_ops._phys(s)}


def _mxfp4_d(v, groups, discrete_col_sfd):
    o = np_ops.np_quant_d_outputs(v, groups, E2M1, NC, discrete_col_sfd)
    return {"d_tensor": o["d"], "d_col": o["d_col"], "sfd_row": o["sfd_row"], "sfd_col": o["sfd_col"]}


def _check_rht(name, case, got, want, err, valid):
    options = case[5]
    y = want["_pre"]["rht"]
    rht_dtype = options.get("rht_dtype", E2M1 if options["rht_mode"] == "colwise" else BF)
    if rht_dtype == BF:
        gv = np.asarray(got["rht_tensor"].astype(jnp.float32)).astype(np.float64)
        return check_values(f"{name} rht_tensor", gv, y, np.broadcast_to(err, y.shape), "bfloat16", valid)
    if options["rht_mode"] == "rowwise":
        def quantize(v):
            codes, s = np_ops.np_nvfp4(v, RHT_NC)
            return {"rht": codes, "sfrht": np_ops._phys(s)}
    else:
        def quantize(v):
            data, s = np_ops.np_rht_colwise_outputs(v, want["_groups"], RHT_NC)
            return {"rht": data, "sfrht": s}
    return check_quantized(name, {"rht": got["rht_tensor"], "sfrht": got["sfrht_tensor"]}, y, err, quantize)
