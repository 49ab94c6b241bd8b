"""Expert groups that end at any row (`m_aligned` < 256, docs/offsets.md#group-alignment) through the public ops on
the GPU: every M-grouped op (quant, srelu, swiglu / geglu, dglu, dsrelu) with tiles straddling group ends, 1-row
and empty experts, rows past the last group (m > valid_m, a last tile clipped at m) and unsanitized offsets (as
device data); 128-aligned ends with odd tile counts (a 2-CTA block over two experts) with and without FP8 D; wgrad
on the same padding-free token offsets. `run_case` poisons the whole output (XLA's allocator handed a NaN block),
runs the jitted op twice (bit-identical), and checks every element of every output against the float64 oracle
(tests/np_ops.py, the op's `m_aligned`): rows of neighbouring experts would differ from their own expert's values,
rows outside every group must be exactly 0. The bundle items record the cases' kernel modules on the CPU machine:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants tests.gpu.padfree_cases:bundle_items
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax import aot

K, N, L = 256, 512, 6                  # A (m, K), B (L, N, K); dgrad: dY (m, K), W2^T (L, N/2, K), C (m, N or N/2)
E4M3 = "float8_e4m3fn"
NORM_CONST = 0.01                      # FP8 D's norm_const (tests/gpu/test_mxfp8_gpu.py's checks assume it)
# pattern -> (m, m_aligned, raw padded_offsets): every 128-row tile boundary is crossed by some group end
PATTERNS = {
    # 1-row expert 1, empty expert 2, a 1-row tail group; every group end inside a tile; valid_m = m
    "straddle": (1000, 1, (37, 38, 38, 300, 555, 1000)),
    # group sizes 1, 0, 129, 2, 300, 5: odd tile counts (2-CTA blocks over two experts); rows 437.. in no group,
    # the last zero tile clipped at m
    "tail": (1000, 1, (1, 1, 130, 132, 432, 437)),
    # device offsets out of range / unaligned / decreasing -> 8, 8, 1000, 1000, 1000, 1000 (floor 8, clip, max)
    "unsanitized": (1000, 8, (13, 9, 5000, -1, 700, 1200)),
    # every expert empty: every row a zero tile
    "all_empty": (1000, 8, (0, 0, 0, 0, 0, 0)),
    # 128-aligned ends with odd tile counts (1, 0, 2, 1, 3, 0 tiles): whole tiles, blocks over two experts
    "odd_tiles_128": (1024, 128, (128, 128, 384, 512, 896, 896)),
}
UNALIGNED = ("straddle", "tail", "unsanitized", "all_empty")
BF, F16, F32 = "bfloat16", "float16", "float32"

# (name, op, options, patterns)
CASES = [
    ("quant_bias_amax", "quant", dict(bias=True, d_dtype=BF, compute_amax=True), UNALIGNED),
    ("quant_f32d", "quant", dict(d_dtype=F32), UNALIGNED),
    ("srelu_bias_amax", "srelu", dict(bias=True, c_dtype=BF, d_dtype=BF, compute_amax=True), UNALIGNED),
    ("swiglu_bias_amax", "glu", dict(act_func="swiglu", bias=True, c_dtype=BF, d_dtype=BF, compute_amax=True),
     UNALIGNED + ("odd_tiles_128",)),
    ("geglu_f32c_limit", "glu", dict(act_func="geglu", c_dtype=F32, d_dtype=F16, glu_limit=3.0, glu_alpha=0.5),
     UNALIGNED),
    ("quant_e4m3d_bias", "quant", dict(bias=True, d_dtype=E4M3), ("odd_tiles_128",)),
    ("dswiglu_dbias_amax", "dglu", dict(act_func="dswiglu", generate_dbias=True, dbias_dtype=F32, compute_amax=True),
     UNALIGNED + ("odd_tiles_128",)),
    ("dgeglu_f32", "dglu", dict(act_func="dgeglu", c_dtype=F32, d_dtype=F32, glu_limit=3.0, glu_alpha=1.702),
     UNALIGNED),
    ("dsrelu_dbias_amax", "dsrelu", dict(generate_dbias=True, dbias_dtype=BF, compute_amax=True,
                                         tanh_clamp_scale=2.0), UNALIGNED),
    ("dsrelu_e4m3d_dbias", "dsrelu", dict(d_dtype=E4M3, generate_dbias=True, dbias_dtype=F32), ("odd_tiles_128",)),
    ("wgrad_tokens", "wgrad", dict(), ("straddle", "tail")),
]
FORWARD = ("quant", "srelu", "glu")
ITEMS = [(case, pattern) for case in CASES for pattern in case[3]]


def _width(op, options):
    """Columns of C (dgrad: the saved C / D_row) of the case."""
    return N // 2 if op == "dsrelu" else N


def inputs(item, seed: int = 0):
    (name, op, options, _), pattern = item
    m, _, offsets = PATTERNS[pattern]
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 8))
    x = dict(offsets=jnp.asarray(offsets, jnp.int32), norm_const=jnp.asarray([NORM_CONST], jnp.float32),
             prob=jax.random.uniform(next(k), (m,), minval=0.1, maxval=1.0),
             alpha=jax.random.uniform(next(k), (L,), minval=0.5, maxval=2.0))
    if op == "wgrad":   # A (K, T), B (N, T) token-contiguous: dy^T and h^T of a padding-free layer
        x["a"] = jax.random.normal(next(k), (K, m)).astype(BF)
        x["b"] = jax.random.normal(next(k), (N, m)).astype(BF)
        return x
    x["a"] = jax.random.normal(next(k), (m, K)).astype(BF)
    if op in FORWARD:
        x["b"] = (jax.random.normal(next(k), (L, N, K)) / 16).astype(BF)
        x["bias"] = jax.random.normal(next(k), (L, N)).astype(BF)
    else:
        n_i = N // 2
        x["b"] = (jax.random.normal(next(k), (L, n_i, K)) / 8).astype(BF)
        x["c"] = (2.0 * jax.random.normal(next(k), (m, _width(op, options)))).astype(options.get("c_dtype", BF))
        x["beta"] = jax.random.uniform(next(k), (L,), minval=0.5, maxval=1.5)
    return x


def call(item, x):
    (name, op, options, _), pattern = item
    options = dict(options)
    m_aligned = PATTERNS[pattern][1]
    if op == "wgrad":
        return cmj.grouped_gemm_wgrad(x["a"], x["b"], x["offsets"], wgrad_dtype=F32, m_aligned=m_aligned)
    options.pop("c_dtype", None) if op not in FORWARD else None
    kw = dict(padded_offsets=x["offsets"], alpha_tensor=x["alpha"], prob_tensor=x["prob"], m_aligned=m_aligned)
    if options.get("d_dtype") == E4M3:
        kw["norm_const_tensor"] = x["norm_const"]
    if op in FORWARD:
        bias = x["bias"] if options.pop("bias", False) else None
        fn = {"quant": cmj.grouped_gemm_quant, "srelu": cmj.grouped_gemm_srelu, "glu": cmj.grouped_gemm_glu}[op]
        return fn(x["a"], x["b"], bias_tensor=bias, **kw, **options)
    kw["beta_tensor"] = x["beta"]
    fn = cmj.grouped_gemm_dglu if op == "dglu" else cmj.grouped_gemm_dsrelu
    return fn(x["a"], x["b"], x["c"], **kw, **options)


def bundle_items():
    return aot.lowering_items(ITEMS, inputs, call)


# ------------------------------------------------------------------------------------------------ GPU run + checks
# (tests/gpu/test_padfree_gpu.py; needs tests/ and tests/gpu/ on sys.path)

def _oracle(item, x):
    import np_ops
    import numpy as np

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
    import harness
    import numpy as np

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
    import numpy as np

    (name, op, options, _), pattern = item
    import harness

    x = inputs(item, seed=zlib.crc32(f"{name}/{pattern}".encode()) % 1000)
    got, again = harness.run_poisoned_twice(functools.partial(call, item), x)
    want = _oracle(item, x)
    fp8 = options.get("d_dtype") == E4M3
    errs = []
    for key, values in got.items():
        if values is None:
            continue
        if not np.array_equal(np.asarray(values).view(np.uint8), np.asarray(again[key]).view(np.uint8)):
            errs.append(f"{key}: two calls differ")
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
    (tests/gpu/test_mxfp8_gpu.check_fp8_outputs)."""
    import numpy as np
    from test_mxfp8_gpu import check_fp8_outputs   # its NORM_CONST is this module's

    (_, op, options, _), pattern = item
    m, m_aligned, _ = PATTERNS[pattern]
    d_key = "d_tensor" if op in FORWARD else "d_row_tensor"
    p = {"num_groups": L, "m_aligned": m_aligned, "epilogue": {"d_dtype": options["d_dtype"], "discrete_col_sfd": False}}
    outs = {"d": np.asarray(got[d_key]), "d_col": np.asarray(got["d_col_tensor"]),
            "sfd_row": np.asarray(got["sfd_row_tensor"]).view(np.uint8),
            "sfd_col": np.asarray(got["sfd_col_tensor"]).view(np.uint8)}
    pre, mag = want["_pre"]["d"], want["_mag"]["d"]
    err = 1e-5 * mag + 2.0 ** -20 * np.abs(pre) + 1e-30
    return check_fp8_outputs(p, outs, {"d": pre}, err, np.asarray(x["offsets"]), m)
