"""Ops with block-scaled inputs (NVFP4, MXFP4, NVFP4 with e8m0 scales, MXFP8 e4m3 / e5m2; forward and dglu /
dsrelu) through the public ops on the dequantizing kernel (kernels/sm90/mainloop_dequant.py): the cases of the GPU
suite (tests/gpu/test_blockscaled_gpu.py; its inputs and checks against the float64 oracle:
tests/gpu/blockscaled_checks.py), the calls, and the bundle items that record their kernel modules on the CPU
machine (lowered at the inputs' shapes and dtypes, `input_avals`):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.blockscaled_cases:bundle_items

Input modes ("exact", "adversarial", "specials") and the tolerance: tests/gpu/blockscaled_checks.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax.formats import exact_in_float16, sf_physical_shape
from lab import harness

E4M3, E5M2, E2M1, E8M0 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu"
FP8 = (E4M3, E5M2)
FORMATS = {"nvfp4": (E2M1, E4M3, 16), "nvfp4e8": (E2M1, E8M0, 16), "mxfp4": (E2M1, E8M0, 32),
           "mxfp8": (E4M3, E8M0, 32), "mxfp8e5": (E5M2, E8M0, 32)}
# weight-only quantization: a bf16 ("w_") or fp16 ("w16_") A (no sfa) with block-scaled B of the named format
WEIGHT_ONLY = {"w_nvfp4": "nvfp4", "w_mxfp4": "mxfp4", "w_mxfp8": "mxfp8",
               "w16_nvfp4": "nvfp4", "w16_nvfp4e8": "nvfp4e8", "w16_mxfp4": "mxfp4", "w16_mxfp8": "mxfp8"}
FORMATS.update({w: FORMATS[f] for w, f in WEIGHT_ONLY.items()})
HALF = "bf16"   # bf16 A and B (the bf16 A of weight-only for both; no scale factors): the discrete-weights cases
FORMATS[HALF] = ("bfloat16", None, None)
M, L = 2048, 4
PATTERNS = {
    "empty_and_tail": (512, 512, 1024, 1792),   # expert 1 empty, rows 1792.. outside every group (m > valid_m)
    "unsanitized": (700, 300, 9999, -5),         # -> ends 512, 512, 2048, 2048
    # 300 experts (the pattern sets L), four of them non-empty, rows 1792.. outside (lab/discrete_cases.py)
    "many_experts": tuple(256 * ((e >= 7) + 2 * (e >= 100) + (e >= 257) + 3 * (e >= 299)) for e in range(300)),
    # one expert of 1792 rows in m 2048: rows per expert past _dequant_first.DEQUANT_FIRST_ROWS, so the public op
    # dequantizes in XLA and runs the bf16 kernel (cudnn_moe_jax._dequant_first; not with an fp16 A)
    "dequant_first": (1792,),
}
MODES = ("exact", "adversarial", "specials")
# (pattern, mode) each case runs in the GPU test: every mode, every routing pattern (~3 s a run)
RUNS = (("empty_and_tail", "exact"), ("unsanitized", "adversarial"), ("empty_and_tail", "specials"),
        ("dequant_first", "exact"), ("dequant_first", "specials"))
NORM_CONST = 0.01   # FP8 D's norm_const (tests/gpu/mxfp8_checks.py's checks assume it)
OPS = {"quant": cmj.grouped_gemm_quant, "srelu": cmj.grouped_gemm_srelu, "glu": cmj.grouped_gemm_glu}
BF, F16, F32 = "bfloat16", "float16", "float32"

# (name, op, format, K, N, options): every forward epilogue kind over the formats; K / N tails (K 208 / 224: a
# partial k-tile and SF atom, N 384 / 320: a partial 256-column tile whose B rows past N are masked)
CASES = [
    ("nvfp4_quant_bias", "quant", "nvfp4", 256, 512, dict(bias=BF, d_dtype=BF)),
    ("nvfp4_swiglu_bias", "glu", "nvfp4", 256, 512, dict(bias=F32, act_func="swiglu", c_dtype=BF, d_dtype=BF)),
    ("nvfp4_geglu_fp8_seg", "glu", "nvfp4", 256, 512, dict(act_func="geglu", glu_limit=3.0, glu_alpha=1.702,
                                                           c_dtype=E4M3, d_dtype=E4M3, discrete_col_sfd=True)),
    ("mxfp4_srelu_tanh_k224", "srelu", "mxfp4", 224, 512, dict(tanh_clamp_scale=2.0, c_dtype=F32, d_dtype=BF,
                                                               no_prob=True)),
    ("mxfp4_quant_e5m2d_n384", "quant", "mxfp4", 256, 384, dict(bias=BF, d_dtype=E5M2)),
    ("nvfp4e8_swiglu_n320", "glu", "nvfp4e8", 256, 320, dict(act_func="swiglu", c_dtype=BF, d_dtype=BF)),
    ("mxfp8_swiglu", "glu", "mxfp8", 256, 512, dict(act_func="swiglu", c_dtype=BF, d_dtype=BF)),
    ("mxfp8_quant_f32_k208_n384", "quant", "mxfp8", 208, 384, dict(d_dtype=F32)),
    ("mxfp8_srelu_fp8_bias", "srelu", "mxfp8", 256, 512, dict(bias=BF, c_dtype=E4M3, d_dtype=E4M3)),
    ("mxfp8e5_geglu_f16", "glu", "mxfp8e5", 256, 512, dict(act_func="geglu", bias=F16, c_dtype=F32, d_dtype=F16)),
    ("mxfp8e5_quant_fp8_seg", "quant", "mxfp8e5", 256, 512, dict(d_dtype=E4M3, discrete_col_sfd=True)),
    # an N-major block-scaled B (b_major="n"): read K-major after XLA's transpose (config.read_problem)
    ("nvfp4_swiglu_nmajor", "glu", "nvfp4", 256, 512, dict(act_func="swiglu", c_dtype=BF, d_dtype=BF, b_major="n")),
    # weight-only: bf16 A, block-scaled B
    ("w_nvfp4_swiglu", "glu", "w_nvfp4", 256, 512, dict(act_func="swiglu", c_dtype=BF, d_dtype=BF)),
    # (one epilogue buffer by default: config.default_config) with 128-row groups: 1x1 clusters
    ("w_mxfp8_swiglu_m128", "glu", "w_mxfp8", 256, 512, dict(act_func="swiglu", c_dtype=BF, d_dtype=BF,
                                                             m_aligned=128)),
    ("w_mxfp8_quant_fp8d_k208_n384", "quant", "w_mxfp8", 208, 384, dict(bias=BF, d_dtype=E4M3)),
    ("w_mxfp4_srelu_f32c", "srelu", "w_mxfp4", 256, 512, dict(c_dtype=F32, d_dtype=BF)),
    # weight-only with an fp16 A (split into two exact bf16 parts in the kernel)
    ("w16_nvfp4_swiglu", "glu", "w16_nvfp4", 256, 512, dict(act_func="swiglu", c_dtype=BF, d_dtype=BF)),
    ("w16_mxfp8_quant_fp8d_k208_n384", "quant", "w16_mxfp8", 208, 384, dict(bias=BF, d_dtype=E4M3)),
    ("w16_mxfp4_srelu_f32c", "srelu", "w16_mxfp4", 256, 512, dict(c_dtype=F32, d_dtype=F32)),
]
# (name, op, format, K, N, options) of the backward ops with block-scaled dY (M, K) and W2^T (L, N, K): the dgrad
# epilogue as for bf16 inputs (saved C (M, 2N) / (M, N) in c_dtype, beta, dprob, dbias, amax, FP8 D_row)
DGRAD_CASES = [
    ("nvfp4_dswiglu_bias_amax", "dglu", "nvfp4", 256, 512, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF,
                                                                generate_dbias=True, dbias_dtype=F32)),
    ("mxfp8_dgeglu_f32", "dglu", "mxfp8", 256, 512, dict(act_func="dgeglu", glu_limit=3.0, glu_alpha=1.702,
                                                         c_dtype=F32, d_dtype=F32)),
    ("mxfp4_dsrelu_e4m3d_k224", "dsrelu", "mxfp4", 224, 512, dict(c_dtype=BF, d_dtype=E4M3, generate_dbias=True,
                                                                  dbias_dtype=BF)),
    ("mxfp8e5_dsrelu_tanh_seg", "dsrelu", "mxfp8e5", 256, 384, dict(tanh_clamp_scale=2.0, c_dtype=E4M3,
                                                                    d_dtype=E5M2, discrete_col_sfd=True,
                                                                    no_prob=True)),
    ("w_nvfp4_dswiglu", "dglu", "w_nvfp4", 256, 512, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF)),
    # D_row stored from registers (the FP4 dglu; the MXFP8 dglu with dbias) with an N tail: 16-byte row chunks past
    # n_out not stored
    ("nvfp4_dswiglu_n384", "dglu", "nvfp4", 256, 384, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF)),
    ("mxfp8_dswiglu_dbias_n384", "dglu", "mxfp8", 256, 384, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF,
                                                                 generate_dbias=True, dbias_dtype=F32)),
    ("w16_nvfp4e8_dswiglu", "dglu", "w16_nvfp4e8", 256, 512, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF,
                                                                  generate_dbias=True, dbias_dtype=F32)),
    ("w16_nvfp4_dswiglu", "dglu", "w16_nvfp4", 256, 512, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF,
                                                              generate_dbias=True, dbias_dtype=F32)),
]
# 128-row groups run 1 x 1 clusters (no cluster-split B), where the consumer warps convert 24 of B's 32 passes a
# stage, each warp three in straight-line code, or all of them (FP4 data: a row a lane; FP8 weights: passes)
# (kernels/sm90/mainloop_dequant.py): forward and dgrad, FP4 and FP8, K and N tails
CASES_1X1 = [
    ("nvfp4_swiglu_1x1", "glu", "nvfp4", 256, 512, dict(act_func="swiglu", c_dtype=BF, d_dtype=BF, m_aligned=128)),
    ("mxfp8_quant_fp8d_1x1", "quant", "mxfp8", 256, 512, dict(bias=BF, d_dtype=E4M3, m_aligned=128)),
    ("mxfp4_srelu_1x1_k224_n384", "srelu", "mxfp4", 224, 384, dict(c_dtype=BF, d_dtype=BF, m_aligned=128)),
    ("w_nvfp4_swiglu_1x1", "glu", "w_nvfp4", 256, 512, dict(act_func="swiglu", c_dtype=BF, d_dtype=BF,
                                                             m_aligned=128)),
    ("nvfp4_dswiglu_1x1", "dglu", "nvfp4", 256, 512, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF,
                                                           m_aligned=128)),
    # FP8 weights: every pass on the consumers, the narrow stage released early (K and N tails); the dgrad's two
    # stages keep 24 passes
    ("w_mxfp8_quant_fp8d_1x1_k208_n384", "quant", "w_mxfp8", 208, 384, dict(bias=BF, d_dtype=E4M3, m_aligned=128)),
    ("w_mxfp8_dswiglu_1x1", "dglu", "w_mxfp8", 256, 512, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF,
                                                               m_aligned=128)),
]
DGRAD_OPS = {"dglu": cmj.grouped_gemm_dglu, "dsrelu": cmj.grouped_gemm_dsrelu}
# outputs computed from the accumulator without an activation: exact on "exact" inputs
EXACT_KEYS = {"quant": ("d_tensor", "d_col_tensor", "amax_tensor", "sfd_row_tensor", "sfd_col_tensor"),
              "srelu": ("c_tensor",), "glu": ("c_tensor",)}


def half_a(label: str):
    """A's 16-bit dtype under a weight-only label: fp16 for "w16_...", else bf16 (the one home of that rule; the
    benchmarks' labels follow it too)."""
    return jnp.float16 if label.startswith("w16_") else jnp.bfloat16


def a_half(fmt: str):
    """The 16-bit dtype of a weight-only format's A (None: A is block-scaled like B)."""
    return half_a(fmt) if fmt in WEIGHT_ONLY else None


def input_avals(case, pattern: str = "empty_and_tail", discrete: bool = False) -> dict:
    """{input: ShapeDtypeStruct (None: absent)} of a case, as tests/gpu/blockscaled_checks.inputs makes them (the
    pattern sets the expert count L): packed FP4 codes as uint8 (rows, K/2), FP8 codes typed, a 16-bit A for the
    weight-only formats (`a_half`; bf16 A and B for HALF), the MMA-tiled scale bytes (e4m3 scales typed, e8m0 as
    uint8), the saved C and beta of the backward ops; `discrete`: also the per-expert lists of `expert_lists`."""
    _, op, fmt, k, n, options = case
    data, sf, vec = FORMATS[fmt]
    L = len(PATTERNS[pattern])
    sds = jax.ShapeDtypeStruct
    code = (lambda *s: sds(s[:-1] + (s[-1] // 2,), jnp.uint8)) if data == E2M1 else (lambda *s: sds(s, data))
    sf_type = jnp.float8_e4m3fn if sf == E4M3 else jnp.uint8
    scaled_a = sf is not None and fmt not in WEIGHT_ONLY
    x = dict(a=sds((M, k), a_half(fmt)) if fmt in WEIGHT_ONLY else code(M, k), b=code(L, n, k),
             sfa=sds(sf_physical_shape(M, k, vec), sf_type) if scaled_a else None,
             sfb=None if sf is None else sds(sf_physical_shape(n, k, vec, L), sf_type), alpha=sds((L,), jnp.float32),
             prob=sds((M,), jnp.float32), offsets=sds((L,), jnp.int32), norm_const=sds((1,), jnp.float32),
             bias=sds((L, n), options.get("bias") or F32))
    if op in DGRAD_OPS:
        x["c"] = sds((M, 2 * n if op == "dglu" else n), options["c_dtype"])
        x["beta"] = sds((L,), jnp.float32)
    if discrete:
        x["bs"] = [sds(x["b"].shape[1:], x["b"].dtype) for _ in range(L)]
        x["sfbs"] = None if sf is None else [sds((1,) + x["sfb"].shape[1:], sf_type) for _ in range(L)]
    return x


def expert_lists(x):
    """x with every expert's weight (and SF buffer) as its own array, for a discrete-weights call."""
    sfb = x["sfb"]
    return dict(x, bs=[x["b"][e] for e in range(x["b"].shape[0])],
                sfbs=None if sfb is None else [sfb[e:e + 1] for e in range(sfb.shape[0])])


def call(case, x, discrete: bool = False):
    """The case's public op call; `discrete`: the weights as per-expert arrays (b_tensors / sfb_tensors, from
    `expert_lists`) instead of the stacked b_tensor / sfb_tensor."""
    _, op, fmt, _, _, options = case
    options = dict(options)
    weights = (dict(b_tensors=x["bs"], sfb_tensors=x["sfbs"]) if discrete
               else dict(b_tensor=x["b"], sfb_tensor=x["sfb"]))
    if op in DGRAD_OPS:
        prob = None if options.pop("no_prob", False) else x["prob"]
        options.pop("c_dtype")
        kw = dict(padded_offsets=x["offsets"], alpha_tensor=x["alpha"], beta_tensor=x["beta"], prob_tensor=prob,
                  sf_vec_size=FORMATS[fmt][2], **options)
        if options.get("d_dtype") in FP8:
            kw["norm_const_tensor"] = x["norm_const"]
        return DGRAD_OPS[op](x["a"], c_tensor=x["c"], sfa_tensor=x["sfa"], **weights, **kw)
    bias = x["bias"] if options.pop("bias", None) else None
    prob = None if options.pop("no_prob", False) else x["prob"]
    kw = dict(padded_offsets=x["offsets"], alpha_tensor=x["alpha"], prob_tensor=prob, bias_tensor=bias,
              sf_vec_size=FORMATS[fmt][2], **options)
    if options.get("d_dtype") in FP8:
        kw["norm_const_tensor"] = x["norm_const"]
    return OPS[op](x["a"], sfa_tensor=x["sfa"], **weights, **kw)


ALL_CASES = CASES + DGRAD_CASES + CASES_1X1
# the forward and dgrad cases whose operands the kernel can stage (kernels/sm90/mainloop_staged.py: a block-scaled or
# bf16 A, or an fp16 A beside NVFP4 weights; K-major B), run under harness.block_scaled_route("staged") on the
# multi-expert patterns
STAGED_CASES = [c for c in CASES + DGRAD_CASES if (not c[2].startswith("w16_") or exact_in_float16(*FORMATS[c[2]][:2]))
                and c[5].get("b_major", "k") == "k"]
STAGED_RUNS = (("empty_and_tail", "exact"), ("unsanitized", "adversarial"), ("empty_and_tail", "specials"))


def bundle_items() -> list:
    """Each case's call lowered for CUDA at `input_avals` (aot records the module it asks for), also at the
    dequantize-first pattern (the staged kernels' modules, and the bf16 kernel's for the calls XLA converts), and
    the STAGED_CASES under the staged route."""
    staged = [harness.on_route("staged", item) for item in bundle_items_for(STAGED_CASES)]
    return bundle_items_for(ALL_CASES) + bundle_items_for(ALL_CASES, "dequant_first") + staged


def bundle_items_for(cases, pattern: str = "empty_and_tail", discrete: bool = False) -> list:
    """The cases' calls (`discrete`: with per-expert weights) lowered for CUDA at `input_avals(case, pattern)`."""
    return [functools.partial(lower, case, pattern, discrete) for case in cases]


def lower(case, pattern: str = "empty_and_tail", discrete: bool = False):
    fn = jax.jit(functools.partial(call, case, discrete=discrete))
    return fn.trace(input_avals(case, pattern, discrete)).lower(lowering_platforms=("cuda",))
