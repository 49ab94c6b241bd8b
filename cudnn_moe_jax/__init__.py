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

__all__ = [
    "formats", "nn", "OpResult", "export_disabled_checks", "set_kernels_enabled", "GroupedGemmProblem", "Epilogue",
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
