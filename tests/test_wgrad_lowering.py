"""CPU: the K-grouped wgrad lowered for CUDA. One module serves every token count T (it is compiled, keyed and
recorded for the symbolic T = 8*t_blocks): recorded into a bundle at one T, then lowered at other Ts with compiling
disabled, from the bundle, without a reference fallback. accumulate_on_output and global scales lower to the kernel
too, with the output declared as an alias of wgrad_tensor.

Compiles one sm_90a module (~10 s; skipped without the CuTe DSL compiler).
"""

from __future__ import annotations

import warnings

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cudnn_moe_jax as cmj  # noqa: E402
from cudnn_moe_jax import _compile, _modules, _runtime  # noqa: E402
from runtime_helpers import assert_lowers_to_one_kernel, custom_calls, needs_cutlass  # noqa: E402

MW, NW, L = 384, 320, 5
sds = jax.ShapeDtypeStruct


def _wgrad(a, b, offsets, gsa, gsb, w):
    return cmj.grouped_gemm_wgrad(a, b, offsets, global_scale_a=gsa, global_scale_b=gsb, wgrad_tensor=w,
                                  accumulate_on_output=True).wgrad_tensor


def _avals(tokens, w_dtype=jnp.float32):
    return (sds((MW, tokens), jnp.bfloat16), sds((NW, tokens), jnp.bfloat16), sds((L,), jnp.int32),
            sds((L,), jnp.float32), sds((L,), jnp.float32), sds((L, MW, NW), w_dtype))


def _lower(tokens, w_dtype=jnp.float32) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # "no GPU kernel for this ... problem" would be raised
        return jax.jit(_wgrad).trace(*_avals(tokens, w_dtype)).lower(lowering_platforms=("cuda",)).as_text()


def test_wgrad_fingerprint_and_avals_are_token_count_free():
    from cudnn_moe_jax._problem import GroupedGemmProblem

    specs = []
    for tokens in (1000, 4096):
        p = GroupedGemmProblem(op="wgrad", m=MW, n=NW, k=tokens, num_groups=L, ab_dtype="bfloat16",
                               wgrad_dtype="float32", has_global_scales=True, accumulate=True)
        names = ("a", "b", "padded_offsets", "global_scale_a", "global_scale_b", "wgrad")
        specs.append(_runtime.grouped_gemm_spec(p, None, names, _avals(tokens), [sds((L, MW, NW), jnp.float32)]))
    assert specs[0] == specs[1] and specs[0].avals_key == specs[1].avals_key
    t = _runtime.symbolic_t()
    assert str(t) == "8*t_blocks" and specs[0].meta["problem"].k is t
    assert [a.shape for a in specs[0].in_avals] == [(MW, t), (NW, t), (L,), (L,), (L,), (L, MW, NW)]
    with pytest.raises(_runtime.KernelUnavailable, match="axis 1 must be k/1 = 4096"):
        _runtime.grouped_gemm_spec(p, None, names, (sds((MW, 1000), jnp.bfloat16),) + _avals(tokens)[1:],
                                   [sds((L, MW, NW), jnp.float32)])


def _bundle_then_no_compile(tmp_path, monkeypatch, lower_once):
    """Record the module of `lower_once()` into a bundle, then make compiling an error: (its custom calls, the
    bundle's entry)."""
    _runtime.import_cutlass()
    bundle = tmp_path / "bundle"
    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [bundle])
    monkeypatch.setattr(_modules, "_MEMORY", {})
    monkeypatch.setenv("CUDNN_MOE_JAX_MODULE_CACHE", "off")
    with _runtime.recording() as got:
        built = custom_calls(lower_once())
    assert len(got) == 1, "one module for the call"
    _runtime.write_bundle(bundle, got)
    (entry,) = _runtime.read_manifest(bundle)["entries"].values()
    monkeypatch.setattr(_modules, "_MEMORY", {})
    monkeypatch.setenv("CUDNN_MOE_JAX_NO_COMPILE", "1")
    monkeypatch.setattr(_compile, "compile_module", lambda s: pytest.fail(f"compiled {s.name} again"))
    return built, entry


@needs_cutlass
def test_wgrad_bundle_built_at_one_token_count_serves_every_count(tmp_path, monkeypatch):
    built, entry = _bundle_then_no_compile(tmp_path, monkeypatch, lambda: _lower(1000))
    assert entry["in_avals"][0]["shape"] == [MW, "8*t_blocks"] and entry["meta"]["problem"]["k"] == "8*t_blocks"
    assert entry["input_output_aliases"] == [[5, 0]]   # wgrad_tensor (operand 5) is the output's buffer
    for tokens in (1000, 2048, 520):
        text = _lower(tokens)
        (call,) = custom_calls(text)
        assert [call[k] for k in ("target", "key", "module")] == [built[0][k] for k in ("target", "key", "module")]
        assert f"tensor<{MW}x{tokens}xbf16>" in call["types"] and f"tensor<{NW}x{tokens}xbf16>" in call["types"]
        line = next(x for x in text.splitlines() if "CuteDSLRT_NvJaxCutlassCall" in x)
        assert "output_operand_alias<output_tuple_indices = [], operand_index = 5" in line, line
    # another W dtype is another module (the output dtype is part of the problem), not served by this one
    with pytest.raises(RuntimeWarning, match="no GPU kernel"):
        _lower(1000, jnp.bfloat16)


# ------------------------------------------------------------------------------------------------ block-scaled
BS_FORMATS = [("float8_e4m3fn", "float8_e8m0fnu", 32), ("float8_e5m2", "float8_e8m0fnu", 32),
              ("float4_e2m1fn", "float8_e8m0fnu", 32), ("float4_e2m1fn", "float8_e8m0fnu", 16),
              ("float4_e2m1fn", "float8_e4m3fn", 16)]


@pytest.mark.parametrize("fmt", BS_FORMATS, ids=lambda f: f"{f[0]}-{f[1]}-{f[2]}")
def test_supports_routes_block_scaled_wgrad(fmt):
    """Every block format to the kernel, token-contiguous (cuDNN's layout) or, FP8, token-major; with the symbolic
    T of its module; mixed majors and token-major FP4, which the kernel does not read, are refused with the reason
    and mapped by `read_problem` to token-contiguous operands (XLA transposes them)."""
    import dataclasses

    from cudnn_moe_jax._problem import GroupedGemmProblem
    from cudnn_moe_jax.kernels.sm90.config import read_problem, supports

    data, sf, vec = fmt
    p = GroupedGemmProblem(op="wgrad", m=384, n=320, k=2048, num_groups=5, ab_dtype=data, sf_dtype=sf,
                           sf_vec_size=vec, wgrad_dtype="bfloat16")
    for q in (p, dataclasses.replace(p, accumulate=True, has_global_scales=True, wgrad_dtype="float32")):
        assert supports(q) is None and supports(_runtime.canonical_problem(q)) is None, q
    tok = dataclasses.replace(p, a_major="m", b_major="n")
    assert supports(tok) is None if data.startswith("float8") else "token-contiguous only" in supports(tok)
    assert "both token-contiguous" in supports(dataclasses.replace(p, a_major="m"))
    assert "16-byte TMA rows" in supports(dataclasses.replace(p, k=2048 + 8))
    if data.startswith("float8"):
        assert "n_w % 16" in supports(dataclasses.replace(tok, n=328))
    for q in (tok, dataclasses.replace(p, a_major="m"), dataclasses.replace(p, b_major="n"),
              dataclasses.replace(tok, n=328)):
        r = read_problem(q)
        assert supports(r) is None, r
        assert (r.a_major, r.b_major) == (("m", "n") if q == tok and data.startswith("float8") else ("k", "k"))
    assert str(_runtime.canonical_problem(p).k) == f"{16 if data.startswith('float8') else 32}*t_blocks"


@needs_cutlass
@pytest.mark.parametrize("fmt", [("bfloat16", None, None)] + BS_FORMATS, ids=lambda f: f"{f[0]}-{f[1]}-{f[2]}")
def test_wgrad_kernel_clips_offsets_to_the_token_count(fmt):
    """The K-grouped kernel reads the token count T (which it clips the offsets to) from A's launcher shape
    (`scheduler.group_extent`): T for every A storage, packed FP4's (m_w, T / 2) bytes included. It read the byte
    columns, T / 2: FP4 experts lost their tokens past T / 2 (the FP4 GPU cases, exact inputs included)."""
    import types

    from cudnn_moe_jax import operands as table
    from cudnn_moe_jax._problem import GroupedGemmProblem
    from cudnn_moe_jax.kernels.sm90.config import Config
    from cudnn_moe_jax.kernels.sm90.kernel import GroupedGemmSm90

    data, sf, vec = fmt
    for m, cluster_m in ((384, 1), (512, 2)):
        p = GroupedGemmProblem(op="wgrad", m=m, n=320, k=2016, num_groups=5, ab_dtype=data, sf_dtype=sf,
                               sf_vec_size=vec, wgrad_dtype="bfloat16")
        kernel = GroupedGemmSm90(p, Config(cluster_m=cluster_m))
        (a,) = [x for x in table.inputs(p) if x.name == "a"]
        assert kernel.sched.group_extent(types.SimpleNamespace(shape=a.shape)) == p.k, (a.shape, p.k)


@needs_cutlass
@pytest.mark.parametrize("name", ["bs_mxfp8_c1", "bs_mxfp4_c2", "bs_nvfp4_c1_gs", "bs_mxfp8e5_tok_c1_gs_acc",
                                  "bs_mxfp4_tok_c1"])
def test_blockscaled_wgrad_lowers_to_the_kernel(name):
    """The public op with block-scaled A / B (lab/wgrad_cases.py: its GPU cases) lowers for CUDA to one kernel
    custom call, the fallback-to-the-reference warning an error."""
    import functools

    from lab import wgrad_cases

    case = next(c for c in wgrad_cases.BS_CASES if c[0] == name)
    assert_lowers_to_one_kernel(functools.partial(wgrad_cases.bs_call, case), wgrad_cases.bs_inputs(case))


@needs_cutlass
@pytest.mark.parametrize("majors", [dict(a_major="m"), dict(b_major="n")])
def test_mixed_major_blockscaled_wgrad_lowers_to_the_kernel(majors):
    """MXFP8 wgrad with one operand token-major and the other token-contiguous: one kernel custom call (the
    token-major operand transposed by XLA first), no fallback to the reference."""
    tokens = 512
    offsets = jnp.asarray([128, 256, 384, 512, 512], jnp.int32)

    def fn(a, b, sfa, sfb):
        return cmj.grouped_gemm_wgrad(a, b, offsets, sfa, sfb, wgrad_dtype="float32", **majors).wgrad_tensor

    avals = _bs_avals(tokens)
    assert_lowers_to_one_kernel(lambda x: fn(*x), (avals[0], avals[1], avals[3], avals[4]))


def _bs_avals(tokens, vec=32):
    from cudnn_moe_jax.formats import sf_segment_bytes

    f8 = jnp.float8_e4m3fn
    return (sds((MW, tokens), f8), sds((NW, tokens), f8), sds((L,), jnp.int32),
            sds((sf_segment_bytes(MW, tokens, vec),), jnp.uint8), sds((sf_segment_bytes(NW, tokens, vec),), jnp.uint8))


def _bs_lower(tokens) -> str:
    def fn(a, b, offsets, sfa, sfb):
        return cmj.grouped_gemm_wgrad(a, b, offsets, sfa, sfb, wgrad_dtype="float32").wgrad_tensor

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return jax.jit(fn).trace(*_bs_avals(tokens)).lower(lowering_platforms=("cuda",)).as_text()


@needs_cutlass
def test_blockscaled_wgrad_bundle_built_at_one_token_count_serves_every_count(tmp_path, monkeypatch):
    """MXFP8 wgrad: the module is recorded for T = 16*t_blocks with the SF segment buffers' sizes as functions of it
    (rup(m_w, 128) * rup(cdiv(T, 32), 4) bytes), so the bundle recorded at one T serves the others. The on-chip
    module: these token counts would otherwise dequantize first (tests/test_dequant_first.py covers that route)."""
    from cudnn_moe_jax import _dequant_first

    monkeypatch.setattr(_dequant_first, "DEQUANT_FIRST_TOKENS", 1 << 30)
    built, entry = _bundle_then_no_compile(tmp_path, monkeypatch, lambda: _bs_lower(2000))
    assert entry["in_avals"][0]["shape"] == [MW, "16*t_blocks"]
    for tokens in (2000, 1024, 4096, 528):
        (call,) = custom_calls(_bs_lower(tokens))
        assert [call[k] for k in ("target", "key", "module")] == [built[0][k] for k in ("target", "key", "module")]
