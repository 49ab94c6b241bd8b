"""The benchmark's calls of the public ops (what a user runs), and the kernel bundle they need.

Each named shape (cudnn_moe_jax.shapes) with its fusion: bf16 inputs (SwiGLU C + D + amax on fc1 / small, plain
D = prob * alpha * acc + amax on fc2), and MXFP8 inputs with bf16 D or FP8 D (+ D_col, SFD_row, SFD_col,
norm_const). The calls take positional arrays in one fixed order, so the benchmark times them beside its peers
(and, in the lab, beside exported kernel modules with the same order):

    bf16:   fn(a, b, padded_offsets, alpha, prob)
    MXFP8:  fn(a, b, sfa, sfb, padded_offsets, alpha, prob[, norm_const])

On a GPU machine without the CuTe DSL compiler the kernels come from a prebuilt bundle, built elsewhere with

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants benchmarks.bench_cases:bundle_items
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax.formats import E4M3, sf_physical_shape
from cudnn_moe_jax.shapes import FUSION, SHAPES

# MXFP8 output variants: label -> FP8 D (else bf16 D)
MXFP8_OUTPUTS = {"bf16d": False, "fp8d": True}


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


def bf16_avals(shape: str) -> tuple:
    m, n, k, groups = SHAPES[shape]
    sds = jax.ShapeDtypeStruct
    return (sds((m, k), jnp.bfloat16), sds((groups, n, k), jnp.bfloat16), sds((groups,), jnp.int32),
            sds((groups,), jnp.float32), sds((m,), jnp.float32))


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
    return items
