"""The benchmark's calls of the public ops (what a user runs), and the kernel bundle they need.

Each named shape (cudnn_moe_jax.shapes) with its fusion: bf16 inputs (SwiGLU C + D + amax on fc1 / small, plain
D = prob * alpha * acc + amax on fc2), and MXFP8 inputs with bf16 D or FP8 D (+ D_col, SFD_row, SFD_col,
norm_const); the format comparison (`block_call`): bf16, MXFP8, NVFP4, MXFP4 inputs on those shapes and on the
memory-bound layers of issue 19 (MEMORY_BOUND); discrete weights (`discrete_call`: the bf16 call with the experts
as L arrays, on DISCRETE_SHAPES); the Hadamard op beside the plain GLU (`hadamard_call`: NVFP4 D, its rowwise /
colwise Hadamard outputs) on fc1 / small. The calls take positional arrays in one fixed order, so the benchmark
times them beside its peers (and, in the lab, beside exported kernel modules with the same order):

    bf16:      fn(a, b, padded_offsets, alpha, prob)
    discrete:  fn(a, (b_0, ..., b_{L-1}), padded_offsets, alpha, prob)
    MXFP8:     fn(a, b, sfa, sfb, padded_offsets, alpha, prob[, norm_const])

On a GPU machine without the CuTe DSL compiler the kernels come from a prebuilt bundle, built elsewhere with

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants benchmarks.bench_cases:bundle_items

(`discrete_bundle_items`: only what `--discrete` needs.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax import formats
from cudnn_moe_jax.formats import E2M1 as FP4
from cudnn_moe_jax.formats import E4M3, sf_physical_shape
from cudnn_moe_jax.shapes import FUSION, SHAPES
from lab.blockscaled_cases import half_a as a_half   # A's dtype under a weight-only label

# MXFP8 output variants: label -> FP8 D (else bf16 D)
MXFP8_OUTPUTS = {"bf16d": False, "fp8d": True}

# Block-scaled input formats of the format comparison (`--formats`): label -> (data dtype, SF dtype, vec), from
# the library's table (formats.BLOCK_FORMATS)
BLOCK_FORMATS = {f: formats.BLOCK_FORMATS[f] for f in ("mxfp8", "nvfp4", "mxfp4")}
# weight-only quantization (bf16 A, block-scaled B): label -> B's format
WEIGHT_ONLY = {"w_nvfp4": "nvfp4", "w_mxfp8": "mxfp8", "w16_nvfp4": "nvfp4"}   # w16: an fp16 A
FORMAT_LABELS = ("bf16",) + tuple(BLOCK_FORMATS) + tuple(WEIGHT_ONLY)
# Shapes of the format comparison besides fc1 / fc2 / small (= FC1 of the first memory-bound layer of issue 19:
# 64 experts x 256 rows, H 2048, I 768): that layer's FC2 and the second layer (128 experts x 128 rows, H 4096,
# I 1024: groups end on multiples of 128, so the calls pass m_aligned=128) -> ((m, N, K, L), (op, act),
# rows/expert)
MEMORY_BOUND = {
    "small_fc2": ((16384, 2048, 768, 64), ("quant", None), 256),
    "e128_fc1": ((16384, 2048, 4096, 128), ("glu", "swiglu"), 128),
    "e128_fc2": ((16384, 4096, 1024, 128), ("quant", None), 128),
}

# Rows per expert between `small` (256) and fc1 (2048) on the two GLU shapes' N and K (`--shapes`, not in the
# default list): where dequantizing in XLA before the bf16 kernel starts to beat the on-chip conversion
# (_dequant_first.DEQUANT_FIRST_ROWS)
ROWS_SWEEP = {f"{base}_r{rows}": ((16384, n, k, 16384 // rows), ("glu", "swiglu"), rows)
              for base, n, k in (("fc1", 4096, 7168), ("small", 1536, 2048)) for rows in (512, 1024, 2048)
              if (base, rows) != ("fc1", 2048)}


def format_shape(shape: str):
    """((m, N, K, L), (op, act), rows per expert) of a format-comparison shape."""
    if shape in MEMORY_BOUND:
        return MEMORY_BOUND[shape]
    if shape in ROWS_SWEEP:
        return ROWS_SWEEP[shape]
    return tuple(SHAPES[shape]), FUSION[shape], SHAPES[shape].m // SHAPES[shape].num_groups


def _call(op: str, act, kw: dict):
    if op == "quant":
        return cmj.grouped_gemm_quant(**kw)
    return cmj.grouped_gemm_glu(act_func=act, **kw)


def bf16_call(shape: str):
    """fn(a, b, padded_offsets, alpha, prob) -> OpResult: the shape's fused op on bf16 inputs, library defaults."""
    op, act = FUSION[shape]

    def fn(a, b, padded_offsets, alpha, prob):
        return _call(op, act, dict(a_tensor=a, b_tensor=b, padded_offsets=padded_offsets, alpha_tensor=alpha,
                                   prob_tensor=prob))

    return fn


def discrete_call(shape: str):
    """fn(a, bs, padded_offsets, alpha, prob) -> OpResult: `bf16_call` with the experts' weights as L separate
    arrays (b_tensors, discrete weights) instead of one stacked (L, N, K) array."""
    op, act = FUSION[shape]

    def fn(a, bs, padded_offsets, alpha, prob):
        return _call(op, act, dict(a_tensor=a, b_tensors=list(bs), padded_offsets=padded_offsets, alpha_tensor=alpha,
                                   prob_tensor=prob))

    return fn


def mxfp8_call(shape: str, fp8_d: bool):
    """fn(a, b, sfa, sfb, padded_offsets, alpha, prob[, norm_const]) -> OpResult: MXFP8 (e4m3 + e8m0 per 32)
    inputs; bf16 D, or e4m3 D with its SFD outputs (then norm_const is the last argument)."""
    op, act = FUSION[shape]

    def fn(a, b, sfa, sfb, padded_offsets, alpha, prob, *norm_const):
        kw = dict(a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb, padded_offsets=padded_offsets,
                  alpha_tensor=alpha, prob_tensor=prob, sf_vec_size=32)
        if fp8_d:
            kw.update(d_dtype=E4M3, norm_const_tensor=norm_const[0])
        return _call(op, act, kw)

    return fn


def block_call(shape: str, fmt: str):
    """fn(a, b, sfa, sfb, padded_offsets, alpha, prob) -> OpResult: the shape's fused op (bf16 D, + C for SwiGLU)
    on inputs of format `fmt` (FORMAT_LABELS): "bf16" (sfa, sfb ignored), block-scaled A and B (BLOCK_FORMATS),
    or a bf16 / fp16 A with block-scaled B (WEIGHT_ONLY; sfa ignored)."""
    _, (op, act), rows = format_shape(shape)

    def fn(a, b, sfa, sfb, padded_offsets, alpha, prob):
        kw = dict(a_tensor=a, b_tensor=b, padded_offsets=padded_offsets, alpha_tensor=alpha, prob_tensor=prob)
        if rows % 256:
            kw["m_aligned"] = rows
        if fmt != "bf16":
            kw.update(sfa_tensor=None if fmt in WEIGHT_ONLY else sfa, sfb_tensor=sfb,
                      sf_vec_size=BLOCK_FORMATS[WEIGHT_ONLY.get(fmt, fmt)][2])
        return _call(op, act, kw)

    return fn


# The Hadamard op beside the plain GLU (`--hadamard`), on the GLU shapes: label -> (op, keyword overrides); every
# call takes (a, b, sfa, sfb, padded_offsets, alpha, prob, norm_const); the NVFP4 outputs use norm_const for both
# encode scales
HADAMARD_SHAPES = ("fc1", "small")
HADAMARD_VARIANTS = {
    "glu": ("glu", {}),                                                    # bf16 D + C + amax
    "glu_fp4d": ("glu", dict(d_dtype=FP4)),                                # MXFP4 D, D_col, SFD_row / SFD_col
    "h_d4": ("hadamard", dict(d_dtype=FP4)),                               # NVFP4 D + sfd, C
    "h_d4_row4": ("hadamard", dict(d_dtype=FP4, rht_mode="rowwise", rht_dtype=FP4)),
    "h_d4_col4": ("hadamard", dict(d_dtype=FP4, rht_mode="colwise")),
    "h_bf16_rowbf16": ("hadamard", dict(rht_mode="rowwise")),             # bf16 D + amax, bf16 Hadamard output
}


def hadamard_call(shape: str, variant: str, fmt: str):
    """fn(a, b, sfa, sfb, padded_offsets, alpha, prob, norm_const) -> OpResult: the GLU shape's SwiGLU as
    `grouped_gemm_glu` or `grouped_gemm_glu_hadamard_quant` (HADAMARD_VARIANTS) on inputs of format `fmt`."""
    op, options = HADAMARD_VARIANTS[variant]

    def fn(a, b, sfa, sfb, padded_offsets, alpha, prob, norm_const):
        kw = dict(a_tensor=a, b_tensor=b, padded_offsets=padded_offsets, alpha_tensor=alpha, prob_tensor=prob,
                  act_func="swiglu", **options)
        if fmt != "bf16":
            kw.update(sfa_tensor=None if fmt in WEIGHT_ONLY else sfa, sfb_tensor=sfb,
                      sf_vec_size=BLOCK_FORMATS[WEIGHT_ONLY.get(fmt, fmt)][2])
        if options.get("d_dtype") == FP4:
            kw["norm_const_tensor"] = norm_const
        if op == "glu":
            return cmj.grouped_gemm_glu(**kw)
        if options.get("rht_dtype") == FP4 or options.get("rht_mode") == "colwise":
            kw["rht_norm_const_tensor"] = norm_const
        return cmj.grouped_gemm_glu_hadamard_quant(**kw)

    return fn


def hadamard_sets(shape: str, fmt: str, count: int) -> list:
    """`count` argument tuples of `hadamard_call(shape, ., fmt)`: operands quantized to `fmt` from N(0, 1) data on
    the device (B scaled by 1/sqrt(K)), a different A per tuple, experts of equal size, uniform prob."""
    import numpy as np

    (m, n, k, L), _, rows = format_shape(shape)
    offsets = jnp.asarray(np.arange(1, L + 1, dtype=np.int32) * rows)
    key = jax.random.PRNGKey(0)
    alpha, prob = jnp.ones((L,), jnp.float32), jax.random.uniform(jax.random.fold_in(key, 2), (m,))
    quant = jax.jit(lambda x: (x.astype(jnp.bfloat16), None))
    if fmt != "bf16":
        data, sf, vec = BLOCK_FORMATS[fmt]
        quant = jax.jit(lambda x: formats.to_block_scaled(x, data, sf, vec))
    b, sfb = quant(jax.random.normal(jax.random.fold_in(key, 1), (L, n, k), jnp.float32) / np.sqrt(k))
    a_sets = [quant(jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.float32)) for i in range(count)]
    return [(a, b, sa, sfb, offsets, alpha, prob, jnp.ones((1,), jnp.float32)) for a, sa in a_sets]


def block_avals(shape: str, fmt: str) -> tuple:
    (m, n, k, groups), _, _ = format_shape(shape)
    sds = jax.ShapeDtypeStruct
    tail = (sds((groups,), jnp.int32), sds((groups,), jnp.float32), sds((m,), jnp.float32))
    if fmt == "bf16":
        return (sds((m, k), jnp.bfloat16), sds((groups, n, k), jnp.bfloat16), None, None) + tail
    data, sf, vec = BLOCK_FORMATS[WEIGHT_ONLY.get(fmt, fmt)]
    dt, kk = (jnp.uint8, k // 2) if data == "float4_e2m1fn" else (jnp.dtype(data), k)
    kb = -(-(-(-k // vec)) // 4)
    sf_dt = jnp.dtype(sf) if sf == E4M3 else jnp.uint8
    a = (sds((m, k), a_half(fmt)), None) if fmt in WEIGHT_ONLY else (sds((m, kk), dt),
                                                                       sds((1, m // 128, kb, 32, 4, 4), sf_dt))
    return (a[0], sds((groups, n, kk), dt), a[1], sds((groups, -(-n // 128), kb, 32, 4, 4), sf_dt)) + tail


def bf16_avals(shape: str) -> tuple:
    m, n, k, groups = SHAPES[shape]
    sds = jax.ShapeDtypeStruct
    return (sds((m, k), jnp.bfloat16), sds((groups, n, k), jnp.bfloat16), sds((groups,), jnp.int32),
            sds((groups,), jnp.float32), sds((m,), jnp.float32))


def discrete_avals(shape: str) -> tuple:
    m, n, k, groups = SHAPES[shape]
    a, _, *tail = bf16_avals(shape)
    return (a, tuple(jax.ShapeDtypeStruct((n, k), jnp.bfloat16) for _ in range(groups)), *tail)


def mxfp8_avals(shape: str, fp8_d: bool) -> tuple:
    m, n, k, groups = SHAPES[shape]
    sds = jax.ShapeDtypeStruct
    avals = (sds((m, k), jnp.float8_e4m3fn), sds((groups, n, k), jnp.float8_e4m3fn),
             sds(sf_physical_shape(m, k, 32), jnp.uint8), sds(sf_physical_shape(n, k, 32, groups), jnp.uint8),
             sds((groups,), jnp.int32), sds((groups,), jnp.float32), sds((m,), jnp.float32))
    return avals + ((sds((1,), jnp.float32),) if fp8_d else ())


def _lower_for_cuda(fn, avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))


def bundle_items() -> list:
    """Callables lowering every benchmark call for cuda: `cudnn_moe_jax.aot build` records the modules they ask
    for (the benchmark's shapes, bf16 and both MXFP8 outputs)."""
    items = [functools.partial(_lower_for_cuda, bf16_call(s), bf16_avals(s)) for s in SHAPES]
    items += [functools.partial(_lower_for_cuda, mxfp8_call(s, fp8), mxfp8_avals(s, fp8))
              for s in SHAPES for fp8 in MXFP8_OUTPUTS.values()]
    return items + format_bundle_items() + discrete_bundle_items()[len(DISCRETE_SHAPES):] + hadamard_bundle_items()


def format_bundle_items(shapes=None, labels=FORMAT_LABELS) -> list:
    """The format comparison's calls (`--formats`) on `shapes` (default FORMAT_SHAPES) in formats `labels`, and
    for the block-scaled ones the route the public op does not take (`other_route`)."""
    from lab import forward_cases

    items = [functools.partial(_lower_for_cuda, block_call(s, f), block_avals(s, f))
             for s in shapes or FORMAT_SHAPES for f in labels]
    for s in shapes or FORMAT_SHAPES:
        for f in labels:
            route = other_route(s, f) if f != "bf16" else None
            if route is not None:
                items.append(forward_cases.lowering_item(route[1], fn=route[2]))
    return items


def other_route(shape: str, fmt: str):
    """(label, problem, jitted fn(a, b, [sfa,] sfb, padded_offsets, alpha, prob)) running a block-scaled format
    call the way its public op does not: `fmt`:on-chip where the op dequantizes first
    (cudnn_moe_jax._dequant_first.dequantize_first), else `fmt`:xla-dequant (XLA's conversion, then the bf16
    kernel); None for an fp16 A beside weights fp16 does not hold exactly (on chip only)."""
    from cudnn_moe_jax._dequant_first import dequantize_first
    from cudnn_moe_jax.operands import has_exact_half
    from lab import bench_kernels, forward_cases

    problem = bench_kernels.format_problem(shape, fmt)
    if not has_exact_half(problem):
        return None
    if dequantize_first(problem):
        return f"{fmt}:on-chip", problem, forward_cases.kernel_fn(problem)
    return f"{fmt}:xla-dequant", problem, forward_cases.dequant_first_fn(problem)


def discrete_bundle_items() -> list:
    """The discrete-weights comparison's modules alone (`--discrete`): the stacked and the discrete bf16 call on
    DISCRETE_SHAPES (stacked first)."""
    return ([functools.partial(_lower_for_cuda, bf16_call(s), bf16_avals(s)) for s in DISCRETE_SHAPES]
            + [functools.partial(_lower_for_cuda, discrete_call(s), discrete_avals(s)) for s in DISCRETE_SHAPES])


def hadamard_bundle_items() -> list:
    """The `--hadamard` benchmark's calls alone (HADAMARD_SHAPES x HADAMARD_VARIANTS x HADAMARD_FORMATS)."""
    return [functools.partial(_lower_for_cuda, hadamard_call(s, v, f),
                              block_avals(s, f) + (jax.ShapeDtypeStruct((1,), jnp.float32),))
            for s in HADAMARD_SHAPES for v in HADAMARD_VARIANTS for f in HADAMARD_FORMATS]


FORMAT_SHAPES = tuple(SHAPES) + tuple(MEMORY_BOUND)
# Shapes of the discrete-weights comparison (`--discrete`: stacked vs per-expert weights, bf16 SwiGLU)
DISCRETE_SHAPES = ("fc1", "small")
HADAMARD_FORMATS = ("nvfp4", "bf16")      # cuDNN's Hadamard op takes FP4 inputs; bf16 beside
