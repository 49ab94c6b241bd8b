"""The on-disk kernel-module cache (`cudnn_moe_jax._module_cache`): round trip, bad entries ignored and rebuilt,
switched off, unwritable, concurrent writers, and a second process that finds what the first compiled."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from runtime_helpers import _BLOCK_CUTLASS, REPO, _python, fake_module, fake_spec, needs_cutlass

from cudnn_moe_jax import _compile, _module_cache, _modules, _runtime

@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private module cache, no bundles, an empty memory cache, and a fake compiler counting its calls."""
    folder = tmp_path / "modules"
    monkeypatch.setenv("CUDNN_MOE_JAX_MODULE_CACHE", str(folder))
    monkeypatch.delenv("CUDNN_MOE_JAX_NO_COMPILE", raising=False)
    monkeypatch.setattr(_modules, "bundle_dirs", lambda: [])
    monkeypatch.setattr(_modules, "_MEMORY", {})
    monkeypatch.setattr(_compile, "compile_unavailable_reason", lambda: None)
    compiled = []

    def compile_module(spec):
        compiled.append(spec)
        return fake_module(b"\x7fELF compiled #%d for " % len(compiled) + spec.fingerprint.encode())

    monkeypatch.setattr(_compile, "compile_module", compile_module)
    return folder, compiled


def forget_memory(monkeypatch):
    monkeypatch.setattr(_modules, "_MEMORY", {})  # what a new process starts with


def test_compiled_module_is_written_and_found_again(cache, monkeypatch):
    folder, compiled = cache
    spec = fake_spec()
    mod = _runtime.get_module(spec)
    path = folder / f"{spec.fingerprint}.module"
    magic, header, data = path.read_bytes().split(b"\n", 2)
    entry = json.loads(header)
    assert magic == _module_cache.MAGIC and data == mod.module
    assert entry["fingerprint"] == spec.fingerprint and entry["avals_key"] == spec.avals_key
    assert entry["key"] == mod.key.hex() and entry["in_avals"] == [{"shape": [8, 8], "dtype": "float32"}]
    assert [p.name for p in folder.iterdir()] == [path.name]  # no temporary file left behind
    forget_memory(monkeypatch)
    monkeypatch.setenv("CUDNN_MOE_JAX_NO_COMPILE", "1")
    monkeypatch.setattr(_compile, "compile_unavailable_reason", lambda: "compiling is disabled (test)")
    assert _runtime.get_module(spec) == mod and len(compiled) == 1
    assert _runtime.has_module(spec.fingerprint) and not _runtime.has_module(fake_spec("test/other").fingerprint)


def _corruptions(raw: bytes) -> dict:
    magic, header, data = raw.split(b"\n", 2)
    entry = json.loads(header)
    other = {**entry, "avals_key": "0" * 32}
    return {
        "truncated": raw[:-7],
        "empty": b"",
        "garbage": os.urandom(300),
        "bad magic": b"something else\n" + header + b"\n" + data,
        "bad json": magic + b"\n{not json\n" + data,
        "header not a dict": magic + b"\n[1, 2]\n" + data,
        "flipped byte": raw[:-1] + bytes([raw[-1] ^ 1]),
        "other avals": magic + b"\n" + json.dumps(other).encode() + b"\n" + data,
        "other fingerprint": magic + b"\n" + json.dumps({**entry, "fingerprint": "f" * 64}).encode() + b"\n" + data,
    }


def test_bad_entries_are_ignored_and_rebuilt(cache, monkeypatch, caplog):
    folder, compiled = cache
    spec = fake_spec()
    _runtime.get_module(spec)
    path = folder / f"{spec.fingerprint}.module"
    for what, bad in _corruptions(path.read_bytes()).items():
        path.write_bytes(bad)
        forget_memory(monkeypatch)
        n = len(compiled)
        with caplog.at_level(logging.WARNING, logger="cudnn_moe_jax.runtime"):
            mod = _runtime.get_module(spec)  # never raises: a bad entry is a miss
        assert len(compiled) == n + 1, what
        assert path.read_bytes().endswith(mod.module), what  # rebuilt: the entry is good again
        forget_memory(monkeypatch)
        assert _runtime.get_module(spec) == mod and len(compiled) == n + 1, what
    assert any("ignoring module-cache entry" in r.message for r in caplog.records)


def test_off_and_unwritable(cache, monkeypatch, tmp_path, caplog):
    folder, compiled = cache
    for off in ("0", "off", "OFF", "none"):
        monkeypatch.setenv("CUDNN_MOE_JAX_MODULE_CACHE", off)
        assert _runtime.module_cache_dir() is None
        forget_memory(monkeypatch)
        _runtime.get_module(fake_spec())
    assert len(compiled) == 4 and not folder.exists()
    monkeypatch.delenv("CUDNN_MOE_JAX_MODULE_CACHE")
    monkeypatch.setenv("CUDNN_MOE_JAX_CACHE", str(tmp_path / "root"))
    assert _runtime.module_cache_dir() == tmp_path / "root" / "modules"  # the default: under cache_dir()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CUDNN_MOE_JAX_MODULE_CACHE", str(blocker / "modules"))
    forget_memory(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="cudnn_moe_jax.runtime"):
        assert _runtime.get_module(fake_spec()).module.startswith(b"\x7fELF")  # the cache is optional
    assert any("not written to the module cache" in r.message for r in caplog.records)


_WRITER = """
import os, sys, time
from cudnn_moe_jax import _compile, _module_cache, _modules, _runtime
import runtime_helpers as t
me, rounds, barrier = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
payload = bytes([me]) * (1 << 20) + b"writer %d" % me
open(os.path.join(barrier, str(me)), "w").close()
deadline = time.time() + 60
while len(os.listdir(barrier)) < 2 and time.time() < deadline:
    time.sleep(0.001)  # start together
spec = t.fake_spec()
for _ in range(rounds):
    assert _modules._to_cache(spec, t.fake_module(payload)) is not None
"""


def test_concurrent_writers_never_leave_a_torn_entry(tmp_path, monkeypatch):
    """Two processes rewrite the same 1 MiB entry 40 times each while this one reads it back in a loop: every read
    is a whole entry of one writer (a torn or half-written file would fail its size / sha256 check)."""
    folder, barrier = tmp_path / "modules", tmp_path / "barrier"
    barrier.mkdir()
    monkeypatch.setenv("CUDNN_MOE_JAX_MODULE_CACHE", str(folder))
    spec = fake_spec()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(i), "40", str(barrier)], env=env, cwd=REPO,
                                stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    reads, seen, notes = 0, set(), []
    running = True
    while running:
        running = any(w.poll() is None for w in writers)  # then one more read after both finished
        mod = _modules._from_cache(spec.fingerprint, spec.avals_key, notes)
        assert not notes, notes
        if mod is not None:
            reads += 1
            seen.add(mod.module[-8:])
            assert mod.module == mod.module[:1] * (1 << 20) + mod.module[-8:]
    assert [w.wait() for w in writers] == [0, 0], [w.stderr.read() for w in writers]
    assert reads > 10 and seen <= {b"writer 1", b"writer 2"}
    assert [p.name for p in folder.iterdir()] == [f"{spec.fingerprint}.module"]


@needs_cutlass
def test_second_process_finds_what_the_first_compiled(tmp_path):
    """Process 1 compiles the real quant kernel at lowering time (m = 2048) and writes it to the module cache;
    process 2, with cutlass blocked and compiling disabled, lowers the op at m = 512 from that entry: no reference
    fallback, the same module."""
    env = {"CUDNN_MOE_JAX_MODULE_CACHE": str(tmp_path / "modules"), "CUDNN_MOE_JAX_BUNDLE": str(tmp_path / "none")}
    lower = textwrap.dedent("""
        import dataclasses, json, os, sys, warnings, jax
        import runtime_helpers as t
        from cudnn_moe_jax import _compile, _module_cache, _modules, _runtime
        warnings.simplefilter("error", RuntimeWarning)  # a reference fallback would warn
        p, _ = t.small_quant_problem()
        ins = _runtime.kernels_package().variants.input_avals(dataclasses.replace(p, m=M))
        files = os.listdir(os.environ["CUDNN_MOE_JAX_MODULE_CACHE"])
        text = jax.jit(t.small_quant).trace(*ins.values()).lower(lowering_platforms=("cuda",)).as_text()
        print(json.dumps([files, t.custom_calls(text)]))
        """)
    (tmp_path / "modules").mkdir()
    before, first = json.loads(_python(lower.replace("M)", "2048)"), env))
    fresh = json.loads(_python(_BLOCK_CUTLASS + lower.replace("M)", "512)") + textwrap.dedent("""
        assert not [m for m in sys.modules if m.split(".")[0] == "cutlass"]
        """), {**env, "CUDNN_MOE_JAX_NO_COMPILE": "1"}))
    files, second = fresh
    assert before == [] and len(files) == 1 and files[0].endswith(".module")
    assert len(first) == len(second) == 1
    assert [first[0][k] for k in ("target", "key", "module")] == [second[0][k] for k in ("target", "key", "module")]
    assert "tensor<512x256xbf16>" in second[0]["types"] and "tensor<2048x256xbf16>" in first[0]["types"]
