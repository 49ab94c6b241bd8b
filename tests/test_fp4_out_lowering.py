"""CPU: FP4 outputs and grouped_gemm_glu_hadamard_quant reach the sm90 kernel on CUDA. The support predicate routes
every Hadamard-op combination (each activation of the table, bf16 / NVFP4 D, no / rowwise bf16 / rowwise NVFP4 /
colwise Hadamard output, user matrix, bias) and the MXFP4 D of quant / srelu / glu over every input format (bf16,
fp16, the block-scaled formats, weight-only) to the kernel; the combinations left out on purpose raise with their
reason; every public call of the GPU suite (lab/fp4_out_cases.py) lowers for CUDA to one kernel custom call with the
fallback-to-the-reference warning turned into an error (one sm_90a compile each, ~10 s; skipped without the CuTe DSL
compiler); and the bundle items lower each call at exactly the GPU suite's input shapes and dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp4_out_checks as checks  # noqa: E402  (tests/gpu on sys.path: tests/conftest.py)
from runtime_helpers import assert_lowers_to_one_kernel, needs_cutlass  # noqa: E402

import cudnn_moe_jax as cmj  # noqa: E402
from cudnn_moe_jax import activations  # noqa: E402
from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem  # noqa: E402
from cudnn_moe_jax.kernels.sm90 import config  # noqa: E402
from lab import fp4_out_cases as cases  # noqa: E402

E2M1, BF = "float4_e2m1fn", "bfloat16"
INPUTS = [("bfloat16", None, None, None), ("float16", None, None, None)] + [
    (d, s, v, None) for d, s, v in config.BLOCK_FORMATS] + [
    (d, s, v, a) for d, s, v in config.BLOCK_FORMATS for a in (BF, "float16")]   # weight-only: bf16 / fp16 A
RHT_OUTPUTS = [(None, None, False), ("rowwise", BF, False), ("rowwise", E2M1, False), ("rowwise", E2M1, True),
               ("colwise", E2M1, False), ("colwise", E2M1, True)]


def _problem(op, fmt, **epi):
    data, sf, vec, a_dtype = fmt
    return GroupedGemmProblem(op=op, m=1024, n=512, k=256, num_groups=3, ab_dtype=data, sf_dtype=sf,
                              sf_vec_size=vec, a_dtype=a_dtype, epilogue=Epilogue(**epi))


def test_supports_routes_every_hadamard_combination():
    for fmt, act, d_dtype, (rht, rht_dtype, user), bias in itertools.product(
            INPUTS, activations.TABLE, (BF, E2M1), RHT_OUTPUTS, (False, True)):
        if fmt[3] is not None and fmt[0].startswith("float8_e5"):
            continue
        p = _problem("glu_hadamard_quant", fmt, act=act, c_dtype=BF, d_dtype=d_dtype, rht=rht, rht_dtype=rht_dtype,
                     has_hadamard=user, has_bias=bias, bias_dtype=BF if bias else None, compute_amax=d_dtype == BF)
        assert config.supports(p) is None, p
        if E2M1 in (d_dtype, rht_dtype):
            assert "N_out % 128" in config.supports(dataclasses.replace(p, n=320 if act == "srelu" else 640))


def test_supports_routes_mxfp4_d_of_the_forward_ops():
    for fmt, (op, act, c_dtype), dcs in itertools.product(
            INPUTS, (("quant", None, None), ("srelu", "srelu", BF), ("glu", "swiglu", BF), ("glu", "geglu", "float32")),
            (False, True)):
        p = _problem(op, fmt, act=act, c_dtype=c_dtype, d_dtype=E2M1, generate_sfd=True, discrete_col_sfd=dcs)
        assert config.supports(p) is None, p
        if op != "glu":   # GLU: N % 64, so N_out % 32 always
            assert "N_out % 16 / 32" in config.supports(dataclasses.replace(p, n=48))


# The combinations left out on purpose, with the reason each raises (cuDNN's own constraints or a layout rule).
UNSUPPORTED = [
    ("FP4 D of dglu (cuDNN writes FP8 or 16/32-bit D_row)", NotImplementedError, "cuDNN's dglu / dsrelu",
     lambda a, b, o: cmj.grouped_gemm_dglu(a, b[:, :64], c_tensor=jnp.ones((512, 128), jnp.bfloat16),
                                           padded_offsets=o, d_dtype=E2M1, norm_const_tensor=jnp.ones(1))),
    ("FP4 D of dsrelu", NotImplementedError, "cuDNN's dglu / dsrelu",
     lambda a, b, o: cmj.grouped_gemm_dsrelu(a, b, c_tensor=jnp.ones((512, 256), jnp.bfloat16), padded_offsets=o,
                                             d_dtype=E2M1, norm_const_tensor=jnp.ones(1))),
    ("FP4 C (no scale factors to dequantize it by)", NotImplementedError, "c_dtype=float4_e2m1fn",
     lambda a, b, o: cmj.grouped_gemm_glu(a, b, padded_offsets=o, c_dtype=E2M1)),
    ("bf16 colwise Hadamard output (cuDNN: NVFP4 only)", ValueError, "colwise",
     lambda a, b, o: cmj.grouped_gemm_glu_hadamard_quant(a, b, padded_offsets=o, rht_mode="colwise",
                                                         rht_dtype=BF)),
    ("NVFP4 outputs need N_out % 128", ValueError, "N_out % 128",
     lambda a, b, o: cmj.grouped_gemm_glu_hadamard_quant(a, b[:, :128], padded_offsets=o, d_dtype=E2M1,
                                                         norm_const_tensor=jnp.ones(1))),
    ("FP4 D needs 16-byte rows (N_out % 32)", ValueError, "multiple of 32",
     lambda a, b, o: cmj.grouped_gemm_quant(a, b[:, :48], padded_offsets=o, d_dtype=E2M1,
                                            norm_const_tensor=jnp.ones(1))),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_combinations_raise_with_their_reason(case):
    _, exc, fragment, fn = case
    a = jnp.ones((512, 64), jnp.bfloat16)
    b = jnp.ones((2, 256, 64), jnp.bfloat16)
    with pytest.raises(exc, match=None) as info:
        fn(a, b, jnp.asarray([256, 512], jnp.int32))
    assert fragment in str(info.value), str(info.value)


@needs_cutlass
@pytest.mark.parametrize("case", cases.ALL_CASES, ids=[c[0] for c in cases.ALL_CASES])
def test_fp4_output_call_lowers_to_the_kernel(case):
    assert_lowers_to_one_kernel(functools.partial(cases.call, case), checks.inputs(case, mode="exact"))


@pytest.mark.parametrize("mode", ["exact", "random"])
@pytest.mark.parametrize("case", cases.ALL_CASES, ids=[c[0] for c in cases.ALL_CASES])
def test_bundle_items_lower_at_the_suite_inputs(case, mode):
    """The bundle items lower each call at lab.fp4_out_cases.input_avals: exactly the shapes and dtypes of the GPU
    suite's inputs in both modes, so the bundle holds the modules the suite asks for."""
    def sds(v):
        return None if v is None else (tuple(v.shape), str(v.dtype))

    got = {k: sds(v) for k, v in checks.inputs(case, mode=mode).items()}
    assert got == {k: sds(v) for k, v in cases.input_avals(case).items()}
