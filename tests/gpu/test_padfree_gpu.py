"""GPU: expert groups that end at any row (m_aligned < 256) through every M-grouped op and wgrad, against the float64
oracle (tests/np_ops.py), every element of every output, the outputs poisoned first; repeated calls bit-identical;
rows outside every group zero; the cases and checks are tests/gpu/padfree_cases.py's.

Needs a Hopper GPU and a bundle with the cases' modules (tests/gpu/padfree_cases.py); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import harness  # noqa: E402
import padfree_cases as cases  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("padfree_cases")


@pytest.mark.parametrize("item", cases.ITEMS, ids=[f"{c[0]}-{p}" for c, p in cases.ITEMS])
def test_padfree_groups_match_float64(item):
    errs = cases.run_case(item)
    assert not errs, errs
