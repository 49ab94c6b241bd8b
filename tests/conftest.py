"""Shared by every test: the folders whose helper modules the tests import by name, and a private module cache.

tests/ holds the float64 oracle (np_ops, np_formats), tests/gpu/ the GPU harness and cases, benchmarks/ the
device timer and the benchmark the CPU tests check. The GPU tools (tools/gpu/_paths.py) put the same folders on
sys.path when they run as scripts.
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
for _folder in (_TESTS.parent / "benchmarks", _TESTS / "gpu", _TESTS):
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
