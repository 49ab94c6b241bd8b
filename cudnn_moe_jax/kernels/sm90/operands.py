"""The sm90 launcher's operands: one table, read by the TensorSpecs (jax_bridge) and by the launcher's unpacking
(gemm.GroupedGemmSm90._unpack). Pure Python (no cutlass import).

Each entry is (name, kind). Kinds: "rows" (m, cols) row-major, m dynamic (m % 256 == 0); "weights" B (L, N, K)
presented as (N, K, L); "sf_rows" / "sf_cols" / "sf_segments" scale-factor buffers whose row blocks follow m;
"m_vector" (m,); "tiles_by_m" (n_parts, m) per-N-tile row partials; "row_tiles" (m / 128, cols) per-M-tile column
partials; "tokens" wgrad's A (m_w, T) / B (n_w, T), T dynamic (T % 8 == 0); "static" everything whose shape
involves neither m nor T.

Backward ops (dglu, dsrelu) are the FC2 dgrad with the activation derivative fused: the saved forward C is read as
an input; dprob and dbias leave the kernel as per-tile partial sums that the lowering reduces in a fixed order
(`finish_dgrad_outputs`), so the result is deterministic without float atomics.
"""

from __future__ import annotations

DGRAD_OPS = ("dglu", "dsrelu")


def _has_c_output(problem) -> bool:
    return problem.op in ("srelu", "glu") and problem.epilogue.c_dtype is not None


def launcher_operands(problem):
    """(inputs, outputs): lists of (name, kind) for the present tensors, in the launcher's argument order
    (after the stream)."""
    epi = problem.epilogue
    if problem.op == "wgrad":
        return _wgrad_operands(problem)
    ins = [("a", "rows"), ("b", "weights")]
    if problem.block_scaled:
        ins += [("sfa", "sf_rows"), ("sfb", "static")]
    ins.append(("padded_offsets", "static"))
    if problem.op in DGRAD_OPS:
        ins += [("c", "rows"), ("alpha", "static"), ("beta", "static")]
        if epi.has_prob:
            ins.append(("prob", "m_vector"))
        if epi.generate_sfd:
            ins.append(("norm_const", "static"))
        outs = [("d", "rows")]
        if epi.generate_sfd:
            outs.append(("d_col", "rows"))
        outs.append(("dprob_parts", "tiles_by_m"))
        if epi.dbias_dtype is not None:
            outs.append(("dbias_parts", "row_tiles"))
        if epi.compute_amax:
            outs.append(("amax", "static"))
        if epi.generate_sfd:
            outs += [("sfd_row", "sf_rows"), ("sfd_col", "sf_segments" if epi.discrete_col_sfd else "sf_cols")]
        return ins, outs
    ins.append(("alpha", "static"))
    if epi.has_prob:
        ins.append(("prob", "m_vector"))
    if epi.has_bias:
        ins.append(("bias", "static"))
    if epi.generate_sfd:
        ins.append(("norm_const", "static"))
    outs = [("c", "rows")] if _has_c_output(problem) else []
    outs.append(("d", "rows"))
    if epi.generate_sfd:
        outs.append(("d_col", "rows"))
    if epi.compute_amax:
        outs.append(("amax", "static"))
    if epi.generate_sfd:
        outs.append(("sfd_row", "sf_rows"))
        outs.append(("sfd_col", "sf_segments" if epi.discrete_col_sfd else "sf_cols"))
    return ins, outs


def _wgrad_operands(problem):
    """A (m_w, T), B (n_w, T), token ends (L,), [gsa, gsb (L,) f32], [the W to add to (L, m_w, n_w)] -> W.
    The order is the public op's input order (ops/backward.py binds a, b, offsets, global scales, wgrad).
    With accumulation the output is the input W's buffer (`input_output_aliases`): the launcher gets the input
    "wgrad" only, reads each tile's old values and overwrites them."""
    ins = [("a", "tokens"), ("b", "tokens"), ("padded_offsets", "static")]
    if problem.has_global_scales:
        ins += [("global_scale_a", "static"), ("global_scale_b", "static")]
    if problem.accumulate:
        return ins + [("wgrad", "static")], [("wgrad_out", "static")]
    return ins, [("wgrad", "static")]


def input_output_aliases(problem) -> dict:
    """{input index: output index} over the launcher's operands (`launcher_operands` order): accumulated wgrad
    writes W into the buffer it reads."""
    if problem.op == "wgrad" and problem.accumulate:
        ins, _ = launcher_operands(problem)
        return {len(ins) - 1: 0}
    return {}


def dgrad_n_parts(problem, config) -> int:
    """CTA tiles along N of a dgrad launch (the rows of its dprob partials), cluster padding included."""
    n_tiles = -(-problem.n // config.tile_n)
    return -(-n_tiles // config.cluster_n) * config.cluster_n


def dgrad_kernel_shape_dtypes(problem, config, m):
    """ShapeDtypeStructs of a dgrad launch's outputs (`launcher_operands` order): d (m, N_out), [FP8 D: d_col
    (m, N_out)], dprob partials (n_parts, m) f32, [dbias partials (m / 128, N_out) f32], [amax (L, 1 or 2) f32],
    [FP8 D: sfd_row, sfd_col as the op's (`_problem.output_specs`)]."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from cudnn_moe_jax._problem import output_specs

    epi = problem.epilogue
    outs = [jax.ShapeDtypeStruct((m, problem.n_out), jnp.dtype(epi.d_dtype))]
    if epi.generate_sfd:
        outs.append(jax.ShapeDtypeStruct((m, problem.n_out), jnp.dtype(epi.d_dtype)))
    outs.append(jax.ShapeDtypeStruct((dgrad_n_parts(problem, config), m), jnp.float32))
    if epi.dbias_dtype is not None:
        outs.append(jax.ShapeDtypeStruct((m // 128, problem.n_out), jnp.float32))
    if epi.compute_amax:
        outs.append(jax.ShapeDtypeStruct((problem.num_groups, 2 if problem.op == "dglu" else 1), jnp.float32))
    if epi.generate_sfd:
        specs = output_specs(dataclasses.replace(problem, m=m))
        outs += [jax.ShapeDtypeStruct(*specs[key]) for key in ("sfd_row_tensor", "sfd_col_tensor")]
    return outs


def finish_dgrad_outputs(problem, kernel_outs, padded_offsets):
    """The op's outputs (`_problem.output_specs` order: d_row, [d_col], dprob, [dbias], [amax], [sfd_row,
    sfd_col]) from a dgrad launch's (the FP8 D outputs pass through).

    dprob: the per-N-tile row partials summed in tile order; dbias: per-group sums of the per-M-tile column
    partials as a one-hot (L, m / 128) x (m / 128, N_out) fp32 product (exact 0/1 weights, fixed order). Both are
    deterministic (no float atomics anywhere)."""
    import jax
    import jax.numpy as jnp

    from cudnn_moe_jax.reference import row_groups, sanitize_offsets

    n_d = 2 if problem.epilogue.generate_sfd else 1      # d (, d_col)
    parts = kernel_outs[n_d]
    dprob = parts[0]
    for j in range(1, parts.shape[0]):
        dprob = dprob + parts[j]
    outs = list(kernel_outs[:n_d]) + [dprob]
    rest = list(kernel_outs[n_d + 1:])
    if problem.epilogue.dbias_dtype is not None:
        col_parts = rest.pop(0)
        m = kernel_outs[0].shape[0]
        group = row_groups(sanitize_offsets(padded_offsets, m), m)[::128]   # group of each 128-row tile
        onehot = (group[None, :] == jnp.arange(problem.num_groups, dtype=group.dtype)[:, None]).astype(jnp.float32)
        dbias = jnp.dot(onehot, col_parts, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        outs.append(dbias.astype(problem.epilogue.dbias_dtype))
    return outs + rest


def launch_outputs(problem, config, op_out_avals, m):
    """(the launch's output avals, `finish(launch_outputs, named_inputs) -> the op's outputs` or None).

    Forward ops: the launch writes exactly the op's outputs. Backward ops: it writes partial sums that `finish`
    reduces in a fixed order (finish_dgrad_outputs)."""
    if problem.op not in DGRAD_OPS:
        return tuple(op_out_avals), None

    def finish(outs, named):
        return finish_dgrad_outputs(problem, outs, named["padded_offsets"])

    return tuple(dgrad_kernel_shape_dtypes(problem, config, m)), finish
