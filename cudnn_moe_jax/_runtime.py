"""CuTe DSL runtime glue: FFI registration, kernel-module caches, prebuilt bundles. No `import cutlass` at import.

A CUDA lowering emits exactly what `cutlass.jax.cutlass_call` (nvidia-cutlass-dsl 4.8.1, jax >= 0.9.1) emits:
`jax.ffi.ffi_call(target, out_avals, input_layouts, output_layouts, input_output_aliases)(*operands, module=...,
key=...)`, one `stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2` (typed FFI; `...NoCudaGraph_v2` if the kernel
sets allow_cuda_graph=False) whose `mhlo.backend_config` holds `module` (x86-64 object embedding the sm_90a cubin)
and `key` (its 32-byte sha256 digest). Only where the module comes from differs: memory -> bundle folders
(`CUDNN_MOE_JAX_BUNDLE`, os.pathsep-separated, then `<package>/_bundle`, `<repo>/.bundle`) -> the on-disk module
cache (`module_cache_dir()`) -> CuTe DSL compile via cutlass.jax's own steps (if `cutlass` imports and
CUDNN_MOE_JAX_NO_COMPILE is unset; the result is written to the module cache) -> `KernelUnavailable(reason)`.

Primitive side: `kernel_lowering(problem, input_names, config, in_avals, out_avals)` -> lowering `(ctx, *args) ->
results` with the module already in hand, or raises KernelUnavailable. It checks `supports`, resolves the config and
computes the fingerprint once each. Lower level, in any `mlir.lower_fun(..., multiple_results=True)` body:
`kernel_call(problem, config, operands, out_avals, input_names=...) -> list[jax.Array]`. The launcher gets what
cutlass_call gives it, `launch(stream, *operands, *outputs, **constexprs)`; a None operand is an absent tensor (no
FFI buffer). Output zero-init is the kernel's. jax.export needs `disabled_checks=export_disabled_checks()`.

Kernel side (`cudnn_moe_jax.kernels.sm90`; its import is pure Python): `supports(problem) ->
None | reason`, `default_config(problem)`, `default_variants()`; `GroupedGemmSm90(problem, config)` (imports cutlass)
with `launch` the `@cute.jit` launcher and `cutlass_call_kwargs` (input_spec, output_spec, compile_key, ...).

One module per problem, whatever the token count: the kernels take m dynamic, and a grouped-GEMM module is
compiled, keyed and recorded for the symbolic m `symbolic_m()` (= 256*m_blocks), never for the call's m; the
K-grouped wgrad likewise for the symbolic token count `symbolic_t()` (= 8*t_blocks, its k). (Compiled for a
concrete m, the device code is the same but the host object's symbol names mangle the shapes, so its bytes would
differ per m.) Fingerprint: sha256 of (the problem with m (wgrad: T) symbolic, input names, config (None -> the
default), arch, every kernels/**.py, cutlass DSL version: installed, else the pin, so a GPU machine without the
compiler computes the build machine's). The avals (m or T symbolic) are recorded beside the module and checked,
not trusted; a call's avals must be exactly them at its m (T).

Bundle: `manifest.json` ({"format": 2, "entries": {fingerprint: {file, key, target, layouts, aliases, avals, ...}}})
plus `<fingerprint>.o` per module. Module cache (`_module_cache`): one file `<fingerprint>.module` per module, the
same entry and the bytes, written atomically (safe under concurrent processes); a bad entry is ignored and rewritten.

`register_runtime()` dlopens libcute_dsl_runtime.so and registers the FFI type and both v2 targets for CUDA; it
must precede XLA's compile of a program holding the call (lowerings try it once themselves).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import lzma
import operator
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from . import _module_cache
from ._module_cache import cache_dir, module_cache_dir  # noqa: F401 (part of this module's API)

log = logging.getLogger("cudnn_moe_jax.runtime")

CUTLASS_DSL_VERSION = "4.8.1"  # the pin in pyproject's [cuda] extra
DEFAULT_ARCH = "sm_90a"
BUNDLE_FORMAT = 2  # 2: m-free fingerprints, avals recorded with m symbolic
MANIFEST = "manifest.json"
LIB_NAME = "libcute_dsl_runtime.so"
FFI_TYPE = "CuteDSLRT_NvJaxCutlassCallTypes_v2"
FFI_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
FFI_TARGET_NO_CUDA_GRAPH = "CuteDSLRT_NvJaxCutlassCallNoCudaGraph_v2"
_EXECUTE = {FFI_TARGET: "CuteDSLRT_NvJaxCutlassCallExecute_v2",
            FFI_TARGET_NO_CUDA_GRAPH: "CuteDSLRT_NvJaxCutlassCallExecuteNoCudaGraph_v2"}
_STAGES = {"prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2", "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2"}
_TYPE_FNS = {"type_id": "CuteDSLRT_NvJaxCutlassCallStateTypeId_v2",
             "type_info": "CuteDSLRT_NvJaxCutlassCallStateTypeInfo_v2"}
PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent


class KernelUnavailable(RuntimeError):
    """No kernel module can be had for a call; `reason` says why and how to get one."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------------------------------------ runtime library

def _wheel_library() -> Optional[Path]:
    try:  # find_spec does not run the package; blocked or broken just means "not there"
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or ()) if spec else ():
        for cuda in ("cu13", "cu12"):
            if (Path(root) / cuda / "lib" / LIB_NAME).is_file():
                return Path(root) / cuda / "lib" / LIB_NAME
    return None


def _unpack_xz(src: Path) -> Path:
    dst = cache_dir() / "runtime" / hashlib.sha256(src.read_bytes()).hexdigest()[:16] / LIB_NAME
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".unpack-")
        with os.fdopen(fd, "wb") as out, lzma.open(src) as z:
            shutil.copyfileobj(z, out, 1 << 22)
        os.replace(tmp, dst)  # atomic: concurrent processes unpack the same bytes
    return dst


def find_runtime_library(lib_path: Optional[str] = None) -> tuple[Optional[Path], list[str]]:
    """(libcute_dsl_runtime.so or None, what was tried). An explicit path or CUDNN_MOE_JAX_RUNTIME is final."""
    env, tried = os.environ.get("CUDNN_MOE_JAX_RUNTIME"), []
    if lib_path or env:
        cands = [("argument" if lib_path else "CUDNN_MOE_JAX_RUNTIME", Path(lib_path or env))]
    else:
        wheel = _wheel_library()
        cands = [("nvidia-cutlass-dsl wheel", wheel)] if wheel else []
        tried += [] if wheel else ["nvidia-cutlass-dsl wheel: not installed"]
        cands.append(("repo .runtime/", REPO_DIR / ".runtime"))
    for origin, path in cands:
        if path.is_dir():
            path = next((path / n for n in (LIB_NAME, LIB_NAME + ".xz") if (path / n).is_file()), path / LIB_NAME)
        if not path.is_file():
            tried.append(f"{origin}: {path} does not exist")
            continue
        if path.name.endswith(".xz"):
            try:
                path = _unpack_xz(path)
            except (OSError, lzma.LZMAError) as e:
                tried.append(f"{origin}: cannot unpack {path} ({e})")
                continue
        return path, tried
    return None, tried


_REG_LOCK = threading.Lock()
_REGISTERED: dict[str, Any] = {}  # path, lib (kept alive), auto_failed


def register_runtime(lib_path: Optional[str] = None) -> bool:
    """Load libcute_dsl_runtime.so and register the CuTe DSL FFI type and targets for CUDA. Idempotent.

    Returns False (logging why) without a CUDA platform or a library. Search: `lib_path`; env
    CUDNN_MOE_JAX_RUNTIME (.so, .so.xz or folder); the nvidia-cutlass-dsl cu13 wheel; the repo's ignored
    `.runtime/libcute_dsl_runtime.so[.xz]` (tools/fetch_runtime.py), unpacked once into `cache_dir()/runtime/`.
    """
    import jax

    with _REG_LOCK:
        if "path" in _REGISTERED:
            return True
        try:
            jax.devices("cuda")
        except RuntimeError as e:
            log.info("CuTe DSL runtime not registered: no CUDA platform (%s)", e)
            return False
        ffi = sys.modules.get("cutlass.jax.ffi")  # cutlass_call may have registered the same targets already
        if ffi is not None and ffi.is_ffi_registered(2):
            _REGISTERED.update(path=str(ffi.find_cute_dsl_runtime_library()))
            return True
        path, tried = find_runtime_library(lib_path)
        if path is None:
            log.warning("CuTe DSL runtime not registered: %s not found (%s)", LIB_NAME, "; ".join(tried))
            return False
        try:
            lib = ctypes.CDLL(str(path))

            def sym(name):
                fn = getattr(lib, name)
                fn.restype = ctypes.c_void_p
                return fn

            jax.ffi.register_ffi_type(
                FFI_TYPE, {k: jax.ffi.pycapsule(sym(n)()) for k, n in _TYPE_FNS.items()}, platform="CUDA")
            for target, execute in _EXECUTE.items():
                stages = {k: jax.ffi.pycapsule(sym(n)) for k, n in {**_STAGES, "execute": execute}.items()}
                jax.ffi.register_ffi_target(target, stages, platform="CUDA")
        except (OSError, AttributeError, TypeError, ValueError, RuntimeError) as e:
            log.warning("CuTe DSL runtime not registered: loading %s failed (%s)", path, e)
            return False
        _REGISTERED.update(path=str(path), lib=lib)
        if ffi is not None and hasattr(ffi, "_REGISTERED_FFI_CALL_TARGETS"):  # keep cutlass from registering again
            ffi._REGISTERED_FFI_CALL_TARGETS.update(_EXECUTE)
            ffi._REGISTERED_FFI_TYPES.add(FFI_TYPE)
        log.info("CuTe DSL runtime registered from %s", path)
        return True


def _auto_register() -> None:
    if "path" not in _REGISTERED and "auto_failed" not in _REGISTERED and not register_runtime():
        _REGISTERED["auto_failed"] = True  # e.g. exporting on a CPU machine; register_runtime() retries


def runtime_library_path() -> Optional[str]:
    return _REGISTERED.get("path")


def export_disabled_checks() -> tuple:
    """`disabled_checks` for jax.export of functions holding our custom calls."""
    import jax.export
    return tuple(jax.export.DisabledSafetyCheck.custom_call(t) for t in sorted(_EXECUTE))


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
    """sha256 over every cudnn_moe_jax/kernels/**.py (relative path + bytes).
    Read once per process: the kernel code a process runs is what it imported, so later edits do not apply."""
    root = PACKAGE_DIR / "kernels"
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        if "__pycache__" not in p.parts:
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def cutlass_dsl_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return CUTLASS_DSL_VERSION


# ------------------------------------------------------------------------------------------------ modules, cache

def _sds(a: Any):
    import jax
    return None if a is None else jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)


def _layouts(ls) -> tuple:
    return tuple(None if l is None else tuple(l) for l in ls)


@dataclasses.dataclass(frozen=True)
class KernelModule:
    """One compiled module plus exactly what cutlass_call puts beside it in the custom call."""

    module: bytes
    key: bytes  # sha256(module).digest()
    target: str = FFI_TARGET
    input_layouts: tuple = ()  # JAX major-to-minor order per present operand (None: default row-major)
    output_layouts: tuple = ()
    input_output_aliases: tuple = ()  # ((input index, output index), ...) over present operands

    def __call__(self, operands: Sequence[Any], out_avals: Sequence[Any]) -> list:
        """Traced op: the custom call over the present operands; one array per out aval."""
        import jax
        _auto_register()
        fun = jax.ffi.ffi_call(self.target, tuple(_sds(a) for a in out_avals),
                               input_output_aliases=dict(self.input_output_aliases),
                               input_layouts=list(self.input_layouts) or None,
                               output_layouts=list(self.output_layouts) or None)
        return list(fun(*[x for x in operands if x is not None], module=self.module, key=self.key))


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


def _module_of(e: dict, data: bytes) -> KernelModule:
    """The KernelModule of entry `e` and its bytes; ValueError if the bytes are not the entry's (sha256)."""
    if hashlib.sha256(data).hexdigest() != e["key"]:
        raise ValueError("sha256 does not match the entry")
    return KernelModule(data, bytes.fromhex(e["key"]), e["target"], _layouts(e["input_layouts"]),
                        _layouts(e["output_layouts"]), tuple(tuple(a) for a in e["input_output_aliases"]))


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
            return _module_of(e, (folder / e["file"]).read_bytes())
        except (OSError, ValueError, KeyError, TypeError) as err:
            notes.append(f"{folder}: unreadable ({err})")
    return None


# ------------------------------------------------------------------------------------------------ module cache

def _from_cache(fp: str, akey: Optional[str], notes: list[str]) -> Optional[KernelModule]:
    """Entry `fp` (built for avals `akey`, unless None) from the on-disk module cache (`_module_cache`)."""
    got = _module_cache.read(fp, akey, notes)
    return None if got is None else _module_of(*got)


def _to_cache(spec: KernelSpec, mod: KernelModule) -> Optional[Path]:
    return _module_cache.write(spec.fingerprint, _entry(spec, mod), mod.module)


# ------------------------------------------------------------------------------------------------ lookup

def compile_unavailable_reason() -> Optional[str]:
    if os.environ.get("CUDNN_MOE_JAX_NO_COMPILE", "") not in ("", "0"):
        return "compiling is disabled by CUDNN_MOE_JAX_NO_COMPILE"
    try:
        if importlib.util.find_spec("cutlass") is None:
            return "the CuTe DSL compiler (nvidia-cutlass-dsl) is not installed"
    except (ImportError, ValueError) as e:
        return f"the CuTe DSL compiler (cutlass) cannot be imported ({e})"
    return None


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
            why = compile_unavailable_reason()
            if why:
                raise _unavailable(spec.name, spec.arch, spec.fingerprint, notes, why)
            mod = compile_module(spec)
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


# ------------------------------------------------------------------------------------------------ compile, bundles

def import_cutlass(arch: str = DEFAULT_ARCH):
    """`import cutlass` set up to compile for `arch` (CUTE_DSL_ARCH is read once, at the first import)."""
    if "cutlass" not in sys.modules or "CUTE_DSL_ARCH" not in os.environ:
        os.environ["CUTE_DSL_ARCH"] = arch
    import cutlass
    from cutlass.cutlass_dsl.cutlass import CuTeDSL
    if CuTeDSL._get_dsl().envar.arch != arch:
        raise KernelUnavailable(f"cutlass was imported with CUTE_DSL_ARCH={CuTeDSL._get_dsl().envar.arch}; set "
                                f"CUTE_DSL_ARCH={arch} before the first `import cutlass` to compile for {arch}")
    return cutlass


def compile_module(spec: KernelSpec) -> KernelModule:
    """Compile with CuTe DSL through cutlass.jax's own steps (the FunctionSpec cutlass_call would build)."""
    import_cutlass(spec.arch)
    import jax
    from cutlass.jax import compile as cc, primitive as cp, types as ct

    if cutlass_dsl_version() != CUTLASS_DSL_VERSION:
        log.warning("nvidia-cutlass-dsl %s installed; pinned: %s", cutlass_dsl_version(), CUTLASS_DSL_VERSION)
    fn, kw = spec.build()
    kw = dict(kw or {})
    input_spec, output_spec = kw.pop("input_spec", None), kw.pop("output_spec", None)
    aliases = cc._normalize_input_output_aliases(kw.pop("input_output_aliases", None))
    target = FFI_TARGET if kw.pop("allow_cuda_graph", True) else FFI_TARGET_NO_CUDA_GRAPH
    options, static = kw.pop("compile_options", None), kw.pop("use_static_tensors", False)
    compile_key = kw.pop("compile_key", None)  # only skips cutlass's IR fingerprinting; the module is the same
    outs, box = tuple(_sds(a) for a in spec.out_avals), {}

    def trace(*present):  # traced, because build_function_spec insists on jax.Array inputs
        it = iter(present)
        args = tuple(None if a is None else next(it) for a in spec.in_avals)
        flat, tree = jax.tree.flatten(args)
        ispec = cp._resolve_input_spec_flat(input_spec, args, flat)
        ospec = cp._resolve_spec_flat(output_spec, list(outs))
        cp._validate_specs("Input", flat, ispec)
        cp._validate_specs("Output", list(outs), ospec)
        out_flat, out_tree = jax.tree.flatten(outs)
        fspec = cc.build_function_spec(flat, tree, out_flat, out_tree, ispec, ospec, dict(aliases), options, static, kw)
        res = cc.get_or_compile_kernel(fn, fspec, compile_key=compile_key)
        to_jax = ct.cutlass_to_jax_layout_order
        box["m"] = KernelModule(res.module, res.fingerprint, target,
                                tuple(to_jax(s.layout) for s in fspec.input_spec),
                                tuple(to_jax(s.layout) for s in fspec.output_spec), tuple(fspec.input_output_aliases))

    jax.eval_shape(trace, *[a for a in spec.in_avals if a is not None])
    return box["m"]


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


# ------------------------------------------------------------------------------------------------ grouped GEMM

@functools.lru_cache(maxsize=1)
def kernels_package():
    """The sm90 kernel package. Its own import is pure Python: `supports`, `default_config`, `default_variants`
    need no cutlass."""
    try:
        from .kernels import sm90
    except ImportError as e:
        raise KernelUnavailable(f"cannot import the sm90 kernels: {e}") from e
    return sm90


def _check_supported(problem) -> None:
    verdict = kernels_package().supports(problem)  # None (or True): implemented; else the reason
    if verdict is not None and verdict is not True:
        raise KernelUnavailable(f"the sm90 kernels do not cover this {problem.op} problem: {verdict}")


@functools.lru_cache(maxsize=1)
def symbolic_m():
    """The row count every grouped-GEMM module is compiled, keyed and recorded for: the jax.export symbolic
    dimension `256*m_blocks` (the kernels take m dynamic, m % 256 == 0; its multiples of 128 simplify exactly)."""
    import jax
    from ._problem import GROUP_ALIGN

    (m,) = jax.export.symbolic_shape(f"{GROUP_ALIGN}*m_blocks")
    return m


@functools.lru_cache(maxsize=1)
def symbolic_t():
    """The token count every wgrad module is compiled, keyed and recorded for: `8*t_blocks` (the kernel reads T
    from A's shape; every T the op accepts is a multiple of `_problem.TOKEN_ALIGN`)."""
    import jax
    from ._problem import TOKEN_ALIGN

    (t,) = jax.export.symbolic_shape(f"{TOKEN_ALIGN}*t_blocks")
    return t


def canonical_problem(problem):
    """`problem` with its dynamic extent symbolic: what identifies its module. M-grouped ops: m (`symbolic_m()`);
    wgrad: the token count k (`symbolic_t()`; its m, the weight rows, is static)."""
    if problem.op == "wgrad":
        return dataclasses.replace(problem, k=symbolic_t())
    return dataclasses.replace(problem, m=symbolic_m())


def _present_outputs(problem) -> tuple:
    import jax
    from ._problem import output_specs

    return tuple(jax.ShapeDtypeStruct(*v) for v in output_specs(problem).values() if v is not None)


def launch_avals(problem, config) -> tuple[tuple, Optional[Callable]]:
    """(what the kernel launch writes for `problem` (m concrete or symbolic), `finish` or None). Forward ops: the
    op's outputs (`_problem.output_specs`); backward ops: per-tile partial sums (the kernel package's
    `launch_outputs`) that `finish(launch outputs, {input name: array})` reduces to the op's outputs."""
    outs = _present_outputs(problem)
    try:
        launch_outputs = getattr(kernels_package(), "launch_outputs", None)
    except KernelUnavailable:
        launch_outputs = None  # no kernel sources here: only the forward ops' (= the op's) outputs are known
    if launch_outputs is None:
        return outs, None
    launch, finish = launch_outputs(problem, config, outs, problem.m)
    return tuple(_sds(a) for a in launch), finish


def grouped_gemm_avals(problem, config, input_names: Sequence[str], in_avals: Sequence[Any],
                       out_avals: Optional[Sequence[Any]] = None) -> tuple[tuple, tuple]:
    """(in, out) avals of the module of this call, m (wgrad: T) symbolic, once the call's avals are checked to be
    exactly those at m = problem.m (T = problem.k) (the axes of `_problem.dynamic_axes`; the launch outputs of
    `launch_avals`, None: those). Every other dimension and dtype is kept, so the recorded avals still pin it.
    KernelUnavailable if not."""
    import jax
    from ._problem import dynamic_axes

    canon, ins = canonical_problem(problem), []
    field, axes = dynamic_axes(problem)
    extent, sym = getattr(problem, field), getattr(canon, field)
    for name, a in zip(input_names, in_avals):
        a = _sds(a)
        if a is not None and name in axes:
            axis, rows = axes[name]
            if len(a.shape) <= axis or a.shape[axis] != extent // rows:
                raise KernelUnavailable(f"input {name} {a.shape}: axis {axis} must be {field}/{rows} = "
                                        f"{extent // rows} for {field} = {extent}")
            a = jax.ShapeDtypeStruct(a.shape[:axis] + (sym // rows,) + a.shape[axis + 1:], a.dtype)
        ins.append(a)
    want = launch_avals(problem, config)[0]
    got = want if out_avals is None else tuple(_sds(a) for a in out_avals)
    if got != want:
        raise KernelUnavailable(f"output avals {got} are not what the {problem.op} launch writes, {want}")
    return tuple(ins), launch_avals(canon, config)[0]


def resolve_config(problem, config):
    """None -> the kernel package's `default_config(problem)` (so None and the explicit default share a module);
    a `(mma_tiler_mn, cluster_shape_mn)` pair of cuDNN hints (from the public ops) -> `config_from_hints`.
    The kernel package sees the problem with m symbolic: a module, hence its config, is the same for every m."""
    if isinstance(config, tuple):
        return kernels_package().config_from_hints(canonical_problem(problem), *config)
    if config is not None:
        return config
    try:
        return kernels_package().default_config(canonical_problem(problem))
    except (KernelUnavailable, AttributeError):
        return None


def _grouped_gemm_fingerprint(canon, input_names: tuple, config, arch: str) -> str:
    return fingerprint("grouped_gemm", canon, input_names, config, arch, kernels_source_digest(),
                       cutlass_dsl_version())


def grouped_gemm_fingerprint(problem, input_names: Sequence[str], config, arch: str = DEFAULT_ARCH) -> str:
    """The module's fingerprint: m is not in it (one module serves every m)."""
    return _grouped_gemm_fingerprint(canonical_problem(problem), tuple(input_names), resolve_config(problem, config),
                                     arch)


def _checked_config(problem, config):
    """`supports` (where the kernel sources are) then the resolved config: once per call."""
    try:
        kernels_package()
    except KernelUnavailable:
        pass  # no kernel sources here: a bundle or the module cache may still hold the module
    else:
        _check_supported(problem)
    return resolve_config(problem, config)


def _spec(problem, config, names: tuple, in_avals, out_avals, arch: str) -> KernelSpec:
    canon = canonical_problem(problem)
    ins, outs = grouped_gemm_avals(problem, config, names, in_avals, out_avals)

    def build():  # the kernel is built for m symbolic: nothing in a module can depend on the m first asked for
        import_cutlass(arch)
        kernel = kernels_package().GroupedGemmSm90(canon, config)
        return getattr(kernel, "launch", kernel), dict(getattr(kernel, "cutlass_call_kwargs", None) or {})

    return KernelSpec(f"grouped_gemm/{problem.op}", _grouped_gemm_fingerprint(canon, names, config, arch), ins, outs,
                      build, arch, meta={"problem": canon, "config": config, "input_names": list(names)})


def grouped_gemm_spec(problem, config, input_names: Sequence[str], in_avals: Sequence[Any],
                      out_avals: Optional[Sequence[Any]] = None, arch: str = DEFAULT_ARCH) -> KernelSpec:
    """The KernelSpec of one launch: `out_avals` are what it writes (`launch_avals`; None: those)."""
    return _spec(problem, _checked_config(problem, config), tuple(input_names), in_avals, out_avals, arch)


def kernel_call(problem, config, operands: Sequence[Any], out_avals: Sequence[Any], *,
                input_names: Sequence[str] = (), arch: str = DEFAULT_ARCH) -> list:
    """The grouped-GEMM launch as a traced op (inside mlir.lower_fun). One array per launch out aval."""
    return call_spec(grouped_gemm_spec(problem, config, input_names, operands, out_avals, arch), operands, out_avals)


def kernel_lowering(problem, input_names: Sequence[str], config, in_avals: Sequence[Any], out_avals: Sequence[Any],
                    arch: str = DEFAULT_ARCH):
    """A CUDA lowering `(ctx, *args) -> results` for this call (`out_avals`: the op's outputs), its module already
    found or compiled, so any failure raises here, where the primitive falls back (KernelUnavailable when there is
    no module). `supports`, the config and the fingerprint are computed once each."""
    names, config = tuple(input_names), _checked_config(problem, config)
    if tuple(_sds(a) for a in out_avals) != _present_outputs(problem):
        raise KernelUnavailable(f"output avals {out_avals} are not the {problem.op} problem's")
    launch, finish = launch_avals(problem, config)  # backward ops: partial sums, reduced by `finish` in fixed order
    mod = get_module(_spec(problem, config, names, in_avals, launch, arch))

    def lower(ctx, *args):
        from jax.interpreters import mlir

        def run(*xs):
            outs = mod(xs, launch)
            return outs if finish is None else finish(outs, dict(zip(names, xs)))

        return mlir.lower_fun(run, multiple_results=True)(ctx, *args)

    return lower
