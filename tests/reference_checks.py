"""The reference-vs-oracle harness of tests/test_reference.py (also tests/test_m_aligned.py's): the operand
formats, group patterns and tolerances, random operands (make_gemm / make_dgrad), the reference op run beside the
float64 oracle (run_both) and the comparisons (docs/numerics.md; the tolerances: tests/test_reference.py's
docstring).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import np_ops as O
import numpy as np
from np_formats import E2M1, E4M3, E5M2, E8M0, np_cdiv, np_e2m1_decode, np_fp8_encode, np_pack_sf, np_unpack_fp4

from cudnn_moe_jax import reference as R

FORMATS = {                       # name -> (ab_dtype, sf_dtype, sf_vec_size)
    "bf16": ("bfloat16", None, None),
    "fp16": ("float16", None, None),
    "mxfp8_e4m3": (E4M3, E8M0, 32),
    "mxfp8_e5m2": (E5M2, E8M0, 32),
    "mxfp4": (E2M1, E8M0, 32),
    "nvfp4": (E2M1, E4M3, 16),
    "nvfp4_e8m0": (E2M1, E8M0, 16),
}
M, L = 1024, 4
GROUPS = {                        # padded_offsets for m = 1024, L = 4
    "balanced": [256, 512, 768, 1024],
    "empty": [256, 256, 768, 768],             # empty experts 1 and 3, valid_m 768 < m
    "giant": [0, 1024, 1024, 1024],
    "last": [0, 0, 0, 1024],
    "short": [256, 256, 512, 512],             # m > valid_m
    "nonmono": [512, 256, 1024, 768],
    "over": [256, 4096, 2048, 9999],
    "negative": [-256, 256, -5, 768],
    "unaligned": [100, 300, 700, 1000],
}
PREC_BITS = {"bfloat16": 8, "float16": 11, "float32": 24}
MIN_SUB = {"bfloat16": 0.0, "float16": 2.0 ** -24, "float32": 0.0}
NORM_CONST = 0.37
NOISE_MAG, NOISE_REL = 2.0 ** -20, 2.0 ** -15     # fp32 noise bound of the reference (see module docstring)
MAX_EXCLUDED = 0.005


# ---------------------------------------------------------------------------------------------------------------
# inputs


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _scale_bytes(rng, shape, sf_dtype):
    if sf_dtype == E8M0:
        return rng.integers(124, 130, shape).astype(np.uint8)            # 2^-3 .. 2^2
    return np_fp8_encode(rng.uniform(0.25, 4.0, shape).astype(np.float32), E4M3).view(np.uint8)


def _physical_sf(rng, s):
    """(L, R, nkb) logical bytes -> physical (L, Rb, Kb, 32, 4, 4), padding filled with random finite bytes."""
    l_, r_, nkb = s.shape
    shape = (l_, np_cdiv(r_, 128), np_cdiv(nkb, 4), 32, 4, 4)
    used = np_pack_sf(np.ones_like(s)).reshape(shape) != 0
    phys = np_pack_sf(s).reshape(shape)
    return np.where(used, phys, rng.integers(1, 0x7E, shape).astype(np.uint8))


def make_operand(rng, shape, fmt):
    """Random storage data (never zeros) and its physical scale factors (None for bf16/fp16)."""
    ab, sf, vec = FORMATS[fmt]
    lead, k = shape[:-1], shape[-1]
    if ab in ("bfloat16", "float16"):
        return rng.uniform(-2, 2, shape).astype(np.float32).astype(O.FLOAT_OUT[ab]), None
    if ab == E2M1:
        lo, hi = rng.integers(0, 16, lead + (k // 2,)), rng.integers(0, 16, lead + (k // 2,))
        data = (lo | (hi << 4)).astype(np.uint8)
    else:
        data = np_fp8_encode(rng.uniform(-3, 3, shape).astype(np.float32), ab)
    s = _scale_bytes(rng, (int(np.prod(lead[:-1], dtype=int)), lead[-1], np_cdiv(k, vec)), sf)
    return data, _physical_sf(rng, s)


def _rms(x, sf, fmt):
    ab, sfd, vec = FORMATS[fmt]
    return float(np.sqrt(np.mean(O.np_operand(x, sf, None, ab, sfd, vec) ** 2)))


def make_gemm(fmt, m, k, n, groups="balanced", bias=None, discrete=False, seed=0):
    """Inputs of a forward (or dgrad) grouped GEMM: dict of numpy arrays + the format kwargs."""
    rng = _rng(fmt, m, k, n, groups, bias, discrete, seed)
    a, sfa = make_operand(rng, (m, k), fmt)
    b, sfb = make_operand(rng, (L, n, k), fmt)
    scale = 2.0 / (np.sqrt(k) * _rms(a, sfa, fmt) * _rms(b, sfb, fmt))
    alpha = (rng.choice([-1.0, 1.0], L) * rng.uniform(0.5, 1.5, L) * scale).astype(np.float32)
    x = dict(a=a, b=b, sfa=sfa, sfb=sfb, padded_offsets=np.asarray(GROUPS[groups], np.int32), alpha=alpha,
             prob=rng.uniform(0.2, 1.0, m).astype(np.float32))
    if bias is not None:
        x["bias"] = rng.uniform(-1, 1, (L, n)).astype(np.float32).astype(O.FLOAT_OUT[bias])
    if discrete:
        x["b"] = tuple(b[i] for i in range(L))
        x["sfb"] = None if sfb is None else tuple(sfb[i:i + 1] for i in range(L))
    ab, sf, vec = FORMATS[fmt]
    return x, dict(ab_dtype=ab, sf_dtype=sf, sf_vec_size=vec)


def to_jnp(x):
    return {k: (None if v is None else tuple(map(jnp.asarray, v)) if isinstance(v, tuple) else jnp.asarray(v))
            for k, v in x.items()}


# ---------------------------------------------------------------------------------------------------------------
# comparisons


def noise(x64, mag):
    return NOISE_MAG * np.asarray(mag) + NOISE_REL * np.abs(x64)


def check_float(name, ref, x64, dtype, mag):
    r = np.asarray(ref)
    assert r.dtype == np.dtype(O.FLOAT_OUT[dtype]), (name, r.dtype, dtype)
    r = r.astype(np.float64)
    x64 = np.asarray(x64, np.float64)
    assert r.shape == x64.shape, (name, r.shape, x64.shape)
    tol = noise(x64, mag) + 2.0 ** (1 - PREC_BITS[dtype]) * np.abs(x64) + MIN_SUB[dtype]
    err = np.abs(r - x64)
    bad = ~(err <= tol)
    assert not bad.any(), (f"{name}: {bad.sum()} / {bad.size} out of tolerance; worst err {err.max():.3g} "
                           f"at {np.unravel_index(np.argmax(err - tol), err.shape)}")


def check_amax(ref, x64, mag, groups):
    """amax (L, k) vs the oracle; tolerance: the noise bound at the largest magnitude of the group's rows."""
    if x64 is None:
        assert ref is None
        return
    r = np.asarray(ref, np.float64)
    assert r.shape == x64.shape, (r.shape, x64.shape)
    tol = np.array([noise(x64[g], np.abs(mag[s:e]).max()).max() if e > s else 0.0
                    for g, (s, e) in enumerate(groups)])
    err = np.abs(r - x64)
    assert (err <= tol[:, None]).all(), (r, x64, tol)


def _values(arr, kind):
    """Comparable float64 values: fp8 decoded (-0 == 0), fp4 nibbles decoded, SF as raw bytes."""
    a = np.asarray(arr)
    if kind == "fp4":
        return np_e2m1_decode(np_unpack_fp4(a.view(np.uint8))).astype(np.float64)
    if kind == "bytes":
        return a.view(np.uint8).astype(np.float64)
    return a.astype(np.float64)


def check_quantized(outputs, ref, x64, mag, quantize):
    """outputs: {ref_key: (oracle_key, kind)}; quantize(x) -> {oracle_key: array}. Exact outside near-ties."""
    x64 = np.asarray(x64, np.float64)
    t = noise(x64, mag)
    mag = np.abs(x64)
    lo = quantize(np.sign(x64) * np.maximum(mag - t, 0.0))
    hi = quantize(np.sign(x64) * (mag + t))
    want = quantize(x64)
    for key, (okey, kind) in outputs.items():
        got = _values(ref[key], kind)
        w, l_, h = (_values(o[okey], kind) for o in (want, lo, hi))
        assert got.shape == w.shape, (key, got.shape, w.shape)
        tie = ~((l_ == h) | (np.isnan(l_) & np.isnan(h)))
        bad = ~((got == w) | (np.isnan(got) & np.isnan(w))) & ~tie
        assert not bad.any(), (f"{key}: {bad.sum()} / {bad.size} mismatches outside near-ties; first "
                               f"{np.argwhere(bad)[:4].tolist()} got {got[bad][:4]} want {w[bad][:4]}")
        assert tie.mean() <= MAX_EXCLUDED, f"{key}: {tie.sum()} / {tie.size} near-tie exclusions"


def check_d_outputs(ref, ora, *, d_key, d_dtype, norm_const, discrete_col_sfd):
    """D (+ D_col, SFD_row, SFD_col for FP8 D) against the oracle's float64 pre-rounding D."""
    x64, mag = ora["_pre"]["d"], ora["_mag"]["d"]
    if d_dtype in O.QUANT_D:
        groups = ora["_groups"]
        kind = "fp4" if d_dtype == E2M1 else "fp8"
        if d_dtype == E2M1:   # packed (m, N/2); D_col transposed, tokens packed (N, m/2)
            assert ref[d_key].shape == (x64.shape[0], x64.shape[1] // 2), ref[d_key].shape
            assert ref["d_col_tensor"].shape == (x64.shape[1], x64.shape[0] // 2), ref["d_col_tensor"].shape
        check_quantized({d_key: ("d", kind), "d_col_tensor": ("d_col", kind),
                         "sfd_row_tensor": ("sfd_row", "bytes"), "sfd_col_tensor": ("sfd_col", "bytes")}, ref, x64,
                        mag, lambda x: O.np_quant_d_outputs(x, groups, d_dtype, norm_const, discrete_col_sfd))
        shape_col = ref["sfd_col_tensor"].shape
        assert (len(shape_col) == 1) == discrete_col_sfd, shape_col
    else:
        check_float(d_key, ref[d_key], x64, d_dtype, mag)
        for k in ("d_col_tensor", "sfd_row_tensor", "sfd_col_tensor"):
            assert ref[k] is None, k


def check_c(ref, ora, c_dtype):
    x64, mag = ora["_pre"]["c"], ora["_mag"]["c"]
    if c_dtype in O.FP8:
        check_quantized({"c_tensor": ("c", "fp8")}, ref, x64, mag, lambda x: dict(c=O.np_cast(x, c_dtype)))
    else:
        check_float("c_tensor", ref["c_tensor"], x64, c_dtype, mag)


def check_fwd_amax(ref, ora):
    check_amax(ref["amax_tensor"], ora["amax_tensor"], ora["_mag"]["d"], ora["_groups"])


def call_ref(name, x, jit=False, **static):
    """The reference op on jnp inputs, eagerly or under jax.jit (static options bound, arrays traced)."""
    fn = functools.partial(getattr(R, name), **static)
    return (jax.jit(fn) if jit else fn)(**to_jnp(x))


def with_jit(cases, *jit_cases):
    """Every case eagerly, plus the listed case indices once more under jax.jit."""
    return [c + (False,) for c in cases] + [cases[i] + (True,) for i in jit_cases]


def run_both(name, jit, x, fmt_kw, **static):
    ref = call_ref(name, x, jit, **fmt_kw, **static)
    ora = getattr(O, name)(**x, **fmt_kw, **static)
    check_keys(ref, ora, jit)
    return ref, ora


def check_keys(ref, ora, jit):
    """cuDNN key order (jax.jit returns dicts with sorted keys, so only the key set there)."""
    want = [k for k in ora if not k.startswith("_")]
    assert (sorted(ref) == sorted(want)) if jit else (list(ref) == want), (list(ref), want)


def make_dgrad(fmt, n_c, i_dim, h_dim, groups, discrete, c_dtype, seed=0):
    """dY (m, H), W2^T (L, I, H) + saved C (m, n_c) in c_dtype, beta (L,)."""
    x, kw = make_gemm(fmt, M, h_dim, i_dim, groups, None, discrete, seed)
    rng = _rng("c", fmt, n_c, c_dtype, groups, seed)
    c32 = rng.uniform(-9, 9, (M, n_c)).astype(np.float32)
    x["c"] = O.np_cast(c32, c_dtype) if c_dtype in O.FP8 else c32.astype(O.FLOAT_OUT[c_dtype])
    x["beta"] = rng.uniform(0.5, 1.5, L).astype(np.float32)
    return x, kw


def check_backward(ref, ora, *, d_dtype, dbias_dtype, dcs):
    check_d_outputs(ref, ora, d_key="d_row_tensor", d_dtype=d_dtype, norm_const=NORM_CONST, discrete_col_sfd=dcs)
    check_float("dprob_tensor", ref["dprob_tensor"], ora["_pre"]["dprob"], "float32", ora["_mag"]["dprob"])
    if dbias_dtype is None:
        assert ref["dbias_tensor"] is None
    else:
        check_float("dbias_tensor", ref["dbias_tensor"], ora["_pre"]["dbias"], dbias_dtype, ora["_mag"]["dbias"])
    check_amax(ref["amax_tensor"], ora["amax_tensor"], ora["_mag"]["d"], ora["_groups"])
