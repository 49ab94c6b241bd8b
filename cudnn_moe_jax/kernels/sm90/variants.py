"""The default variant set of the sm90 kernels (what `python -m cudnn_moe_jax.aot build` compiles by default and
what tests/test_kernels_compile.py checks): bf16/fp16 x {quant, srelu, swiglu, geglu} x {bias, no bias}, with a
representative spread of C/D dtypes, plus block-scaled sets (MXFP8, NVFP4, MXFP4), on the named benchmark shapes.
Pure Python (no cutlass import).
"""

from __future__ import annotations

import itertools

from cudnn_moe_jax import operands as table
from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.formats import E4M3, E5M2, E8M0
from cudnn_moe_jax.shapes import SHAPES  # name: (m, N, K, L)

from .config import default_config

# The forward ops' input names in binding order (the operand table's).
INPUT_NAMES = table.input_order("glu")
E2M1 = "float4_e2m1fn"


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


def mxfp8_epilogue_variants():
    """(ab_dtype, op, Epilogue) of the MXFP8 set: each fusion with bf16 and FP8 D (SFD_row/D_col/SFD_col, both
    SFD_col layouts), e4m3 and e5m2 inputs, FP8 / half / fp32 C, bias and GLU options."""
    bf, f16, f32 = "bfloat16", "float16", "float32"
    fp8d = dict(generate_sfd=True, compute_amax=False)
    return [
        (E4M3, "glu", Epilogue(act="swiglu", c_dtype=bf, d_dtype=bf, compute_amax=True)),
        (E4M3, "glu", Epilogue(act="swiglu", c_dtype=bf, d_dtype=E4M3, **fp8d)),
        (E4M3, "glu", Epilogue(act="geglu", has_bias=True, bias_dtype=f32, c_dtype=E4M3, d_dtype=E4M3,
                               discrete_col_sfd=True, glu_limit=7.0, **fp8d)),
        (E5M2, "glu", Epilogue(act="swiglu", has_bias=True, bias_dtype=bf, c_dtype=f32, d_dtype=f16,
                               glu_alpha=1.702, compute_amax=True)),
        (E4M3, "quant", Epilogue(d_dtype=bf, compute_amax=True)),
        (E4M3, "quant", Epilogue(d_dtype=E4M3, has_bias=True, bias_dtype=bf, discrete_col_sfd=True, **fp8d)),
        (E5M2, "quant", Epilogue(d_dtype=E5M2, **fp8d)),
        (E5M2, "srelu", Epilogue(act="srelu", c_dtype=E5M2, d_dtype=E4M3, **fp8d)),
        (E4M3, "srelu", Epilogue(act="srelu", has_bias=True, bias_dtype=f16, c_dtype=bf, d_dtype=f32,
                                 tanh_clamp_scale=4.0)),
    ]


def fp4_epilogue_variants():
    """(sf_dtype, vec, op, Epilogue) of the FP4 set (NVFP4: e4m3 scales, vec 16; MXFP4: e8m0, vec 32; NVFP4 with
    e8m0 scales): each fusion, bf16 and FP8 D, bias and GLU options."""
    bf, f32 = "bfloat16", "float32"
    fp8d = dict(generate_sfd=True, compute_amax=False)
    return [
        (E4M3, 16, "glu", Epilogue(act="swiglu", c_dtype=bf, d_dtype=bf, compute_amax=True)),
        (E4M3, 16, "glu", Epilogue(act="geglu", has_bias=True, bias_dtype=f32, c_dtype=E4M3, d_dtype=E4M3,
                                   glu_limit=7.0, **fp8d)),
        (E4M3, 16, "quant", Epilogue(d_dtype=bf, compute_amax=True)),
        (E8M0, 32, "glu", Epilogue(act="swiglu", c_dtype=bf, d_dtype=E4M3, discrete_col_sfd=True, **fp8d)),
        (E8M0, 32, "srelu", Epilogue(act="srelu", has_bias=True, bias_dtype=bf, c_dtype=f32, d_dtype=bf,
                                     tanh_clamp_scale=4.0, compute_amax=True)),
        (E8M0, 16, "quant", Epilogue(d_dtype=E5M2, has_bias=True, bias_dtype=bf, **fp8d)),
    ]


def problems(shape=(2048, 512, 256, 4), ab_dtypes=("bfloat16", "float16"), mxfp8=True, fp4=True):
    m, n, k, groups = shape
    out = [GroupedGemmProblem(op=op, m=m, n=n, k=k, num_groups=groups, ab_dtype=ab, epilogue=epi)
           for ab in ab_dtypes for op, epi in epilogue_variants(ab)]
    if mxfp8:
        out += [GroupedGemmProblem(op=op, m=m, n=n, k=k, num_groups=groups, ab_dtype=ab, sf_dtype=E8M0,
                                   sf_vec_size=32, epilogue=epi) for ab, op, epi in mxfp8_epilogue_variants()]
    if fp4:
        out += [GroupedGemmProblem(op=op, m=m, n=n, k=k, num_groups=groups, ab_dtype=E2M1, sf_dtype=sf,
                                   sf_vec_size=vec, epilogue=epi) for sf, vec, op, epi in fp4_epilogue_variants()]
    return out


def input_avals(problem):
    """{name: ShapeDtypeStruct} of the present inputs, in launcher order (the operand table's)."""
    import jax

    return {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in table.input_specs(problem).items()}


def symbolic_avals(problem, m, rows=None):
    """input_avals with the dynamic extent `m` (symbolic under jax.export): the row count (m % 256 == 0), for wgrad
    the token count T (T % 8 == 0); the axes of `operands.dynamic_axes`. `rows` ({"a_rows" / "b_rows": size},
    symbolic too; None: the problem's): a gathered operand's own row / token count, on the axes of
    `operands.gathered_axes`."""
    _, axes = table.dynamic_axes(problem)
    gathered = {k: v for k, v in table.gathered_axes(problem).items() if rows and v[1] in rows}
    out = {}
    for name, a in input_avals(problem).items():
        if name in axes:
            axis, per = axes[name]
            a = table.with_axis_size(a, axis, table.axis_extent(per, m))
        elif name in gathered:
            axis, field = gathered[name]
            a = table.with_axis_size(a, axis, rows[field])
        out[name] = a
    return out


def default_variants(shape_names=tuple(SHAPES)):
    """(problem, config, {input name: aval}) for the aot bundle: every epilogue variant on the named shapes."""
    items = []
    for name in shape_names:
        for p in problems(SHAPES[name]):
            if p.op in ("glu", "srelu") and p.epilogue.c_dtype is None:
                continue  # kernel-level variant without C (compile-tested): the public ops always produce C
            items.append((p, default_config(p), input_avals(p)))
    return items
