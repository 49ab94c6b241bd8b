"""cudnn_moe_jax: fused Mixture-of-Experts grouped-GEMM ops for JAX.

cuDNN-frontend-compatible names and keywords; lowered to CuTe DSL kernels on Hopper GPUs where one covers the
call, and to the pure-jnp reference everywhere else. See README.md.
"""

from . import formats
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

__all__ = [
    "formats", "nn", "OpResult", "GroupedGemmProblem", "Epilogue",
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
