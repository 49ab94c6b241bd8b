"""CPU checks of the M-grouped kernels with group ends below 256-row blocks (m_aligned < 256: the schedule's tile
lists, kernels/scheduler.py): each compiles for sm_90a with m symbolic (one module for every routing), its SASS has
HGMMA and TMA, no local-memory spills, wgmma not serialized (lab.sass.check_sass), and, where tiles are
clipped at group ends (m_aligned < 128), the row-clipped stores as 16-byte shared loads and global stores
(LDS.128 / STG.E.128). Also the support rules of the alignments. Skipped without the CuTe DSL compiler;
~12 modules x 3-6 s.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import config as sm90_config
from lab.sass import check_sass, sass_or_skip

BF, F16, F32 = "bfloat16", "float16", "float32"
E4M3, E5M2, E8M0 = "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"


def _problem(op, m_aligned, act=None, ab=BF, **epi):
    return GroupedGemmProblem(op=op, m=2048, n=epi.pop("n", 512), k=256, num_groups=4, ab_dtype=ab,
                              m_aligned=m_aligned, b_major=epi.pop("b_major", "k"),
                              sf_dtype=epi.pop("sf_dtype", None), sf_vec_size=epi.pop("sf_vec_size", None),
                              epilogue=Epilogue(act=act, **epi))


# name -> (problem, config or None, clipped tiles)
CASES = {
    # forward, tiles clipped at group ends: D (16 / 32-bit), C (gate and up), amax masked by row
    "quant_bias_amax_a1": (_problem("quant", 1, has_bias=True, bias_dtype=BF, d_dtype=BF, compute_amax=True),
                           None, True),
    "quant_f32d_a8": (_problem("quant", 8, d_dtype=F32), None, True),
    "srelu_amax_a8": (_problem("srelu", 8, "srelu", c_dtype=BF, d_dtype=BF, compute_amax=True), None, True),
    "swiglu_bias_a16": (_problem("glu", 16, "swiglu", has_bias=True, bias_dtype=BF, c_dtype=BF, d_dtype=BF,
                                 compute_amax=True), None, True),
    "geglu_f32c_f16_a1": (_problem("glu", 1, "geglu", ab=F16, c_dtype=F32, d_dtype=F16, glu_limit=7.0), None, True),
    "swiglu_e1_64experts_a1": (dataclasses.replace(_problem("glu", 1, "swiglu", c_dtype=BF, d_dtype=BF),
                                                   num_groups=64), None, True),   # one epilogue buffer
    # 128-aligned ends with a 2-CTA cluster: whole tiles, a block's two tiles may use two experts' B
    "swiglu_a128": (_problem("glu", 128, "swiglu", c_dtype=BF, d_dtype=BF, compute_amax=True), None, False),
    "quant_e4m3d_a128": (_problem("quant", 128, d_dtype=E4M3, generate_sfd=True, has_bias=True, bias_dtype=BF),
                         None, False),
    # other clusters: 1x1 (no B multicast), 1x2 (A multicast along N)
    "srelu_a1_c1x1": (_problem("srelu", 1, "srelu", c_dtype=BF, d_dtype=BF),
                      sm90_config.Config(cluster_m=1), True),
    "quant_a4_c1x2": (_problem("quant", 4, d_dtype=BF), sm90_config.Config(cluster_m=1, cluster_n=2), True),
    # backward: D_row clipped, dprob / dbias / amax of the group's rows only
    "dswiglu_dbias_amax_a1": (_problem("dglu", 1, "dswiglu", c_dtype=BF, d_dtype=BF, compute_amax=True,
                                       dbias_dtype=F32), None, True),
    "dsrelu_f32_nmajor_a8": (_problem("dsrelu", 8, "dsrelu", c_dtype=F32, d_dtype=F32, dbias_dtype=BF,
                                      b_major="n"), None, True),
    "dgeglu_e4m3_a128": (_problem("dglu", 128, "dgeglu", c_dtype=BF, d_dtype=E4M3, generate_sfd=True,
                                  dbias_dtype=F32), None, False),
    # MXFP8 (the dequantizing mainloop) with 128-aligned ends: 1x1 clusters (default_config), whole row blocks
    "mxfp8_swiglu_a128": (_problem("glu", 128, "swiglu", ab=E4M3, sf_dtype=E8M0, sf_vec_size=32, c_dtype=BF,
                                   d_dtype=BF, n=256), None, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_padfree_kernel_compiles(name):
    problem, config, clipped = CASES[name]
    sass = sass_or_skip(problem, config)
    # HGMMA (block-scaled inputs: the dequantizing mainloop, bf16 wgmma), TMA, no spills, wgmma not serialized
    check_sass(sass, block_scaled=False)
    vector_stores = len(re.findall(r"\bSTG\.E\.128\b", sass))
    vector_loads = len(re.findall(r"\bLDS\.128\b", sass))
    if clipped:
        assert vector_stores > 0 and vector_loads > 0, "row-clipped stores are not 16-byte LDS / STG"
    else:
        assert vector_stores == 0, "whole tiles only: no row-clipped stores expected"


def test_support_rules_of_the_alignment():
    supports = sm90_config.supports
    assert supports(_problem("glu", 1, "swiglu", c_dtype=BF, d_dtype=BF)) is None
    assert "multiple of m_aligned=8" in supports(dataclasses.replace(_problem("quant", 8, d_dtype=BF), m=2044))
    fp8d = _problem("quant", 64, d_dtype=E4M3, generate_sfd=True)
    assert "m_aligned=64" in supports(fp8d)
    mx = _problem("quant", 64, ab=E4M3, sf_dtype=E8M0, sf_vec_size=32, d_dtype=BF)
    assert "m_aligned=64" in supports(mx)
    mx128 = dataclasses.replace(mx, m_aligned=128)
    assert supports(mx128) is None
    assert sm90_config.default_config(mx128).cluster_m == 1
    assert sm90_config.config_from_hints(mx128, cluster_shape_mn=(2, 1)).cluster_m == 1
    assert sm90_config.default_config(dataclasses.replace(mx, m_aligned=256)).cluster_m == 2
