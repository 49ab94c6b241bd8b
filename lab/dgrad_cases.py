"""Backward-op cases (grouped_gemm_dglu / grouped_gemm_dsrelu through the public ops) of the GPU suite
(tests/gpu/test_dgrad_gpu.py: the run and every check against the float64 oracle), and the bundle items that
record their kernel modules on the CPU machine:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.dgrad_cases:bundle_items
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax import aot

M, H, I, L = 2048, 256, 512, 4     # dY (M, H), W2^T (L, I, H); dglu C / D_row (M, 2I), dsrelu (M, I)
PATTERNS = {
    "empty_and_tail": (512, 512, 1024, 1792),   # expert 1 empty, rows 1792.. outside every group (m > valid_m)
    "skewed": (1536, 1536, 1792, 2048),          # one expert holds 3/4 of the rows, two empty
    "unsanitized": (700, 300, 9999, -5),         # -> ends 512, 512, 2048, 2048 (not multiples of 256, > m, < 0)
}

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
FP8 = (E4M3, E5M2)
NORM_CONST = 0.01   # FP8 D's norm_const (as float32; tests/gpu/mxfp8_checks.py's checks assume it)

# (name, op, act, options, ab dtype, C dtype)
CASES = [
    ("dswiglu_bias_amax", "dglu", "dswiglu", dict(generate_dbias=True, dbias_dtype="float32", compute_amax=True),
     "bfloat16", "bfloat16"),
    ("dgeglu_limit_alpha", "dglu", "dgeglu", dict(glu_limit=3.0, glu_alpha=1.702, d_dtype="float32"),
     "bfloat16", "float32"),
    ("dswiglu_fp16_bf16dbias", "dglu", "dswiglu", dict(generate_dbias=True, dbias_dtype="bfloat16",
                                                       d_dtype="float16"), "float16", "float16"),
    ("dsrelu_bias_amax", "dsrelu", None, dict(generate_dbias=True, dbias_dtype="float32", compute_amax=True),
     "bfloat16", "bfloat16"),
    ("dsrelu_tanh_noprob", "dsrelu", None, dict(tanh_clamp_scale=2.0, no_prob=True), "bfloat16", "float32"),
    # FP8 D_row with SFD_row / D_col / SFD_col (norm_const = NORM_CONST); dglu quantizes gate and up blocks apart
    ("dswiglu_e4m3_bias_amax", "dglu", "dswiglu", dict(d_dtype=E4M3, generate_dbias=True, dbias_dtype="float32",
                                                       compute_amax=True), "bfloat16", "bfloat16"),
    ("dgeglu_e4m3_segsfd", "dglu", "dgeglu", dict(d_dtype=E4M3, discrete_col_sfd=True, glu_limit=3.0,
                                                  glu_alpha=1.702), "bfloat16", "float32"),
    ("dsrelu_e5m2_bias_amax", "dsrelu", None, dict(d_dtype=E5M2, generate_dbias=True, dbias_dtype="bfloat16",
                                                   compute_amax=True), "bfloat16", "bfloat16"),
    ("dsrelu_e5m2_segsfd_noprob", "dsrelu", None, dict(d_dtype=E5M2, discrete_col_sfd=True, tanh_clamp_scale=2.0,
                                                       no_prob=True), "float16", "float32"),
    # FP8 saved C (a forward op's e4m3 / e5m2 c_dtype; `inputs` casts random normal data to it): 8-bit C subtiles
    # widened to fp32 exactly in the epilogue, then beta * C as for a 16-bit C
    ("dswiglu_e4m3c_bias_amax", "dglu", "dswiglu", dict(generate_dbias=True, dbias_dtype="float32",
                                                        compute_amax=True), "bfloat16", E4M3),
    ("dsrelu_e5m2c_e4m3", "dsrelu", None, dict(d_dtype=E4M3, generate_dbias=True, dbias_dtype="float32"),
     "bfloat16", E5M2),
    ("dgpt_oss_swiglu_bias_amax", "dglu", "dgpt_oss_swiglu", dict(generate_dbias=True, dbias_dtype="float32",
                                                                  compute_amax=True), "bfloat16", "bfloat16"),
    # C exactly at the clamp bounds and one float32 step beyond (beta = 1): the derivative's pass-through there
    ("dgpt_oss_swiglu_clamp_edges", "dglu", "dgpt_oss_swiglu", dict(glu_limit=1.5, glu_alpha=1.2, d_dtype="float32",
                                                                    clamp_edges=1.5), "bfloat16", "float32"),
]


def inputs(case, pattern: str = "empty_and_tail", seed: int = 0):
    _, op, _, options, ab, c_dtype = case
    width = 2 * I if op == "dglu" else I
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = dict(
        a=jax.random.normal(keys[0], (M, H)).astype(ab),
        b=(jax.random.normal(keys[1], (L, I, H)) / 8).astype(ab),
        c=(2.0 * jax.random.normal(keys[2], (M, width))).astype(c_dtype),
        prob=jax.random.uniform(keys[3], (M,), minval=0.1, maxval=1.0),
        alpha=jax.random.uniform(keys[4], (L,), minval=0.5, maxval=2.0),
        beta=jax.random.uniform(keys[5], (L,), minval=0.5, maxval=1.5),
        offsets=jnp.asarray(PATTERNS[pattern], jnp.int32),
        norm_const=jnp.asarray([NORM_CONST], jnp.float32),
    )
    if "clamp_edges" in options:   # every 3rd value of C at +-limit or one float32 step beyond it, beta = 1
        lim = jnp.float32(options["clamp_edges"])
        edges = jnp.asarray([lim, -lim, jnp.nextafter(lim, jnp.inf), jnp.nextafter(-lim, -jnp.inf)], c_dtype)
        flat = x["c"].reshape(-1)
        picks = jnp.arange(0, flat.size, 3)
        x["c"] = flat.at[picks].set(edges[picks % 4]).reshape(x["c"].shape)
        x["beta"] = jnp.ones((L,), jnp.float32)
    return x


def call(case, x):
    _, op, act, options, _, _ = case
    options = dict(options)
    options.pop("clamp_edges", None)
    prob = None if options.pop("no_prob", False) else x["prob"]
    kw = dict(padded_offsets=x["offsets"], alpha_tensor=x["alpha"], beta_tensor=x["beta"], prob_tensor=prob,
              **options)
    if options.get("d_dtype") in FP8:
        kw["norm_const_tensor"] = x["norm_const"]
    if op == "dglu":
        return cmj.grouped_gemm_dglu(x["a"], x["b"], x["c"], act_func=act, **kw)
    return cmj.grouped_gemm_dsrelu(x["a"], x["b"], x["c"], **kw)


def bundle_items():
    return aot.lowering_items(CASES, inputs, call)
