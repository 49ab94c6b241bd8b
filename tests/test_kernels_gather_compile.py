"""CPU checks of the kernels with gathered operands (kernels/sm90/mainloop_gather.py): the M-grouped ops with A's
rows through `a_index`, the weight gradient with A's and / or B's tokens through `a_index` / `b_index`. Each
compiles for sm_90a with m (wgrad: T) symbolic, its SASS has HGMMA, TMA for the operands not gathered, the gathered
ones by 16-byte cp.async (LDGSTS.E.BYPASS.128, a stage's copies per lane unrolled), no local-memory spills and (the
M-grouped ones) wgmma not serialized; plus the support rules and cluster choices. Skipped without the CuTe DSL
compiler; ~10 modules x 5-15 s.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import config as sm90_config
from lab.sass import check_sass, sass_or_skip

BF, F16, F32, E4M3 = "bfloat16", "float16", "float32", "float8_e4m3fn"


def _problem(op, m_aligned, act=None, ab=BF, **epi):
    return GroupedGemmProblem(op=op, m=2048, n=epi.pop("n", 512), k=epi.pop("k", 256), num_groups=4, ab_dtype=ab,
                              m_aligned=m_aligned, b_major=epi.pop("b_major", "k"), a_rows=1000,
                              epilogue=Epilogue(act=act, **epi))


# the routed layer's four M-grouped calls (64-row groups) and other epilogues / alignments / clusters
CASES = {
    "swiglu_fc1_a64": (_problem("glu", 64, "swiglu", c_dtype=BF, d_dtype=BF), None),
    "quant_fc2_a64": (_problem("quant", 64, d_dtype=BF, has_prob=False), None),
    "dswiglu_dbias_nmajor_a64": (_problem("dglu", 64, "dswiglu", c_dtype=BF, d_dtype=BF, dbias_dtype=F32,
                                          b_major="n"), None),
    "quant_bias_amax_k200_a256": (_problem("quant", 256, d_dtype=BF, has_bias=True, bias_dtype=BF,
                                           compute_amax=True, k=200), None),
    "srelu_f16_a1_c1x1": (_problem("srelu", 1, "srelu", ab=F16, c_dtype=F32, d_dtype=F16),
                          sm90_config.Config(cluster_m=1)),
    "quant_e4m3d_a128": (_problem("quant", 128, d_dtype=E4M3, generate_sfd=True), None),
}


def _wgrad(a_rows=None, b_rows=None, m=512, n=512):
    return GroupedGemmProblem(op="wgrad", m=m, n=n, k=2048, num_groups=4, ab_dtype=BF, wgrad_dtype=F32,
                              a_major="m", b_major="n", a_rows=a_rows, b_rows=b_rows)


# the layer's two weight gradients: dW2 = dY^T h (A gathered: 2-CTA clusters along M, B multicast), dW1 = dC^T x
# (B gathered: along N, A multicast); both gathered (1x1), and an fp16 A-gathered one with 128-row W tiles
WGRAD_CASES = {
    "wgrad_dw2_gather_a": (_wgrad(a_rows=1000), 32),
    "wgrad_dw1_gather_b": (_wgrad(b_rows=1000), 64),
    "wgrad_gather_ab": (_wgrad(a_rows=1000, b_rows=900), 96),
    "wgrad_gather_a_f16_m128": (dataclasses.replace(_wgrad(a_rows=1000, m=128), ab_dtype=F16), 32),
}


@pytest.mark.parametrize("name", list(WGRAD_CASES))
def test_gathered_wgrad_compiles(name):
    problem, copies = WGRAD_CASES[name]
    sass = sass_or_skip(problem)
    assert "HGMMA" in sass and "UTMASTG" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "local-memory spills in the kernel"
    assert ("UTMALDG" in sass) == (problem.a_rows is None or problem.b_rows is None)
    # a stage's 64 tokens x tile rows / 8 chunks: A (128 rows) 32 copies a lane, B (256) 64
    assert len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", sass)) >= copies


@pytest.mark.parametrize("name", list(CASES))
def test_gathered_a_kernel_compiles(name):
    problem, config = CASES[name]
    sass = sass_or_skip(problem, config)
    check_sass(sass, block_scaled=False)
    assert len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", sass)) >= 32, \
        "A's rows are not copied by 16-byte cp.async, 32 a lane and stage"


def test_support_rules_of_gathered_a():
    supports = sm90_config.supports
    assert supports(CASES["swiglu_fc1_a64"][0]) is None
    mx = dataclasses.replace(_problem("quant", 128, ab=E4M3, d_dtype=BF), sf_dtype="float8_e8m0fnu",
                             sf_vec_size=32)
    assert "gathered rows / tokens" in supports(mx)
    fc1 = CASES["swiglu_fc1_a64"][0]
    assert sm90_config.config_from_hints(fc1, cluster_shape_mn=(2, 2)).cluster_n == 1   # A is never multicast
    from cudnn_moe_jax.kernels.sm90.kernel import kernel_class_for

    with pytest.raises(NotImplementedError, match="cluster_n 1"):
        kernel_class_for(fc1)(fc1, sm90_config.Config(cluster_m=1, cluster_n=2))
    assert "token-major" in supports(dataclasses.replace(_wgrad(a_rows=1000), a_major="k"))
    assert "token-major" in supports(dataclasses.replace(_wgrad(b_rows=1000), b_major="k"))
    assert sm90_config.default_config(_wgrad(b_rows=1000)) == sm90_config.Config(cluster_m=1, cluster_n=2)
    assert sm90_config.default_config(_wgrad(a_rows=10, b_rows=10)) == sm90_config.Config(cluster_m=1)
    assert sm90_config.default_config(_wgrad(a_rows=1000)).cluster_m == 2
