"""How the sm90 kernel meets `cutlass.jax.cutlass_call`: the TensorSpec of each operand kind, the call's keyword
arguments and a ready-made call.

The operands, their order, shapes and kinds are the operand table's (`cudnn_moe_jax.operands`, docs there). Every
array is row-major unless a major says otherwise; B is presented to the kernel as (N, K, L) through `mode` (no
copy), discrete weights as L arrays (N, K). Tensors whose shape involves `m` are dynamic with `m % m_aligned == 0`
declared (256 by default), so one compiled module serves every `m` (and `jax.export` with a symbolic `m` works);
likewise wgrad's A (m_w, T) / B (n_w, T) with `T % 8 == 0`, and a gathered A (a_rows, K) with any row count; the
others are static.
"""

from __future__ import annotations

import dataclasses

from cutlass.jax import TensorSpec, cutlass_call

from cudnn_moe_jax import operands as table
from cudnn_moe_jax.formats import SF_ATOM_BYTES, SF_ATOM_ROWS
from cudnn_moe_jax.limits import k_align, values_per_byte

from .config import supports
from .kernel import GroupedGemmSm90


def _spec(problem, operand: table.Bound) -> TensorSpec:
    name, kind, shape = operand.name, operand.kind, operand.shape
    align = problem.m_aligned   # m's divisibility; scale factors along M need align % 128 == 0 (ops/_checks)
    if kind == "tokens":  # wgrad (rows, T), T dynamic; token-major ("m" / "n"): rows contiguous, as stored
        token_major = (problem.a_major, problem.b_major)[name == "b"] != "k"
        return TensorSpec(layout=(0, 1) if token_major else None,   # packed FP4: (rows, T / 2) bytes
                          divisibility=(shape[0], k_align(problem.ab_dtype) // values_per_byte(problem.ab_dtype)))
    if kind == "staged_tokens":   # the staged wgrad's bf16 (rows, T + 64 L), T dynamic; token-major as the codes
        return TensorSpec(layout=(0, 1) if problem.a_major == "m" else None,
                          divisibility=(shape[0], k_align(problem.ab_dtype)))
    if kind == "token_chunks":    # its flags, a number of 512-token chunks of the padded T
        return TensorSpec(divisibility=(1,))
    if kind == "weights" and len(shape) == 2:  # discrete: one expert's (N, K) (N contiguous for b_major "n")
        return TensorSpec(static=True, layout=(0, 1) if problem.b_major == "n" else None)
    if kind == "weights" and problem.b_major == "n":
        return TensorSpec(mode=(1, 2, 0), static=True, layout=(2, 0, 1))  # (L, N, K) with N contiguous
    if kind == "gathered_tokens":  # wgrad's gathered (rows, T_src), token-major: T_src dynamic, any value
        return TensorSpec(layout=(0, 1), divisibility=(shape[0], 1))
    if kind == "gathered_rows":  # gathered A (a_rows, K): its row count is dynamic too, any value
        return TensorSpec(divisibility=(1, shape[1]))
    if kind == "rows":  # (m, cols): m dynamic
        return TensorSpec(divisibility=(align, shape[1]))
    if kind == "weights":
        return TensorSpec(mode=(1, 2, 0), static=True)  # B (L, N, K) -> (N, K, L)
    if kind == "cols_by_m":  # (cols, m / 2): packed FP4 tokens (dynamic) along the rows
        return TensorSpec(divisibility=(shape[0], align // 2))
    if kind == "sf_rows":  # (1, m / 128 row blocks (dynamic), Kb, atom...)
        return TensorSpec(divisibility=(1, max(1, align // SF_ATOM_ROWS), 1) + shape[3:])
    if kind == "sf_cols":  # (1, cols / 128, m / 128 k-block quads (dynamic), atom...)
        return TensorSpec(divisibility=(1, 1, max(1, align // SF_ATOM_ROWS)) + shape[3:])
    if kind == "sf_segments":
        return TensorSpec(divisibility=(SF_ATOM_BYTES,))
    if kind == "m_vector":   # wgrad: a token index (T % 8 == 0)
        return TensorSpec(divisibility=(k_align(problem.ab_dtype) if problem.op == "wgrad" else align,))
    if kind == "tiles_by_m":
        return TensorSpec(divisibility=(1, align))
    if kind == "row_tiles":   # m / 128 tiles, or cdiv(m, 128) + L (operands.m_tiles)
        return TensorSpec(divisibility=(max(1, align // table.ROW_TILE) if align % table.ROW_TILE == 0 else 1,
                                        shape[1]))
    assert kind == "static", kind
    return TensorSpec(static=True)


def tensor_specs(problem, config=None):
    """(input_spec, output_spec) lists for the present tensors, in launcher order (the operand table's)."""
    return ([_spec(problem, b) for b in table.inputs(problem)],
            [_spec(problem, b) for b in table.launch_outputs(problem, config)])


def cutlass_call_kwargs(kernel) -> dict:
    """TensorSpecs (present tensors, launcher order) and aliases for `cutlass.jax.cutlass_call(kernel.launch,
    **kwargs)`."""
    ins, outs = tensor_specs(kernel.problem, kernel.config)
    kwargs = {"input_spec": tuple(ins), "output_spec": tuple(outs)}
    aliases = table.input_output_aliases(kernel.problem)
    if aliases:
        kwargs["input_output_aliases"] = aliases
    return kwargs


def launch_shape_dtypes(problem, config, m, k=None):
    """The launch's output ShapeDtypeStructs for `m` rows (`m` may be symbolic; wgrad: m is W's static rows and
    `k` the token count, which the staged wgrad's workspaces follow)."""
    import jax

    launch = table.launch_outputs(dataclasses.replace(problem, m=m, k=problem.k if k is None else k), config)
    return [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in launch]


def call_of(kernel):
    """A function `(*present inputs, in the operand table's order) -> tuple(launch outputs)` for use under jit,
    launching `kernel` (any object with `problem`, `config`, `launch`, `cache_key`)."""
    kwargs = cutlass_call_kwargs(kernel)
    # m: the rows of A, or with a gathered A (a_rows, K) the length of a_index (wgrad: A's rows m_w either way)
    gathered = kernel.problem.a_rows is not None and kernel.problem.op != "wgrad"
    m_source = table.input_names(kernel.problem).index("a_index") if gathered else 0

    field, axes = table.dynamic_axes(kernel.problem)
    token_axis = axes.get("a") if field == "k" else None   # wgrad's A (m_w, T / per byte): the token count

    def call(*arrays):
        m = arrays[m_source].shape[0]
        k = None if token_axis is None else arrays[0].shape[token_axis[0]] * token_axis[1]
        fn = cutlass_call(
            kernel,
            output_shape_dtype=tuple(launch_shape_dtypes(kernel.problem, kernel.config, m, k)),
            input_spec=kwargs["input_spec"],
            output_spec=kwargs["output_spec"],
            input_output_aliases=kwargs.get("input_output_aliases", {}),
            compile_key=kernel.cache_key,
        )
        return fn(*arrays)

    call.kernel = kernel
    return call


def make_call(problem, config=None):
    """`call_of(GroupedGemmSm90(problem, config))`; NotImplementedError where the kernel does not cover `problem`."""
    reason = supports(problem)
    if reason is not None:
        raise NotImplementedError(reason)
    return call_of(GroupedGemmSm90(problem, config))
