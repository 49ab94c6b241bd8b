"""GPU: expert groups that end at any row (m_aligned < 256) through every M-grouped op and wgrad, against the float64
oracle (tests/np_ops.py), every element of every output, the outputs poisoned first; repeated calls bit-identical;
rows outside every group zero. The cases are lab/padfree_cases.py's, the checks tests/gpu/padfree_checks.py's;
`pytest -m sanitize` selects the compute-sanitizer subset.

Needs a Hopper GPU and a bundle with the cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import padfree_checks as checks  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)
from lab import harness  # noqa: E402
from lab import padfree_cases as cases  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.padfree_cases")

# the compute-sanitizer subset (memcheck / racecheck): tiles clipped at group ends by row-predicated stores, 1-row
# and empty experts, the last zero tile clipped at m, 2-CTA blocks over two experts without B multicast, a masked
# last tile
SANITIZE = {"swiglu_bias_amax-straddle", "swiglu_bias_amax-odd_tiles_128", "quant_f32d-tail", "dswiglu_dbias_amax-tail",
            "dsrelu_dbias_amax-unsanitized", "wgrad_tokens-straddle"}


@pytest.mark.parametrize("item", harness.sanitize_params([(f"{c[0]}-{p}", ((c, p),)) for c, p in cases.ITEMS],
                                                         SANITIZE))
def test_padfree_groups_match_float64(item):
    errs = checks.run_case(item)
    assert not errs, errs
