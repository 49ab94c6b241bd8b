"""The routed layer's training step on the padding-free layout (nn.moe_layer(..., m_aligned=1)) and on its
default one, lowered for CUDA on this CPU machine: value_and_grad of nn.moe_layer (router, permutation, the fused
expert MLP, its backward) lowers every GEMM to a kernel module of the padding-free schedule (a fallback to the
reference would warn, and the warning is an error here), the permuted buffer holds the routed rows only, and the
step holds no device loop (XLA:GPU runs a while loop with a host round trip per iteration: the searchsorted of
the routing once left the GPU idle ~0.5 ms a step, benchmarks/RESULTS.md run 65).

Compiles ~6 small kernel modules for sm_90a (skipped without the CuTe DSL compiler).
"""

from __future__ import annotations

import re
import warnings

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from cudnn_moe_jax import nn  # noqa: E402
from lab.sass import require_compiler  # noqa: E402


@pytest.mark.parametrize("act,bias,m_aligned", [("swiglu", True, 1), ("srelu", False, 1), ("swiglu", False, None)])
def test_moe_layer_value_and_grad_lowers_to_padfree_kernels(act, bias, m_aligned):
    require_compiler()   # cutlass imported for sm_90a, or skip
    T, H, I, L, k = 200, 256, 128, 6, 2
    n1 = I if act == "srelu" else 2 * I
    sd = jax.ShapeDtypeStruct
    avals = dict(x=sd((T, H), jnp.bfloat16), router=sd((H, L), jnp.float32), w1=sd((L, n1, H), jnp.bfloat16),
                 w2=sd((L, H, I), jnp.bfloat16), b1=sd((L, n1), jnp.bfloat16) if bias else None)

    def loss(p):
        align = {} if m_aligned is None else dict(m_aligned=m_aligned)
        y, aux = nn.moe_layer(p["x"], p["router"], p["w1"], p["w2"], p["b1"], top_k=k, act=act, **align)
        return jnp.sum(y.astype(jnp.float32) ** 2), aux["padded_offsets"]

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # "no GPU kernel for this ... problem" would be raised
        lowered = jax.jit(jax.value_and_grad(loss, has_aux=True)).trace(avals).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    calls = [line for line in text.splitlines() if "CuteDSLRT_NvJaxCutlassCall" in line]
    assert len(calls) == 6, f"expected the six GEMMs as kernel custom calls, found {len(calls)}"
    assert "stablehlo.while" not in text, "a device loop in the layer's step (a host round trip per iteration)"
    if m_aligned is None:
        return
    rows = nn.permuted_rows(T, k, L, m_aligned=1)
    assert rows == T * k   # padding-free: the routed rows (a multiple of 8 here)
    # the GEMMs read the (rows, .) permuted activations, not cuDNN's worst-case 256-padded buffer
    dims = set(re.findall(r"tensor<(\d+)x\d+xbf16>", " ".join(calls)))
    assert str(rows) in dims and str(nn.permuted_rows(T, k, L, m_aligned=256)) not in dims, dims
