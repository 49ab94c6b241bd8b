"""Runtime plumbing: module cache, bundles, lowering without the compiler, export, FFI registration, a GPU run.

A tiny CuTe DSL kernel (elementwise f32 add) stands in for the grouped GEMM: the path it takes (aot build ->
bundle -> lowering with `cutlass` blocked -> custom call -> libcute_dsl_runtime on the GPU) is the one the
primitive takes. The GPU test reads a prebuilt bundle (CUDNN_MOE_JAX_BUNDLE) and, optionally, a jax.export
artifact made on a CPU machine (CUDNN_MOE_JAX_TEST_EXPORT); `tools/runtime_smoke.py prepare DIR` writes both.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib
import json
import lzma
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runtime_helpers import (HAVE_CUTLASS, REPO, TINY_SHAPES, _BLOCK_CUTLASS, _python, _tiny_launcher, custom_calls,
                             needs_cutlass, small_quant, small_quant_problem, tiny_program, tiny_spec)

from cudnn_moe_jax import _compile, _lowering, _modules, _runtime, operands
from cudnn_moe_jax._problem import GroupedGemmProblem
from lab.sass import fatbins

# ------------------------------------------------------------------------------------------------ CPU tests

def test_fingerprint_is_stable_and_sensitive():
    p = GroupedGemmProblem(op="quant", m=512, n=128, k=64, num_groups=3, ab_dtype="bfloat16")
    fp = _runtime.grouped_gemm_fingerprint(p, ("a", "b"), None)
    code = ("from cudnn_moe_jax import _runtime; from cudnn_moe_jax._problem import GroupedGemmProblem as G; "
            "print(_runtime.grouped_gemm_fingerprint(G(op='quant', m=512, n=128, k=64, num_groups=3, "
            "ab_dtype='bfloat16'), ('a', 'b'), None))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONHASHSEED": "123"}, check=True).stdout.strip()
    assert other == fp
    assert _runtime.grouped_gemm_fingerprint(dataclasses.replace(p, m=4096), ("a", "b"), None) == fp  # any m
    assert _runtime.grouped_gemm_fingerprint(dataclasses.replace(p, n=256), ("a", "b"), None) != fp
    assert _runtime.grouped_gemm_fingerprint(p, ("a", "b"), {"tile": (128, 256)}) != fp
    assert _runtime.grouped_gemm_fingerprint(p, ("a", "b", "alpha"), None) != fp
    assert _runtime.grouped_gemm_fingerprint(p, ("a", "b"), None, arch="sm_100a") != fp


def test_find_runtime_library_unpacks_xz_once(tmp_path, monkeypatch):
    payload = os.urandom(1000)
    xz = tmp_path / "libcute_dsl_runtime.so.xz"
    xz.write_bytes(lzma.compress(payload))
    monkeypatch.setenv("CUDNN_MOE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDNN_MOE_JAX_RUNTIME", str(tmp_path))
    path, _ = _runtime.find_runtime_library()
    assert path.read_bytes() == payload and str(path).startswith(str(tmp_path / "cache"))
    mtime = path.stat().st_mtime_ns
    assert _runtime.find_runtime_library()[0] == path and path.stat().st_mtime_ns == mtime
    monkeypatch.setenv("CUDNN_MOE_JAX_RUNTIME", str(tmp_path / "missing.so"))
    path, tried = _runtime.find_runtime_library()
    assert path is None and "does not exist" in tried[0]


@pytest.mark.skipif(bool(jax.devices()[0].platform == "gpu"), reason="CPU-only behaviour")
def test_register_runtime_without_cuda_returns_false():
    assert _runtime.register_runtime() is False
    assert _runtime.register_runtime() is False  # idempotent, no exception


def test_unavailable_message_says_how_to_get_a_module(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDNN_MOE_JAX_NO_COMPILE", "1")
    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [tmp_path])
    with pytest.raises(_runtime.KernelUnavailable) as err:
        _runtime.get_module(tiny_spec((8, 8)))
    assert "pip install cudnn-moe-jax[cuda]" in str(err.value)
    assert "python -m cudnn_moe_jax.aot build --arch sm_90a --out DIR" in str(err.value)
    assert "CUDNN_MOE_JAX_BUNDLE=DIR" in str(err.value)


def quant_call(m):
    """(problem, input names, input avals, output avals) of a small bf16 quant call with m rows."""
    p = GroupedGemmProblem(op="quant", m=m, n=128, k=64, num_groups=2, ab_dtype="bfloat16")
    names = ("a", "b", "padded_offsets", "alpha", "prob")
    ins = (jax.ShapeDtypeStruct((m, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2, 128, 64), jnp.bfloat16),
           jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.float32),
           jax.ShapeDtypeStruct((m,), jnp.float32))
    return p, names, ins, [jax.ShapeDtypeStruct(*v) for v in operands.output_specs(p).values() if v is not None]


def lower_quant(m) -> str:
    """The quant call's primitive lowered for cuda (a fresh jit each time: no jit cache hit), as text."""
    from cudnn_moe_jax import _primitive

    p, names, ins, _ = quant_call(m)
    return jax.jit(lambda *xs: _primitive.grouped_gemm_p.bind(*xs, problem=p, input_names=names, config=None)).trace(
        *ins).lower(lowering_platforms=("cuda",)).as_text()


def _fake_grouped_gemm_bundle(folder, problem, names, in_avals, out_avals):
    module = b"\x7fELF not really a module"
    spec = _runtime.grouped_gemm_spec(problem, None, names, in_avals, out_avals)
    mod = _runtime.KernelModule(module, hashlib.sha256(module).digest(), _runtime.FFI_TARGET,
                                ((0, 1), (0, 1, 2), (0,), (0,), (0,)), ((0, 1),), ())
    _runtime.write_bundle(folder, [(spec, mod)])
    return mod


def test_export_helper_adds_the_disabled_checks_plain_jax_export_needs(tmp_path, monkeypatch):
    """Plain jax.export.export of a CUDA lowering refuses the CuTe DSL custom calls and prints each in full (the
    module bytes); cudnn_moe_jax.export is the same call with export_disabled_checks() added. No compiler needed:
    the module comes from a bundle."""
    import cudnn_moe_jax as cmj
    from cudnn_moe_jax import _primitive

    p, names, ins, outs = quant_call(256)
    monkeypatch.setenv("CUDNN_MOE_JAX_NO_COMPILE", "1")
    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [tmp_path])
    monkeypatch.setattr(_modules, "_MEMORY", {})
    _fake_grouped_gemm_bundle(tmp_path, p, names, ins, outs)
    fn = jax.jit(lambda *xs: _primitive.grouped_gemm_p.bind(*xs, problem=p, input_names=names, config=None))
    with pytest.raises(ValueError, match="Cannot serialize code with custom calls"):
        jax.export.export(fn, platforms=["cuda"])(*ins)
    exp = cmj.export(fn, platforms=["cuda"])(*ins)
    (call,) = custom_calls(exp.mlir_module())
    assert exp.platforms == ("cuda",) and "not really a module" in call["module"]
    assert set(exp.disabled_safety_checks) >= set(cmj.export_disabled_checks())
    readme = (REPO / "README.md").read_text()
    assert "cudnn_moe_jax.export(" in readme and not re.search(r"(?<![\w.])jax\.export\(", readme)  # a module


def test_primitive_lowers_grouped_gemm_from_bundle_or_falls_back(tmp_path, monkeypatch):
    """The real primitive's CUDA lowering takes a bundle module through kernel_lowering (no compiler)."""

    p, names, ins, outs = quant_call(256)
    monkeypatch.setenv("CUDNN_MOE_JAX_NO_COMPILE", "1")
    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [tmp_path])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = lower_quant(256)
    assert not custom_calls(text) and any("aot build" in str(w.message) for w in caught)
    mod = _fake_grouped_gemm_bundle(tmp_path, p, names, ins, outs)
    monkeypatch.setattr(_modules, "_MEMORY", {})
    for m in (256, 1024, 4096):  # built for m = 256; one module serves every m
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a reference fallback would warn
            (call,) = custom_calls(lower_quant(m))
        assert call["target"] == _runtime.FFI_TARGET
        assert 'module = "\\7FELF not really a module"' in call["attributes"]
        assert f"tensor<{m}x64xbf16>" in call["types"] and f"tensor<{m}x128xbf16>" in call["types"]
    assert mod.key.hex() == hashlib.sha256(mod.module).hexdigest()


def test_grouped_gemm_spec_is_m_symbolic_and_checks_the_avals():
    from cudnn_moe_jax import _problem

    specs = []
    for m in (256, 768):
        p, names, ins, outs = quant_call(m)
        specs.append(_runtime.grouped_gemm_spec(p, None, names, ins, outs))
    assert specs[0] == specs[1] and specs[0].avals_key == specs[1].avals_key  # fingerprint, avals: no m in them
    sym = _runtime.symbolic_m()
    assert str(sym) == "256*m_blocks"
    assert specs[0].in_avals[0].shape == (sym, 64) and specs[0].in_avals[4].shape == (sym,)
    assert [a.shape for a in specs[0].out_avals] == [(sym, 128)]
    assert specs[0].meta["problem"].m is sym
    p, names, ins, outs = quant_call(512)
    with pytest.raises(_runtime.KernelUnavailable, match="axis 0 must be m/1 = 512"):
        _runtime.grouped_gemm_spec(p, None, names, ins[:4] + (jax.ShapeDtypeStruct((256,), jnp.float32),), outs)
    with pytest.raises(_runtime.KernelUnavailable, match="output avals"):
        _runtime.grouped_gemm_spec(p, None, names, ins, [outs[0], jax.ShapeDtypeStruct((2, 2), jnp.float32)])
    # MXFP8 with FP8 D: sfa's row blocks and every SF output shape are in m_blocks too
    mx = GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype="float8_e4m3fn",
                            sf_dtype="float8_e8m0fnu", sf_vec_size=32,
                            epilogue=_problem.Epilogue(d_dtype="float8_e4m3fn", generate_sfd=True))
    avals = _runtime.kernels_package().variants.input_avals(mx)
    out = [jax.ShapeDtypeStruct(*v) for v in operands.output_specs(mx).values() if v is not None]
    spec = _runtime.grouped_gemm_spec(mx, None, list(avals), list(avals.values()), out)
    blocks = sym // 128  # = 2*m_blocks: SF row blocks of 128
    assert str(blocks) == "2*m_blocks" and dict(zip(avals, spec.in_avals))["sfa"].shape == (1, blocks, 1, 32, 4, 4)
    assert [a.shape for a in spec.out_avals] == [(sym, 256), (sym, 256), (1, blocks, 2, 32, 4, 4),
                                                 (1, 2, blocks, 32, 4, 4)]


def test_lowering_checks_support_config_and_digest_once(tmp_path, monkeypatch):
    """One lowering from a bundle calls `supports`, `resolve_config` (hence `default_config`) and the kernels' source
    digest once each (before m-free modules: resolve_config 4 times and the digest, which read every kernel file,
    twice; the digest now reads the files once per process)."""
    from cudnn_moe_jax import _primitive  # noqa: F401 (registers the primitive's lowerings)

    monkeypatch.setenv("CUDNN_MOE_JAX_NO_COMPILE", "1")
    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [tmp_path])
    _fake_grouped_gemm_bundle(tmp_path, *quant_call(256))
    pkg, counts = _runtime.kernels_package(), collections.Counter()

    def counted(obj, name):
        fn = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a, **k: (counts.update([name]), fn(*a, **k))[1])

    for obj, name in ((pkg, "supports"), (pkg, "default_config"), (_lowering, "resolve_config"),
                      (_modules, "kernels_source_digest")):
        counted(obj, name)
    for m in (256, 512):
        counts.clear()
        assert len(custom_calls(lower_quant(m))) == 1
        assert counts == {"supports": 1, "default_config": 1, "resolve_config": 1, "kernels_source_digest": 1}


@needs_cutlass
def test_aot_build_says_which_modules_it_compiled_and_which_came_from_the_cache(tmp_path, monkeypatch, capsys):
    """A second build takes the modules from the on-disk module cache: every line and the summary say so, and how
    to compile again (--no-cache)."""
    from cudnn_moe_jax import aot

    monkeypatch.setenv("CUDNN_MOE_JAX_MODULE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [])

    def build(out, *flags):
        monkeypatch.setattr(_modules, "_MEMORY", {})              # a fresh process: nothing in memory
        assert aot.main(["build", "--out", str(tmp_path / out), "--variants", "runtime_helpers:tiny_variants",
                         *flags]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == len(TINY_SHAPES) + 1 and all(line.startswith("ok ") for line in lines[:-1]), lines
        return lines

    first = build("first")
    assert all(line.endswith("  compiled") for line in first[:-1]) and first[-1].endswith(
        f"(0 failed): {len(TINY_SHAPES)} compiled"), first
    second = build("second")
    cache = f"module cache {tmp_path / 'cache'}"
    assert all(line.endswith(cache) for line in second[:-1]), second
    assert f"{len(TINY_SHAPES)} from the {cache}; modules in the cache were not recompiled" in second[-1]
    assert "--no-cache or CUDNN_MOE_JAX_MODULE_CACHE=off" in second[-1]
    third = build("third", "--no-cache")
    assert all(line.endswith("  compiled") for line in third[:-1]), third
    manifests = [_runtime.read_manifest(tmp_path / out)["entries"] for out in ("first", "second", "third")]
    assert manifests[0].keys() == manifests[1].keys() == manifests[2].keys()
    assert {e["key"] for e in manifests[0].values()} == {e["key"] for e in manifests[2].values()}  # same bytes


@needs_cutlass
def test_bundle_lowering_without_cutlass_matches_cutlass_call(tmp_path):
    bundle = tmp_path / "bundle"
    env = {"CUDNN_MOE_JAX_BUNDLE": str(bundle), "CUDNN_MOE_JAX_CACHE": str(tmp_path / "cache")}
    out = _python(f"import sys; from cudnn_moe_jax import aot; sys.exit(aot.main(['build', '--arch', 'sm_90a', "
                  f"'--out', {str(bundle)!r}, '--variants', 'runtime_helpers:tiny_variants']))", env)
    assert out.count("ok ") == len(TINY_SHAPES), out
    listing = _python(f"from cudnn_moe_jax import aot; aot.main(['list', {str(bundle)!r}])", env)
    assert listing.count("test/tiny_add") == len(TINY_SHAPES)

    # The GPU machine's situation: no compiler at all. Lower, export for cuda, never import cutlass.
    export_path = tmp_path / "tiny.jax_export"
    ours = json.loads(_python(_BLOCK_CUTLASS + textwrap.dedent(f"""
        import json, sys, jax, jax.numpy as jnp
        import runtime_helpers as t
        from cudnn_moe_jax import _compile, _lowering, _modules, _runtime, operands
        a = jax.ShapeDtypeStruct((64, 128), jnp.float32)
        lowered = jax.jit(t.tiny_program).trace(a, a).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert "api_version=API_VERSION_TYPED_FFI" in lowered.as_text(dialect="hlo")
        exp = jax.export.export(jax.jit(t.tiny_program), platforms=["cuda"],
                                disabled_checks=_runtime.export_disabled_checks())(a, a)
        open({str(export_path)!r}, "wb").write(exp.serialize())
        assert not [m for m in sys.modules if m.split(".")[0] == "cutlass"]
        print(json.dumps(t.custom_calls(text)))
        """), env))

    # The reference: cutlass_call itself, in a fresh process (the module must be byte-identical across processes).
    theirs = json.loads(_python("""
        import json, os
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
        import jax, jax.numpy as jnp
        import cutlass.jax
        import runtime_helpers as t
        def f(a, b):
            out = jax.ShapeDtypeStruct(a.shape, a.dtype)
            return cutlass.jax.cutlass_call(t._tiny_launcher(), output_shape_dtype=out)(a, b) * 2.0 + 1.0
        a = jax.ShapeDtypeStruct((64, 128), jnp.float32)
        print(json.dumps(t.custom_calls(jax.jit(f).trace(a, a).lower(lowering_platforms=("cuda",)).as_text())))
        """, {}))
    assert len(ours) == len(theirs) == 1
    assert ours == theirs
    assert ours[0]["target"] == "CuteDSLRT_NvJaxCutlassCall_v2"
    for attr in ("mhlo.backend_config = {key = ", "module = \"\\7FELF",
                 "operand_layouts = [dense<[1, 0]> : tensor<2xindex>, dense<[1, 0]> : tensor<2xindex>]",
                 "result_layouts = [dense<[1, 0]> : tensor<2xindex>]"):
        assert attr in ours[0]["attributes"], attr
    exp = jax.export.deserialize(export_path.read_bytes())
    (exported,) = custom_calls(exp.mlir_module())
    assert exp.platforms == ("cuda",)
    assert [exported[k] for k in ("target", "key", "module")] == [ours[0][k] for k in ("target", "key", "module")]


@needs_cutlass
def test_real_primitive_bundle_built_at_one_m_serves_every_m(tmp_path):
    """cmj.grouped_gemm_quant from an aot bundle built at m = 2048, lowered with cutlass blocked and compiling
    disabled at m = 2048, 512 and 4096: no reference fallback, the one module each time, and it is the kernel
    package's own cutlass_call (kernels/sm90/jax_bridge.make_call) exported for the symbolic m, attribute for
    attribute."""
    bundle = tmp_path / "bundle"
    env = {"CUDNN_MOE_JAX_BUNDLE": str(bundle), "CUDNN_MOE_JAX_MODULE_CACHE": "off"}
    _python(f"import sys; from cudnn_moe_jax import aot; sys.exit(aot.main(['build', '--out', {str(bundle)!r}, "
            f"'--variants', 'runtime_helpers:small_quant_variants']))", env)
    ((entry),) = _runtime.read_manifest(bundle)["entries"].values()
    assert entry["in_avals"][0]["shape"] == ["256*m_blocks", 256] and entry["meta"]["problem"]["m"] == "256*m_blocks"
    ours = json.loads(_python(_BLOCK_CUTLASS + textwrap.dedent("""
        import dataclasses, json, sys, warnings, jax
        import runtime_helpers as t
        from cudnn_moe_jax import _compile, _lowering, _modules, _runtime, operands
        warnings.simplefilter("error", RuntimeWarning)  # a reference fallback would warn
        p, _ = t.small_quant_problem()
        calls = {}
        for m in (2048, 512, 4096):
            ins = _runtime.kernels_package().variants.input_avals(dataclasses.replace(p, m=m))
            text = jax.jit(t.small_quant).trace(*ins.values()).lower(lowering_platforms=("cuda",)).as_text()
            calls[m] = t.custom_calls(text)
        assert not [m for m in sys.modules if m.split(".")[0] == "cutlass"]
        print(json.dumps(calls))
        """), {**env, "CUDNN_MOE_JAX_NO_COMPILE": "1"}))
    theirs = json.loads(_python("""
        import importlib, json, jax
        import runtime_helpers as t
        from cudnn_moe_jax import _compile, _lowering, _modules, _runtime, operands
        _runtime.import_cutlass()
        p, ins = t.small_quant_problem()
        pkg = _runtime.kernels_package()
        call = importlib.import_module(pkg.__name__ + ".jax_bridge").make_call(p)
        exp = jax.export.export(jax.jit(lambda *xs: call(*xs)), platforms=["cuda"],
                                disabled_checks=_runtime.export_disabled_checks())(
            *pkg.variants.symbolic_avals(p, _runtime.symbolic_m()).values())
        print(json.dumps(t.custom_calls(exp.mlir_module())))
        """, {}))
    assert len(theirs) == 1 and [len(c) for c in ours.values()] == [1, 1, 1]
    for m, (call,) in ours.items():  # (jax.export adds the symbolic m's shape operands and their layouts)
        assert f"tensor<{m}x256xbf16>" in call["types"] and call["types"] == ours["2048"][0]["types"].replace(
            "2048x", f"{m}x")
        assert [call[k] for k in ("target", "key", "module")] == [theirs[0][k] for k in ("target", "key", "module")]
        assert call["attributes"] == ours["2048"][0]["attributes"]


@pytest.mark.slow  # four compiles: ~15-22 s on 2 cores
@needs_cutlass
def test_module_bytes_are_the_same_for_every_m(monkeypatch):
    """Measured: compiled by cutlass_call for a concrete m, the device code (fatbin) is the same for every m, but
    the host object mangles the launcher's argument shapes into its symbol names, so its bytes differ per m.
    `_runtime` compiles for the symbolic m: every m gets the very same bytes."""
    _runtime.import_cutlass()
    from cutlass.jax import compile as cc

    p, _ = small_quant_problem()
    pkg = _runtime.kernels_package()
    bridge = importlib.import_module(pkg.__name__ + ".jax_bridge")
    ours, raw = {}, {}
    for m in (2048, 512):
        q = dataclasses.replace(p, m=m)
        ins = pkg.variants.input_avals(q)
        outs = [jax.ShapeDtypeStruct(*v) for v in operands.output_specs(q).values() if v is not None]
        monkeypatch.setattr(cc, "_CUTLASS_COMPILE_CACHE", {})  # compile each time, not cutlass's in-memory hit
        ours[m] = _runtime.compile_module(_runtime.grouped_gemm_spec(q, None, list(ins), list(ins.values()),
                                                                     outs)).module
        jax.jit(bridge.make_call(q)).trace(*ins.values()).lower(lowering_platforms=("cuda",))  # compiles
        assert len(cc._CUTLASS_COMPILE_CACHE) == 2
        (raw[m],) = [r.module for r in cc._CUTLASS_COMPILE_CACHE.values() if r.module != ours[m]]
    assert ours[2048] == ours[512]
    assert raw[2048] != raw[512] and fatbins(raw[2048]) == fatbins(raw[512]) == fatbins(ours[512])


@needs_cutlass
def test_backward_op_compiles_one_module_for_every_m(monkeypatch):
    """dsrelu, whose launch writes per-tile partial sums that the lowering reduces: compiled once at lowering (for
    the symbolic m, partials included), then served from memory at another m; no reference fallback."""
    import cudnn_moe_jax as cmj

    _runtime.import_cutlass()
    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [])
    monkeypatch.setattr(_modules, "_MEMORY", {})
    monkeypatch.setenv("CUDNN_MOE_JAX_MODULE_CACHE", "off")
    compiled, real_compile = [], _runtime.compile_module
    monkeypatch.setattr(_compile, "compile_module", lambda spec: compiled.append(spec) or real_compile(spec))

    def f(a, b, c, offsets, prob):
        r = cmj.grouped_gemm_dsrelu(a, b, c, padded_offsets=offsets, prob_tensor=prob, generate_dbias=True,
                                    dbias_dtype="float32", compute_amax=True)
        return r.d_row_tensor, r.dprob_tensor, r.dbias_tensor, r.amax_tensor

    L, H, I, sds, calls = 2, 128, 256, jax.ShapeDtypeStruct, {}  # dY (m, H), W2^T (L, I, H), C (m, I)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a reference fallback would warn
        for m in (512, 1024):
            args = (sds((m, H), jnp.bfloat16), sds((L, I, H), jnp.bfloat16), sds((m, I), jnp.bfloat16),
                    sds((L,), jnp.int32), sds((m,), jnp.float32))
            (calls[m],) = custom_calls(jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text())
    sym = _runtime.symbolic_m()
    ((spec,),) = [compiled]
    # d_row, dprob partials (one N tile), dbias partials per 128-row tile, amax
    assert [a.shape for a in spec.out_avals] == [(sym, I), (1, sym), (sym // 128, I), (L, 1)]
    assert calls[512]["module"] == calls[1024]["module"] and calls[512]["key"] == calls[1024]["key"]
    assert "-> (tensor<1024x256xbf16>, tensor<1x1024xf32>, tensor<8x256xf32>, tensor<2x1xf32>)" in calls[1024]["types"]


@needs_cutlass
def test_compile_at_lowering_memory_cache_and_recording(monkeypatch):
    _runtime.import_cutlass("sm_90a")
    import cutlass.jax

    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [])
    a = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    with _runtime.recording() as got:  # compiled inside the primitive's lowering
        (ours,) = custom_calls(jax.jit(tiny_program).trace(a, a).lower(lowering_platforms=("cuda",)).as_text())
    ((spec, mod),) = got
    assert spec == tiny_spec((16, 16)) and mod.key == hashlib.sha256(mod.module).digest()
    monkeypatch.setattr(_compile, "compile_module", lambda s: pytest.fail("memory cache missed"))
    assert _runtime.get_module(tiny_spec((16, 16))) is mod
    theirs_fn = lambda x, y: cutlass.jax.cutlass_call(_tiny_launcher(), output_shape_dtype=a)(x, y) * 2.0 + 1.0
    (theirs,) = custom_calls(jax.jit(theirs_fn).trace(a, a).lower(lowering_platforms=("cuda",)).as_text())
    assert ours == theirs


# ------------------------------------------------------------------------------------------------ GPU

def _has_cuda() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device")
def test_tiny_kernel_runs_on_gpu_from_bundle():
    assert _runtime.register_runtime(), "libcute_dsl_runtime.so not found (tools/fetch_runtime.py)"
    print(f"\njax {jax.__version__}, runtime {_runtime.runtime_library_path()}, cutlass importable: {HAVE_CUTLASS}")
    rng = np.random.default_rng(0)
    for shape in TINY_SHAPES:
        a, b = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
        got = np.asarray(jax.jit(tiny_program)(a, b))
        want = (a + b) * np.float32(2) + np.float32(1)
        assert np.array_equal(got, want), f"{shape}: max |diff| {np.abs(got - want).max()}"
        for _ in range(3):  # replays (XLA may capture the call in a CUDA graph)
            assert np.array_equal(np.asarray(jax.jit(tiny_program)(a, b)), want)
        print(f"bundle path {shape}: exact, module from {_runtime.bundle_dirs()[0]}")
    if not HAVE_CUTLASS:
        assert not [m for m in sys.modules if m.split(".")[0] == "cutlass"]
    export = os.environ.get("CUDNN_MOE_JAX_TEST_EXPORT")
    if export:  # made by jax on a CPU machine (possibly another jax version), run here
        exp = jax.export.deserialize(Path(export).read_bytes())
        a, b = (rng.standard_normal((64, 128), dtype=np.float32) for _ in range(2))
        got = np.asarray(exp.call(a, b))
        assert np.array_equal(got, (a + b) * np.float32(2) + np.float32(1))
        print(f"exported artifact (calling convention v{exp.calling_convention_version}): exact")


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device")
def test_real_kernel_runs_on_gpu_from_bundle():
    """The production path: public op -> primitive -> bundle module (no compiler) -> H200; vs the reference. The
    bundle's m is 2048; the one module also runs m = 1024 and 4096."""
    from cudnn_moe_jax import _primitive

    assert _runtime.register_runtime()
    p0, ins = small_quant_problem()
    names = tuple(ins)
    if not _runtime.has_module(_runtime.grouped_gemm_fingerprint(p0, names, None)) and not HAVE_CUTLASS:
        pytest.skip("no bundle module for the small quant problem (tools/runtime_smoke.py prepare)")
    _, k = ins["a"].shape
    groups, n, _ = ins["b"].shape
    rng = np.random.default_rng(1)
    b = jnp.asarray(0.1 * rng.standard_normal((groups, n, k)), jnp.bfloat16)
    alpha = jnp.asarray([1.0, 2.0, 0.5, 1.5], jnp.float32)
    for m in (2048, 1024, 4096):
        p = dataclasses.replace(p0, m=m)
        a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        # expert 1 empty; 7m/8 rounds down to 256 rows: the rows from `valid` on are in no group
        ends = [m // 4, m // 4, 3 * m // 4, 7 * m // 8]
        valid = ends[-1] // 256 * 256
        offsets = jnp.asarray(ends, jnp.int32)
        prob = jnp.asarray(rng.uniform(size=m), jnp.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a reference fallback would warn
            got = jax.jit(small_quant)(a, b, offsets, alpha, prob)
        hlo = jax.jit(small_quant).lower(a, b, offsets, alpha, prob).as_text()
        assert _runtime.FFI_TARGET in hlo
        want = jax.jit(functools.partial(_primitive.reference_outputs, p, names))(a, b, offsets, alpha, prob)
        d, amax = np.asarray(got.d_tensor, np.float32), np.asarray(got.amax_tensor)
        d_ref, amax_ref = np.asarray(want[0], np.float32), np.asarray(want[1])
        np.testing.assert_allclose(d, d_ref, rtol=2**-7, atol=1e-3)
        assert valid < m and not d[valid:].any()
        np.testing.assert_allclose(amax, amax_ref, rtol=2**-7)
        print(f"grouped_gemm_quant {m}x{n}x{k}x{groups} from bundle: max |d - ref| {np.abs(d - d_ref).max():.3g}, "
              f"bitwise equal {np.mean(d == d_ref):.4f} of elements, amax {amax.ravel()}")


def test_kernels_only_raises_on_every_fallback_of_a_problem():
    """The GPU suites' guard: the ops warn once per problem about a fallback to the reference, so without clearing
    that record a second test of a problem whose module is missing would run the reference and pass."""
    import warnings

    import pytest

    from cudnn_moe_jax import _primitive
    from cudnn_moe_jax._problem import GroupedGemmProblem
    from lab import harness

    problem = GroupedGemmProblem(op="quant", m=256, n=256, k=256, num_groups=1, ab_dtype="bfloat16")
    for _ in range(2):
        with harness.kernels_only(), pytest.raises(RuntimeWarning, match="no GPU kernel"):
            _primitive._warn_once(problem, "no module (test)")
    with warnings.catch_warnings(record=True) as seen:   # outside the guard: still once per problem
        warnings.simplefilter("always")
        _primitive._warn_once(problem, "no module (test)")
    assert not seen
