"""cudnn_moe_jax: fused Mixture-of-Experts grouped-GEMM ops for JAX.

cuDNN-frontend-compatible names and keywords; lowered to CuTe DSL kernels on Hopper GPUs where one covers the
call, and to the pure-jnp reference everywhere else. See README.md.
"""

from . import formats
from ._primitive import set_kernels_enabled
from ._problem import Epilogue, GroupedGemmProblem
from ._results import OpResult
from .ops import (
    grouped_gemm_dglu,
    grouped_gemm_dsrelu,
    grouped_gemm_dswiglu,
    grouped_gemm_glu,
    grouped_gemm_glu_hadamard_quant,
    grouped_gemm_quant,
    grouped_gemm_srelu,
    grouped_gemm_swiglu,
    grouped_gemm_wgrad,
)

__version__ = "0.1.0"


def export_disabled_checks() -> tuple:
    """`disabled_checks` to pass to `jax.export.export(..., platforms=["cuda"])` for functions using these ops:
    on CUDA they lower to CuTe DSL runtime custom calls, which jax.export does not know as stable."""
    from ._runtime import export_disabled_checks as checks

    return checks()


def export(fun_jit, *, platforms=None, disabled_checks=(), **kwargs):
    """`jax.export.export` for functions using these ops: the same call, with `export_disabled_checks()` added to
    `disabled_checks`. Use it as `cudnn_moe_jax.export(jax.jit(f), platforms=["cuda"])(*args)`.

    Without those checks disabled, jax.export refuses the CUDA lowering's CuTe DSL custom calls and its error
    prints every call in full -- the embedded kernel binary, ~100 KB of text per kernel -- which this library
    cannot intercept from inside `jax.export.export`; hence this helper.
    """
    import jax.export

    return jax.export.export(fun_jit, platforms=platforms,
                             disabled_checks=tuple(disabled_checks) + export_disabled_checks(), **kwargs)


__all__ = [
    "formats", "nn", "OpResult", "export", "export_disabled_checks", "set_kernels_enabled", "GroupedGemmProblem", "Epilogue",
    "grouped_gemm_quant", "grouped_gemm_srelu", "grouped_gemm_swiglu", "grouped_gemm_glu",
    "grouped_gemm_glu_hadamard_quant", "grouped_gemm_dglu", "grouped_gemm_dswiglu", "grouped_gemm_dsrelu",
    "grouped_gemm_wgrad",
]


def __getattr__(name):
    # `nn` imports flax/equinox wrappers lazily; keep `import cudnn_moe_jax` light.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(name)
