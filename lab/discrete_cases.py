"""Discrete per-expert weights (`b_tensors=[...]`, `sfb_tensors=[...]`) through the public ops on the kernels
(kernels/sm90/experts.py: each expert's B / SFB read through its own TMA descriptor): every forward and backward
op, bf16 and block-scaled B (the dequantizing mainloop), weight-only, an N-major B. The GPU suite
(tests/gpu/test_discrete_gpu.py) checks each discrete call against the float64 oracle (tests/gpu/blockscaled_checks.py:
every output element, outputs poisoned first, two calls bit-identical, exact outputs bit for bit on "exact" inputs)
and against the same call with the stacked `b_tensor` / `sfb_tensor`: identical bytes in every output. The cases
are in lab/blockscaled_cases.py's shape (its `call(case, x, discrete)` and `input_avals`); the bundle items record
both calls of every case:

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.discrete_cases:bundle_items

Routing patterns (lab.blockscaled_cases.PATTERNS): an empty expert and rows past the last group, unsanitized
offsets, 300 experts of which 296 are empty.
"""

from __future__ import annotations

from lab import blockscaled_cases as bc

BF, F16, F32, E4M3, E5M2 = bc.BF, bc.F16, bc.F32, bc.E4M3, bc.E5M2

# (name, op, format, K, N, options): the blockscaled_cases shape (bc.call / bc.input_avals and the checks read it)
CASES = [
    ("bf16_quant_bias", "quant", bc.HALF, 256, 512, dict(bias=BF, d_dtype=BF)),
    ("bf16_swiglu_bias_n384", "glu", bc.HALF, 256, 384, dict(bias=F32, act_func="swiglu", c_dtype=BF, d_dtype=BF)),
    ("bf16_srelu_fp8d", "srelu", bc.HALF, 256, 512, dict(c_dtype=BF, d_dtype=E4M3, discrete_col_sfd=True)),
    ("bf16_quant_nmajor", "quant", bc.HALF, 256, 512, dict(d_dtype=F32, b_major="n")),
    ("bf16_dswiglu_dbias", "dglu", bc.HALF, 256, 512, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF,
                                                          generate_dbias=True, dbias_dtype=F32)),
    ("bf16_dsrelu_tanh", "dsrelu", bc.HALF, 256, 384, dict(tanh_clamp_scale=2.0, c_dtype=F32, d_dtype=BF)),
    ("nvfp4_swiglu_bias", "glu", "nvfp4", 256, 512, dict(bias=F32, act_func="swiglu", c_dtype=BF, d_dtype=BF)),
    ("mxfp8_quant_f32_k208_n384", "quant", "mxfp8", 208, 384, dict(d_dtype=F32)),
    ("mxfp4_srelu_tanh_k224", "srelu", "mxfp4", 224, 512, dict(tanh_clamp_scale=2.0, c_dtype=F32, d_dtype=BF,
                                                               no_prob=True)),
    ("w_mxfp8_quant_fp8d_k208_n384", "quant", "w_mxfp8", 208, 384, dict(bias=BF, d_dtype=E4M3)),
    ("nvfp4_dswiglu_bias_amax", "dglu", "nvfp4", 256, 512, dict(act_func="dswiglu", c_dtype=BF, d_dtype=BF,
                                                                generate_dbias=True, dbias_dtype=F32)),
    ("mxfp8e5_dsrelu_e4m3d", "dsrelu", "mxfp8e5", 256, 384, dict(c_dtype=E4M3, d_dtype=E4M3,
                                                                 discrete_col_sfd=True)),
]
# 300 experts: more than the descriptor-table kernel's threads (kernels/sm90/experts.py BUILD_THREADS) and more
# than 4 KiB of its kernel parameters (2 x 300 addresses)
MANY_EXPERTS = ("nvfp4_quant_300_experts", "quant", "nvfp4", 256, 128, dict(d_dtype=BF))
CASES.append(MANY_EXPERTS)
# (pattern, mode) each case runs in the GPU test (bc.PATTERNS: the pattern sets the expert count)
RUNS = (("empty_and_tail", "exact"), ("unsanitized", "adversarial"))


def runs(case):
    return (("many_experts", "exact"),) if case is MANY_EXPERTS else RUNS


def bundle_items():
    """Both calls (stacked, discrete) of every case, lowered for CUDA at the inputs of its first run: the modules
    the GPU test needs (one module per case and weight layout serves every pattern of the same expert count)."""
    return [item for discrete in (False, True) for case in CASES
            for item in bc.bundle_items_for([case], runs(case)[0][0], discrete)]
