"""The kernel class of a problem: one per op kind, each a composition over the shared body (gemm.py)."""

from __future__ import annotations

from typing import Optional

from cudnn_moe_jax._problem import DGRAD_OPS

from .config import Config
from .dgrad import GroupedGemmSm90Dgrad
from .forward import GroupedGemmSm90Forward
from .hadamard import GroupedGemmSm90Hadamard
from .wgrad import GroupedGemmSm90Wgrad


def kernel_class_for(problem):
    """forward ops (quant / srelu / glu; glu_hadamard_quant), dgrad ops (dglu / dsrelu) or wgrad."""
    if problem.op == "wgrad":
        return GroupedGemmSm90Wgrad
    if problem.op == "glu_hadamard_quant":
        return GroupedGemmSm90Hadamard
    if problem.op in DGRAD_OPS:
        return GroupedGemmSm90Dgrad
    return GroupedGemmSm90Forward


def GroupedGemmSm90(problem, config: Optional[Config] = None):  # noqa: N802 - the kernel's name at the call sites
    """The kernel object of `problem` (NotImplementedError with the reason when the sm90 kernel does not cover
    it): `.launch` is the `@cute.jit` launcher, `.cutlass_call_kwargs` its TensorSpecs."""
    return kernel_class_for(problem)(problem, config)
