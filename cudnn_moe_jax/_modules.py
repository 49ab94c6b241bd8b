"""Kernel modules: fingerprints, where a module comes from, and bundles.

A module is found by its fingerprint (sha256 of what it depends on: for the grouped GEMM the problem with its dynamic
extent symbolic, the input names, the config, the arch, every kernels/**.py and activations.py and the cutlass DSL
version: installed, else the pin, so a GPU machine without the compiler computes the build machine's; `_lowering`)
in: memory -> bundle folders (`CUDNN_MOE_JAX_BUNDLE`, os.pathsep-separated, then `<package>/_bundle`,
`<repo>/.bundle`) -> the on-disk module cache (`_module_cache`, `module_cache_dir()`) -> a CuTe DSL compile
(`_compile`; if `cutlass` imports and CUDNN_MOE_JAX_NO_COMPILE is unset; the result is written to the module cache)
-> `KernelUnavailable(reason)`. The avals a module was built for are recorded beside it and checked, not trusted.

Bundle: `manifest.json` ({"format": 2, "entries": {fingerprint: {file, key, target, layouts, aliases, avals, ...}}})
plus `<fingerprint>.o` per module. Module cache: one file `<fingerprint>.module` per module, the same entry and the
bytes, written atomically (safe under concurrent processes); a bad entry is ignored and rewritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import operator
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from . import _compile, _module_cache
from ._compile import DEFAULT_ARCH, KernelUnavailable, cutlass_dsl_version
from ._ffi import KernelModule, layouts
from ._module_cache import module_cache_dir

BUNDLE_FORMAT = 2  # 2: m-free fingerprints, avals recorded with m symbolic
MANIFEST = "manifest.json"
PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent


# ------------------------------------------------------------------------------------------------ fingerprints

def _canon(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__type__": type(x).__qualname__, **{f.name: _canon(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, enum.Enum):
        return f"{type(x).__qualname__}.{x.name}"
    if isinstance(x, dict):
        return {str(k): _canon(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_canon(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return repr(x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        import numpy as np
        return {"shape": [_dim(d) for d in x.shape], "dtype": str(np.dtype(x.dtype))}
    return repr(x)


def _dim(d: Any):
    try:
        return operator.index(d)
    except TypeError:  # a jax.export symbolic dimension: its canonical text, e.g. "256*m_blocks"
        return str(d)


def fingerprint(*parts: Any) -> str:
    """sha256 hex of a canonical JSON of `parts` (dataclasses, enums, containers, avals, scalars)."""
    return hashlib.sha256(json.dumps(_canon(parts), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def kernels_source_digest() -> str:
    """sha256 over every cudnn_moe_jax/kernels/**.py and activations.py (the device code reads its constants and
    option defaults) (relative path + bytes).
    Read once per process: the kernel code a process runs is what it imported, so later edits do not apply."""
    h = hashlib.sha256()
    for p in sorted((PACKAGE_DIR / "kernels").rglob("*.py")) + [PACKAGE_DIR / "activations.py"]:
        if "__pycache__" not in p.parts:
            h.update(p.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ modules

@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What finds or compiles one module; `build()` (imports cutlass) -> (launcher, cutlass_call kwargs).
    A module found under `fingerprint` is used only if it was built for the same avals (checked, not trusted)."""

    name: str
    fingerprint: str
    in_avals: tuple  # jax.ShapeDtypeStruct, or None for an absent tensor
    out_avals: tuple
    build: Callable[[], tuple] = dataclasses.field(compare=False, repr=False)
    arch: str = DEFAULT_ARCH
    meta: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def avals_key(self) -> str:
        return fingerprint(self.in_avals, self.out_avals)[:32]




_MEMORY: dict[tuple[str, str], KernelModule] = {}  # (fingerprint, avals_key) -> module
_LOCK = threading.RLock()
_RECORDERS: list[list] = []


@contextlib.contextmanager
def recording():
    """`with recording() as got:` collects (spec, module) for every module handed out meanwhile (aot uses it)."""
    got: list = []
    _RECORDERS.append(got)
    try:
        yield got
    finally:
        _RECORDERS.remove(got)


def bundle_dirs() -> list[Path]:
    env = [Path(p) for p in os.environ.get("CUDNN_MOE_JAX_BUNDLE", "").split(os.pathsep) if p]
    return env + [PACKAGE_DIR / "_bundle", REPO_DIR / ".bundle"]


@functools.lru_cache(maxsize=32)
def _read_manifest(path: str, mtime_ns: int) -> dict:
    man = json.loads(Path(path).read_text())  # mtime_ns is in the cache key: a rewritten manifest is read again
    if man.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"{path}: bundle format {man.get('format')!r}, expected {BUNDLE_FORMAT}")
    return man


def read_manifest(folder: Path | str) -> dict:
    path = Path(folder) / MANIFEST
    return _read_manifest(str(path), path.stat().st_mtime_ns)


def _entry(spec: KernelSpec, mod: KernelModule) -> dict:
    """What a bundle manifest and a module-cache file record beside a module's bytes."""
    return {"name": spec.name, "fingerprint": spec.fingerprint, "key": mod.key.hex(), "size": len(mod.module),
            "target": mod.target, "input_layouts": _canon(mod.input_layouts),
            "output_layouts": _canon(mod.output_layouts), "input_output_aliases": _canon(mod.input_output_aliases),
            "arch": spec.arch, "cutlass_dsl_version": cutlass_dsl_version(), "avals_key": spec.avals_key,
            "in_avals": _canon(spec.in_avals), "out_avals": _canon(spec.out_avals), "meta": _canon(spec.meta)}


def _entry_mismatch(e: dict, akey: Optional[str]) -> Optional[str]:
    if akey is not None and e["avals_key"] != akey:
        return f"entry is for other avals {e['in_avals']} -> {e['out_avals']}"
    return None


def _module_of(e: dict, data: bytes, origin: str) -> KernelModule:
    """The KernelModule of entry `e` and its bytes; ValueError if the bytes are not the entry's (sha256)."""
    if hashlib.sha256(data).hexdigest() != e["key"]:
        raise ValueError("sha256 does not match the entry")
    return KernelModule(data, bytes.fromhex(e["key"]), e["target"], layouts(e["input_layouts"]),
                        layouts(e["output_layouts"]), tuple(tuple(a) for a in e["input_output_aliases"]), origin)


def _from_bundles(fp: str, akey: Optional[str], notes: list[str]) -> Optional[KernelModule]:
    """Entry `fp` (built for avals `akey`, unless None) from the first bundle folder that holds it."""
    for folder in bundle_dirs():
        if not (folder / MANIFEST).is_file():
            continue
        try:
            e = read_manifest(folder)["entries"].get(fp)
            why = "no entry" if e is None else _entry_mismatch(e, akey)
            if why:
                notes.append(f"{folder}: {why}")
                continue
            return _module_of(e, (folder / e["file"]).read_bytes(), f"bundle {folder}")
        except (OSError, ValueError, KeyError, TypeError) as err:
            notes.append(f"{folder}: unreadable ({err})")
    return None


# ------------------------------------------------------------------------------------------------ module cache

def _from_cache(fp: str, akey: Optional[str], notes: list[str]) -> Optional[KernelModule]:
    """Entry `fp` (built for avals `akey`, unless None) from the on-disk module cache (`_module_cache`)."""
    got = _module_cache.read(fp, akey, notes)
    return None if got is None else _module_of(*got, f"module cache {module_cache_dir()}")


def _to_cache(spec: KernelSpec, mod: KernelModule) -> Optional[Path]:
    return _module_cache.write(spec.fingerprint, _entry(spec, mod), mod.module)



# ------------------------------------------------------------------------------------------------ lookup

def _unavailable(name: str, arch: str, fp: str, notes: list[str], why: str) -> KernelUnavailable:
    looked = "; ".join(notes) or "no bundle folder: CUDNN_MOE_JAX_BUNDLE is unset and no default bundle exists"
    return KernelUnavailable(
        f"no CuTe DSL kernel module for {name} (arch {arch}, fingerprint {fp[:16]}): not in any bundle nor the "
        f"module cache ({module_cache_dir() or 'off'}) [{looked}] and {why}. Either `pip install "
        f"cudnn-moe-jax[cuda]` to compile at lowering time, or on any x86-64 machine with the compiler run "
        f"`python -m cudnn_moe_jax.aot build --arch {arch} --out DIR` and set CUDNN_MOE_JAX_BUNDLE=DIR.")


def get_module(spec: KernelSpec) -> KernelModule:
    """memory -> bundle -> module cache -> compile (-> module cache) -> KernelUnavailable. Thread-safe; memoised by
    (fingerprint, avals)."""
    with _LOCK:
        key, notes = (spec.fingerprint, spec.avals_key), []
        mod = (_MEMORY.get(key) or _from_bundles(spec.fingerprint, spec.avals_key, notes)
               or _from_cache(spec.fingerprint, spec.avals_key, notes))
        if mod is None:
            why = _compile.compile_unavailable_reason()
            if why:
                raise _unavailable(spec.name, spec.arch, spec.fingerprint, notes, why)
            mod = _compile.compile_module(spec)
            _to_cache(spec, mod)
        _MEMORY[key] = mod
        for got in _RECORDERS:
            got.append((spec, mod))
        return mod


def has_module(fp: str) -> bool:
    """Whether memory, a bundle or the module cache holds a module under fingerprint `fp` (for any avals)."""
    with _LOCK:
        return (any(k[0] == fp for k in _MEMORY) or _from_bundles(fp, None, []) is not None
                or _from_cache(fp, None, []) is not None)


def call_spec(spec: KernelSpec, operands: Sequence[Any], out_avals: Sequence[Any]) -> list:
    return get_module(spec)(operands, out_avals)



def write_bundle(out_dir: Path | str, items: Iterable[tuple[KernelSpec, KernelModule]]) -> Path:
    """Add modules to the bundle in `out_dir` (created, or its manifest extended). Returns the manifest path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / MANIFEST
    man = json.loads(mpath.read_text()) if mpath.is_file() else {}
    if man.get("format") != BUNDLE_FORMAT:  # entries of another format can never match: start afresh
        man = {"format": BUNDLE_FORMAT, "entries": {}}
    for spec, mod in items:
        (out / f"{spec.fingerprint}.o").write_bytes(mod.module)
        man["entries"][spec.fingerprint] = {**_entry(spec, mod), "file": f"{spec.fingerprint}.o"}
    man["format"] = BUNDLE_FORMAT
    tmp = mpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(man, indent=1, sort_keys=True))
    os.replace(tmp, mpath)
    return mpath
