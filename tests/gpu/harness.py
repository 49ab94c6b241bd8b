"""Shared pieces of the GPU tests, tools and lab benchmarks of the sm90 kernels.

The GPU machine has no CuTe DSL compiler, so kernels travel as `jax.export` artifacts built on a CPU machine:

    python tools/gpu/build_artifacts.py            # CPU machine with nvidia-cutlass-dsl: writes .out/kgpu/
    python tools/fetch_runtime.py                  # .runtime/libcute_dsl_runtime.so.xz (never committed)

On the GPU machine `load(name)` deserializes an artifact and `register()` registers the runtime's FFI handlers
(`cudnn_moe_jax._runtime.register_runtime`, else the same ~30 lines inline). Cases are described in
`.out/kgpu/manifest.json` (problem fields, config, group patterns, shapes) so the GPU side needs no cutlass.

Also here: the routing patterns the GPU tests run and the tolerance check of a device result against the float64
oracle, which is the CPU tests' own (tests/np_ops.py: np_forward_oracle, np_sanitized_ends, np_group_of_rows).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
ART_DIR = Path(os.environ.get("CUDNN_MOE_KGPU_DIR", REPO / ".out" / "kgpu"))
M_ALIGN = 256

# ------------------------------------------------------------------------------------------- artifacts / runtime


def manifest():
    path = ART_DIR / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def gpu_available() -> bool:
    try:
        import jax

        return bool(jax.devices("gpu"))
    except Exception:  # noqa: BLE001
        return False


def runtime_or_skip(section: str) -> str:
    """For a GPU test module's fixture: skip without artifacts of `section` or without a GPU, else register."""
    import pytest

    if not (manifest() or {}).get(section):
        pytest.skip(f"no {section!r} GPU test artifacts in {ART_DIR} (run tools/gpu/build_artifacts.py on a CPU "
                    "machine)")
    if not gpu_available():
        pytest.skip("no GPU")
    return register()


def register() -> str:
    """Register the CuTe DSL runtime FFI handlers once (cudnn_moe_jax._runtime); returns the library path."""
    from cudnn_moe_jax import _runtime

    if not _runtime.register_runtime():
        raise RuntimeError("CuTe DSL runtime could not be registered (see the cudnn_moe_jax log)")
    return _runtime.runtime_library_path()


def load(name: str):
    """The deserialized `jax.export.Exported` of artifact `name`."""
    import jax

    return jax.export.deserialize(bytearray((ART_DIR / f"{name}.jaxexp").read_bytes()))


# ------------------------------------------------------------------------------------------- routing patterns


PATTERNS = {
    # name -> function(m, L) -> offsets (int list)
    "uniform": lambda m, L: [(g + 1) * (m // L) // M_ALIGN * M_ALIGN for g in range(L - 1)] + [m],
    "empty_experts": lambda m, L: [0] + [m // 2 // M_ALIGN * M_ALIGN] * (L - 2) + [m],
    "one_expert": lambda m, L: [0] * (L - 1) + [m],
    "first_only": lambda m, L: [m] * L,
    "skewed": lambda m, L: list(np.cumsum(_skew_sizes(m, L))),
    "m_gt_valid": lambda m, L: [(g + 1) * (m // 2 // L) // M_ALIGN * M_ALIGN for g in range(L)],
    "unsanitized": lambda m, L: ([300, 100, 10 * m, m - 200] + [m] * L)[:L],
}


def offsets_for(pattern: str, m: int, L: int) -> list:
    """The pattern's offsets, cut or padded (with m) to exactly L entries."""
    return [int(x) for x in (list(PATTERNS[pattern](m, L)) + [m] * L)[:L]]


def _skew_sizes(m: int, L: int):
    blocks = m // M_ALIGN
    w = np.array([2.0 ** -g for g in range(L)])
    sizes = np.floor(w / w.sum() * blocks).astype(int)
    sizes[0] += blocks - sizes.sum()
    return (sizes * M_ALIGN).tolist()


# ------------------------------------------------------------------------------------------- tolerance


RTOL = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 3e-5}


def compare(name: str, got, ref, dtype: str, valid_rows=None) -> list:
    """Problems found comparing `got` (device result) with the float64 `ref` (list of strings, empty = ok)."""
    errs = []
    got = np.asarray(got).astype(np.float64)
    if got.shape != ref.shape:
        return [f"{name}: shape {got.shape} != {ref.shape}"]
    if not np.isfinite(got).all():
        errs.append(f"{name}: {int((~np.isfinite(got)).sum())} non-finite values")
    if valid_rows is not None and (~valid_rows).any():
        outside = got[~valid_rows]
        if np.any(outside != 0):
            errs.append(f"{name}: {int((outside != 0).sum())} nonzero values in rows outside every group")
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    tol = 1e-5 * scale + RTOL[dtype] * np.abs(ref)
    bad = np.abs(got - ref) > tol
    if bad.any():
        idx = np.argwhere(bad)[:3].tolist()
        errs.append(f"{name}: {int(bad.sum())}/{bad.size} elements out of tolerance, e.g. at {idx}: got "
                    f"{[got[tuple(i)] for i in idx]} ref {[ref[tuple(i)] for i in idx]}")
    return errs


# ------------------------------------------------------------------------------------------------ public-op cases
# (tests/gpu/test_*_gpu.py that run the public ops from a kernel bundle: dgrad, wgrad, public_ops)

ULP = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 2 ** -24}   # half an output step, relative
SUBNORMAL_STEP = {"bfloat16": 2.0 ** -133, "float16": 2.0 ** -24, "float32": 2.0 ** -149}


def skip_without_gpu_or_bundle(cases_module: str) -> None:
    """Module-level skip of a public-op GPU test: no GPU, or no kernel bundle (every case would fall back)."""
    import pytest

    from cudnn_moe_jax import _runtime

    if not gpu_available():
        pytest.skip("no GPU", allow_module_level=True)
    if not any(d.is_dir() for d in _runtime.bundle_dirs()):
        pytest.skip(f"no kernel bundle: build one with the command in tests/gpu/{cases_module}.py (and carry `.bundle`"
                    " to the GPU machine) -- without it every case would fall back to the reference",
                    allow_module_level=True)


def run_poisoned_twice(fn, x):
    """fn(x) jitted and called twice, XLA's allocator handed NaN-filled memory before each call, a fallback to the
    reference an error (its RuntimeWarning): (first outputs, second outputs)."""
    import warnings

    import jax

    fn = jax.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # a fallback to the reference would warn
        poison_allocator()
        out = jax.block_until_ready(fn(x))
        poison_allocator()
        again = jax.block_until_ready(fn(x))
    return out, again


def poison_allocator(nbytes: int = 256 << 20) -> None:
    """Hand XLA's allocator a NaN-filled block: outputs a kernel forgets to write then read NaN, not zeros."""
    import jax.numpy as jnp

    x = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x

