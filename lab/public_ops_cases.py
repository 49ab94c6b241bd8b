"""Cases that run the PUBLIC ops (cudnn_moe_jax.grouped_gemm_*) end to end on CUDA: primitive -> _runtime ->
kernel module from a bundle -> XLA FFI custom call. Shared by the CPU bundle build and the GPU test
(tests/gpu/test_public_ops_gpu.py).

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.public_ops_cases:bundle_items

(`.bundle` is git-ignored and is where `_runtime` looks by default in a checkout.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj

M, K, N, L = 2048, 256, 512, 4
# Expert 1 empty, expert 3 skewed; rows 1792.. are outside every group (m > valid_m).
OFFSETS = (512, 512, 1024, 1792)

# (name, op, options): every public forward op the sm90 kernel covers, bf16 in (FP8 D: with norm_const, D_col and
# the SFD outputs).
CASES = [
    ("quant_bias", cmj.grouped_gemm_quant, dict(bias=True, d_dtype="bfloat16")),
    ("quant_fp16_out_f32", cmj.grouped_gemm_quant, dict(bias=False, d_dtype="float32")),
    ("srelu_bias", cmj.grouped_gemm_srelu, dict(bias=True, c_dtype="bfloat16", d_dtype="bfloat16")),
    ("srelu_tanh", cmj.grouped_gemm_srelu, dict(bias=False, c_dtype="float32", d_dtype="bfloat16",
                                               tanh_clamp_scale=2.0)),
    ("swiglu", cmj.grouped_gemm_glu, dict(bias=True, act_func="swiglu", c_dtype="bfloat16", d_dtype="bfloat16")),
    ("geglu_limit", cmj.grouped_gemm_glu, dict(bias=False, act_func="geglu", c_dtype="bfloat16",
                                               d_dtype="bfloat16", glu_limit=3.0, glu_alpha=0.5)),
    ("quant_fp8d", cmj.grouped_gemm_quant, dict(bias=True, d_dtype="float8_e4m3fn", norm_const=True)),
    ("swiglu_fp8c_e5m2d", cmj.grouped_gemm_glu, dict(bias=False, act_func="swiglu", c_dtype="float8_e4m3fn",
                                                     d_dtype="float8_e5m2", norm_const=True)),
    ("gpt_oss_swiglu", cmj.grouped_gemm_glu, dict(bias=True, act_func="gpt_oss_swiglu", c_dtype="bfloat16",
                                                  d_dtype="bfloat16")),
    ("gpt_oss_swiglu_limit", cmj.grouped_gemm_glu, dict(bias=False, act_func="gpt_oss_swiglu", c_dtype="float32",
                                                        d_dtype="float32", glu_limit=1.5, glu_alpha=1.2)),
]


def inputs(seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    return dict(
        a=jax.random.normal(keys[0], (M, K)).astype(jnp.bfloat16),
        b=(jax.random.normal(keys[1], (L, N, K)) / 16).astype(jnp.bfloat16),
        prob=jax.random.uniform(keys[2], (M,)),
        alpha=jax.random.uniform(keys[3], (L,), minval=0.5, maxval=2.0),
        bias=jax.random.normal(keys[4], (L, N)).astype(jnp.bfloat16),
        offsets=jnp.asarray(OFFSETS, jnp.int32),
        norm_const=jnp.asarray([0.75], jnp.float32),
    )


def call(op, options, x):
    options = dict(options)
    bias = x["bias"] if options.pop("bias") else None
    norm_const = x["norm_const"] if options.pop("norm_const", False) else None
    return op(x["a"], x["b"], padded_offsets=x["offsets"], alpha_tensor=x["alpha"], prob_tensor=x["prob"],
              bias_tensor=bias, norm_const_tensor=norm_const, **options)


def example_step():
    """The main job's jitted forward+backward step (examples/moe_layer.py defaults)."""
    from examples import moe_layer

    return moe_layer, moe_layer.parse_args([])


def bundle_items():
    """Callables that lower each case (and the example's step) for cuda: aot records the modules they ask for."""
    x = inputs()
    items = []
    for _, op, options in CASES:
        fn = jax.jit(functools.partial(call, op, options))
        items.append(lambda fn=fn: fn.trace(x).lower(lowering_platforms=("cuda",)))
    moe_layer, args = example_step()
    items.append(lambda: moe_layer.lower_step_for(args, platform="cuda"))
    return items
