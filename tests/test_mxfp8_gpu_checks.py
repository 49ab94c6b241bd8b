"""CPU self-test of the MXFP8 GPU checks (tests/gpu/mxfp8_checks.py): the GPU suite's own call (the primitive with
the kernels' argument order, lab.forward_cases.kernel_fn), lowered here to the pure-jnp reference, must pass every
check (MXFP8 and bf16 / fp16 inputs), and corrupted outputs (one e8m0 byte, one FP8 code, a nonzero padding byte, a
value in a row outside every group) must be caught. The GPU run has no second chance, so the checker is validated
here.
"""

from __future__ import annotations

import mxfp8_checks as g
import numpy as np
import pytest

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from lab.forward_cases import kernel_fn

E4M3, E5M2, E8M0 = "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"


def _p(op, epi, n=256, k=96, L=3, ab=E4M3):
    return GroupedGemmProblem(op=op, m=1024, n=n, k=k, num_groups=L, ab_dtype=ab, sf_dtype=E8M0, sf_vec_size=32,
                              epilogue=epi)


def _h(op, epi, n=256, k=96, L=3, ab="bfloat16"):
    """bf16 / fp16 inputs: the checker's other input path (FP8 epilogue from half-precision A / B)."""
    return GroupedGemmProblem(op=op, m=1024, n=n, k=k, num_groups=L, ab_dtype=ab, epilogue=epi)


CASES = {
    "swiglu_fp8d": _p("glu", Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype=E4M3, generate_sfd=True)),
    "geglu_fp8d_seg_e5m2": _p("glu", Epilogue(act="geglu", has_bias=True, bias_dtype="float32", c_dtype=E5M2,
                                              d_dtype=E5M2, generate_sfd=True, discrete_col_sfd=True),
                              n=320, ab=E5M2),
    "quant_bf16": _p("quant", Epilogue(d_dtype="bfloat16", compute_amax=True)),
    "srelu_f16": _p("srelu", Epilogue(act="srelu", c_dtype="float32", d_dtype="float16", tanh_clamp_scale=4.0)),
    "bf16in_quant_fp8d": _h("quant", Epilogue(d_dtype=E4M3, has_bias=True, bias_dtype="bfloat16",
                                              generate_sfd=True)),
    "f16in_swiglu_fp8c_fp8d_seg": _h("glu", Epilogue(act="swiglu", c_dtype=E4M3, d_dtype=E5M2, generate_sfd=True,
                                                     discrete_col_sfd=True), n=320, ab="float16"),
}


@pytest.mark.parametrize("pattern,kind", [("m_gt_valid", "adversarial"), ("unsanitized", "uniform_b")])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_passes_the_gpu_checks(case, pattern, kind):
    p = CASES[case]
    errs = g.run_case(case, p, pattern, 1024, kind, kernel_fn(p))
    assert not errs, "\n".join(errs)


def test_checks_catch_corruption():
    p = CASES["geglu_fp8d_seg_e5m2"]
    ref = kernel_fn(p)

    def corrupt(which):
        def call(*args):
            outs = {k: np.array(x) for k, x in ref(*args).items()}
            d, d_col = outs["d_tensor"], outs["d_col_tensor"]
            sfd_row, sfd_col = outs["sfd_row_tensor"].view(np.uint8), outs["sfd_col_tensor"].view(np.uint8)
            if which == "sf":
                sfd_row.reshape(-1)[np.flatnonzero(sfd_row.reshape(-1))[5]] += 1
            elif which == "code":
                flat = d.view(np.uint8).reshape(-1)
                i = np.flatnonzero(np.abs(d.astype(np.float32).reshape(-1)) > 1)[7]
                flat[i] ^= 0x01
            elif which == "padding":
                sfd_col.reshape(-1)[-1] = 7
            elif which == "outside":
                d_col[-1, 3] = 1.0
            return outs
        return call

    for which in ("sf", "code", "padding", "outside"):
        errs = g.run_case("x", p, "m_gt_valid", 1024, "adversarial", corrupt(which))
        assert errs, f"corruption {which!r} not detected"
