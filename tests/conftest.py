"""Shared by every test: the import roots of the test helpers, and a private module cache.

The checkout's root (the lab package `lab`, `benchmarks`, `examples`: imported as packages, as the scripts run
from the root with `python -m`), tests/ (the float64 oracle: np_ops, np_formats) and tests/gpu/ (the GPU suites'
checks, e.g. mxfp8_checks), the last two imported by name. This is the only sys.path insert of the repository.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The suite compiles kernels for Hopper; CUTE_DSL_ARCH is read once, when the first test imports cutlass (any test may
# be first: an `importorskip("cutlass")` counts).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS / "gpu", _TESTS, _TESTS.parent):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


@pytest.fixture(scope="session", autouse=True)
def _private_module_cache(tmp_path_factory):
    """Kernel modules compiled by the tests go to a per-session module cache, not the user's
    (~/.cache/cudnn_moe_jax/modules): a test that compiles must compile. Subprocesses inherit it through the
    environment. An explicit CUDNN_MOE_JAX_MODULE_CACHE (a folder to reuse, or `off`) is left alone."""
    if "CUDNN_MOE_JAX_MODULE_CACHE" in os.environ:
        yield
        return
    os.environ["CUDNN_MOE_JAX_MODULE_CACHE"] = str(tmp_path_factory.mktemp("module_cache"))
    try:
        yield
    finally:
        os.environ.pop("CUDNN_MOE_JAX_MODULE_CACHE", None)
