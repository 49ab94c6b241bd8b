"""Shared by every test: the folders whose helper modules the tests import by name.

tests/ holds the float64 oracle (np_ops, np_formats), tests/gpu/ the GPU harness and cases, benchmarks/ the
device timer and the benchmark the CPU tests check. The GPU tools (tools/gpu/_paths.py) put the same folders on
sys.path when they run as scripts.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS.parent / "benchmarks", _TESTS / "gpu", _TESTS):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
