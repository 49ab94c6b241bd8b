"""Expert groups that end at any row (`m_aligned` < 256, docs/offsets.md#group-alignment) through the public ops on
the GPU: every M-grouped op (quant, srelu, swiglu / geglu, dglu, dsrelu) with tiles straddling group ends, 1-row
and empty experts, rows past the last group (m > valid_m, a last tile clipped at m) and unsanitized offsets (as
device data); 128-aligned ends with odd tile counts (a 2-CTA block over two experts) with and without FP8 D; wgrad
on the same padding-free token offsets. The GPU suite (tests/gpu/test_padfree_gpu.py; its run and checks against
the float64 oracle with the op's `m_aligned`: tests/gpu/padfree_checks.py) runs every (case, pattern) of ITEMS.
Here: the cases, their inputs and calls, and the bundle items that record their kernel modules on the CPU machine:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.padfree_cases:bundle_items
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax import aot

K, N, L = 256, 512, 6                  # A (m, K), B (L, N, K); dgrad: dY (m, K), W2^T (L, N/2, K), C (m, N or N/2)
E4M3 = "float8_e4m3fn"
NORM_CONST = 0.01                      # FP8 D's norm_const (tests/gpu/mxfp8_checks.py's checks assume it)
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
    # the routed layer's 64-row groups and cuDNN's 256 (lab.gather_cases runs them)
    "aligned64": (1024, 64, (192, 192, 448, 640, 704, 960)),
    "aligned256": (1024, 256, (256, 256, 512, 768, 1024, 1024)),
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
    if "a_index" in x:   # lab.gather_cases: A's rows gathered
        kw["a_index"] = x["a_index"]
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
