"""The CuTe DSL runtime's custom call: libcute_dsl_runtime.so found and registered as XLA FFI targets, and
`KernelModule`, one compiled module with the custom call that runs it. No `import cutlass`.

A CUDA lowering emits exactly what `cutlass.jax.cutlass_call` (nvidia-cutlass-dsl 4.8.1, jax >= 0.9.1) emits:
`jax.ffi.ffi_call(target, out_avals, input_layouts, output_layouts, input_output_aliases)(*operands, module=...,
key=...)`, one `stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2` (typed FFI; `...NoCudaGraph_v2` if the kernel
sets allow_cuda_graph=False) whose `mhlo.backend_config` holds `module` (x86-64 object embedding the sm_90a cubin)
and `key` (its 32-byte sha256 digest). The launcher gets what cutlass_call gives it, `launch(stream, *operands,
*outputs, **constexprs)`; a None operand is an absent tensor (no FFI buffer). jax.export needs
`disabled_checks=export_disabled_checks()`.

`register_runtime()` dlopens libcute_dsl_runtime.so and registers the FFI type and both v2 targets for CUDA; it
must precede XLA's compile of a program holding the call (a KernelModule's call tries it once itself).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import logging
import lzma
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from ._module_cache import cache_dir

log = logging.getLogger("cudnn_moe_jax.runtime")

LIB_NAME = "libcute_dsl_runtime.so"
FFI_TYPE = "CuteDSLRT_NvJaxCutlassCallTypes_v2"
FFI_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
FFI_TARGET_NO_CUDA_GRAPH = "CuteDSLRT_NvJaxCutlassCallNoCudaGraph_v2"
_EXECUTE = {FFI_TARGET: "CuteDSLRT_NvJaxCutlassCallExecute_v2",
            FFI_TARGET_NO_CUDA_GRAPH: "CuteDSLRT_NvJaxCutlassCallExecuteNoCudaGraph_v2"}
_STAGES = {"prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2", "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2"}
_TYPE_FNS = {"type_id": "CuteDSLRT_NvJaxCutlassCallStateTypeId_v2",
             "type_info": "CuteDSLRT_NvJaxCutlassCallStateTypeInfo_v2"}
REPO_DIR = Path(__file__).resolve().parent.parent


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


# ------------------------------------------------------------------------------------------------ the call

def sds(a: Any):
    """`a`'s ShapeDtypeStruct (None stays None: an absent tensor)."""
    import jax
    return None if a is None else jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)


def layouts(ls) -> tuple:
    """Recorded layouts (JSON lists) as the tuples a KernelModule holds."""
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
    # Where this process got it: "compiled", "module cache <dir>" or "bundle <dir>" (aot build reports it).
    origin: str = dataclasses.field(default="compiled", compare=False)

    def __call__(self, operands: Sequence[Any], out_avals: Sequence[Any]) -> list:
        """Traced op: the custom call over the present operands; one array per out aval."""
        import jax
        _auto_register()
        fun = jax.ffi.ffi_call(self.target, tuple(sds(a) for a in out_avals),
                               input_output_aliases=dict(self.input_output_aliases),
                               input_layouts=list(self.input_layouts) or None,
                               output_layouts=list(self.output_layouts) or None)
        return list(fun(*[x for x in operands if x is not None], module=self.module, key=self.key))
