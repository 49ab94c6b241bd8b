"""The reference's GEMMs with 16-bit operands (the CUDA fallback) and its expert-wise token contraction (wgrad)."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_moe_jax as cmj
from cudnn_moe_jax import formats, nn, reference


def _rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("ends", [[300, 300, 700, 1000], [0, 256, 512, 1000], [999, 5, 1000, 1000], [64, 64, 64, 64]])
def test_expert_token_matmul_matches_float64(ends):
    """Every (token tile, expert) pair is visited, straddling tiles are masked, empty experts give exact zeros."""
    rng = np.random.default_rng(len(ends) + ends[0])
    a, b = rng.standard_normal((24, 1000)), rng.standard_normal((40, 1000))
    sane = reference.sanitize_token_offsets(jnp.asarray(ends, jnp.int32), 1000)
    got = np.asarray(jax.jit(reference.expert_token_matmul)(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                                                            sane))
    lo = 0
    for e, hi in enumerate(np.asarray(sane)):
        want = a[:, lo:hi] @ b[:, lo:hi].T
        np.testing.assert_allclose(got[e], want, rtol=1e-5, atol=1e-4 * np.sqrt(max(hi - lo, 1)))
        if hi == lo:
            assert not got[e].any()
        lo = hi


def test_tensor_core_operands_same_results():
    """16-bit operands give the f32 path's products (dequantization to bf16 is exact) and fp32 sums."""
    rng = np.random.default_rng(7)
    m, n, k, L = 1024, 96, 160, 3
    offsets = jnp.asarray([256, 256, 1024], jnp.int32)
    x, w = _rand(rng, (m, k), jnp.bfloat16), _rand(rng, (L, n, k), jnp.bfloat16)
    data, sf = formats.to_block_scaled(x.astype(jnp.float32), "float8_e4m3fn")
    wdata, wsf = formats.to_block_scaled(w.astype(jnp.float32), "float8_e4m3fn")

    def both(fn):
        plain = fn()
        with reference.tensor_core_operands():
            fast = fn()
        return np.asarray(plain, np.float32), np.asarray(fast, np.float32)

    for a, b, kw in ((x, w, {}), (data, wdata, dict(sfa_tensor=sf, sfb_tensor=wsf))):
        plain, fast = both(lambda: cmj.grouped_gemm_quant(a, b, padded_offsets=offsets, d_dtype="float32",
                                                          **kw).d_tensor)
        np.testing.assert_allclose(fast, plain, rtol=1e-6, atol=1e-5)
    tok = jnp.asarray([100, 100, 900], jnp.int32)
    plain, fast = both(lambda: cmj.grouped_gemm_wgrad(x.T[:, :912], x.T[:96, :912], tok,
                                                      wgrad_dtype="float32").wgrad_tensor)
    np.testing.assert_allclose(fast, plain, rtol=1e-6, atol=1e-5)


def test_tensor_core_operands_fp16_a_with_block_scaled_b():
    """An fp16 A beside block-scaled weights runs as two bf16 GEMMs (A's exact hi / lo split): on operands whose
    products and sums are exact (11-bit A values, coarse FP4 / FP8 weights) bit for bit the f32 path's result,
    with an inf in A giving inf (its lo part 0, not inf - inf) where the f32 path has it."""
    rng = np.random.default_rng(3)
    m, n, k, L = 512, 64, 128, 2
    offsets = jnp.asarray([256, 512], jnp.int32)
    a = jnp.asarray(rng.integers(-2048, 2049, (m, k)) / 1024, jnp.float16)    # 11 significant bits
    a = a.at[5, 3].set(jnp.inf)
    hi, lo = reference.split_f16(a)
    f = np.asarray(a, np.float64)
    np.testing.assert_array_equal(np.where(np.isinf(f), f, np.asarray(hi, np.float64) + np.asarray(lo, np.float64)),
                                  f)
    for fmt in ("nvfp4", "mxfp8", "mxfp4"):
        data, sf, vec = formats.BLOCK_FORMATS[fmt]
        w = jnp.asarray(rng.integers(-8, 9, (L, n, k)) / 4, jnp.float32)
        b, sfb = formats.to_block_scaled(w, data, sf, vec)
        call = lambda: cmj.grouped_gemm_quant(a, b, None, sfb, offsets, d_dtype="float32",  # noqa: E731
                                              sf_vec_size=vec).d_tensor
        plain = np.asarray(call())
        with reference.tensor_core_operands():
            fast = np.asarray(call())
        np.testing.assert_array_equal(fast, plain)
        assert np.isinf(fast[5]).any() or np.isnan(fast[5]).any()


def _dots(hlo: str):
    """Operand element types of every dot / convolution in (stable)HLO text."""
    return re.findall(r"stablehlo\.dot_general[^\n]*:\s*\(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", hlo)


@pytest.mark.parametrize("act", ["swiglu", "srelu"])
def test_cuda_fallback_step_has_no_fp32_gemm(act):
    """The training step lowered for CUDA with the kernels off: every GEMM has 16-bit operands (tensor cores)."""
    L, rows, H, I = 2, 256, 128, 64
    n1 = I if act == "srelu" else 2 * I
    off = jnp.asarray([rows, 2 * rows], jnp.int32)
    sd = jax.ShapeDtypeStruct

    def step(x, w1, w2, prob, dy):
        y, vjp = jax.vjp(lambda x, w1, w2, prob: nn.moe_mlp(x, w1, w2, prob, None, off, act), x, w1, w2, prob)
        return y, vjp(dy)

    cmj.set_kernels_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hlo = jax.jit(step).trace(
                sd((L * rows, H), jnp.bfloat16), sd((L, n1, H), jnp.bfloat16), sd((L, H, I), jnp.bfloat16),
                sd((L * rows,), jnp.float32), sd((L * rows, H), jnp.bfloat16)).lower(
                lowering_platforms=("cuda",)).as_text()
    finally:
        cmj.set_kernels_enabled(True)
    dots = _dots(hlo)
    assert len(dots) >= 4, hlo[:2000]   # fc1, fc2, dgrads, wgrads (functions of equal shapes are shared)
    assert all(t in ("bf16", "f16") for pair in dots for t in pair), dots


def test_operand_majors_are_hints_with_the_same_result():
    """b_major / a_major change what a kernel reads as contiguous, never the math: the reference ignores them,
    and bad values or an a_major on an op without one are errors naming the argument."""
    rng = np.random.default_rng(3)
    m, n, k, L = 512, 64, 96, 2
    x, w = _rand(rng, (m, k), jnp.bfloat16), _rand(rng, (L, k, n), jnp.bfloat16)   # w as a (L, K, N) checkpoint
    off = jnp.asarray([256, 512], jnp.int32)
    plain = cmj.grouped_gemm_quant(x, jnp.swapaxes(w, 1, 2), padded_offsets=off, d_dtype="float32").d_tensor
    hinted = cmj.grouped_gemm_quant(x, jnp.swapaxes(w, 1, 2), padded_offsets=off, d_dtype="float32",
                                    b_major="n").d_tensor
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(hinted))
    tok = jnp.asarray([200, 512], jnp.int32)
    a, b = _rand(rng, (m, 64), jnp.bfloat16), _rand(rng, (m, 32), jnp.bfloat16)       # token-major (T, rows)
    w1 = cmj.grouped_gemm_wgrad(a.T, b.T, tok, wgrad_dtype="float32").wgrad_tensor
    w2 = cmj.grouped_gemm_wgrad(a.T, b.T, tok, wgrad_dtype="float32", a_major="m", b_major="n").wgrad_tensor
    np.testing.assert_array_equal(np.asarray(w1), np.asarray(w2))
    with pytest.raises(ValueError, match="b_major must be one of"):
        cmj.grouped_gemm_quant(x, jnp.swapaxes(w, 1, 2), padded_offsets=off, b_major="m")
    with pytest.raises(TypeError, match="a_major"):
        cmj.grouped_gemm_quant(x, jnp.swapaxes(w, 1, 2), padded_offsets=off, a_major="m")


def test_one_activation_table_unknown_names_fail_everywhere():
    """An activation outside cudnn_moe_jax.activations is a ValueError at every layer, never a silent default."""
    from cudnn_moe_jax import activations
    from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
    from cudnn_moe_jax.kernels.sm90 import config

    assert activations.get("dgeglu") is activations.get("geglu") and activations.get("srelu").output_width(8) == 8
    with pytest.raises(ValueError, match="not an activation"):
        activations.get("gelu")
    with pytest.raises(ValueError, match="not an activation"):
        Epilogue(act="gelu").is_glu
    x, w = jnp.ones((256, 64), jnp.bfloat16), jnp.ones((1, 128, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="act_func"):
        cmj.grouped_gemm_glu(x, w, padded_offsets=jnp.asarray([256], jnp.int32), act_func="gelu")
    with pytest.raises(ValueError, match="act="):
        nn.moe_mlp(x, w, jnp.ones((1, 64, 64), jnp.bfloat16), jnp.ones((256,)), None,
                   jnp.asarray([256], jnp.int32), "gelu")
    bad = GroupedGemmProblem(op="glu", m=256, n=128, k=64, num_groups=1, ab_dtype="bfloat16",
                             epilogue=Epilogue(act="relu2"))
    assert "glu act must be one of" in config.supports(bad)


def test_dgrad_partial_sums_reduce_in_a_fixed_order():
    """The lowering's reduction of the dgrad kernel's partials (the operand table's `finish`): dprob =
    the N-tile partials summed in tile order, dbias = per-group sums of the 128-row tile partials (rows past the
    last group and empty groups add nothing), amax passed through; equal to float64 sums, bit-identical reruns.
    A NaN / inf partial stays in its own group's dbias (a one-hot product spread 0 * NaN = NaN to every group),
    and one past the last group (never-written partials may hold anything) reaches none."""
    from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
    from cudnn_moe_jax import operands

    rng = np.random.default_rng(11)
    m, n, L = 1024, 96, 4
    problem = GroupedGemmProblem(op="dsrelu", m=m, n=n, k=64, num_groups=L, ab_dtype="bfloat16",
                                 epilogue=Epilogue(act="dsrelu", c_dtype="bfloat16", dbias_dtype="float32",
                                                   compute_amax=True))
    d = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    dprob_parts = rng.standard_normal((3, m)).astype(np.float32)
    dbias_parts = rng.standard_normal((m // 128, n)).astype(np.float32)
    dbias_parts[1, 5], dbias_parts[4, 7], dbias_parts[7, 9] = np.nan, np.inf, np.nan   # groups 0, 2; none
    amax = jnp.asarray(rng.random((L, 1)), jnp.float32)
    offsets = jnp.asarray([256, 256, 700, 768], jnp.int32)       # -> ends 256, 256, 512, 768; rows 768.. in none

    def finish():
        return operands.finish(problem)([d, jnp.asarray(dprob_parts), jnp.asarray(dbias_parts), amax],
                                        {"padded_offsets": offsets})

    out = jax.jit(finish)()
    again = jax.jit(finish)()
    np.testing.assert_allclose(np.asarray(out[1]), dprob_parts.astype(np.float64).sum(0), rtol=1e-6, atol=1e-6)
    ends, lo = [256, 256, 512, 768], 0
    for g, hi in enumerate(ends):
        want = dbias_parts[lo // 128:hi // 128].astype(np.float64).sum(0)
        np.testing.assert_allclose(np.asarray(out[2][g]), want, rtol=1e-6, atol=1e-6)   # NaN where want's
        lo = hi
    assert np.isnan(np.asarray(out[2])).sum() == 1 and np.isinf(np.asarray(out[2])).sum() == 1
    assert not np.asarray(out[2][1]).any()                      # the empty group
    np.testing.assert_array_equal(np.asarray(out[3]), np.asarray(amax))
    for x, y in zip(out, again):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
