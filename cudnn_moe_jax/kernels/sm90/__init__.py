"""Hopper (sm_90a) CuTe DSL kernels of cudnn_moe_jax.

Entry points used by the JAX layer:
  read_problem(problem) -> problem      the operand majors the kernels read (the lowering applies it first; XLA
                                        transposes an operand whose hinted major a kernel does not read)
  supports(problem) -> None | str       None when implemented here, else the reason (pure Python, no cutlass)
  default_config(problem) -> Config     measured default schedule
  GroupedGemmSm90(problem, config=None) kernel object; its `@cute.jit` `launch(stream, *tensors)` (also
                                        `__call__`) is the launcher to hand to `cutlass.jax.cutlass_call`
                                        (operands: the operand table, cudnn_moe_jax/operands.py)
  cutlass_call_kwargs(kernel)           the matching input/output TensorSpecs (jax_bridge)
  default_variants()                    (problem, config, input avals) of the default aot bundle.
Importing `GroupedGemmSm90` or `cutlass_call_kwargs` imports cutlass (set CUTE_DSL_ARCH=sm_90a before the first
`import cutlass`).
"""

from .config import Config, config_from_hints, default_config, read_problem, supports
from .variants import default_variants

__all__ = ["Config", "config_from_hints", "GroupedGemmSm90", "cutlass_call_kwargs", "default_config",
           "default_variants", "read_problem", "supports", "tensor_specs"]


def __getattr__(name):
    if name == "GroupedGemmSm90":
        from .kernel import GroupedGemmSm90

        return GroupedGemmSm90
    if name in ("cutlass_call_kwargs", "tensor_specs"):
        from . import jax_bridge

        return getattr(jax_bridge, name)
    raise AttributeError(name)
