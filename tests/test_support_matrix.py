"""CPU: every public op over every input format and output kind reaches a kernel on CUDA -- no combination falls
back to the reference for lack of one. Each call is lowered for CUDA with the kernel lowering replaced by a
recorder (no module is compiled): the problem the op hands the kernels must pass `supports` after `read_problem`
(the operand majors the kernels read). The combinations refused on purpose raise at the op with their reason
(tests/test_fp4_out_lowering.py: UNSUPPORTED); every GPU-suite call lowers to a real kernel in the *_lowering tests.
"""

from __future__ import annotations

import functools
import warnings

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cudnn_moe_jax as cmj  # noqa: E402
from cudnn_moe_jax import _lowering, activations, formats  # noqa: E402
from cudnn_moe_jax.formats import BF16 as BF, E2M1 as FP4, E4M3, E5M2, F16, F32  # noqa: E402
from cudnn_moe_jax.kernels.sm90 import config  # noqa: E402

M, N, K, L = 512, 256, 256, 2
HALF = {"bf16": BF, "fp16": F16}
# input formats: 16-bit A and B, block-scaled A and B, a 16-bit A with block-scaled B (weight-only)
INPUTS = list(HALF) + list(formats.BLOCK_FORMATS) + [f"{h}+{f}" for h in HALF for f in formats.BLOCK_FORMATS]
FORWARD_D = (BF, F16, F32, E4M3, E5M2, FP4)
C_DTYPES = (BF, F16, F32, E4M3, E5M2)
BACKWARD_D = (BF, F16, F32, E4M3, E5M2)


@functools.lru_cache(maxsize=None)
def operands(fmt: str, discrete: bool = False) -> dict:
    """a, b (or b_tensors), sfa, sfb, sf_vec_size of an input format."""
    half, _, block = fmt.rpartition("+") if "+" in fmt else ("", "", fmt)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (M, K))
    w = jax.random.normal(jax.random.fold_in(key, 1), (L, N, K))
    if block in HALF:
        a, b, sfa, sfb, vec = x.astype(HALF[block]), w.astype(HALF[block]), None, None, None
    else:
        data, sf, vec = formats.BLOCK_FORMATS[block]
        a, sfa = formats.to_block_scaled(x, data, sf, vec)
        b, sfb = formats.to_block_scaled(w, data, sf, vec)
        if half:
            a, sfa = x.astype(HALF[half]), None
    out = dict(a_tensor=a, sfa_tensor=sfa, sf_vec_size=vec)
    if discrete:
        out.update(b_tensors=[b[e] for e in range(L)], sfb_tensors=None if sfb is None else [sfb[e:e + 1]
                                                                                            for e in range(L)])
    else:
        out.update(b_tensor=b, sfb_tensor=sfb)
    return out


def recorded_problems(monkeypatch, calls) -> list:
    """The problems `calls` (thunks calling public ops) hand the kernel lowering for CUDA."""
    seen = []

    def record(problem, *args, **kwargs):
        seen.append(problem)
        raise _lowering.KernelUnavailable("recorded")   # the primitive then lowers the reference

    monkeypatch.setattr(_lowering, "kernel_lowering", record)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for call in calls:
            jax.jit(call).trace().lower(lowering_platforms=("cuda",))
    return seen


def assert_all_reach_a_kernel(problems, count: int):
    assert len(problems) == count, "a call lowered no grouped GEMM"
    refused = [(p, config.supports(config.read_problem(p))) for p in problems]
    refused = [r for r in refused if r[1] is not None]
    assert not refused, refused[:3]


def _norm(d_dtype):
    return jnp.ones(1) if d_dtype in (E4M3, E5M2, FP4) else None


OFFSETS = jnp.asarray([256, 512], jnp.int32)


@pytest.mark.parametrize("fmt", INPUTS)
def test_forward_ops_reach_a_kernel(fmt, monkeypatch):
    """quant / srelu / glu (every GLU activation; every D and C dtype; N-major and discrete weights) and the
    Hadamard op (bf16 / NVFP4 D; no, rowwise bf16 / NVFP4, colwise NVFP4 output)."""
    x = operands(fmt)
    common = dict(padded_offsets=OFFSETS, **x)
    calls = [functools.partial(cmj.grouped_gemm_quant, d_dtype=d, norm_const_tensor=_norm(d), **common)
             for d in FORWARD_D]
    calls += [functools.partial(cmj.grouped_gemm_srelu, c_dtype=c, d_dtype=BF, **common) for c in C_DTYPES]
    calls += [functools.partial(cmj.grouped_gemm_srelu, d_dtype=d, norm_const_tensor=_norm(d), **common)
              for d in FORWARD_D]
    calls += [functools.partial(cmj.grouped_gemm_glu, act_func=act, **common) for act in activations.GLU_NAMES]
    calls += [functools.partial(cmj.grouped_gemm_glu, c_dtype=c, d_dtype=d, norm_const_tensor=_norm(d), **common)
              for c in (BF, E4M3) for d in FORWARD_D]
    for d in (BF, FP4):
        for rht, rht_dtype in ((None, None), ("rowwise", BF), ("rowwise", FP4), ("colwise", FP4)):
            calls.append(functools.partial(
                cmj.grouped_gemm_glu_hadamard_quant, d_dtype=d, rht_mode=rht, rht_dtype=rht_dtype,
                norm_const_tensor=_norm(d), rht_norm_const_tensor=jnp.ones(1) if rht else None,
                **common))
    b_n = dict(common, b_major="n")
    calls.append(functools.partial(cmj.grouped_gemm_quant, d_dtype=BF, **b_n))
    disc = dict(padded_offsets=OFFSETS, **operands(fmt, discrete=True))
    calls.append(functools.partial(cmj.grouped_gemm_glu, **disc))
    assert_all_reach_a_kernel(recorded_problems(monkeypatch, calls), len(calls))


@pytest.mark.parametrize("fmt", INPUTS)
def test_backward_ops_reach_a_kernel(fmt, monkeypatch):
    """dglu (every GLU derivative) and dsrelu over every D_row and saved-C dtype, N-major and discrete weights."""
    x = operands(fmt)
    common = dict(padded_offsets=OFFSETS, **x)

    def c(width, dtype=BF):
        return jnp.ones((M, width), jnp.float32).astype(dtype if dtype not in (E4M3, E5M2) else jnp.dtype(dtype))

    calls = [functools.partial(cmj.grouped_gemm_dglu, c_tensor=c(2 * N), act_func="d" + act, **common)
             for act in activations.GLU_NAMES]
    calls += [functools.partial(cmj.grouped_gemm_dglu, c_tensor=c(2 * N, cd), d_dtype=d, norm_const_tensor=_norm(d),
                                **common) for cd in (BF, F32, E4M3) for d in BACKWARD_D]
    calls += [functools.partial(cmj.grouped_gemm_dsrelu, c_tensor=c(N, cd), d_dtype=d, norm_const_tensor=_norm(d),
                                **common) for cd in (BF, F32, E4M3) for d in BACKWARD_D]
    calls.append(functools.partial(cmj.grouped_gemm_dsrelu, c_tensor=c(N), b_major="n", **common))
    disc = dict(padded_offsets=OFFSETS, **operands(fmt, discrete=True))
    calls.append(functools.partial(cmj.grouped_gemm_dsrelu, c_tensor=c(N), **disc))
    assert_all_reach_a_kernel(recorded_problems(monkeypatch, calls), len(calls))


WGRAD_INPUTS = list(HALF) + list(formats.BLOCK_FORMATS)


@pytest.mark.parametrize("fmt", WGRAD_INPUTS)
def test_wgrad_reaches_a_kernel(fmt, monkeypatch):
    """wgrad over every input format, every pair of operand majors, bf16 / fp32 W, with and without accumulation
    (NVFP4 with its global scales)."""
    mw, nw, tokens = 256, 128, 512
    key = jax.random.PRNGKey(2)
    xa, xb = jax.random.normal(key, (mw, tokens)), jax.random.normal(jax.random.fold_in(key, 1), (nw, tokens))
    offsets = jnp.asarray([200, tokens], jnp.int32)
    if fmt in HALF:
        ops = dict(a_tensor=xa.astype(HALF[fmt]), b_tensor=xb.astype(HALF[fmt]))
    else:
        data, sf, vec = formats.BLOCK_FORMATS[fmt]
        (a, sa), (b, sb) = (formats.quantize_rows(v, data, sf, vec) for v in (xa, xb))
        ops = dict(a_tensor=a, b_tensor=b, sfa_tensor=formats.pack_sf_segments(sa, offsets, vec),
                   sfb_tensor=formats.pack_sf_segments(sb, offsets, vec), sf_vec_size=vec)
        if sf == E4M3:
            ops.update(global_scale_a=jnp.ones(L), global_scale_b=jnp.ones(L))
    calls = []
    for a_major, b_major in (("k", "k"), ("m", "n"), ("m", "k"), ("k", "n")):
        for wd in (BF, F32):
            calls.append(functools.partial(cmj.grouped_gemm_wgrad, offsets_tensor=offsets, wgrad_dtype=wd,
                                           a_major=a_major, b_major=b_major, **ops))
        calls.append(functools.partial(cmj.grouped_gemm_wgrad, offsets_tensor=offsets, a_major=a_major,
                                       b_major=b_major, wgrad_tensor=jnp.zeros((L, mw, nw), jnp.float32),
                                       accumulate_on_output=True, **ops))
    assert_all_reach_a_kernel(recorded_problems(monkeypatch, calls), len(calls))
