"""How the sm90 kernel meets `cutlass.jax.cutlass_call`: tensor specs, output shapes, a ready-made call.

Canonical JAX arrays (NOTES.md): a (m, K), b (L, N, K), padded_offsets (L,) int32, alpha (L,) f32, prob (m,) f32,
bias (L, N); outputs c (m, N), d (m, N_out), amax (L, 1) f32. Every array is row-major; B is presented to the
kernel as (N, K, L) through `mode` (no copy). Tensors whose shape involves `m` are dynamic with `m % 256 == 0`
declared, so one compiled module serves every `m` (and `jax.export` with a symbolic `m` works); the others are
static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from cutlass.jax import TensorSpec, cutlass_call

from .config import supports
from .gemm import GroupedGemmSm90

M_ALIGN = 256


def _has(problem):
    epi = problem.epilogue
    has_c = epi.c_dtype is not None and problem.op != "quant"
    return epi.has_prob, epi.has_bias, has_c, epi.compute_amax


def tensor_specs(problem):
    """(input_spec, output_spec) lists for the present tensors, in launcher order."""
    has_prob, has_bias, has_c, has_amax = _has(problem)
    n, k, n_out = problem.n, problem.k, problem.n_out
    ins = [
        TensorSpec(divisibility=(M_ALIGN, k)),  # a
        TensorSpec(mode=(1, 2, 0), static=True),  # b -> (N, K, L)
        TensorSpec(static=True),  # padded_offsets
        TensorSpec(static=True),  # alpha
    ]
    if has_prob:
        ins.append(TensorSpec(divisibility=(M_ALIGN,)))
    if has_bias:
        ins.append(TensorSpec(static=True))
    outs = []
    if has_c:
        outs.append(TensorSpec(divisibility=(M_ALIGN, n)))
    outs.append(TensorSpec(divisibility=(M_ALIGN, n_out)))
    if has_amax:
        outs.append(TensorSpec(static=True))
    return ins, outs


def output_shape_dtypes(problem, m):
    """ShapeDtypeStructs of (c?, d, amax?) for `m` rows (`m` may be symbolic)."""
    _, _, has_c, has_amax = _has(problem)
    epi = problem.epilogue
    outs = []
    if has_c:
        outs.append(jax.ShapeDtypeStruct((m, problem.n), jnp.dtype(epi.c_dtype)))
    outs.append(jax.ShapeDtypeStruct((m, problem.n_out), jnp.dtype(epi.d_dtype)))
    if has_amax:
        outs.append(jax.ShapeDtypeStruct((problem.num_groups, 1), jnp.float32))
    return outs


def make_call(problem, config=None):
    """A function `(a, b, padded_offsets, alpha, [prob], [bias]) -> tuple(c?, d, amax?)` for use under jit."""
    reason = supports(problem)
    if reason is not None:
        raise NotImplementedError(reason)
    kernel = GroupedGemmSm90(problem, config)
    ins, outs = tensor_specs(problem)

    def call(*arrays):
        m = arrays[0].shape[0]
        fn = cutlass_call(
            kernel,
            output_shape_dtype=tuple(output_shape_dtypes(problem, m)),
            input_spec=tuple(ins),
            output_spec=tuple(outs),
            compile_key=kernel.cache_key,
        )
        return fn(*arrays)

    call.kernel = kernel
    return call
