"""Group alignments below 256 (cuDNN's `m_aligned` keyword, docs/offsets.md#group-alignment): the reference vs the
float64 oracle (tests/np_ops.py) with group ends at any multiple of m_aligned (1-row and empty experts, groups that
straddle every 128-row tile, m > valid_m, invalid offsets sanitized to the alignment), and the API's rules (the
accepted values, m and the offsets as multiples of it, scale-factor operands keeping 128).

Tolerances and comparisons are tests/reference_checks.py's (tests/test_reference.py's harness).
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax import reference as R

import np_ops as O
import reference_checks as TR
from np_formats import E4M3, E5M2

L = TR.L
# (m, m_aligned, raw padded_offsets): every pattern has a group end inside a 128-row tile
PATTERNS = {
    "one_row": (997, 1, [1, 1, 300, 997]),              # a 1-row expert, an empty one, m not a multiple of 8
    "tail": (1000, 8, [40, 48, 48, 616]),                # rows 616.. outside every group
    "straddle": (1024, 16, [112, 400, 656, 1024]),       # every end inside a 128-row tile
    "unsanitized": (960, 64, [100, -3, 5000, 700]),      # -> 64, 64, 960, 960 (rounded down to 64, clipped)
    "sf128": (1024, 128, [128, 128, 640, 896]),          # scale-factor operands: multiples of 128
}


def _case(fmt, pattern, n, bias=None, seed=0):
    m, align, offsets = PATTERNS[pattern]
    x, kw = TR.make_gemm(fmt, m, 96, n, "balanced", bias, seed=seed)
    x["padded_offsets"] = np.asarray(offsets, np.int32)
    x["norm_const"] = np.array([TR.NORM_CONST], np.float32)
    return x, kw, align


def _groups_are(ora, pattern):
    m, align, offsets = PATTERNS[pattern]
    assert ora["_groups"] == O.np_groups(offsets, m, align)


QUANT = [("bf16", "bfloat16", "bfloat16", "one_row"), ("fp16", "float32", None, "tail"),
         ("bf16", "float16", "float32", "unsanitized"), ("bf16", E4M3, None, "sf128"),
         ("mxfp8_e5m2", E5M2, "bfloat16", "sf128")]


@pytest.mark.parametrize("fmt,d_dtype,bias,pattern", QUANT)
def test_quant(fmt, d_dtype, bias, pattern):
    x, kw, align = _case(fmt, pattern, 128, bias)
    dcs = d_dtype in O.FP8
    ref, ora = TR.run_both("grouped_gemm_quant", False, x, kw, d_dtype=d_dtype, compute_amax=True,
                           discrete_col_sfd=dcs, m_aligned=align)
    _groups_are(ora, pattern)
    TR.check_d_outputs(ref, ora, d_key="d_tensor", d_dtype=d_dtype, norm_const=TR.NORM_CONST, discrete_col_sfd=dcs)
    TR.check_fwd_amax(ref, ora)


@pytest.mark.parametrize("fmt,act,pattern,jit", [("bf16", "swiglu", "one_row", False),
                                                 ("fp16", "geglu", "straddle", True),
                                                 ("mxfp8_e4m3", "swiglu", "sf128", False)])
def test_glu(fmt, act, pattern, jit):
    x, kw, align = _case(fmt, pattern, 256, "bfloat16")
    d_dtype = E4M3 if fmt.startswith("mxfp8") else "bfloat16"
    ref, ora = TR.run_both("grouped_gemm_glu", jit, x, kw, act_func=act, c_dtype="float32", d_dtype=d_dtype,
                           compute_amax=True, m_aligned=align)
    _groups_are(ora, pattern)
    TR.check_c(ref, ora, "float32")
    TR.check_d_outputs(ref, ora, d_key="d_tensor", d_dtype=d_dtype, norm_const=TR.NORM_CONST, discrete_col_sfd=False)
    TR.check_fwd_amax(ref, ora)


@pytest.mark.parametrize("pattern", ["tail", "unsanitized"])
def test_srelu(pattern):
    x, kw, align = _case("bf16", pattern, 128)
    ref, ora = TR.run_both("grouped_gemm_srelu", False, x, kw, c_dtype="bfloat16", d_dtype="bfloat16",
                           tanh_clamp_scale=2.0, compute_amax=True, m_aligned=align)
    TR.check_c(ref, ora, "bfloat16")
    TR.check_d_outputs(ref, ora, d_key="d_tensor", d_dtype="bfloat16", norm_const=TR.NORM_CONST,
                       discrete_col_sfd=False)
    TR.check_fwd_amax(ref, ora)


def _dgrad_case(pattern, n_c, i_dim, c_dtype):
    m, align, offsets = PATTERNS[pattern]
    x, kw = TR.make_gemm("bf16", m, 96, i_dim, "balanced", None)
    rng = np.random.default_rng(m + n_c)
    x["c"] = rng.uniform(-9, 9, (m, n_c)).astype(np.float32).astype(O.FLOAT_OUT[c_dtype])
    x["beta"] = rng.uniform(0.5, 1.5, L).astype(np.float32)
    x["padded_offsets"] = np.asarray(offsets, np.int32)
    return x, kw, align


@pytest.mark.parametrize("pattern,jit", [("one_row", False), ("straddle", True), ("tail", False)])
def test_dglu(pattern, jit):
    x, kw, align = _dgrad_case(pattern, 256, 128, "bfloat16")
    ref, ora = TR.run_both("grouped_gemm_dglu", jit, x, kw, act_func="dswiglu", d_dtype="bfloat16",
                           dbias_dtype="float32", compute_amax=True, m_aligned=align)
    _groups_are(ora, pattern)
    TR.check_backward(ref, ora, d_dtype="bfloat16", dbias_dtype="float32", dcs=False)


@pytest.mark.parametrize("pattern", ["unsanitized", "one_row"])
def test_dsrelu(pattern):
    x, kw, align = _dgrad_case(pattern, 128, 128, "float32")
    ref, ora = TR.run_both("grouped_gemm_dsrelu", False, x, kw, tanh_clamp_scale=1.5, d_dtype="float16",
                           dbias_dtype="bfloat16", compute_amax=True, m_aligned=align)
    TR.check_backward(ref, ora, d_dtype="float16", dbias_dtype="bfloat16", dcs=False)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_sanitize_offsets_to_the_alignment(pattern):
    m, align, offsets = PATTERNS[pattern]
    ends = np.asarray(R.sanitize_offsets(jnp.asarray(offsets, jnp.int32), m, align))
    assert ends.tolist() == [e for _, e in O.np_groups(offsets, m, align)]
    assert not np.any(ends % align)


def test_grouped_matmul_tiles_every_group_from_its_first_row():
    """Tiles straddling group ends, 1-row and empty groups: every row times its own group's weight, exactly as
    the dense per-row product (same fp32 products and sums: the inputs are small integers)."""
    rng = np.random.default_rng(5)
    m, k, n = 203, 32, 24
    a = rng.integers(-3, 4, (m, k)).astype(np.float32)
    b = rng.integers(-3, 4, (L, n, k)).astype(np.float32)
    ends = jnp.asarray([1, 1, 150, 190], jnp.int32)
    out = np.asarray(R.grouped_matmul(jnp.asarray(a), jnp.asarray(b), ends, m_aligned=1))
    gid = O.np_group_of_rows(np.asarray(ends), m, align=1)
    want = np.zeros((m, n), np.float32)
    for r in range(m):
        if gid[r] < L:
            want[r] = a[r] @ b[gid[r]].T
    np.testing.assert_array_equal(out, want)


# ------------------------------------------------------------------------------------------------ the API's rules


def _ops_inputs(m, offsets, dtype=jnp.bfloat16):
    a = jnp.ones((m, 64), dtype)
    b = jnp.ones((L, 64, 64), dtype)
    return a, b, jnp.asarray(offsets, jnp.int32)


def test_default_is_cudnn_256():
    a, b, off = _ops_inputs(512, [256, 256, 512, 512])
    out = cmj.grouped_gemm_quant(a, b, padded_offsets=off)
    same = cmj.grouped_gemm_quant(a, b, padded_offsets=off, m_aligned=256)
    np.testing.assert_array_equal(np.asarray(out.d_tensor, np.float32), np.asarray(same.d_tensor, np.float32))
    a, b, off = _ops_inputs(512, [100, 256, 512, 512])
    with pytest.raises(ValueError, match=r"padded_offsets\[0\]=100 is not a multiple of 256: .*m_aligned=256"):
        cmj.grouped_gemm_quant(a, b, padded_offsets=off)


def test_unaligned_ends_pass_with_a_smaller_m_aligned():
    a, b, off = _ops_inputs(200, [3, 3, 100, 200])
    d = np.asarray(cmj.grouped_gemm_quant(a, b, padded_offsets=off, m_aligned=1).d_tensor, np.float32)
    assert np.all(d == 64.0)


@pytest.mark.parametrize("value", [3, 0, 512, 2.0, True])
def test_m_aligned_values(value):
    a, b, off = _ops_inputs(512, [256, 256, 512, 512])
    with pytest.raises(ValueError, match="m_aligned must be one of"):
        cmj.grouped_gemm_quant(a, b, padded_offsets=off, m_aligned=value)


def test_m_and_offsets_follow_m_aligned():
    a, b, off = _ops_inputs(100, [8, 16, 16, 96])
    with pytest.raises(ValueError, match=r"rows m=100 must be a positive multiple of 8 \(m_aligned"):
        cmj.grouped_gemm_quant(a, b, padded_offsets=off, m_aligned=8)
    a, b, off = _ops_inputs(96, [8, 12, 16, 96])
    with pytest.raises(ValueError, match=r"padded_offsets\[1\]=12 is not a multiple of 8: .*m_aligned=8"):
        cmj.grouped_gemm_quant(a, b, padded_offsets=off, m_aligned=8)


def test_scale_factor_operands_keep_128():
    a, b, off = _ops_inputs(256, [64, 64, 128, 256])
    with pytest.raises(ValueError, match=r"m_aligned=64: an FP8 d_dtype .* multiple of 128"):
        cmj.grouped_gemm_quant(a, b, padded_offsets=off, d_dtype="float8_e4m3fn",
                               norm_const_tensor=jnp.ones((1,), jnp.float32), m_aligned=64)
    c = jnp.ones((256, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"m_aligned=8: an FP8 d_dtype"):
        cmj.grouped_gemm_dglu(a, b, c, padded_offsets=off, d_dtype="float8_e5m2",
                              norm_const_tensor=jnp.ones((1,), jnp.float32), m_aligned=8)
    from cudnn_moe_jax import formats
    x = jnp.ones((256, 64), jnp.float32)
    qa, sa = formats.to_block_scaled(x, "mxfp8")
    qb, sb = formats.to_block_scaled(jnp.ones((L, 64, 64), jnp.float32), "mxfp8")
    with pytest.raises(ValueError, match=r"m_aligned=32: block-scaled float8_e4m3fn A .* multiple of 128"):
        cmj.grouped_gemm_quant(qa, qb, sa, sb, padded_offsets=off, m_aligned=32)
    out = cmj.grouped_gemm_quant(qa, qb, sa, sb, padded_offsets=jnp.asarray([128, 128, 128, 256], jnp.int32),
                                 m_aligned=128)
    assert out.d_tensor.shape == (256, 64)


def test_wgrad_takes_the_keyword():
    a = jnp.ones((64, 40), jnp.bfloat16)
    out = cmj.grouped_gemm_wgrad(a, a, jnp.asarray([3, 3, 17, 40], jnp.int32), m_aligned=1)
    assert out.wgrad_tensor.shape == (L, 64, 64)


def test_traced_offsets_are_sanitized_to_the_alignment():
    a, b, _ = _ops_inputs(64, [0, 0, 0, 0])
    fn = jax.jit(lambda off: cmj.grouped_gemm_quant(a, b, padded_offsets=off, m_aligned=4).d_tensor)
    d = np.asarray(fn(jnp.asarray([7, 5, 30, 63], jnp.int32)), np.float32)   # -> 4, 4, 28, 60
    assert np.all(d[:60] == 64.0) and np.all(d[60:] == 0.0)


def test_dbias_partials_of_list_tiles_reduce_by_the_tile_ends():
    """The lowering's dbias reduction for tile lists (kernels/scheduler.py): one partial per list tile, each group's
    tiles cut from its first row (ends 1, 1, 130, 300 -> 1, 0, 2, 2 tiles), rows past the last tile never written
    (NaN here) and dropped."""
    from cudnn_moe_jax import operands
    from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem

    m, n = 300, 64
    problem = GroupedGemmProblem(op="dsrelu", m=m, n=n, k=64, num_groups=L, ab_dtype="bfloat16", m_aligned=1,
                                 epilogue=Epilogue(act="dsrelu", c_dtype="bfloat16", dbias_dtype="float32"))
    rows = operands.m_tiles(problem)
    assert rows == 3 + L
    parts = np.random.default_rng(3).standard_normal((rows, n)).astype(np.float32)
    parts[5:] = np.nan
    d = jnp.zeros((m, n), jnp.bfloat16)
    out = operands.finish(problem)([d, jnp.zeros((2, m), jnp.float32), jnp.asarray(parts)],
                                   {"padded_offsets": jnp.asarray([1, 1, 130, 300], jnp.int32)})
    want = [parts[0], np.zeros(n), parts[1] + parts[2], parts[3] + parts[4]]
    np.testing.assert_allclose(np.asarray(out[2]), np.stack(want), rtol=1e-6, atol=1e-6)


def test_weight_only_block_scaled_b_takes_any_alignment():
    """bf16 A with block-scaled weights: only B has scale factors (along N, not M), so any m_aligned passes;
    every row times its own group's dequantized weight."""
    from cudnn_moe_jax import formats

    m, n, k = 100, 64, 64
    key = jax.random.PRNGKey(9)
    a = jax.random.normal(key, (m, k)).astype(jnp.bfloat16)
    b, sfb = formats.to_block_scaled(jax.random.normal(jax.random.fold_in(key, 1), (L, n, k)), "mxfp8")
    ends = np.array([3, 3, 61, 97])
    out = cmj.grouped_gemm_quant(a, b, None, sfb, jnp.asarray(ends, jnp.int32), d_dtype="float32", m_aligned=1)
    w = np.asarray(formats.from_block_scaled(b, sfb, "mxfp8"), np.float64)
    a64, want = np.asarray(a, np.float64), np.zeros((m, n))
    for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends)):
        want[s:e] = a64[s:e] @ w[g].T
    np.testing.assert_allclose(np.asarray(out.d_tensor), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
