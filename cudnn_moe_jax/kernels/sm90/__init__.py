"""Hopper (sm_90a) CuTe DSL kernels of cudnn_moe_jax.

Entry points used by the JAX layer:
  supports(problem) -> None | str       None when implemented here, else the reason (pure Python, no cutlass)
  default_config(problem) -> Config     measured default schedule
  GroupedGemmSm90(problem, config=None) kernel object; its `@cute.jit` `launch(stream, *tensors)` (also
                                        `__call__`) is the launcher to hand to `cutlass.jax.cutlass_call`
                                        (argument order in `gemm.py`); `kernel.cutlass_call_kwargs` holds the
                                        matching input/output TensorSpecs.
  default_variants()                    (problem, config, input avals) of the default aot bundle.
Importing `GroupedGemmSm90` imports cutlass (set CUTE_DSL_ARCH=sm_90a before the first `import cutlass`).
"""

from .config import Config, config_from_hints, default_config, supports
from .operands import launch_outputs
from .variants import default_variants

__all__ = ["Config", "config_from_hints", "GroupedGemmSm90", "default_config", "default_variants", "launch_outputs", "supports", "tensor_specs",
           "output_shape_dtypes"]


def __getattr__(name):
    if name == "GroupedGemmSm90":
        from .gemm import GroupedGemmSm90

        return GroupedGemmSm90
    if name in ("tensor_specs", "output_shape_dtypes"):
        from . import jax_bridge

        return getattr(jax_bridge, name)
    raise AttributeError(name)
