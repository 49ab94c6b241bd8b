"""Compile a kernel module for sm_90a on the CPU machine and read its SASS (cuobjdump from the nvidia wheel).

`compile_module(problem, config)` lowers the kernel the way the runtime does (m or T symbolic) and returns the
module bytes (`compile_or_skip`: the same in a test, skipped without the compiler); `sass_of(module)`
disassembles every embedded cubin; `check_sass(sass, block_scaled)` is the compile tests' check (wgmma not
serialized, TMA, no spills); `normalized(sass)` drops what names the launcher (mangled symbol names), so
two trees that emit the same instructions compare equal.
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

FATBIN_MAGIC = 0xBA55ED50


class CompilerUnavailable(RuntimeError):
    """The CuTe DSL compiler (or cuobjdump) is not installed here."""


def cutlass_sm90():
    """Import cutlass targeting sm_90a (CUTE_DSL_ARCH must be set before the first import)."""
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    try:
        import cutlass
        import cutlass.jax  # noqa: F401
        from cutlass.cutlass_dsl.cutlass import CuTeDSL
    except Exception as e:  # noqa: BLE001 - any import problem means "no compiler here"
        raise CompilerUnavailable(f"CuTe DSL compiler not importable: {e}") from e
    if CuTeDSL._get_dsl().envar.arch != "sm_90a":
        raise CompilerUnavailable("cutlass was imported for another arch; set CUTE_DSL_ARCH=sm_90a")
    return cutlass


def cuobjdump() -> str | None:
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


def sass_of(module: bytes, tool: str | None = None) -> str:
    tool = tool or cuobjdump()
    if tool is None:
        raise CompilerUnavailable("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    texts = []
    with tempfile.TemporaryDirectory() as tmp:
        for j, fb in enumerate(fatbins(module)):
            path = os.path.join(tmp, f"m{j}.fatbin")
            with open(path, "wb") as f:
                f.write(fb)
            texts.append(subprocess.run([tool, "-sass", "-res-usage", path], capture_output=True, text=True,
                                        check=True).stdout)
    return "\n".join(texts)


def check_sass(sass: str, block_scaled: bool, problem=None) -> None:
    """The compile tests' SASS check: sm_90a, wgmma (block_scaled: the FP8-wgmma MXFP8 mainloop, QGMMA + scale
    HGMMA; everything else bf16 / fp16 HGMMA) not serialized, TMA loads, D by TMA stores (or, where the kernel of
    `problem` stores D from registers, by 16-byte stores: a dgrad's D_row), no local memory."""
    assert "arch = sm_90a" in sass
    assert ("QGMMA" if block_scaled else "HGMMA") in sass
    registers = False
    if problem is not None and problem.op in ("dglu", "dsrelu"):
        from cudnn_moe_jax.kernels.sm90 import GroupedGemmSm90

        registers = GroupedGemmSm90(problem).d_from_registers
    assert "UTMALDG" in sass and ("UTMASTG" in sass) != registers and (not registers or "STG.E.128" in sass)
    assert not re.search(r"\b(LDL|STL)\b", sass), "local-memory spills in the kernel"
    assert all(int(s) == 0 for s in re.findall(r"LOCAL:(\d+)", sass))
    if not block_scaled:
        # a stage's k16 wgmmas form one commit group (only its last HGMMA sets gsb0) and one group stays in
        # flight (DEPBAR.LE gsb0, 0x1); a serialized wgmma (ptxas C7514) sets gsb0 and waits on every HGMMA
        hgmma = re.findall(r"HGMMA\.\S+ [^;]*;", sass)
        assert sum("gsb0" in h for h in hgmma) < len(hgmma), "wgmma serialized: every HGMMA ends a group"
        assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass), "no wgmma group kept in flight"
    if block_scaled:
        # per 32-K block: the data QGMMA and the scale-product HGMMA are issued back to back (two commit groups,
        # waited for one after the other). ptxas serializes wgmma (C7514) when it cannot prove the accumulators
        # retired: then a wait follows every wgmma, also between a QGMMA and its HGMMA
        events = re.findall(r"\b(QGMMA|HGMMA\.64x(?:32|64|128)x16\.F32\.BF16|WARPGROUP\.DEPBAR)\b", sass)
        n_q = events.count("QGMMA")
        assert n_q == sum(e.startswith("HGMMA") for e in events) > 0, "one scale HGMMA per data QGMMA"
        after_q = [events[i + 1] for i, e in enumerate(events[:-1]) if e == "QGMMA"]
        assert all(e.startswith("HGMMA") for e in after_q), "wgmma serialized (a wait between QGMMA and HGMMA)"


_SYMBOL = re.compile(r"\b(_Z\w+|kernel_\w+|cutlass_\w+)")


def normalized(sass: str) -> str:
    """SASS without symbol names and file paths (they name Python classes / modules, not instructions)."""
    lines = []
    for line in sass.splitlines():
        if "Fatbin" in line or line.strip().startswith("code for") or "Function :" in line:
            continue
        lines.append(_SYMBOL.sub("SYM", line))
    return "\n".join(lines)


def require_compiler():
    """For the tests: `cutlass_sm90()`, or skip the calling test (pytest) where the compiler is unavailable."""
    import pytest

    try:
        return cutlass_sm90()
    except CompilerUnavailable as e:
        pytest.skip(str(e))


def compile_or_skip(problem, config=None, axis: str | None = "auto") -> bytes:
    """For the tests: `compile_module`, or skip the calling test where the compiler is unavailable."""
    require_compiler()
    return compile_module(problem, config, axis)


def sass_or_skip(problem, config=None) -> str:
    """For the tests: the SASS of `problem`'s module (`compile_or_skip`), or skip the calling test where cuobjdump
    is missing."""
    import pytest

    module = compile_or_skip(problem, config)
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return sass_of(module, tool)


def compile_module(problem, config=None, axis: str | None = "auto") -> bytes:
    """Lower + export the kernel of `problem` for CUDA and return the compiled module's bytes.

    axis: "auto" = the runtime's symbolic axis (m for the M-grouped ops, T for wgrad); None = concrete shapes."""
    cutlass = cutlass_sm90()
    import jax
    from cutlass.jax.compile import _CUTLASS_COMPILE_CACHE

    from cudnn_moe_jax.kernels.sm90 import variants
    from cudnn_moe_jax.kernels.sm90.jax_bridge import make_call

    call = make_call(problem, config)
    if axis is None:
        avals = list(variants.input_avals(problem).values())
    else:
        from cudnn_moe_jax._lowering import symbolic_t

        (dim,) = (symbolic_t(problem.ab_dtype),) if problem.op == "wgrad" else jax.export.symbolic_shape("m")
        avals = list(variants.symbolic_avals(problem, dim).values())
    before = set(_CUTLASS_COMPILE_CACHE)
    exp = jax.export.export(jax.jit(call), platforms=["cuda"],
                            disabled_checks=cutlass.jax.get_export_disabled_safety_checks())(*avals)
    assert "CuteDSLRT_NvJaxCutlassCall" in exp.mlir_module()
    new = [k for k in _CUTLASS_COMPILE_CACHE if k not in before]
    assert len(new) == 1, "expected exactly one compiled module"
    return _CUTLASS_COMPILE_CACHE[new[0]].module
