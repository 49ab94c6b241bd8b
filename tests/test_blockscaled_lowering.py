"""CPU: every public op call of the block-scaled GPU suite (lab/blockscaled_cases.py: NVFP4, MXFP4, NVFP4
with e8m0 scales, MXFP8 e4m3 / e5m2; quant, srelu, glu, dglu, dsrelu) lowers for CUDA to one kernel custom call,
with the fallback-to-the-reference warning turned into an error, and the support predicate routes every
block-scaled format of every M-grouped op to the kernel. Compiles one sm_90a module per case (~10 s each; skipped
without the CuTe DSL compiler).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

jax = pytest.importorskip("jax")

import blockscaled_checks as checks  # noqa: E402  (tests/gpu on sys.path: tests/conftest.py)
from runtime_helpers import assert_lowers_to_one_kernel, needs_cutlass  # noqa: E402

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem  # noqa: E402
from cudnn_moe_jax.kernels.sm90 import config  # noqa: E402
from lab import blockscaled_cases as cases  # noqa: E402


def test_supports_routes_every_block_format_and_op():
    fwd = {"quant": Epilogue(d_dtype="bfloat16"), "srelu": Epilogue(act="srelu", c_dtype="bfloat16"),
           "glu": Epilogue(act="swiglu", c_dtype="bfloat16"),
           "dglu": Epilogue(act="dswiglu", c_dtype="bfloat16"), "dsrelu": Epilogue(act="dsrelu", c_dtype="bfloat16")}
    for (data, sf, vec), (op, epi) in ((f, o) for f in config.BLOCK_FORMATS for o in fwd.items()):
        p = GroupedGemmProblem(op=op, m=512, n=256, k=256, num_groups=2, ab_dtype=data, sf_dtype=sf,
                               sf_vec_size=vec, epilogue=epi)
        assert config.supports(p) is None, p
        assert "16-byte" in config.supports(dataclasses.replace(p, k=240 if data.startswith("float4") else 232))
        nmajor = dataclasses.replace(p, b_major="n")     # not read by the kernel: K-major after XLA's transpose
        assert "N-major" in config.supports(nmajor) and config.read_problem(nmajor) == p
        assert config.supports(dataclasses.replace(p, a_dtype="bfloat16")) is None    # weight-only
        assert config.supports(dataclasses.replace(p, a_dtype="float16")) is None    # fp16 A (split in two)


@needs_cutlass
@pytest.mark.parametrize("case", cases.ALL_CASES, ids=[c[0] for c in cases.ALL_CASES])
def test_blockscaled_op_lowers_to_the_kernel(case):
    assert_lowers_to_one_kernel(functools.partial(cases.call, case), checks.inputs(case, mode="exact"))


@pytest.mark.parametrize("case", cases.ALL_CASES, ids=[c[0] for c in cases.ALL_CASES])
def test_bundle_items_lower_at_the_suite_inputs(case):
    """The bundle items lower each call at lab.blockscaled_cases.input_avals: exactly the shapes and dtypes of the
    GPU suite's inputs (the numpy quantizer's), so the bundle holds the modules the suite asks for."""
    def sds(v):
        return None if v is None else (tuple(v.shape), str(v.dtype))

    got = {k: sds(v) for k, v in checks.inputs(case, mode="adversarial").items()}
    assert got == {k: sds(v) for k, v in cases.input_avals(case).items()}
