"""Public ops: cuDNN names and keywords, validation, result objects."""

from .backward import grouped_gemm_dglu, grouped_gemm_dsrelu, grouped_gemm_dswiglu, grouped_gemm_wgrad
from .forward import grouped_gemm_glu, grouped_gemm_quant, grouped_gemm_srelu, grouped_gemm_swiglu
from .hadamard import grouped_gemm_glu_hadamard_quant

__all__ = [
    "grouped_gemm_quant", "grouped_gemm_srelu", "grouped_gemm_swiglu", "grouped_gemm_glu",
    "grouped_gemm_glu_hadamard_quant", "grouped_gemm_dglu", "grouped_gemm_dswiglu", "grouped_gemm_dsrelu",
    "grouped_gemm_wgrad",
]
