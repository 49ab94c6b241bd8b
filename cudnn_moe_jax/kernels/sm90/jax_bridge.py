"""How the sm90 kernel meets `cutlass.jax.cutlass_call`: tensor specs, output shapes, a ready-made call.

Canonical JAX arrays (NOTES.md): a (m, K), b (L, N, K), [MXFP8: sfa (1, m/128, Kb, 32, 4, 4), sfb (L, cdiv(N,128),
Kb, 32, 4, 4) uint8], padded_offsets (L,) int32, alpha (L,) f32, prob (m,) f32, bias (L, N), [FP8 D: norm_const (1,)
f32]; outputs c (m, N), d (m, N_out), [FP8 D: d_col (m, N_out)], amax (L, 1) f32, [FP8 D: sfd_row (1, m/128,
cdiv(N_out/32, 4), 32, 4, 4), sfd_col (1, cdiv(N_out,128), m/128, 32, 4, 4) or flat per-expert segments]. Every array is row-major; B is presented to the
kernel as (N, K, L) through `mode` (no copy). Tensors whose shape involves `m` are dynamic with `m % 256 == 0`
declared, so one compiled module serves every `m` (and `jax.export` with a symbolic `m` works); likewise wgrad's
A (m_w, T) / B (n_w, T) with `T % 8 == 0`; the others are static.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from cutlass.jax import TensorSpec, cutlass_call

from cudnn_moe_jax._problem import GROUP_ALIGN as M_ALIGN
from cudnn_moe_jax._problem import TOKEN_ALIGN, output_specs

from .config import supports
from .gemm import GroupedGemmSm90
from .operands import DGRAD_OPS, dgrad_kernel_shape_dtypes, input_output_aliases, launcher_operands


def _spec(problem, name: str, kind: str) -> TensorSpec:
    if kind == "tokens":  # wgrad (rows, T), T dynamic; token-major ("m" / "n"): rows contiguous, as stored
        token_major = (problem.a_major, problem.b_major)[name == "b"] != "k"
        rows = problem.m if name == "a" else problem.n
        return TensorSpec(layout=(0, 1) if token_major else None, divisibility=(rows, TOKEN_ALIGN))
    if kind == "weights" and problem.b_major == "n":
        return TensorSpec(mode=(1, 2, 0), static=True, layout=(2, 0, 1))  # (L, N, K) with N contiguous
    if kind == "rows":  # (m, cols): m dynamic
        cols = {"a": problem.k, "c": problem.n_out if problem.op in DGRAD_OPS else problem.n}.get(name, problem.n_out)
        return TensorSpec(divisibility=(M_ALIGN, cols))
    if kind == "weights":
        return TensorSpec(mode=(1, 2, 0), static=True)  # B (L, N, K) -> (N, K, L)
    if kind == "sf_rows":
        return TensorSpec(divisibility=(1, M_ALIGN // 128, 1, 32, 4, 4))  # m/128 row blocks (dynamic)
    if kind == "sf_cols":
        return TensorSpec(divisibility=(1, 1, M_ALIGN // 128, 32, 4, 4))
    if kind == "sf_segments":
        return TensorSpec(divisibility=(512,))
    if kind == "m_vector":
        return TensorSpec(divisibility=(M_ALIGN,))
    if kind == "tiles_by_m":
        return TensorSpec(divisibility=(1, M_ALIGN))
    if kind == "row_tiles":
        return TensorSpec(divisibility=(M_ALIGN // 128, problem.n_out))
    assert kind == "static", kind
    return TensorSpec(static=True)


def tensor_specs(problem):
    """(input_spec, output_spec) lists for the present tensors, in launcher order (`operands.launcher_operands`)."""
    ins, outs = launcher_operands(problem)
    return [_spec(problem, *x) for x in ins], [_spec(problem, *x) for x in outs]


def output_shape_dtypes(problem, m):
    """ShapeDtypeStructs of the present outputs for `m` rows (`m` may be symbolic; m % 256 == 0), in launcher
    order c?, d, d_col?, amax?, sfd_row?, sfd_col? = `_problem.output_specs` order (the one shape table)."""
    specs = output_specs(dataclasses.replace(problem, m=m))
    return [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in
            (v for v in specs.values() if v is not None)]


def launch_shape_dtypes(problem, config, m):
    """The launch's output ShapeDtypeStructs: dgrad's partial sums, else the op's outputs (wgrad: W (L, m_w, n_w),
    whose m is the static weight rows A's first axis holds)."""
    if problem.op in DGRAD_OPS:
        return dgrad_kernel_shape_dtypes(problem, config, m)
    return output_shape_dtypes(problem, m)


def make_call(problem, config=None, kernel_class=GroupedGemmSm90):
    """A function `(a, b, [sfa, sfb], padded_offsets, alpha, [prob], [bias], [norm_const]) -> tuple(c?, d,
    d_col?, amax?, sfd_row?, sfd_col?)` for use under jit."""
    reason = supports(problem)
    if reason is not None:
        raise NotImplementedError(reason)
    kernel = kernel_class(problem, config)
    ins, outs = tensor_specs(problem)

    def call(*arrays):
        m = arrays[0].shape[0]
        fn = cutlass_call(
            kernel,
            output_shape_dtype=tuple(launch_shape_dtypes(problem, kernel.config, m)),
            input_spec=tuple(ins),
            output_spec=tuple(outs),
            input_output_aliases=input_output_aliases(problem),
            compile_key=kernel.cache_key,
        )
        return fn(*arrays)

    call.kernel = kernel
    return call
