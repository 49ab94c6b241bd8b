"""The sm90 launcher's operands, read from the operand table (`cudnn_moe_jax.operands`): their names and kinds in
the launcher's argument order, the aliased outputs, and the launcher's unpacking (`GroupedGemmSm90Base._unpack`).
Pure Python (no cutlass import).

The launcher receives what `cutlass.jax.cutlass_call` passes after the stream: the present inputs in binding order,
then the present launch outputs (an output aliased to an input is passed once, as the input). Backward ops (dglu,
dsrelu) write dprob and dbias as per-tile partial sums (`dprob_parts`, `dbias_parts`) that the lowering reduces in
a fixed order (`operands.finish`), so the result is deterministic without float atomics.
"""

from __future__ import annotations

from cudnn_moe_jax import operands as table

# Every name a launcher may look up (absent tensors: None), over all ops.
_LAUNCH_NAMES = table.launch_names()


def launcher_operands(problem, config=None):
    """(inputs, outputs): lists of (name, kind) of the present tensors, in the launcher's argument order."""
    return ([(b.name, b.kind) for b in table.inputs(problem)],
            [(b.name, b.kind) for b in table.launch_outputs(problem, config)])


def input_output_aliases(problem) -> dict:
    """{input index: output index} over the launcher's operands: accumulated wgrad writes W into the buffer it
    reads."""
    return table.input_output_aliases(problem)


def unpack(problem, tensors, config=None) -> dict:
    """The launcher's tensors by name (`launcher_operands` order); every other launcher name None. Aliased outputs
    do not reach the launcher (cutlass_call passes only their input); absent tensors may arrive as None."""
    ins, outs = launcher_operands(problem, config)
    aliased = set(input_output_aliases(problem).values())
    names = [name for name, _ in ins] + [name for j, (name, _) in enumerate(outs) if j not in aliased]
    present = [x for x in tensors if x is not None]
    if len(present) != len(names):
        raise ValueError(f"expected {len(names)} tensors ({names}), got {len(present)}")
    named = dict.fromkeys(_LAUNCH_NAMES)
    named.update(zip(names, present))
    return named
