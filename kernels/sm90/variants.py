"""The default variant set of the sm90 kernels (what `python -m cudnn_moe_jax.aot build` compiles by default and
what tests/test_kernels_compile.py checks): bf16/fp16 x {quant, srelu, swiglu, geglu} x {bias, no bias}, with a
representative spread of C/D dtypes, on the named benchmark shapes. Pure Python (no cutlass import).
"""

from __future__ import annotations

import itertools

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem

from .config import default_config

# name: (m, N, K, L): fc1 = SwiGLU FC1 (N interleaves gate/up), fc2 = FC2 (quant), small = many small experts
SHAPES = {
    "fc1": (16384, 4096, 7168, 8),
    "fc2": (16384, 7168, 2048, 8),
    "small": (16384, 1536, 2048, 64),
}
INPUT_NAMES = ("a", "b", "padded_offsets", "alpha", "prob", "bias")


def epilogue_variants(ab_dtype: str):
    """(op, Epilogue) pairs: every fusion with and without bias; the C/D dtypes rotate through bf16/fp16/fp32."""
    half = ab_dtype
    out = []
    for act, bias in itertools.product(("quant", "srelu", "swiglu", "geglu"), (False, True)):
        bias_dtype = ("float32" if act in ("srelu", "geglu") else half) if bias else None
        if act == "quant":
            out.append(("quant", Epilogue(act=None, has_bias=bias, bias_dtype=bias_dtype, d_dtype=half,
                                          compute_amax=True)))
            if not bias:
                out.append(("quant", Epilogue(act=None, d_dtype="float32", compute_amax=False)))
        elif act == "srelu":
            out.append(("srelu", Epilogue(act="srelu", has_bias=bias, bias_dtype=bias_dtype, c_dtype=half,
                                          d_dtype=half, compute_amax=True)))
            if not bias:
                out.append(("srelu", Epilogue(act="srelu", c_dtype="float32", d_dtype=half, tanh_clamp_scale=4.0,
                                              compute_amax=True)))
        else:
            out.append(("glu", Epilogue(act=act, has_bias=bias, bias_dtype=bias_dtype, c_dtype=half, d_dtype=half,
                                        compute_amax=True)))
            if not bias:
                out.append(("glu", Epilogue(act=act, c_dtype=None, d_dtype="float32", glu_limit=7.0,
                                            glu_alpha=1.702 if act == "swiglu" else None, compute_amax=False)))
    return out


def problems(shape=(2048, 512, 256, 4), ab_dtypes=("bfloat16", "float16")):
    m, n, k, groups = shape
    return [GroupedGemmProblem(op=op, m=m, n=n, k=k, num_groups=groups, ab_dtype=ab, epilogue=epi)
            for ab in ab_dtypes for op, epi in epilogue_variants(ab)]


def input_avals(problem):
    """{name: ShapeDtypeStruct} of the present inputs, in launcher order."""
    import jax
    import jax.numpy as jnp

    m, n, k, L = problem.m, problem.n, problem.k, problem.num_groups
    epi = problem.epilogue
    avals = {
        "a": jax.ShapeDtypeStruct((m, k), jnp.dtype(problem.ab_dtype)),
        "b": jax.ShapeDtypeStruct((L, n, k), jnp.dtype(problem.ab_dtype)),
        "padded_offsets": jax.ShapeDtypeStruct((L,), jnp.int32),
        "alpha": jax.ShapeDtypeStruct((L,), jnp.float32),
    }
    if epi.has_prob:
        avals["prob"] = jax.ShapeDtypeStruct((m,), jnp.float32)
    if epi.has_bias:
        avals["bias"] = jax.ShapeDtypeStruct((L, n), jnp.dtype(epi.bias_dtype))
    return avals


def default_variants(shape_names=tuple(SHAPES)):
    """(problem, config, {input name: aval}) for the aot bundle: every epilogue variant on the named shapes."""
    items = []
    for name in shape_names:
        for p in problems(SHAPES[name]):
            items.append((p, default_config(p), input_avals(p)))
    return items
