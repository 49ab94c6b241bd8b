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
- "nodrop": as "noconv" without the slab drops and the lead (no frontier, no tiles-read counts, no converter held):
  every flag is published at once, so the producer's waits are their acquires alone (run 198: 0.117 ms where noconv
  ran 0.123 and idle 0.116: the acquires ~1%, the lead and the drops ~4%).
- "storeonly": as the library, but each job stores zeros (no code or scale loads, no arithmetic): the workspace's
  writes alone.
- "loadonly": as the library, but each job loads its codes (as the library) and one scale byte a row (near the
  segment's start, not at the library's addresses) and converts and stores nothing: the reads alone.

Measured (RESULTS run 196, H100, `small` W2 NVFP4 op ms): library 0.145, noconv 0.124, nowait 0.195, idle 0.115 (the
bf16 wgrad 0.112): structure ~3%, flags and waits ~8%, conversion ~17%. "nowait" is no bound: with no wait the
frontier runs ahead, no converter is held, none drops its read slabs, and the GEMM reads the workspace from DRAM
before it is converted. Run 199 (H100, `small` W2 NVFP4 / MXFP8 op ms): noconv 0.124 / 0.123, storeonly 0.136 / 0.137,
loadonly 0.132 / 0.148, library 0.143 / 0.163 -- the writes and the reads add up to the whole conversion.

And one variant of the on-chip block-scaled wgrad (mainloop_dequant_wgrad: A converted in the consumers'
registers, B by the stage workers), forced onto the `small` / e128_a128 rows by the on-chip route:

- "bfree": the stage workers and consumer passes convert nothing (B's bf16 stage is garbage; the TMA loads, the
  cluster copies and every barrier stay): the rate of a wgrad whose B arrives in bf16 for free and whose A is
  converted in registers -- what a staged-B / A-in-registers wgrad could reach at best (run 198: `small` W2 NVFP4
  0.132 ms, 0.86x of its forward; e128_a128 0.463; run 200: `small` W1 NVFP4 0.249-0.250 ms, 0.80x, W1 MXFP8
  token-major 0.272-0.273, 0.91x).

The staged variants are selected by a `Config.consumer_b_passes` mark (unused by the staged wgrad, but in the
module's fingerprint):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_p --variants lab.staged_wgrad_probe:bundle_items
    python -m lab.staged_wgrad_probe --shape small          # (GPU) the wgrad rows under each variant, alternated
    ncu ... python -m lab.staged_wgrad_probe --profile noconv "small/wgrad w2 nvfp4"   # one variant for ncu

"bfree" by a `Config.mx_n_parts` mark (unused without mxfp8_wgmma): `bundle_items_onchip`, `main_onchip`
(`python -c "from lab import staged_wgrad_probe as p; p.main_onchip('small')"`).
"""

from __future__ import annotations

import sys

from lab import harness

MARKS = {"noconv": 29, "nowait": 30, "idle": 31, "nodrop": 28, "storeonly": 27, "loadonly": 26}
SPLITS = ("storeonly", "loadonly")   # the variants that run the jobs' writes or reads alone (and wait as the library)
ONCHIP_MARK = 4             # mx_n_parts of "bfree"
ONCHIP_ROWS = ("wgrad w2 nvfp4", "wgrad w2 mxfp8", "wgrad w1 nvfp4", "wgrad w1 mxfp8 tok")
ROWS = ("wgrad w2 nvfp4", "wgrad w2 mxfp8", "wgrad w1 nvfp4")
SHAPES = ("small", "e128_a128")


def variant_class(base, label: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64, const_expr

    from cudnn_moe_jax.kernels import dequant as dq
    from cudnn_moe_jax.kernels.sm90 import mainloop_staged_wgrad as sw
    from cudnn_moe_jax.kernels.sm90.mainloop_staged import BATCH, SLAB, ld_global_scalar, raise_to
    from cudnn_moe_jax.operands import STAGED_CHUNK_K

    class Probe(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if label == "nodrop":
                self.discards = False

        @cute.jit
        def convert_job(self, mCodes, mSF, mOut, rows_total: cutlass.Constexpr, row0, c, lane, sEnds, padded,
                        scratch):
            if const_expr(label == "nowait" or label in SPLITS):
                super().convert_job(mCodes, mSF, mOut, rows_total, row0, c, lane, sEnds, padded, scratch)

        @cute.jit
        def convert_rows(self, mCodes, mSF, mOut, rows_total: cutlass.Constexpr, row0, c, lane, g,
                         general: cutlass.Constexpr, masked: cutlass.Constexpr):
            if const_expr(label == "storeonly"):   # the jobs' stores (zeros) without their loads or arithmetic
                rows = cutlass.min(Int32(SLAB), Int32(rows_total) - row0)
                out_row = Int64(mOut.shape[1]) * 2
                out = (mOut.iterator.toint() + Int64(row0) * out_row
                       + Int64(c * STAGED_CHUNK_K + lane * dq.GROUP) * 2)
                for i in cutlass.range(SLAB, unroll=8):
                    if g.live & (i < rows):
                        dq.st_global_v4(out + Int64(i) * out_row, [Int32(0)] * 4)
                        dq.st_global_v4(out + Int64(i) * out_row + 16, [Int32(0)] * 4)
            elif const_expr(label == "loadonly"):   # the jobs' code and scale loads, nothing converted or stored
                rows = cutlass.min(Int32(SLAB), Int32(rows_total) - row0)
                codes = mCodes.iterator.toint() + Int64(row0) * mCodes.shape[1]
                seen = Int32(0)
                for i0 in cutlass.range(0, SLAB, BATCH[self.fp4], unroll=1):
                    loaded = []
                    for u in cutlass.range_constexpr(BATCH[self.fp4]):
                        i = cutlass.min(i0 + u, rows - 1)
                        loaded.append((self.load_codes(codes + Int64(i) * mCodes.shape[1], mCodes.shape[1],
                                                       g.token, general),
                                       ld_global_scalar(mSF.iterator.toint() + Int64(g.block + i * 16))))
                    for raw, scale in loaded:
                        for w in raw:
                            seen = seen ^ w
                        seen = seen ^ scale
                if seen == Int32(0x7F3A5C1B):   # (never: keeps the loads)
                    dq.st_global_v4(mOut.iterator.toint(), [seen] * 4)
            else:
                super().convert_rows(mCodes, mSF, mOut, rows_total, row0, c, lane, g, general, masked)

        @cute.jit
        def wait_chunk(self, header, tile, c):
            if const_expr(label in ("noconv", "nodrop") or label in SPLITS):
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


def bfree_class(base):
    """The on-chip wgrad mainloop `base` with B's conversion skipped (module docstring)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    class BFree(base):
        @cute.jit
        def process_stage(self, worker: cutlass.Constexpr, smem, sA, sB, idx: Int32, k: Int32, k_count: Int32,
                          tile_ctx, lane: Int32):
            pass

        @cute.jit
        def consumer_b_pass(self, b_thread, row0: Int32, lane: Int32, idx: Int32, k: Int32):
            pass

    BFree.__name__ = f"{base.__name__}_bfree"
    return BFree


def patch():
    """In a bundle build: staged wgrads whose config carries a MARKS value get that variant."""
    from cudnn_moe_jax.kernels.sm90 import wgrad

    library = wgrad.GroupedGemmSm90Wgrad.mainloop_class_for
    labels = {v: k for k, v in MARKS.items()}

    def mainloop_class_for(self, problem):
        cls = library(self, problem)
        if problem.block_scaled and not problem.staged and self.config.mx_n_parts == ONCHIP_MARK:
            return bfree_class(cls)
        label = labels.get(self.config.consumer_b_passes)
        return variant_class(cls, label) if problem.staged and label else cls

    wgrad.GroupedGemmSm90Wgrad.mainloop_class_for = mainloop_class_for


def change(label):
    if label is None:
        return None
    return harness.config_change(lambda p: p.op == "wgrad" and p.staged, consumer_b_passes=MARKS[label])


def change_onchip(label):
    """The schedule change of the on-chip variant `label` ("bfree"; None: the library's on-chip wgrad)."""
    if label is None:
        return None
    assert label == "bfree", label
    return harness.config_change(lambda p: p.op == "wgrad" and p.block_scaled and not p.staged,
                                 mx_n_parts=ONCHIP_MARK)


def bundle_items_onchip() -> list:
    """The on-chip route's wgrad rows (ONCHIP_ROWS) on `small` / e128_a128, as the library runs them and as "bfree"."""
    from lab import bench_dequant_first as bdf

    patch()
    return [harness.on_route("on-chip", harness.under_schedule(change_onchip(label), bdf._lowering(fn, avals)))
            for label in (None, "bfree") for shape in SHAPES for row in ONCHIP_ROWS
            for fn, avals in bdf._rows(shape, row, "on-chip")]


def main_onchip(shape: str) -> None:
    """(GPU) the ONCHIP_ROWS on chip as the library runs them and as "bfree", alternated, two rounds."""
    from benchmarks import bench_moe_ops
    from lab import bench_dequant_first  # noqa: F401  (e128_a128)

    for rnd in (1, 2):
        for label in (None, "bfree"):
            print(f"== round {rnd} on chip, variant {label or 'library'}", flush=True)
            with harness.block_scaled_route("on-chip"), harness.schedule_override(change_onchip(label)):
                for row in ONCHIP_ROWS:
                    bench_moe_ops.main(["--shape", shape, "--only", row])


def bundle_items() -> list:
    import lab.bench_dequant_first  # noqa: F401  (e128_a128)
    from benchmarks import bench_moe_ops

    patch()
    return [harness.under_schedule(change(label), item) for label in (None, *MARKS)
            for row in ROWS for item in bench_moe_ops.bundle_items(SHAPES, row)]


def profile(label: str, what: str) -> None:
    """(GPU, under ncu) one bench_moe_ops row (`what` = "SHAPE/ROW") as variant `label` ("library": as it is),
    four calls: lab.profile_one's ops kind under the variant's schedule change."""
    import lab.bench_dequant_first  # noqa: F401
    from lab import profile_one

    with harness.schedule_override(None if label == "library" else change(label)):
        profile_one.main("ops", what)


def main(argv) -> None:
    import lab.bench_dequant_first  # noqa: F401
    from benchmarks import bench_moe_ops

    if argv[:1] == ["--profile"]:   # --profile LABEL SHAPE/ROW
        profile(argv[1], argv[2])
        return
    for rnd in (1, 2):
        for label in (None, *MARKS):
            print(f"== round {rnd} variant {label or 'library'}", flush=True)
            for row in ROWS:
                with harness.schedule_override(change(label)):
                    bench_moe_ops.main(argv + ["--only", row])


if __name__ == "__main__":
    main(sys.argv[1:])
