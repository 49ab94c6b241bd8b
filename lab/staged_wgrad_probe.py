"""Where the staged block-scaled wgrad's time goes with few tokens per expert (`small`: 64 experts x 256 tokens).

On the H100 the staged NVFP4 W2 wgrad runs 0.143 ms where the bf16 wgrad kernel alone on the converted operands runs
~0.113 (RESULTS runs 156, 191): the staging costs ~25% there, and the lead does not matter from 2 chunks up (run
158), so the GEMM is not waiting for late conversions. Rate-only variants of `StagedKGroupedMainloop` (outputs are
garbage where the workspace is not converted; timing only):

- "noconv": the converter warps take and publish every job but convert nothing (no code loads, no bf16 stores):
  the flags, waits, frontier and slab drops alone.
- "nowait": the converters convert as in the library; the producer raises the frontier but waits on no flag (and
  has no proxy fence): the GEMM never stalls on a chunk.
- "idle": no converter work at all and no waits: the bf16 K-grouped kernel with the staged kernel's register split
  and padded workspaces (garbage).

Measured (RESULTS run 196, H100, `small` W2 NVFP4 op ms): library 0.145, noconv 0.124, nowait 0.195, idle 0.115 (the
bf16 wgrad 0.112): structure ~3%, flags and waits ~8%, conversion ~17%. "nowait" is no bound: with no wait the
frontier runs ahead, no converter is held, none drops its read slabs, and the GEMM reads the workspace from DRAM
before it is converted.

Selected by a `Config.consumer_b_passes` mark (unused by the staged wgrad, but in the module's fingerprint):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_p --variants lab.staged_wgrad_probe:bundle_items
    python -m lab.staged_wgrad_probe --shape small          # (GPU) the wgrad rows under each variant, alternated
"""

from __future__ import annotations

import sys

from lab import harness

MARKS = {"noconv": 29, "nowait": 30, "idle": 31}
ROWS = ("wgrad w2 nvfp4", "wgrad w2 mxfp8", "wgrad w1 nvfp4")
SHAPES = ("small", "e128_a128")


def variant_class(base, label: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass import const_expr

    from cudnn_moe_jax.kernels.sm90 import mainloop_staged_wgrad as sw
    from cudnn_moe_jax.kernels.sm90.mainloop_staged import raise_to

    class Probe(base):
        @cute.jit
        def convert_job(self, mCodes, mSF, mOut, rows_total: cutlass.Constexpr, row0, c, lane, sEnds, padded,
                        scratch):
            if const_expr(label == "nowait"):
                super().convert_job(mCodes, mSF, mOut, rows_total, row0, c, lane, sEnds, padded, scratch)

        @cute.jit
        def wait_chunk(self, header, tile, c):
            if const_expr(label == "noconv"):
                super().wait_chunk(header, tile, c)
            elif const_expr(self.discards):
                if cute.arch.lane_idx() == 0:
                    raise_to(sw.frontier_word(header), c)

        @cute.jit
        def convert(self, args, cta):
            if const_expr(label != "idle"):
                super().convert(args, cta)

    Probe.__name__ = f"{base.__name__}_{label}"
    return Probe


def patch():
    """In a bundle build: staged wgrads whose config carries a MARKS value get that variant."""
    from cudnn_moe_jax.kernels.sm90 import wgrad

    library = wgrad.GroupedGemmSm90Wgrad.mainloop_class_for
    labels = {v: k for k, v in MARKS.items()}

    def mainloop_class_for(self, problem):
        cls = library(self, problem)
        label = labels.get(self.config.consumer_b_passes)
        return variant_class(cls, label) if problem.staged and label else cls

    wgrad.GroupedGemmSm90Wgrad.mainloop_class_for = mainloop_class_for


def change(label):
    if label is None:
        return None
    return harness.config_change(lambda p: p.op == "wgrad" and p.staged, consumer_b_passes=MARKS[label])


def bundle_items() -> list:
    import lab.bench_dequant_first  # noqa: F401  (e128_a128)
    from benchmarks import bench_moe_ops

    patch()
    return [harness.under_schedule(change(label), item) for label in (None, *MARKS)
            for row in ROWS for item in bench_moe_ops.bundle_items(SHAPES, row)]


def main(argv) -> None:
    import lab.bench_dequant_first  # noqa: F401
    from benchmarks import bench_moe_ops

    for rnd in (1, 2):
        for label in (None, *MARKS):
            print(f"== round {rnd} variant {label or 'library'}", flush=True)
            for row in ROWS:
                with harness.schedule_override(change(label)):
                    bench_moe_ops.main(argv + ["--only", row])


if __name__ == "__main__":
    main(sys.argv[1:])
