"""Public API: result object, canonical/3-D forms, validation errors, jit/eager/export, autodiff/vmap errors,
and the defined behaviour of bad device offsets."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_moe_jax as cmj
from cudnn_moe_jax import formats

M, K, N, L = 512, 64, 128, 3
OFFSETS = np.array([256, 256, 512], np.int32)  # expert 1 empty


def _bf16(key, shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(key), shape)).astype(jnp.bfloat16)


@pytest.fixture(scope="module")
def data():
    return dict(a=_bf16(1, (M, K)), b=_bf16(2, (L, N, K)), prob=jax.random.uniform(jax.random.PRNGKey(3), (M,)),
                alpha=jnp.array([1.0, 2.0, 0.5], jnp.float32), offsets=jnp.asarray(OFFSETS))


@pytest.fixture(scope="module")
def mx():
    x = jax.random.normal(jax.random.PRNGKey(4), (M, K)) * 3
    w = jax.random.normal(jax.random.PRNGKey(5), (L, N, K))
    a, sfa = formats.to_block_scaled(x, "float8_e4m3fn")
    b, sfb = formats.to_block_scaled(w, "float8_e4m3fn")
    return dict(a=a, b=b, sfa=sfa, sfb=sfb)


# ---------------------------------------------------------------------------------------------------------------
# Result object

def test_result_unpacks_indexes_and_crosses_jit(data):
    out = cmj.grouped_gemm_glu(data["a"], data["b"], padded_offsets=data["offsets"], prob_tensor=data["prob"])
    c, d, d_col, amax, sfd_row, sfd_col = out
    assert out.keys() == ("c_tensor", "d_tensor", "d_col_tensor", "amax_tensor", "sfd_row_tensor",
                          "sfd_col_tensor")
    assert out["d_tensor"] is d and out.d_tensor is d and out[1] is d
    assert d_col is None and sfd_row is None and sfd_col is None
    assert c.shape == (M, N) and d.shape == (M, N // 2) and amax.shape == (L, 1)
    with pytest.raises(KeyError):
        out["nope"]
    import copy
    import pickle

    for clone in (copy.copy(out), copy.deepcopy(out), pickle.loads(pickle.dumps(out))):
        assert clone.keys() == out.keys()
        np.testing.assert_array_equal(np.asarray(clone.d_tensor, np.float32), np.asarray(d, np.float32))
    jitted = jax.jit(lambda a, b, o, p: cmj.grouped_gemm_glu(a, b, padded_offsets=o, prob_tensor=p))(
        data["a"], data["b"], data["offsets"], data["prob"])
    assert isinstance(jitted, cmj.OpResult) and jitted.keys() == out.keys()
    for x, y in zip(out, jitted):
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_cudnn_3d_shapes_flat_sf_and_uint8_sf_are_accepted(data, mx):
    ref = cmj.grouped_gemm_quant(mx["a"], mx["b"], mx["sfa"], mx["sfb"], data["offsets"], data["alpha"],
                                 data["prob"])
    alt = cmj.grouped_gemm_quant(mx["a"][:, :, None], mx["b"], jnp.ravel(mx["sfa"]),
                                 jax.lax.bitcast_convert_type(mx["sfb"], jnp.uint8),
                                 data["offsets"], data["alpha"].reshape(L, 1, 1), data["prob"].reshape(M, 1, 1))
    np.testing.assert_array_equal(np.asarray(ref.d_tensor, np.float32), np.asarray(alt.d_tensor, np.float32))


def test_sf_outputs_have_sf_dtype_and_physical_shape(data, mx):
    out = cmj.grouped_gemm_quant(mx["a"], mx["b"], mx["sfa"], mx["sfb"], data["offsets"], data["alpha"],
                                 data["prob"], norm_const_tensor=jnp.ones((1,)), d_dtype="float8_e4m3fn")
    assert out.d_tensor.dtype == jnp.float8_e4m3fn and out.d_col_tensor.shape == (M, N)
    assert out.sfd_row_tensor.dtype == jnp.float8_e8m0fnu
    assert out.sfd_row_tensor.shape == (1, M // 128, 1, 32, 4, 4)
    assert out.sfd_col_tensor.shape == (1, N // 128, M // 32 // 4, 32, 4, 4)
    assert out.amax_tensor is None
    flat = cmj.grouped_gemm_quant(mx["a"], mx["b"], mx["sfa"], mx["sfb"], data["offsets"], data["alpha"],
                                  data["prob"], norm_const_tensor=jnp.ones((1,)), d_dtype="float8_e4m3fn",
                                  discrete_col_sfd=True)
    assert flat.sfd_col_tensor.shape == (N * M // 32,)


# ---------------------------------------------------------------------------------------------------------------
# Validation: every static rule raises before lowering, naming the argument

def _quant(data, **kw):
    args = dict(a_tensor=data["a"], b_tensor=data["b"], padded_offsets=data["offsets"])
    args.update(kw)
    return cmj.grouped_gemm_quant(**args)


BAD_INPUTS = [
    # (description, kwargs override, exception, message fragment)
    ("m not multiple of 256", lambda d, mx: dict(a_tensor=d["a"][:300]), ValueError, "multiple of 256"),
    ("A/B dtype mismatch", lambda d, mx: dict(b_tensor=d["b"].astype(jnp.float16)), TypeError, "same dtype"),
    ("K mismatch", lambda d, mx: dict(b_tensor=d["b"][:, :, :32]), ValueError, "does not match"),
    ("B not 3-D", lambda d, mx: dict(b_tensor=d["b"][0]), ValueError, "(L, N, K)"),
    ("offsets wrong length", lambda d, mx: dict(padded_offsets=d["offsets"][:2]), ValueError, "padded_offsets"),
    ("offsets float", lambda d, mx: dict(padded_offsets=d["offsets"].astype(jnp.float32)), TypeError,
     "padded_offsets"),
    ("alpha wrong length", lambda d, mx: dict(alpha_tensor=jnp.ones(5)), ValueError, "alpha_tensor"),
    ("prob wrong length", lambda d, mx: dict(prob_tensor=jnp.ones(7)), ValueError, "prob_tensor"),
    ("bias wrong shape", lambda d, mx: dict(bias_tensor=jnp.ones((N, L), jnp.bfloat16)), ValueError,
     "bias_tensor"),
    ("bias int dtype", lambda d, mx: dict(bias_tensor=jnp.ones((L, N), jnp.int32)), ValueError, "bias_tensor"),
    ("scales for bf16", lambda d, mx: dict(sfa_tensor=mx["sfa"]), TypeError, "sfa_tensor"),
    ("fp8 without scales", lambda d, mx: dict(a_tensor=mx["a"], b_tensor=mx["b"]), TypeError, "sfa_tensor"),
    ("fp8 vec 16", lambda d, mx: dict(a_tensor=mx["a"], b_tensor=mx["b"], sfa_tensor=mx["sfa"],
                                      sfb_tensor=mx["sfb"], sf_vec_size=16), ValueError, "sf_vec_size"),
    ("sfa wrong size", lambda d, mx: dict(a_tensor=mx["a"], b_tensor=mx["b"], sfa_tensor=mx["sfa"][:, :1],
                                          sfb_tensor=mx["sfb"]), ValueError, "sfa_tensor"),
    ("sfb float32", lambda d, mx: dict(a_tensor=mx["a"], b_tensor=mx["b"], sfa_tensor=mx["sfa"],
                                       sfb_tensor=mx["sfb"].astype(jnp.float32)), TypeError, "sfb_tensor"),
    ("sf_vec_size with bf16", lambda d, mx: dict(sf_vec_size=32), ValueError, "sf_vec_size"),
    ("fp8 D without norm_const", lambda d, mx: dict(d_dtype="float8_e4m3fn"), ValueError, "norm_const_tensor"),
    ("bad d_dtype", lambda d, mx: dict(d_dtype=jnp.int8), ValueError, "d_dtype"),
    ("fp4 D without norm_const", lambda d, mx: dict(d_dtype="float4_e2m1fn"), ValueError, "norm_const_tensor"),
    ("fp4 D, N_out % 32", lambda d, mx: dict(b_tensor=d["b"][:, :48], bias_tensor=None, d_dtype="float4_e2m1fn",
                                             norm_const_tensor=jnp.ones(1)), ValueError, "multiple of 32"),
    ("discrete_col_sfd without FP8 D", lambda d, mx: dict(discrete_col_sfd=True), ValueError,
     "discrete_col_sfd"),
    ("acc_dtype", lambda d, mx: dict(acc_dtype=jnp.float16), ValueError, "acc_dtype"),
    ("m_aligned", lambda d, mx: dict(m_aligned=100), ValueError, "m_aligned"),
    ("stream", lambda d, mx: dict(stream=1), ValueError, "stream"),
    ("unknown keyword", lambda d, mx: dict(c_dtype="bfloat16"), TypeError,
     "unexpected keyword argument(s) ['c_dtype']"),
    ("mma_tiler_mn not a pair", lambda d, mx: dict(mma_tiler_mn=128), ValueError, "mma_tiler_mn"),
    ("too many experts", lambda d, mx: dict(b_tensor=jnp.zeros((1025, 8, K), jnp.bfloat16),
                                            padded_offsets=jnp.zeros(1025, jnp.int32)), ValueError, "1024"),
    ("b and b_tensors", lambda d, mx: dict(b_tensors=[d["b"][0]] * L), ValueError, "exactly one"),
    ("b_tensors mixed shapes", lambda d, mx: dict(b_tensor=None, b_tensors=[d["b"][0], d["b"][1, :64]]),
     ValueError, "b_tensors"),
    ("sfb_tensors for bf16", lambda d, mx: dict(b_tensor=None, b_tensors=list(d["b"]), sfb_tensors=list(mx["sfb"])),
     TypeError, "sfb_tensors must be None"),
    ("fp8 b_tensors without sfb_tensors", lambda d, mx: dict(a_tensor=mx["a"], b_tensor=None, b_tensors=list(mx["b"]),
                                                             sfa_tensor=mx["sfa"]), TypeError, "sfb_tensors"),
    ("sfb_tensors mixed SF dtypes", lambda d, mx: dict(
        a_tensor=mx["a"], b_tensor=None, b_tensors=list(mx["b"]), sfa_tensor=mx["sfa"],
        sfb_tensors=[mx["sfb"][0:1].view(jnp.float8_e8m0fnu), mx["sfb"][1:2].view(jnp.float8_e4m3fn),
                     mx["sfb"][2:3]]), TypeError,
     "share one scale-factor dtype"),
    ("fp4 as float4 dtype", lambda d, mx: dict(a_tensor=jnp.zeros((M, K), jnp.float4_e2m1fn)), TypeError,
     "uint8"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_clear_error(data, mx, case):
    _, override, exc, fragment = case
    with pytest.raises(exc, match=None) as info:
        _quant(data, **override(data, mx))
    assert fragment in str(info.value), str(info.value)


def test_bad_inputs_of_other_ops(data):
    a, b, o = data["a"], data["b"], data["offsets"]
    with pytest.raises(ValueError, match="act_func"):
        cmj.grouped_gemm_glu(a, b, padded_offsets=o, act_func="relu")
    with pytest.raises(ValueError, match="multiple of 64"):
        cmj.grouped_gemm_glu(a, b[:, :96], padded_offsets=o)
    with pytest.raises(ValueError, match="b_tensors: N=96"):
        cmj.grouped_gemm_glu(a, b_tensors=list(b[:, :96]), padded_offsets=o)
    with pytest.raises(ValueError, match="glu_limit"):
        cmj.grouped_gemm_glu(a, b, padded_offsets=o, glu_limit=-1.0)
    with pytest.raises(TypeError, match="glu_alpha"):
        cmj.grouped_gemm_glu(a, b, padded_offsets=o, glu_alpha="two")
    with pytest.raises(ValueError, match="tanh_clamp_scale"):
        cmj.grouped_gemm_srelu(a, b, padded_offsets=o, tanh_clamp_scale=0.0)
    for op in (cmj.grouped_gemm_srelu, cmj.grouped_gemm_glu):    # C is always an output of these ops
        with pytest.raises(TypeError, match="c_dtype"):
            op(a, b, padded_offsets=o, c_dtype=None)
    with pytest.raises(ValueError, match="c_tensor"):
        cmj.grouped_gemm_dglu(a, b[:, :32], c_tensor=jnp.ones((M, 10), jnp.bfloat16),
                              padded_offsets=o)
    with pytest.raises(NotImplementedError, match="d_dtype=float4_e2m1fn: cuDNN's dglu / dsrelu"):
        cmj.grouped_gemm_dsrelu(a, b, c_tensor=jnp.ones((M, N), jnp.bfloat16), padded_offsets=o,
                                d_dtype="float4_e2m1fn", norm_const_tensor=jnp.ones(1))
    with pytest.raises(NotImplementedError, match="c_dtype=float4_e2m1fn"):
        cmj.grouped_gemm_glu(a, b, padded_offsets=o, c_dtype="float4_e2m1fn")
    with pytest.raises(ValueError, match="dbias_dtype"):
        cmj.grouped_gemm_dsrelu(a, b, c_tensor=jnp.ones((M, N), jnp.bfloat16), padded_offsets=o,
                                dbias_dtype="float32")
    with pytest.raises(ValueError, match="N_out % 128"):
        cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o, d_dtype="float4_e2m1fn",
                                            norm_const_tensor=jnp.ones(1))
    with pytest.raises(ValueError, match="colwise"):
        cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o, rht_mode="colwise", rht_dtype="bfloat16")
    with pytest.raises(ValueError, match="hadamard_tensor"):           # would be ignored without an RHT output
        cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o, hadamard_tensor=jnp.eye(16))
    with pytest.raises(ValueError, match="glu_limit"):                 # srelu has no GLU options
        cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o, act_func="srelu", glu_limit=1.0)
    with pytest.raises(ValueError, match="wgrad_tensor"):
        cmj.grouped_gemm_wgrad(a.T, a.T, o, accumulate_on_output=True)
    with pytest.raises(ValueError, match="global_scale"):
        cmj.grouped_gemm_wgrad(a.T, a.T, o, global_scale_a=jnp.ones(L))
    with pytest.raises(ValueError, match="wgrad_tensor dtype"):
        cmj.grouped_gemm_wgrad(a.T, a.T, o, wgrad_tensor=jnp.zeros((L, K, K), jnp.int32), accumulate_on_output=True)


# ---------------------------------------------------------------------------------------------------------------
# Execution modes

def test_eager_calls_reuse_one_compilation(data):
    from cudnn_moe_jax import _primitive

    args = dict(a_tensor=data["a"], b_tensor=data["b"], padded_offsets=data["offsets"], alpha_tensor=data["alpha"])
    first = cmj.grouped_gemm_quant(**args, d_dtype="float16").d_tensor
    misses = _primitive._jitted.cache_info().misses
    second = cmj.grouped_gemm_quant(**args, d_dtype="float16").d_tensor
    assert _primitive._jitted.cache_info().misses == misses       # same static call: no new jit (no recompile)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


def test_eager_jit_and_export_agree(data):
    def f(a, b, o, p, al):
        return cmj.grouped_gemm_srelu(a, b, padded_offsets=o, prob_tensor=p, alpha_tensor=al)

    args = (data["a"], data["b"], data["offsets"], data["prob"], data["alpha"])
    eager = f(*args)
    jitted = jax.jit(f)(*args)
    exported = jax.export.export(jax.jit(f))(*args)
    restored = jax.export.deserialize(exported.serialize())
    via_export = restored.call(*args)
    for key in ("c_tensor", "d_tensor", "amax_tensor"):
        e = np.asarray(eager[key], np.float32)
        np.testing.assert_array_equal(e, np.asarray(jitted[key], np.float32))
        np.testing.assert_array_equal(e, np.asarray(via_export[key], np.float32))


def test_export_for_cuda_platform_lowers_without_a_gpu(data):
    def f(a, b, o):
        return cmj.grouped_gemm_quant(a, b, padded_offsets=o).d_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        exported = jax.export.export(jax.jit(f), platforms=["cuda"],
                                     disabled_checks=cmj.export_disabled_checks())(data["a"], data["b"],
                                                                                    data["offsets"])
    assert exported.platforms == ("cuda",)
    assert exported.out_avals[0].shape == (M, N)


def test_grad_and_vmap_name_the_explicit_backward_ops(data):
    def loss(a):
        return jnp.sum(cmj.grouped_gemm_quant(a, data["b"], padded_offsets=data["offsets"]).d_tensor
                       .astype(jnp.float32))

    with pytest.raises(TypeError, match="grouped_gemm_dglu"):
        jax.grad(loss)(data["a"])
    with pytest.raises(TypeError, match="vmap"):
        jax.vmap(lambda a: cmj.grouped_gemm_quant(a, data["b"], padded_offsets=data["offsets"]).d_tensor)(
            data["a"][None])


# ---------------------------------------------------------------------------------------------------------------
# Bad device offsets: defined output (sanitized ends), never out of bounds

@pytest.mark.parametrize("bad, sanitized", [
    ([512, 256, 512], [512, 512, 512]),        # decreasing -> running max
    ([256, 9999, -5], [256, 512, 512]),        # beyond m -> clipped to m; negative after -> running max
    ([300, 300, 700], [256, 256, 512]),        # not multiples of 256 -> rounded down, clipped
    ([-256, -1, 0], [0, 0, 0]),                # all empty -> every output zero
])
def test_bad_offsets_have_the_sanitized_semantics(data, bad, sanitized):
    def run(offsets):
        return cmj.grouped_gemm_glu(data["a"], data["b"], padded_offsets=jnp.asarray(offsets, jnp.int32),
                                    prob_tensor=data["prob"], alpha_tensor=data["alpha"])

    got, want = jax.jit(run)(bad), run(sanitized)
    for key in ("c_tensor", "d_tensor", "amax_tensor"):
        g = np.asarray(got[key], np.float32)
        assert np.all(np.isfinite(g))
        np.testing.assert_array_equal(g, np.asarray(want[key], np.float32))
    valid = sanitized[-1]
    assert not np.any(np.asarray(got.c_tensor, np.float32)[valid:])


def test_hadamard_srelu_takes_tanh_clamp_scale(data):
    a, b, o, p = data["a"], data["b"], data["offsets"], data["prob"]
    plain = cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o, prob_tensor=p, act_func="srelu")
    clamped = cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o, prob_tensor=p, act_func="srelu",
                                                  tanh_clamp_scale=0.5)
    want = cmj.grouped_gemm_srelu(a, b, padded_offsets=o, prob_tensor=p, tanh_clamp_scale=0.5).d_tensor
    np.testing.assert_array_equal(np.asarray(clamped.d_tensor, np.float32), np.asarray(want, np.float32))
    assert np.max(np.asarray(clamped.d_tensor, np.float32)) <= 0.25 * 1.01  # (s * tanh(.))^2 <= s^2, prob <= 1
    assert np.max(np.asarray(plain.d_tensor, np.float32)) > 0.25
    with pytest.raises(ValueError, match="tanh_clamp_scale"):
        cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o, tanh_clamp_scale=0.5)


def test_wgrad_dtype_conflict_with_accumulated_tensor(data):
    a, o = data["a"], data["offsets"]
    existing = jnp.ones((L, 64, 64), jnp.float32)
    out = cmj.grouped_gemm_wgrad(a.T, a.T, o, wgrad_tensor=existing, accumulate_on_output=True)
    assert out.wgrad_tensor.dtype == jnp.float32
    with pytest.raises(ValueError, match="wgrad_dtype"):
        cmj.grouped_gemm_wgrad(a.T, a.T, o, wgrad_tensor=existing, accumulate_on_output=True,
                               wgrad_dtype="bfloat16")


def test_uint8_scale_factors_mean_e8m0_and_e4m3_scales_arrive_typed():
    x = jax.random.normal(jax.random.PRNGKey(9), (M, K))
    w = jax.random.normal(jax.random.PRNGKey(10), (L, N, K))
    a, sfa = formats.to_block_scaled(x, "float4_e2m1fn", "float8_e4m3fn", 16)
    b, sfb = formats.to_block_scaled(w, "float4_e2m1fn", "float8_e4m3fn", 16)
    assert sfa.dtype == jnp.float8_e4m3fn and sfb.dtype == jnp.float8_e4m3fn
    out = cmj.grouped_gemm_quant(a, b, sfa, sfb, jnp.asarray(OFFSETS))  # sf_vec_size 16 inferred from e4m3
    assert bool(jnp.all(jnp.isfinite(out.d_tensor.astype(jnp.float32))))
    with pytest.raises(TypeError, match="share one scale-factor dtype"):
        cmj.grouped_gemm_quant(a, b, jax.lax.bitcast_convert_type(sfa, jnp.uint8), sfb, jnp.asarray(OFFSETS))


@pytest.mark.parametrize("name, vec_args", [("nvfp4", (None, 16)), ("mxfp4", (32,)), ("nvfp4_e8m0", (16,))])
def test_fp4_formats_by_name_give_the_exact_result(name, vec_args):
    """The first-user case: all-equal operands, K = 64 (6.0 is exact in every FP4 format), so D = 36 * K exactly;
    'nvfp4' used to quantize as MXFP4 and gave half of it with sf_vec_size=16, with no error."""
    k = 64
    a, sfa = formats.to_block_scaled(jnp.full((M, k), 6.0), name)
    b, sfb = formats.to_block_scaled(jnp.full((L, N, k), 6.0), name)
    for vec in vec_args:
        d = cmj.grouped_gemm_quant(a, b, sfa, sfb, jnp.asarray(OFFSETS), sf_vec_size=vec, d_dtype="float32").d_tensor
        np.testing.assert_array_equal(np.asarray(d), np.full((M, N), 36.0 * k, np.float32))


def test_fp4_random_operands_by_format_name_match_the_float64_oracle():
    x = jax.random.normal(jax.random.PRNGKey(12), (M, 128)) * 3
    w = jax.random.normal(jax.random.PRNGKey(13), (L, N, 128))
    for name in ("nvfp4", "mxfp4", "nvfp4_e8m0"):
        a, sfa = formats.to_block_scaled(x, name)
        b, sfb = formats.to_block_scaled(w, name)
        vec = formats.BLOCK_FORMATS[name][2]
        d = cmj.grouped_gemm_quant(a, b, sfa, sfb, jnp.asarray(OFFSETS), sf_vec_size=vec, d_dtype="float32")
        xa = np.asarray(formats.from_block_scaled(a, sfa, name), np.float64)
        wb = np.asarray(formats.from_block_scaled(b, sfb, name), np.float64)
        want = np.zeros((M, N))
        for g, (start, end) in enumerate(zip([0, *OFFSETS[:-1]], OFFSETS)):
            want[start:end] = xa[start:end] @ wb[g].T
        np.testing.assert_allclose(np.asarray(d.d_tensor), want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


def test_scales_quantized_for_another_vec_size_are_rejected():
    """Where K tells the vec sizes apart (K > 64), FP4 scales of the other vec have another shape: the error says
    which vec they were made for. e4m3 scales are NVFP4 (vec 16) by their dtype."""
    x, w = jnp.ones((M, 128)), jnp.ones((L, N, 128))
    a, sfa = formats.to_block_scaled(x, "mxfp4")
    b, sfb = formats.to_block_scaled(w, "mxfp4")
    with pytest.raises(ValueError, match="sfa_tensor: .*shape is that of sf_vec_size=32 scales"):
        cmj.grouped_gemm_quant(a, b, sfa, sfb, jnp.asarray(OFFSETS), sf_vec_size=16)
    a16, sfa16 = formats.to_block_scaled(x, "nvfp4_e8m0")
    with pytest.raises(ValueError, match="sfa_tensor: .*shape is that of sf_vec_size=16 scales"):
        cmj.grouped_gemm_quant(a16, b, sfa16, sfb, jnp.asarray(OFFSETS), sf_vec_size=32)
    with pytest.raises(ValueError, match=r"sfb_tensors\[0\]: .*shape is that of sf_vec_size=32 scales"):
        cmj.grouped_gemm_quant(a16, b_tensors=list(b), sfa_tensor=sfa16, sfb_tensors=[s[None] for s in sfb],
                               padded_offsets=jnp.asarray(OFFSETS), sf_vec_size=16)
    nv_a, nv_sfa = formats.to_block_scaled(x, "nvfp4")
    nv_b, nv_sfb = formats.to_block_scaled(w, "nvfp4")
    with pytest.raises(ValueError, match="float8_e4m3fn scale factors require sf_vec_size=16"):
        cmj.grouped_gemm_quant(nv_a, nv_b, nv_sfa, nv_sfb, jnp.asarray(OFFSETS), sf_vec_size=32)
    with pytest.raises(ValueError, match="sf_vec_size is required for FP4 inputs with e8m0 scales"):
        cmj.grouped_gemm_quant(a, b, sfa, sfb, jnp.asarray(OFFSETS))


@pytest.mark.parametrize("layout, fix", [
    ("cudnn (N, K, L)", lambda w: jnp.transpose(w, (2, 0, 1))),
    ("torch (L, K, N)", lambda w: jnp.swapaxes(w, 1, 2)),
])
def test_weights_in_cudnn_or_torch_layout_name_the_transpose(data, layout, fix):
    w = data["b"]                                        # (L, N, K), N = 128, K = 64
    held = jnp.transpose(w, (1, 2, 0)) if layout.startswith("cudnn") else jnp.swapaxes(w, 1, 2)
    with pytest.raises(ValueError) as info:
        cmj.grouped_gemm_quant(data["a"], held, padded_offsets=data["offsets"])
    message = str(info.value)
    assert "(L, N, K)" in message and "has K in the middle" in message, message
    assert ("jnp.transpose(b, (2, 0, 1))" if layout.startswith("cudnn") else "jnp.swapaxes(b, 1, 2)") in message
    np.testing.assert_array_equal(fix(held), w)                 # the named transpose is the right one
    with pytest.raises(ValueError, match=r"looks like \(K, N\): pass its transpose"):
        cmj.grouped_gemm_quant(data["a"], b_tensors=[x.T for x in w], padded_offsets=data["offsets"])


# ---------------------------------------------------------------------------------------------------------------
# Concrete (eager) offsets are checked; errors name the argument, the index, the rule and the call that fixes it

@pytest.mark.parametrize("bad, fragment", [
    ([256, 300, 512], "padded_offsets[1]=300 is not a multiple of 256"),
    ([512, 256, 512], "padded_offsets[1]=256 is smaller than padded_offsets[0]=512"),
    ([256, 512, 768], "padded_offsets[2]=768 is outside [0, 512]"),
    ([-256, 256, 512], "padded_offsets[0]=-256 is outside [0, 512]"),
])
def test_concrete_offsets_breaking_the_rules_raise(data, bad, fragment):
    a, b = data["a"], data["b"]
    c = jnp.ones((M, N), jnp.bfloat16)
    calls = [lambda o: cmj.grouped_gemm_quant(a, b, padded_offsets=o),
             lambda o: cmj.grouped_gemm_glu(a, b, padded_offsets=o),
             lambda o: cmj.grouped_gemm_srelu(a, b, padded_offsets=o),
             lambda o: cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o),
             lambda o: cmj.grouped_gemm_dsrelu(a, b, c_tensor=c, padded_offsets=o)]
    for call in calls:
        for offsets in (bad, np.asarray(bad, np.int32), jnp.asarray(bad, jnp.int32)):
            with pytest.raises(ValueError) as info:
                call(offsets)
            assert fragment in str(info.value) and "cudnn_moe_jax.nn.route" in str(info.value), str(info.value)


def test_offsets_the_host_knows_are_checked_under_jit_too_and_the_docs_say_so(data):
    """README and docs/ops.md describe what ops/_checks.offsets_vector does: values known on the host (eager, or a
    NumPy / concrete array closed over under jit) are checked; traced ones are sanitized."""
    a, b, bad = data["a"], data["b"], [256, 300, 512]
    for const in (np.asarray(bad, np.int32), jnp.asarray(bad, jnp.int32)):
        with pytest.raises(ValueError, match=r"padded_offsets\[1\]=300 is not a multiple of 256"):
            jax.jit(lambda a: cmj.grouped_gemm_quant(a, b, padded_offsets=const).d_tensor)(a)
    traced = jax.jit(lambda a, o: cmj.grouped_gemm_quant(a, b, padded_offsets=o).d_tensor)(a, jnp.asarray(bad))
    want = cmj.grouped_gemm_quant(a, b, padded_offsets=jnp.asarray([256, 256, 512])).d_tensor   # sanitized ends
    np.testing.assert_array_equal(np.asarray(traced, np.float32), np.asarray(want, np.float32))
    root = Path(__file__).resolve().parents[1]
    readme, ops = (root / "README.md").read_text(), (root / "docs" / "ops.md").read_text()
    assert "Offsets known on the host" in readme and "Offset values are checked when the host knows them" in ops
    assert "offset values, prob values) is never checked" not in ops


def test_concrete_wgrad_token_offsets_are_checked(data):
    a = data["a"]
    for bad, fragment in (([256, 128, 512], "offsets_tensor[1]=128 is smaller than offsets_tensor[0]=256"),
                          ([100, 200, 513], "offsets_tensor[2]=513 is outside [0, 512]")):
        with pytest.raises(ValueError) as info:
            cmj.grouped_gemm_wgrad(a.T, a.T, jnp.asarray(bad, jnp.int32))
        assert fragment in str(info.value), str(info.value)
    # token ends need no 256 rule, and traced ends are sanitized instead of checked
    cmj.grouped_gemm_wgrad(a.T, a.T, jnp.asarray([100, 100, 512], jnp.int32))
    jax.jit(lambda o: cmj.grouped_gemm_wgrad(a.T, a.T, o).wgrad_tensor)(jnp.asarray([256, 128, 999], jnp.int32))


def test_scale_factor_errors_name_the_packer_that_fixes_them(mx, data):
    with pytest.raises(ValueError) as info:
        _quant(data, a_tensor=mx["a"], b_tensor=mx["b"], sfa_tensor=mx["sfa"][:, :1], sfb_tensor=mx["sfb"])
    assert "formats.to_block_scaled" in str(info.value) and "formats.pack_sf" in str(info.value)
    # wgrad takes per-expert segment scales: the hint is the segment packer, and following it works
    x = jax.random.normal(jax.random.PRNGKey(11), (K, M))          # (rows, tokens): tokens contiguous
    codes, s = formats.quantize_rows(x, formats.E4M3)
    tiled = formats.pack_sf(s)
    with pytest.raises(ValueError) as info:
        cmj.grouped_gemm_wgrad(codes, codes, data["offsets"], tiled, tiled, sf_vec_size=32)
    assert "formats.pack_sf_segments(s, offsets_tensor, sf_vec_size)" in str(info.value), str(info.value)
    seg = formats.pack_sf_segments(s, data["offsets"], 32)
    w = cmj.grouped_gemm_wgrad(codes, codes, data["offsets"], seg, seg, sf_vec_size=32, wgrad_dtype="float32")
    deq = np.asarray(formats.dequantize(codes, s, formats.E4M3, formats.E8M0, 32))
    np.testing.assert_allclose(np.asarray(w.wgrad_tensor[0]), deq[:, :256] @ deq[:, :256].T, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("data,sf,vec", [(formats.E2M1, formats.E4M3, 16), (formats.E2M1, formats.E8M0, 32),
                                         (formats.E4M3, formats.E8M0, 32)])
def test_weight_only_bf16_a_with_block_scaled_b(data, sf, vec):
    """A bf16 (or fp16) A, block-scaled weights, sfa_tensor=None: the weights dequantized exactly, A used as stored
    (forward and dgrad); an FP8 A without scales, or scales for the bf16 A, are errors naming the rule."""
    m, n, k, groups = 512, 128, 128, 2
    key = jax.random.PRNGKey(5)
    a = jax.random.normal(key, (m, k)).astype(jnp.bfloat16)
    b, sfb = formats.to_block_scaled(jax.random.normal(jax.random.fold_in(key, 1), (groups, n, k)), data, sf, vec)
    offsets = jnp.asarray([256, 512], jnp.int32)
    out = cmj.grouped_gemm_quant(a, b, None, sfb, offsets, d_dtype="float32", sf_vec_size=vec)
    w = np.asarray(formats.from_block_scaled(b, sfb, data, sf, vec), np.float64)
    a64 = np.asarray(a, np.float64)
    want = np.concatenate([a64[:256] @ w[0].T, a64[256:] @ w[1].T])
    np.testing.assert_allclose(np.asarray(out.d_tensor), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    c = jax.random.normal(jax.random.fold_in(key, 2), (m, n)).astype(jnp.bfloat16)
    dgrad = cmj.grouped_gemm_dsrelu(a, b, c, None, sfb, offsets, sf_vec_size=vec, d_dtype="float32")
    assert dgrad.d_row_tensor.shape == (m, n)
    a16 = a.astype(jnp.float16)                      # an fp16 A: the same math on its values
    out16 = cmj.grouped_gemm_quant(a16, b, None, sfb, offsets, d_dtype="float32", sf_vec_size=vec)
    a64 = np.asarray(a16, np.float64)
    want = np.concatenate([a64[:256] @ w[0].T, a64[256:] @ w[1].T])
    np.testing.assert_allclose(np.asarray(out16.d_tensor), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(TypeError, match="weight-only"):
        cmj.grouped_gemm_quant(a.astype(jnp.float8_e5m2), b, None, sfb, offsets, sf_vec_size=vec)
    _, sfa = formats.to_block_scaled(jnp.ones((m, k)), data, sf, vec)
    with pytest.raises(TypeError, match="weight-only"):
        cmj.grouped_gemm_quant(a, b, sfa, sfb, offsets, sf_vec_size=vec)
