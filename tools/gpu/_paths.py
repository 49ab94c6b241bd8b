"""sys.path of the GPU tools when they run as scripts (`python tools/gpu/NAME.py`): the checkout (its
cudnn_moe_jax, also from a worktree the editable install does not point at) and the test modules the tools share
with the GPU tests, imported by name as pytest does through tests/conftest.py (tests/gpu: harness and the test
cases; tests: the float64 oracle and tests/test_kernels_compile.py's SASS helpers)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _folder in (REPO / "tests" / "gpu", REPO / "tests", REPO):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
