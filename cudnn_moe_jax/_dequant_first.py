"""Block-scaled calls with many rows (wgrad: tokens) per expert: dequantize in XLA, then the 16-bit kernel.

The dequantizing mainloop converts every B tile on chip once per M block that reads it, so its cost grows with the
rows per expert; a conversion by XLA before the GEMM costs one pass over the operands' bytes (read the codes, write
bf16) whatever the rows. Converted exactly (an FP8 / FP4 code times its block scale has at most 8 significant bits,
and bf16 has fp32's exponent range: the reference's `tensor_core_operands` operands), the bf16 kernel then computes
the same products and fp32 sums. `dequantize_first` says, by measurement on the H200, which problems go this way
(benchmarks/RESULTS.md runs 83-88; docs/backends.md); the primitive's CUDA lowering asks it when the call names no
explicit kernel config and then binds `half_problem` on `dequantized_inputs` (`_primitive.bind_dequantized`). An
fp16 A (weight-only) goes this way only with weights exact in fp16 (`formats.exact_in_float16`: NVFP4), converted to
fp16 for the fp16 kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import reference
from ._problem import GroupedGemmProblem
from .operands import half_dtype, has_exact_half
from .limits import FP4

# Rows per expert (m / L of the call) from which an M-grouped block-scaled problem is dequantized first, by the width
# of the data (RESULTS runs 83-86, 91): from 1024 rows the route won on both shapes (K 7168 / 2048: MXFP8 +34% / +5%,
# NVFP4 +12% / +4%); at 512 it lost with K 2048 (MXFP8 -13%, NVFP4 -14%) and NVFP4 with K 7168 (-3%)
DEQUANT_FIRST_ROWS = {"fp8": 1024, "fp4": 1024}
# Tokens per expert (T / L) from which a block-scaled wgrad is dequantized first (both operands are token operands:
# XLA's pass costs the same per token, the on-chip kernel converts each token tile once per W tile of the other
# operand): +9..+102% from 512 on the fc step's shapes; at 256 (64 experts, H 2048, I 768) -3..+10% token-contiguous,
# +30 / +47% token-major; at 128 (128 experts, H 4096, I 1024) +9..+59%. Fewer not measured (RESULTS runs 89-93).
# Token-contiguous operands are then staged in the kernel (`staged_problem`), which beat XLA's pass at 2048, 256 and
# 128 tokens per expert (RESULTS run 123, W1 and W2: +11..+16%, +16..+28%, +18..+27%)
DEQUANT_FIRST_TOKENS = 128
# Token-major (FP8) wgrad operands are staged where the GEMM does at least this many FLOPs per converted code,
# 2 m_w n_w / (m_w + n_w) (their converters spend more per code: each pair of rows its own scales, NaN per element):
# staged vs XLA's pass (RESULTS run 124) fc W2 (3186) +6%, W1 (5213) +4%; e128 W2 (1638) +3%, W1 (2731) +7%; small W1
# (1755) +5%, W2 (1117) -8%
STAGED_TOKEN_MAJOR_FLOPS_PER_CODE = 1400


def dequantize_first(problem: GroupedGemmProblem) -> bool:
    """Whether the CUDA lowering runs `problem` (m concrete; wgrad: T) as XLA's exact dequantization to bf16
    followed by the bf16 kernel: the on-chip conversion converts each B tile once per M block that reads it, XLA
    once, so with enough rows (tokens) per expert its pass (read the codes, write bf16) pays for itself. Not for an
    fp16 A unless fp16 holds the dequantized weights exactly (`formats.exact_in_float16`), not for a symbolic extent
    (a module's, not a call's)."""
    if not problem.block_scaled or not has_exact_half(problem):
        return False
    if problem.op == "wgrad":
        return isinstance(problem.k, int) and problem.k // problem.num_groups >= DEQUANT_FIRST_TOKENS
    if not isinstance(problem.m, int):
        return False
    return problem.m // problem.num_groups >= DEQUANT_FIRST_ROWS["fp4" if problem.ab_dtype == FP4 else "fp8"]


def staged_problem(problem: GroupedGemmProblem, by_size: bool = True):
    """`problem` with its operands staged inside the kernel (kernels/sm90/mainloop_staged.py: converted once into
    bf16 workspaces beside the GEMM, the same values and the same bf16 kernel as XLA's route below) where the kernel
    implements that for it, else None (XLA's conversion then the bf16 kernel); token-major wgrad operands only where
    the GEMM is large enough for their costlier conversion (`STAGED_TOKEN_MAJOR_FLOPS_PER_CODE`; `by_size` False:
    wherever the kernel stages them, for the suites and benchmarks that pin the staged kernel)."""
    from .kernels.sm90.config import supports

    staged = dataclasses.replace(problem, staged=True)
    if by_size and problem.op == "wgrad" and problem.a_major == "m":
        if 2 * problem.m * problem.n < STAGED_TOKEN_MAJOR_FLOPS_PER_CODE * (problem.m + problem.n):
            return None
    return staged if supports(staged) is None else None


def half_problem(problem: GroupedGemmProblem) -> GroupedGemmProblem:
    """The 16-bit problem computing `problem` on exactly dequantized operands: same op, shapes, epilogue and operand
    majors (the 16-bit kernel reads every major, so XLA writes the operands in the codes' own memory order: no
    transposed copy), A and B in `half_dtype`, no scale-factor inputs."""
    return dataclasses.replace(problem, ab_dtype=half_dtype(problem), sf_dtype=None, sf_vec_size=None, a_dtype=None)


def _half(f32_values, major: str, dtype: str = "bfloat16"):
    """The reference's exact fp32 dequantization rounded to `dtype` (bf16: exact but for magnitudes below 2^-126;
    fp16: for the formats `formats.exact_in_float16` names), written as uint32 words of two 16-bit values adjacent
    in memory: XLA:GPU stores a 16-bit fusion output 2 bytes at a time, at half the rate of 4-byte words (an MXFP8
    operand 140 -> 91 us, 2.5 -> 3.9 TB/s; RESULTS run 90). The pairs run along the operand's contiguous axis
    (`major` "k": the last; "m" / "n": the one before it), so the kernel's operand layout reads the words back
    through bitcasts, no copy; decode, scales, rounding and packing are one fusion."""
    axis = -1 if major == "k" else -2
    x = jnp.moveaxis(f32_values.astype(dtype), axis, -1)
    if x.shape[-1] % 2:
        return jnp.moveaxis(x, -1, axis)
    half = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    pairs = half.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    words = pairs[..., 0] | (pairs[..., 1] << 16)      # little-endian: element 2j in the low half
    return jnp.moveaxis(jax.lax.bitcast_convert_type(words, x.dtype).reshape(x.shape), -1, axis)


def dequantized_inputs(problem: GroupedGemmProblem, inputs: dict) -> dict:
    """`inputs` of `problem` ({canonical name: array}, discrete weights as tuples) -> those of `half_problem`: A
    (unless already 16-bit: weight-only quantization) and B dequantized to its `half_dtype`, sfa / sfb dropped."""
    out = {k: v for k, v in inputs.items() if k not in ("sfa", "sfb")}
    kw = dict(ab_dtype=problem.ab_dtype, sf_dtype=problem.sf_dtype, sf_vec_size=problem.sf_vec_size)
    if problem.op == "wgrad":   # token operands, scales in per-expert segments of the sanitized token ends
        ends = reference.sanitize_token_offsets(inputs["padded_offsets"], problem.k)
        for name in ("a", "b"):
            major = problem.a_major if name == "a" else problem.b_major
            values = reference.dequantize_tokens(inputs[name], inputs["sf" + name], ends, **kw,
                                                 token_major=major != "k")
            out[name] = _half(values, major)
        return out
    if inputs.get("sfa") is not None:
        out["a"] = _half(reference.dequantize_a(inputs["a"], inputs["sfa"], **kw), problem.a_major)
    half = half_dtype(problem)
    b, sfb = inputs["b"], inputs.get("sfb")
    if isinstance(b, (tuple, list)):  # discrete weights stay per-expert arrays
        sfbs = sfb if isinstance(sfb, (tuple, list)) else (None,) * len(b)
        out["b"] = tuple(_half(reference.dequantize_b(bi[None], si, **kw)[0], problem.b_major, half)
                         for bi, si in zip(b, sfbs))
    else:
        out["b"] = _half(reference.dequantize_b(b, sfb, **kw), problem.b_major, half)
    return out
