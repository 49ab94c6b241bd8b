"""CPU checks of the sm90 kernels: every default variant compiles for sm_90a through `cutlass_call` + `jax.export`
(symbolic m: one module for every m), and its SASS has wgmma (HGMMA) and no local-memory spills (LDL/STL).

Skipped when the CuTe DSL compiler is not installed. ~24 variants x ~2 s on 2 cores.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

import pytest

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import config as sm90_config
from cudnn_moe_jax.kernels.sm90 import variants

FATBIN_MAGIC = 0xBA55ED50


def _cutlass_sm90():
    """Import cutlass targeting sm_90a, or skip."""
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    try:
        import cutlass  # noqa: F401
        import cutlass.jax  # noqa: F401
        from cutlass.cutlass_dsl.cutlass import CuTeDSL
    except Exception as e:  # noqa: BLE001 - any import problem means "no compiler here"
        pytest.skip(f"CuTe DSL compiler not importable: {e}")
    if CuTeDSL._get_dsl().envar.arch != "sm_90a":
        pytest.skip("cutlass was imported for another arch; set CUTE_DSL_ARCH=sm_90a")
    return cutlass


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    for site in sys.path:
        hits = glob.glob(os.path.join(site, "nvidia", "cu1*", "bin", "cuobjdump"))
        if hits:
            return hits[0]
    return None


def fatbins(module: bytes) -> list:
    """The fatbin images embedded in a CuTe DSL host object (the cubin lives inside)."""
    out, i = [], 0
    while True:
        i = module.find(struct.pack("<I", FATBIN_MAGIC), i)
        if i < 0:
            return out
        _, _, header, size = struct.unpack_from("<IHHQ", module, i)
        out.append(module[i:i + header + size])
        i += header + size


def sass_of(module: bytes, tool: str) -> str:
    texts = []
    with tempfile.TemporaryDirectory() as tmp:
        for j, fb in enumerate(fatbins(module)):
            path = os.path.join(tmp, f"m{j}.fatbin")
            with open(path, "wb") as f:
                f.write(fb)
            texts.append(subprocess.run([tool, "-sass", "-res-usage", path], capture_output=True, text=True,
                                        check=True).stdout)
    return "\n".join(texts)


def compile_module(problem, config=None) -> bytes:
    """Lower + export with a symbolic m; returns the module bytes cutlass_call compiled."""
    cutlass = _cutlass_sm90()
    import jax
    from cutlass.jax.compile import _CUTLASS_COMPILE_CACHE

    from cudnn_moe_jax.kernels.sm90.jax_bridge import make_call

    call = make_call(problem, config)
    (m,) = jax.export.symbolic_shape("m")
    avals = variants.input_avals(problem)
    sym = [jax.ShapeDtypeStruct((m,) + a.shape[1:], a.dtype) if name in ("a", "prob") else a
           for name, a in avals.items()]
    before = set(_CUTLASS_COMPILE_CACHE)
    exp = jax.export.export(jax.jit(call), platforms=["cuda"],
                            disabled_checks=cutlass.jax.get_export_disabled_safety_checks())(*sym)
    assert "CuteDSLRT_NvJaxCutlassCall" in exp.mlir_module()
    new = [k for k in _CUTLASS_COMPILE_CACHE if k not in before]
    assert len(new) == 1, "expected exactly one compiled module"
    return _CUTLASS_COMPILE_CACHE[new[0]].module


VARIANTS = variants.problems()


def _id(p):
    e = p.epilogue
    parts = [p.ab_dtype[:4], p.op if p.op != "glu" else e.act, "bias" if e.has_bias else "nobias",
             f"c{e.c_dtype[:4] if e.c_dtype else '-'}", f"d{e.d_dtype[:4]}"]
    return "-".join(parts)


@pytest.mark.parametrize("problem", VARIANTS, ids=[_id(p) for p in VARIANTS])
def test_variant_compiles_with_wgmma_and_no_spills(problem):
    module = compile_module(problem)
    assert fatbins(module), "no fatbin in the compiled module"
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    sass = sass_of(module, tool)
    assert "arch = sm_90a" in sass
    assert "HGMMA" in sass
    assert "UTMALDG" in sass and "UTMASTG" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "local-memory spills in the kernel"
    assert all(int(s) == 0 for s in re.findall(r"LOCAL:(\d+)", sass))


@pytest.mark.parametrize("cfg", [sm90_config.Config(tile_n=128, cluster_m=1, epi_stages=1),
                                 sm90_config.Config(tile_n=256, cluster_m=1),
                                 sm90_config.Config(tile_n=256, cluster_m=2, epi_pin=True),
                                 sm90_config.Config(tile_n=256, cluster_m=1, cluster_n=2)],
                         ids=["128x128-1x1-e1", "128x256-1x1", "128x256-2x1-pin", "128x256-1x2"])
def test_other_configs_compile(cfg):
    problem = GroupedGemmProblem(op="glu", m=2048, n=512, k=256, num_groups=4, ab_dtype="bfloat16",
                                 epilogue=Epilogue(act="swiglu", c_dtype="bfloat16", compute_amax=True))
    assert fatbins(compile_module(problem, cfg))


def test_supports_reasons():
    ok = GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype="bfloat16")
    assert sm90_config.supports(ok) is None
    bad = [
        GroupedGemmProblem(op="dglu", m=512, n=256, k=128, num_groups=2, ab_dtype="bfloat16",
                           epilogue=Epilogue(act="dswiglu")),
        GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype="float8_e4m3fn",
                           sf_dtype="float8_e8m0fnu", sf_vec_size=32),
        GroupedGemmProblem(op="quant", m=500, n=256, k=128, num_groups=2, ab_dtype="bfloat16"),
        GroupedGemmProblem(op="quant", m=512, n=256, k=100, num_groups=2, ab_dtype="bfloat16"),
        GroupedGemmProblem(op="glu", m=512, n=96, k=128, num_groups=2, ab_dtype="bfloat16",
                           epilogue=Epilogue(act="swiglu")),
        GroupedGemmProblem(op="quant", m=512, n=256, k=128, num_groups=2, ab_dtype="bfloat16",
                           epilogue=Epilogue(d_dtype="float8_e4m3fn", generate_sfd=True)),
    ]
    for p in bad:
        reason = sm90_config.supports(p)
        assert isinstance(reason, str) and reason, p


def test_default_config_and_variants_are_consistent():
    for p in VARIANTS:
        cfg = sm90_config.default_config(p)
        assert isinstance(cfg, sm90_config.Config) and hash(cfg) is not None
    items = variants.default_variants(("small",))
    assert len(items) == len(VARIANTS)
    for p, cfg, avals in items:
        assert sm90_config.supports(p) is None and list(avals)[:4] == list(variants.INPUT_NAMES[:4])
