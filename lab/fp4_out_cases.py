"""FP4 outputs on the GPU through the public ops: `grouped_gemm_glu_hadamard_quant` (kernels/sm90/hadamard.py: GLU
or sReLU, bf16 or NVFP4 D, rowwise / colwise Hadamard outputs, user matrix, amax) and the MXFP4 D of quant / srelu /
glu (kernels/sm90/epilogue_fp4d.py: D packed, D_col transposed and packed along the tokens, SFD_row / SFD_col in both
layouts). The cases, calls and input avals of the GPU suite (tests/gpu/test_fp4_out_gpu.py; its inputs and checks
against the float64 oracle: tests/gpu/fp4_out_checks.py), and the bundle items that record the kernel modules on the
CPU machine (lowered at the inputs' shapes and dtypes, `input_avals`):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.fp4_out_cases:bundle_items

Input modes: "exact" (issue 19 item 6's inputs; "pm1" cases: every output bit-exact) and "random"
(tests/gpu/fp4_out_checks.py says what each checks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from lab import blockscaled_cases as bc

E4M3, E2M1, BF, F32 = bc.E4M3, bc.E2M1, bc.BF, bc.F32
M, L = bc.M, bc.L
NC, RHT_NC = 0.01, 0.37            # norm_const of D, of the Hadamard output
MAX_TIES = 0.01
PATTERNS = bc.PATTERNS
RUNS = (("empty_and_tail", "exact"), ("unsanitized", "random"))

# (name, op, input format ("bf16" or lab.blockscaled_cases.FORMATS), K, N, options); op "hadamard" is
# grouped_gemm_glu_hadamard_quant. N tails: N_out 384 (srelu, N 384) leaves half a 256-column tile.
CASES = [
    ("h_srelu_pm1_bf16d_row4", "hadamard", "bf16", 16, 256,
     dict(act_func="srelu", d_dtype=BF, rht_mode="rowwise", rht_dtype=E2M1, pm1=True)),
    ("h_srelu_pm1_d4_col", "hadamard", "bf16", 16, 384,
     dict(act_func="srelu", d_dtype=E2M1, rht_mode="colwise", compute_amax=True, pm1=True)),
    ("h_srelu_pm1_d4_rowbf16", "hadamard", "bf16", 16, 256,
     dict(act_func="srelu", d_dtype=E2M1, rht_mode="rowwise", rht_dtype=BF, pm1=True)),
    ("h_nvfp4_swiglu_d4_row4", "hadamard", "nvfp4", 256, 512,
     dict(act_func="swiglu", d_dtype=E2M1, rht_mode="rowwise", rht_dtype=E2M1)),
    ("h_bf16_geglu_bias_rowbf16", "hadamard", "bf16", 256, 512,
     dict(act_func="geglu", bias=F32, glu_limit=3.0, d_dtype=BF, rht_mode="rowwise")),
    ("h_mxfp8_swiglu_d4_col", "hadamard", "mxfp8", 256, 512,
     dict(act_func="swiglu", glu_alpha=1.2, d_dtype=E2M1, rht_mode="colwise")),
    ("h_nvfp4_srelu_user_col_n384", "hadamard", "nvfp4", 256, 384,
     dict(act_func="srelu", tanh_clamp_scale=2.0, d_dtype=BF, rht_mode="colwise", user_matrix=True)),
    ("h_bf16_gptoss_d4_user_row4", "hadamard", "bf16", 256, 512,
     dict(act_func="gpt_oss_swiglu", d_dtype=E2M1, rht_mode="rowwise", rht_dtype=E2M1, user_matrix=True,
          no_prob=True)),
    ("h_w_nvfp4_swiglu_bf16d", "hadamard", "w_nvfp4", 256, 512, dict(act_func="swiglu", d_dtype=BF)),
    ("quant_bf16_mxfp4d_bias", "quant", "bf16", 256, 512, dict(bias=BF, d_dtype=E2M1)),
    ("glu_nvfp4_swiglu_mxfp4d_seg", "glu", "nvfp4", 256, 512,
     dict(act_func="swiglu", c_dtype=BF, d_dtype=E2M1, discrete_col_sfd=True)),
    ("srelu_mxfp8_mxfp4d_n384", "srelu", "mxfp8", 256, 384, dict(c_dtype=F32, d_dtype=E2M1)),
]
OPS = {"hadamard": cmj.grouped_gemm_glu_hadamard_quant, **bc.OPS}


def call(case, x):
    _, op, fmt, _, _, options = case
    options = {key: v for key, v in options.items() if key not in ("pm1",)}
    bias = x["bias"] if options.pop("bias", None) else None
    prob = None if options.pop("no_prob", False) else x["prob"]
    kw = dict(padded_offsets=x["offsets"], alpha_tensor=x["alpha"], prob_tensor=prob, bias_tensor=bias)
    if fmt != "bf16":
        kw["sf_vec_size"] = bc.FORMATS[fmt][2]
    if op == "hadamard":
        if options.pop("user_matrix", False):
            kw["hadamard_tensor"] = x["hadamard"]
        if options["d_dtype"] == E2M1:
            kw["norm_const_tensor"] = x["norm_const"]
        if options.get("rht_mode") and options.get("rht_dtype", E2M1 if options["rht_mode"] == "colwise" else BF) \
                == E2M1:
            kw["rht_norm_const_tensor"] = x["rht_norm_const"]
    elif options["d_dtype"] == E2M1:
        kw["norm_const_tensor"] = x["norm_const"]
    return OPS[op](x["a"], x["b"], x["sfa"], x["sfb"], **kw, **options)


def companion(case):
    """The same Hadamard call with bf16 D: its D is the transform's input (the kernel's fp32 D does not depend on
    D's format), the only way to see it when D is NVFP4."""
    name, op, fmt, k, n, options = case
    return (name + "+bf16d", op, fmt, k, n, dict(options, d_dtype=BF, compute_amax=False))


def _needs_companion(case) -> bool:
    return case[1] == "hadamard" and case[5]["d_dtype"] == E2M1 and case[5].get("rht_mode") is not None


ALL_CASES = CASES + [companion(c) for c in CASES if _needs_companion(c)]


def input_avals(case) -> dict:
    """{input: ShapeDtypeStruct (None: absent)} of a case, as tests/gpu/fp4_out_checks.inputs makes them (both modes):
    bf16 A / B for "bf16" and pm1 cases, else lab.blockscaled_cases.input_avals' operands of the format; alpha,
    prob, bias, offsets, the two norm constants and the 16 x 16 user matrix."""
    _, op, fmt, k, n, options = case
    sds = jax.ShapeDtypeStruct
    if fmt == "bf16" or options.get("pm1"):
        x = dict(a=sds((M, k), jnp.bfloat16), b=sds((L, n, k), jnp.bfloat16), sfa=None, sfb=None)
    else:
        full = bc.input_avals((None, "glu", fmt, k, n, {}))
        x = {key: full[key] for key in ("a", "b", "sfa", "sfb")}
    x.update(alpha=sds((L,), jnp.float32), prob=sds((M,), jnp.float32), bias=sds((L, n), options.get("bias") or F32),
             offsets=sds((L,), jnp.int32), norm_const=sds((1,), jnp.float32), rht_norm_const=sds((1,), jnp.float32),
             hadamard=sds((16, 16), jnp.float32))
    return x


def bundle_items() -> list:
    """Each call of ALL_CASES lowered for CUDA at `input_avals` (aot records the module it asks for)."""
    return [functools.partial(lower, case) for case in ALL_CASES]


def lower(case):
    return jax.jit(functools.partial(call, case)).trace(input_avals(case)).lower(lowering_platforms=("cuda",))
