"""Block-scaled calls with many rows (wgrad: tokens) per expert: dequantize in XLA, then the 16-bit kernel.

The dequantizing mainloop converts every B tile on chip once per M block that reads it, so its cost grows with the
rows per expert; a conversion by XLA before the GEMM costs one pass over the operands' bytes (read the codes, write
bf16) whatever the rows. Converted exactly (an FP8 / FP4 code times its block scale has at most 8 significant bits,
and bf16 has fp32's exponent range: the reference's `tensor_core_operands` operands), the bf16 kernel then computes
the same products and fp32 sums. `dequantize_first` says, by measurement on the H200, which problems go this way
(benchmarks/RESULTS.md runs 83-88; docs/backends.md); the primitive's CUDA lowering asks it when the call names no
explicit kernel config and then binds `bf16_problem` on `dequantized_inputs` (`_primitive.bind_dequantized`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import formats, reference
from ._problem import GroupedGemmProblem
from .limits import FP4

# Rows per expert (m / L of the call) from which an M-grouped block-scaled problem is dequantized first, by the width
# of the data: NVFP4 won from 1024 rows (K 7168 +16%, K 2048 +2%) and lost at 512; MXFP8 won at 2048 and at 1024
# only with K 7168 (K 2048: -9%); RESULTS runs 83-86
DEQUANT_FIRST_ROWS = {"fp8": 2048, "fp4": 1024}
# Tokens per expert (T / L) from which a block-scaled wgrad is dequantized first (both operands are token operands,
# so XLA's pass costs the same per token whatever the rows): +14..+71% at 2048 on the fc step (RESULTS runs 84-88);
# fewer tokens per expert not measured
DEQUANT_FIRST_TOKENS = 2048


def dequantize_first(problem: GroupedGemmProblem) -> bool:
    """Whether the CUDA lowering runs `problem` (m concrete; wgrad: T) as XLA's exact dequantization to bf16
    followed by the bf16 kernel: the on-chip conversion converts each B tile once per M block that reads it, XLA
    once, so with enough rows (tokens) per expert its pass (read the codes, write bf16) pays for itself. Not for an
    fp16 A (no 16-bit type holds both operands exactly), not for a symbolic extent (a module's, not a call's)."""
    if not problem.block_scaled or problem.a_dtype == "float16":
        return False
    if problem.op == "wgrad":
        return isinstance(problem.k, int) and problem.k // problem.num_groups >= DEQUANT_FIRST_TOKENS
    if not isinstance(problem.m, int):
        return False
    return problem.m // problem.num_groups >= DEQUANT_FIRST_ROWS["fp4" if problem.ab_dtype == FP4 else "fp8"]


def bf16_problem(problem: GroupedGemmProblem) -> GroupedGemmProblem:
    """The bf16 problem computing `problem` on exactly dequantized operands: same op, shapes, epilogue and operand
    majors (the bf16 kernel reads every major, so XLA writes the bf16 operands in the codes' own memory order: no
    transposed copy), A and B bf16, no scale-factor inputs."""
    return dataclasses.replace(problem, ab_dtype="bfloat16", sf_dtype=None, sf_vec_size=None, a_dtype=None)


def _codes_f32(codes, data_dtype: str):
    """Codes (..., K) [packed FP4: uint8 (..., K/2), element 2j in the low nibble] -> fp32 values (..., K), as
    elementwise integer work that XLA fuses into the consumer (no table gather, no stacked copy): an e2m1 code
    s e e m is +-2^(e-1) (1 + m/2), or m/2 for e = 0, placed straight into fp32 bits."""
    if data_dtype != FP4:   # XLA's fp8 -> fp32 convert (an integer bit placement measured slower: RESULTS run 86)
        return formats.decode(codes, data_dtype)
    packed = formats.as_u8(codes)
    shape = packed.shape[:-1] + (2 * packed.shape[-1],)
    pairs = jnp.broadcast_to(packed[..., None], packed.shape + (2,)).reshape(shape).astype(jnp.uint32)
    odd = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1) & 1
    nib = (pairs >> (odd << 2)) & 0xF
    e, m = (nib >> 1) & 3, nib & 1
    mag = jnp.where(e == 0, m * jnp.uint32(0x3F000000), ((e + 126) << 23) | (m << 22))
    return jax.lax.bitcast_convert_type(mag | ((nib & 8) << 28), jnp.float32)


def _scales_f32(scales, sf_dtype: str):
    return formats.e8m0_decode(scales) if sf_dtype == formats.E8M0 else formats.decode(scales, sf_dtype)


def _to_bf16(codes, scales, data_dtype: str, sf_dtype: str, vec: int):
    """Codes (..., K) times their block scales (logical uint8 (..., cdiv(K, vec))), rounded to bf16 (exact but for
    magnitudes below 2^-126): the reference's dequantization (`reference.dequantize_a/_b`) in a form XLA runs as
    one fusion at memory speed (the scales repeated by a broadcast, not a gather)."""
    vals = _codes_f32(codes, data_dtype)
    k = vals.shape[-1]
    s = _scales_f32(scales, sf_dtype)
    rep = jnp.broadcast_to(s[..., None], s.shape + (vec,)).reshape(s.shape[:-1] + (s.shape[-1] * vec,))
    return (vals * rep[..., :k]).astype(jnp.bfloat16)


def dequantize_a(a, sfa, problem: GroupedGemmProblem):
    """A (m, K) codes + MMA-tiled sfa -> (m, K) bf16."""
    k = problem.k
    s = formats.unpack_sf(sfa, a.shape[0], formats.cdiv(k, problem.sf_vec_size))[0]
    return _to_bf16(a, s, problem.ab_dtype, problem.sf_dtype, problem.sf_vec_size)


def dequantize_b(b, sfb, problem: GroupedGemmProblem):
    """B (L, N, K) codes + MMA-tiled sfb -> (L, N, K) bf16."""
    s = formats.unpack_sf(sfb, b.shape[1], formats.cdiv(problem.k, problem.sf_vec_size), b.shape[0])
    return _to_bf16(b, s, problem.ab_dtype, problem.sf_dtype, problem.sf_vec_size)


def _bf16_weights(b, sfb, problem: GroupedGemmProblem):
    if isinstance(b, (tuple, list)):  # discrete weights stay per-expert arrays
        sfbs = sfb if isinstance(sfb, (tuple, list)) else (None,) * len(b)
        return tuple(dequantize_b(bi[None], si, problem)[0] for bi, si in zip(b, sfbs))
    return dequantize_b(b, sfb, problem)


def dequantized_inputs(problem: GroupedGemmProblem, inputs: dict) -> dict:
    """`inputs` of `problem` ({canonical name: array}, discrete weights as tuples) -> those of `bf16_problem`: A
    (unless already bf16: weight-only quantization) and B dequantized to bf16, sfa / sfb dropped."""
    out = {k: v for k, v in inputs.items() if k not in ("sfa", "sfb")}
    if problem.op == "wgrad":   # token operands, scales in per-expert segments of the sanitized token ends
        ends = reference.sanitize_token_offsets(inputs["padded_offsets"], problem.k)
        for name in ("a", "b"):
            x = inputs[name]
            s = formats.segment_token_scales(inputs["sf" + name], x.shape[0], ends, problem.k, problem.sf_vec_size)
            out[name] = (_codes_f32(x, problem.ab_dtype) * _scales_f32(s, problem.sf_dtype)).astype(jnp.bfloat16)
        return out
    if inputs.get("sfa") is not None:
        out["a"] = dequantize_a(inputs["a"], inputs["sfa"], problem)
    out["b"] = _bf16_weights(inputs["b"], inputs.get("sfb"), problem)
    return out
