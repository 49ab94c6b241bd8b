"""The MoE training step (nn.moe_mlp forward + backward) lowered for CUDA on this CPU machine: every op lowers to
a kernel (a fallback to the reference would warn, and the warning is an error here), for every activation of the
table, with and without bias; the backward's weights and token-major activations reach their kernels without
transposes (the kernels declare the transposed layouts, checked in the lowered custom calls).

Compiles ~20 small kernel modules for sm_90a (skipped without the CuTe DSL compiler).
"""

from __future__ import annotations

import os
import re
import warnings

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from cudnn_moe_jax import activations, nn  # noqa: E402


def _compiler():
    if "cutlass" not in __import__("sys").modules:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    try:
        import cutlass  # noqa: F401
        import cutlass.jax  # noqa: F401
    except Exception as e:  # noqa: BLE001 - no compiler here
        pytest.skip(f"CuTe DSL compiler not importable: {e}")


@pytest.mark.parametrize("act", list(activations.TABLE))
@pytest.mark.parametrize("bias", [False, True])
def test_training_step_lowers_to_kernels_only(act, bias):
    _compiler()
    L, rows, H, I = 2, 256, 256, 128
    n1 = activations.TABLE[act].input_width(I)
    off = jnp.asarray([rows, 2 * rows], jnp.int32)
    sd = jax.ShapeDtypeStruct

    def step(x, w1, w2, prob, b1, dy):
        y, vjp = jax.vjp(lambda *p: nn.moe_mlp(*p, off, act), x, w1, w2, prob, b1 if bias else None)
        return y, vjp(dy)

    avals = (sd((L * rows, H), jnp.bfloat16), sd((L, n1, H), jnp.bfloat16), sd((L, H, I), jnp.bfloat16),
             sd((L * rows,), jnp.float32), sd((L, n1), jnp.bfloat16), sd((L * rows, H), jnp.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # "no GPU kernel for this ... problem" would be raised
        text = jax.jit(step).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "CuteDSLRT_NvJaxCutlassCall" in line]
    assert len(calls) >= 6, f"expected the six GEMMs as kernel custom calls, found {len(calls)}"
    # the N-major weights and the token-major wgrad operands: non-default operand layouts on the custom calls
    layouts = [re.search(r"operand_layouts = \[(.*?)\], result_layouts", c).group(1) for c in calls]
    # minor-to-major: (m, T) read m-contiguous = [0, 1]; (L, N, K) read N-contiguous = [1, 2, 0]
    wgrads = [x for x in layouts if x.count("dense<[0, 1]>") == 2]
    weights = [x for x in layouts if "dense<[1, 2, 0]>" in x]
    assert len(wgrads) == 2 and len(weights) == 2, layouts
