"""GPU: gathered operands -- A rows (`a_index`) through every M-grouped op, the weight gradient's A / B tokens
(`a_index` / `b_index`): each output bit-identical to the same op on the pre-gathered rows (the same kernel schedule
and summation order; only how the operand reaches shared memory differs) and
within the padding-free suite's bounds of the float64 oracle, outputs poisoned first, two calls bit-identical. The
cases are lab/gather_cases.py's (lab/padfree_cases.py's with A of another row count and indices outside it);
`pytest -m sanitize` selects the compute-sanitizer subset.

Needs a Hopper GPU and a bundle with the cases' modules (tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import functools

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402
import padfree_checks as checks  # noqa: E402  (tests/conftest.py puts tests/ and tests/gpu/ on sys.path)

from lab import gather_cases as cases  # noqa: E402
from lab import harness  # noqa: E402

pytestmark = pytest.mark.gpu
harness.skip_without_gpu_or_bundle("lab.gather_cases")

# memcheck / racecheck: straddling tiles and indices outside A, the layer's 64-row groups, the dgrad
SANITIZE = {"swiglu_bias_amax-straddle", "swiglu_bias_amax-aligned64", "dswiglu_dbias_amax-tail",
            "quant_f32d-unsanitized", "dswiglu_dbias_nmajor-straddle", "wgrad_gather_a-straddle",
            "wgrad_gather_b-aligned64"}


@pytest.mark.parametrize("item", harness.sanitize_params([(f"{c[0]}-{p}", ((c, p),)) for c, p in cases.ITEMS],
                                                         SANITIZE))
def test_gathered_rows_match_pregathered_and_float64(item):
    (name, op, options, _), pattern = item
    x = cases.inputs(item, seed=7)
    fn = jax.jit(functools.partial(cases.call, item))
    got, again = harness.run_twice(fn, x)
    want, _ = harness.run_twice(fn, cases.pregathered(x))
    errs = harness.repeat_differences(got, again)
    errs += [f"{key}: differs from the op on the pre-gathered rows" for key, g in got.items() if g is not None
             and not np.array_equal(np.asarray(g).view(np.uint8), np.asarray(want[key]).view(np.uint8))]
    pre = cases.pregathered(x)
    if op == "wgrad":   # the oracle takes token-contiguous (rows, T) operands
        pre = dict(pre, a=pre["a"].T, b=pre["b"].T)
    # the oracle's math ignores the operands' memory order (b_major is a layout hint)
    plain = ((name, op, {k: v for k, v in options.items() if k != "b_major"}, item[0][3]), pattern)
    oracle = checks._oracle(plain, pre)
    for key, values in got.items():
        if values is not None and not (options.get("d_dtype") == "float8_e4m3fn" and key in checks.FP8_KEYS):
            errs += checks._value_errors(key, values, oracle)
    assert not errs, errs
