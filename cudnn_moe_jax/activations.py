"""The expert activations: one table, read by the ops (argument checks), the problem (output width), the
reference, the kernels (their device functions dispatch on these names) and `nn`.

| name | GLU | output width | options | backward act_func (op) |
|---|---|---|---|---|
| swiglu | gate/up 32-column blocks | N / 2 | glu_limit, glu_alpha | dswiglu (grouped_gemm_dglu) |
| geglu | gate/up 32-column blocks | N / 2 | glu_limit, glu_alpha | dgeglu (grouped_gemm_dglu) |
| srelu | no | N | tanh_clamp_scale | dsrelu (grouped_gemm_dsrelu) |

The math of each (value and derivative) is in docs/activations.md; `reference._glu` / `reference._srelu` compute
it in jnp, `kernels/epilogue.py` on the device. A name outside the table is a ValueError everywhere.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Activation:
    name: str                 # the forward act_func
    glu: bool                 # gate/up pairs of 32-column blocks: half as many outputs as GEMM columns
    derivative: str           # the backward act_func
    forward_op: str           # the problem op of the fused FC1 forward
    backward_op: str          # the problem op of the fused FC2 dgrad + derivative
    options: tuple            # the keyword options it takes

    def output_width(self, n: int) -> int:
        return n // 2 if self.glu else n


TABLE = {a.name: a for a in (
    Activation("swiglu", True, "dswiglu", "glu", "dglu", ("glu_limit", "glu_alpha")),
    Activation("geglu", True, "dgeglu", "glu", "dglu", ("glu_limit", "glu_alpha")),
    Activation("srelu", False, "dsrelu", "srelu", "dsrelu", ("tanh_clamp_scale",)),
)}
BY_DERIVATIVE = {a.derivative: a for a in TABLE.values()}
GLU_NAMES = tuple(a.name for a in TABLE.values() if a.glu)
GLU_DERIVATIVES = tuple(a.derivative for a in TABLE.values() if a.glu)


def get(name, arg: str = "act_func") -> Activation:
    """The activation of a forward or a backward name ("swiglu" or "dswiglu"); ValueError naming `arg` else."""
    found = TABLE.get(name) or BY_DERIVATIVE.get(name)
    if found is None:
        raise ValueError(f"{arg}={name!r} is not an activation: expected one of {tuple(TABLE)} (forward) or "
                         f"{tuple(BY_DERIVATIVE)} (backward)")
    return found
