"""The named benchmark shapes of the MoE grouped GEMM: the one home of fc1 / fc2 / small (pure Python).

Used by the benchmark (benchmarks/), the GPU tools (tools/gpu/) and the kernels' default aot variants
(kernels/sm90/variants.py). `m` is the static row count of the permuted activations (a multiple of 256); a
benchmark times one routing draw on it, `GROUP_SIZES` rows per expert, so valid_m = sum(GROUP_SIZES[name]) <= m.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


class GemmShape(NamedTuple):
    """One grouped GEMM: A (m, K) against L experts B (L, N, K). Unpacks as (m, n, k, num_groups)."""

    m: int
    n: int
    k: int
    num_groups: int


SHAPES = {
    "fc1": GemmShape(16384, 4096, 7168, 8),     # FC1 of a large MoE layer: N = 2I interleaves gate / up
    "fc2": GemmShape(16384, 7168, 2048, 8),     # its FC2 (hidden 7168 = N, I = 2048 = K)
    "small": GemmShape(16384, 1536, 2048, 64),  # many small experts
}

# (op, act) each shape is benchmarked with: the fused epilogue of that layer's forward GEMM.
FUSION: dict[str, tuple[str, Optional[str]]] = {"fc1": ("glu", "swiglu"), "fc2": ("quant", None),
                                                "small": ("glu", "swiglu")}

# The routing draw each shape is timed on: rows per expert (multiples of 256).
GROUP_SIZES: dict[str, tuple[int, ...]] = {"fc1": (2048,) * 8, "fc2": (2048,) * 8, "small": (256,) * 64}

# Further routing draws, run on another shape's problem: name -> (shape, rows per expert). skewed: half the rows
# in expert 0 and two empty experts, on fc1.
ROUTINGS: dict[str, tuple[str, tuple[int, ...]]] = {
    "skewed": ("fc1", (8192, 2048, 2048, 0, 1024, 1024, 0, 2048)),
}
