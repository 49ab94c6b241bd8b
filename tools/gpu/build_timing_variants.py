"""Timing-only MXFP8 modules (wrong results): the default fc1 kernel with its fold replaced, to split tensor time
from the fold's cost. Added to the `mxfp8_bench` section of the manifest as `mxbench_fc1_timing_<variant>`, so
`run_device.sh mxbench` (or `bench_grouped_gemm.py --mxfp8 --artifacts --shapes fc1`) times them beside the real
kernel.

    python tools/gpu/build_timing_variants.py [VARIANT ...]      # after build_artifacts.py --only mxfp8_bench

ptxas deletes a wgmma whose result is never read (it leaves a placeholder `HGMMA.64x8x16.F16 RZ`), and serializes the
wgmmas (a full wait after each) when only some of a wgmma's results are read, so every variant reads all of each
wgmma it keeps, and the SASS is checked for both (docs/history/kernels.md, MXFP8 items 5-6). Each variant is
a subclass of the kernel with its own mainloop class, exported in its own process: cutlass caches modules per
(problem, config), which a replaced mainloop does not change.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import _paths  # noqa: F401  (tools/gpu: the checkout and tests/ on sys.path)
import build_artifacts as ba

import cutlass.cute as cute

from cudnn_moe_jax.kernels.sm90 import default_config
from cudnn_moe_jax.kernels.sm90 import mainloop_mxfp8 as mx
from cudnn_moe_jax.kernels.sm90.gemm import GroupedGemmSm90
from cudnn_moe_jax.kernels.sm90.mainloop import WgmmaMainloop


class _FaddMainloop(mx.Mxfp8Mainloop):
    """Data wgmma only (the scale wgmma is deleted by ptxas), one FADD per value reading P."""

    @staticmethod
    def fold(acc, P, S, base: int):
        for i in range(cute.size(P)):
            acc[base + i] = acc[base + i] + P[i]


class _PlainMainloop(_FaddMainloop):
    """No scales at all: the data wgmmas accumulate straight into acc (a per-tensor-scaled FP8 GEMM on the same
    tiles, pipeline and epilogue): the bf16 k-loop, one stage's batch in flight while the next is issued, with the
    MXFP8 stage wait (which also waits for the decoder warps, as the real kernel's does)."""

    @cute.jit
    def mma_tile(self, ab_pipeline, read_state, release_state, operands, acc, k_count, dec_mbar):
        tiled_mma, _, tCrA, tCrB = operands[:4]
        return WgmmaMainloop.mma_tile(self, ab_pipeline, read_state, release_state, (tiled_mma, tCrA, tCrB), acc,
                                      k_count, dec_mbar)


def _kernel_with(mainloop):
    class TimingKernel(GroupedGemmSm90):
        MXFP8_MAINLOOP = mainloop

    return TimingKernel


# name -> (kernel class, whether the scale wgmma is kept, Config changes). Variants that read only some of P / S
# (no fold, or a fold on S[0]) were dropped: ptxas then waits for every wgmma right after its issue (serialized;
# run 19's `keep`, `keep_p`, `ffma_s0`), so they timed a different schedule.
VARIANTS = {"fadd": (_kernel_with(_FaddMainloop), False, {}),
            # the ceiling of this tile / pipeline / epilogue structure for FP8 data without per-block scales
            "plain": (_kernel_with(_PlainMainloop), False, {"mx_n_parts": 1})}


def _check_sass(variant: str, problem, config, kernel_class) -> None:
    """The variant's SASS has the data wgmmas, the scale wgmmas iff intended, and no placeholder wgmma."""
    from test_kernels_compile import _cuobjdump, compile_module, sass_of

    tool = _cuobjdump()
    if tool is None:
        print(f"warn {variant}: cuobjdump not found, SASS not checked", flush=True)
        return
    sass = sass_of(compile_module(problem, config, kernel_class), tool)
    has_q = "QGMMA.64x" in sass
    has_s = re.search(r"HGMMA\.64x\d+x16\.F32\.BF16", sass) is not None
    if not has_q or has_s != VARIANTS[variant][1] or "HGMMA.64x8x16.F16 RZ" in sass:
        raise SystemExit(f"{variant}: unexpected wgmmas in the SASS (data {has_q}, scale {has_s})")
    # the real k-loop drains once per stage (one `wait 0`); a variant whose wgmmas ptxas serialized waits after each
    full_waits = sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    if full_waits > 1:
        raise SystemExit(f"{variant}: ptxas serialized the wgmmas ({full_waits} full waits in the SASS)")


def _build_one(variant: str) -> None:
    kernel_class, _, changes = VARIANTS[variant]
    problem = ba.mxfp8_bench_problem("fc1_bf16d")
    config = dataclasses.replace(default_config(problem), **changes)
    _check_sass(variant, problem, config, kernel_class)
    out = ba.REPO / ".out" / "kgpu"
    name = f"mxbench_fc1_timing_{variant}"
    (out / f"{name}.jaxexp").write_bytes(ba.export(problem, config, False, kernel_class).serialize())
    man_path = out / "manifest.json"
    man = json.loads(man_path.read_text())
    man.setdefault("mxfp8_bench", {})[name] = ba.manifest_entry(problem, config, False)
    man_path.write_text(json.dumps(man, indent=1, sort_keys=True))
    print(f"ok   {name}", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        _build_one(argv[1])
        return 0
    names = argv or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    failed = 0
    for name in names:
        failed += subprocess.call([sys.executable, __file__, "--one", name]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
