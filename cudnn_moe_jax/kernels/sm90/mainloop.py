"""bf16/fp16 wgmma mainloop of the sm90 grouped GEMM: shared-memory layouts, the TMA producer k-loop and the
wgmma consumer k-loop for one output tile.

A (valid rows of one expert) and B[g] are both K-major (A `(m, K)`, B `(L, N, K)` row-major), so both operands use
128-byte-swizzled K-major shared-memory atoms and SS wgmma (m64nNk16, N = tile_n). Two consumer warpgroups split
the 128-row tile into 64-row halves ("cooperative"); both read the whole B tile.

The MXFP8 path (mainloop_mxfp8.Mxfp8Mainloop) is another mainloop class with the same roles (FP8 wgmma per
32-wide K block, folded with its scale products); the kernel class does not change.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

TILE_K = 64  # 4 x k16 wgmma per stage; 128 B of bf16 per row = one SW128 atom


def _major(mn: bool):
    return cute.nvgpu.OperandMajorMode.MN if mn else cute.nvgpu.OperandMajorMode.K


def make_tiled_mma(ab_dtype, tile_n: int, num_consumer_wgs: int = 2, a_mn: bool = False,
                   b_mn: bool = False) -> cute.TiledMma:
    """a_mn / b_mn: the operand's shared-memory tile is M / N-major (16-bit wgmma reads either)."""
    return sm90_utils.make_trivial_tiled_mma(
        ab_dtype,
        ab_dtype,
        _major(a_mn),
        _major(b_mn),
        Float32,
        (num_consumer_wgs, 1, 1),
        tiler_mn=(64, tile_n),
    )


def ab_stage_bytes(ab_dtype, tile_m: int, tile_n: int) -> int:
    return (tile_m + tile_n) * TILE_K * ab_dtype.width // 8


def make_ab_smem_layouts(ab_dtype, tile_m: int, tile_n: int, stages: int, a_mn: bool = False,
                         b_mn: bool = False):
    """Staged (rows, TILE_K, stages) swizzled layouts of A and B: K-major, or M / N-major (the swizzle atom runs
    along the rows) for an operand whose global memory has M / N contiguous (TMA copies boxes either way)."""
    layouts = []
    for rows, mn in ((tile_m, a_mn), (tile_n, b_mn)):
        if mn:
            atom = warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(LayoutEnum.COL_MAJOR, ab_dtype, rows), ab_dtype
            )
            layouts.append(cute.tile_to_shape(atom, (rows, TILE_K, stages), order=(1, 0, 2)))
            continue
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, ab_dtype, TILE_K), ab_dtype
        )
        layouts.append(cute.tile_to_shape(atom, (rows, TILE_K, stages), order=(0, 1, 2)))
    return tuple(layouts)



@cute.jit
def copy_ab_stage(tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, bar, k: Int32, s: Int32,
                  a_mcast_mask, b_mcast_mask, descriptors=None):
    """TMA of K tile `k` of A and B into stage `s` on the stage's barriers (both mainloops' producers); B through
    the expert's own descriptor with discrete weights (`descriptors`: experts.ExpertDescriptors, else None); no A
    (`tma_atom_a` None) where the mainloop copies A itself (mainloop_gather)."""
    if const_expr(tma_atom_a is not None):
        cute.copy(tma_atom_a, tAgA[(None, k)], tAsA[(None, s)], tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
    cute.copy(tma_atom_b, tBgB[(None, k)], tBsB[(None, s)], tma_bar_ptr=bar, mcast_mask=b_mcast_mask,
              tma_desc_ptr=None if const_expr(descriptors is None) else descriptors.b)

LAUNCH_REGS = 168   # registers per thread at launch (65536 / 384 threads, a multiple of 8)


def consumer_regs(producer_regs: int) -> int:
    """The consumer warpgroups' registers (setmaxnreg) beside a producer warpgroup of `producer_regs`: what the
    producer gives up, shared by the two consumer warpgroups, a multiple of 8 (asking for more than the CTA's
    launch registers would block setmaxnreg.inc forever); 40 -> 232, 56 -> 224."""
    return LAUNCH_REGS + (LAUNCH_REGS - producer_regs) // 2 // 8 * 8


class WgmmaMainloop:
    """Producer and consumer k-loops over one tile. Pipeline states are returned (loop-carried by the caller).

    The mainloop protocol the kernel class reads (Mxfp8Mainloop implements it too):
      `from_problem`             the instance for a problem, its config and the chosen A/B stage count;
      `TILE_K`, `smem_stage_bytes` / `tx_bytes`   shared memory and TMA bytes of one A/B stage;
      `tiled_mma()`, `ab_smem_layouts()`          the wgmma and the staged A / B layouts;
      `tma_operands()`                            element type and TMA box K of the loaded A / B stages;
      `smem_fields()`, `smem_tensors()`           the mainloop's own shared memory (none here) and its views;
      `SMEM_FIXED_BYTES`                          of it, the bytes outside the A/B stages (the stage fit);
      `scale_tmas()`, `partition_scale_loads()`   TMA atoms / partitions of scale factors (none here);
      `producer_inputs()`                         what the producer reads besides A / B (default: the scale
                                                  partitions; staged mainloops: their chunks' flags);
      `tma_sources()`                             the launcher tensors the producer's TMA reads as A / B (the
                                                  staged mainloop: its bf16 workspaces);
      `CONVERT_WARPS`, `convert()`                warps of the producer warpgroup that convert the operands once
                                                  into those workspaces (mainloop_staged; none here);
      `STAGE_WORKERS`, `process_stage()`          warps of the producer warpgroup that rework each loaded stage
                                                  in shared memory before the consumers read it (none here);
      `publish_stage()`                           what a stage worker does once its stores are made (fence them
                                                  for the wgmma's async proxy, arrive on the stage's worker barrier;
                                                  the dequantizing mainloop's cluster-split B also copies its half of
                                                  B to the other CTA of the cluster);
      `REGISTER_TIGHT`                            the k-loop keeps nearly every consumer register live;
      `PRODUCER_REGS`                             registers of the producer warpgroup's threads (setmaxnreg; the
                                                  consumers get the rest, `consumer_regs`);
      `PRODUCER_ARRIVALS`                         arrivals on a stage's full barrier besides the TMA bytes (the
                                                  producer warp's own copies, e.g. the gathering mainloop's cp.async
                                                  rows);
      `load_tile`, `consumer_operands`, `mma_tile`  the per-tile producer and consumer k-loops (both get the
                                                  schedule's tile); `load_tile` takes the tile's B partition (of
                                                  its expert) and, with discrete weights, the expert's TMA
                                                  descriptors (`experts.ExpertDescriptors`, which the B and SFB
                                                  loads go through, the expert index then 0; else None);
                                                  it runs `produce_stages`, which calls the mainloop's
      `load_stage_scales`                         per stage after the A / B TMA (block-scaled: scale loads)."""

    TILE_K = TILE_K
    STAGE_WORKERS = ()
    CONVERT_WARPS = ()          # mainloop_staged: warps of the producer warpgroup converting the operands
    REGISTER_TIGHT = False
    PRODUCER_REGS = 40
    PRODUCER_ARRIVALS = 1
    SMEM_FIXED_BYTES = 0

    def __init__(self, ab_dtype, tile_m: int, tile_n: int, stages: int, a_mn: bool = False, b_mn: bool = False):
        self.ab_dtype = ab_dtype
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.stages = stages
        self.a_mn, self.b_mn = a_mn, b_mn

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(ab_dtype, config.tile_m, config.tile_n, stages, problem.a_major == "m", problem.b_major == "n")

    smem_stage_bytes = staticmethod(ab_stage_bytes)
    tx_bytes = staticmethod(ab_stage_bytes)

    def tiled_mma(self) -> cute.TiledMma:
        return make_tiled_mma(self.ab_dtype, self.tile_n, a_mn=self.a_mn, b_mn=self.b_mn)

    def ab_smem_layouts(self):
        return make_ab_smem_layouts(self.ab_dtype, self.tile_m, self.tile_n, self.stages, self.a_mn, self.b_mn)

    def tma_operands(self):
        """((element type, TMA box extent along K) of A, of B): what the producer's TMA loads into `sA` / `sB`."""
        return (self.ab_dtype, self.TILE_K), (self.ab_dtype, self.TILE_K)

    def tma_sources(self, tensors):
        """(A, B) launcher tensors the producer's TMA reads (mainloop_staged: its bf16 workspaces)."""
        return tensors["a"], tensors["b"]

    def scale_layouts(self):
        return None, None

    def smem_fields(self):
        """(name, struct field type) of the mainloop's shared memory, placed after the epilogue's C buffer."""
        return []

    def smem_tensors(self, storage, tidx, nthreads):
        """Views of `smem_fields` (called by every thread before the CTA barrier of the kernel's setup)."""
        return None

    def scale_tmas(self, tensors, cluster_m: int, cluster_n: int):
        """(atom, tensor) of the A and B scale factors' TMA (none without scales)."""
        return None, None, None, None

    def partition_scale_loads(self, tma_atom_sfa, mSFA, tma_atom_sfb, mSFB, smem, rank_m, rank_n):
        """The producer's TMA partitions of the scale factors (none without scales)."""
        return None

    def producer_inputs(self, args, smem, rank_m, rank_n):
        """What `load_tile` reads besides A / B (its `side_inputs`): the scale factors' partitions."""
        return self.partition_scale_loads(args.tma_atom_sfa, args.mSFA, args.tma_atom_sfb, args.mSFB, smem, rank_m,
                                          rank_n)

    @cute.jit
    def consumer_operands(self, tiled_mma, sA, sB, smem, wg: Int32):
        """(mma, A fragment, B fragment) of consumer warpgroup `wg`."""
        thr_mma = tiled_mma.get_slice(wg * 128)
        return (tiled_mma, tiled_mma.make_fragment_A(thr_mma.partition_A(sA)),
                tiled_mma.make_fragment_B(thr_mma.partition_B(sB)))

    @cute.jit
    def produce_stages(self, ab_pipeline, prod_state, ab_copies, a_mcast_mask, b_mcast_mask, k_count: Int32,
                       scales=None, descriptors=None, b_own=None):
        """The producer's k-loop of one tile (every mainloop's `load_tile`): per stage acquire it, TMA its A and B
        (`ab_copies` = (tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB)), then the mainloop's scale loads of the stage
        (`self.load_stage_scales(scales, bar, k, s, ...)` where `scales` is not None: the per-tile state its
        `load_tile` set up), commit (Mxfp8Mainloop calls it as `WgmmaMainloop.produce_stages(self, ...)`).
        `b_own`: WgmmaMainloop.load_tile's (2-CTA blocks over two experts' B)."""
        tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB = ab_copies
        prod_state.reset_count()
        for _k in cutlass.range(k_count, unroll=1):
            ab_pipeline.producer_acquire(prod_state)
            bar = ab_pipeline.producer_get_barrier(prod_state)
            k = prod_state.count
            s = prod_state.index
            if const_expr(b_own is None):
                copy_ab_stage(tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, bar, k, s, a_mcast_mask, b_mcast_mask,
                              descriptors)
            else:
                tBgB_other, tBsB_other, multicast, own_mask = b_own
                if multicast:
                    copy_ab_stage(tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, bar, k, s, a_mcast_mask,
                                  b_mcast_mask, descriptors)
                else:
                    copy_ab_stage(tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, bar, k, s, a_mcast_mask,
                                  own_mask, descriptors)
                    cute.copy(tma_atom_b, tBgB_other[(None, k)], tBsB_other[(None, s)], tma_bar_ptr=bar,
                              mcast_mask=own_mask,
                              tma_desc_ptr=None if const_expr(descriptors is None) else descriptors.b)
            if const_expr(scales is not None):
                self.load_stage_scales(scales, bar, k, s, a_mcast_mask, b_mcast_mask, descriptors)
            ab_pipeline.producer_commit(prod_state)
            prod_state.advance()
        return prod_state

    @cute.jit
    def load_tile(
        self,
        ab_pipeline,
        prod_state,
        tma_atom_a: cute.CopyAtom,
        tAgA: cute.Tensor,  # (TMA, k_tiles) of this tile
        tAsA: cute.Tensor,  # (TMA, stages)
        tma_atom_b: cute.CopyAtom,
        tBgB: cute.Tensor,
        tBsB: cute.Tensor,
        a_mcast_mask,
        b_mcast_mask,
        k_count: Int32,
        side_inputs=None,
        tile=None,
        descriptors=None,
        b_own=None,
    ):
        """k_count stages of one tile (`side_inputs`: what the producer reads besides A / B -- the scale factors'
        partitions, a gathering source, the staged chunks' flags (loads.producer); `tile`: the tile's coordinates;
        both unused here).
        `b_own` = (the other CTA's half of this tile's B, its smem partition, multicast, this CTA's own mask):
        a 2-CTA cluster whose tiles may use two experts' B (tile lists) multicasts B only when `multicast`; else
        each CTA loads both halves to itself (the same bytes arrive per stage either way)."""
        return self.produce_stages(ab_pipeline, prod_state, (tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB),
                                   a_mcast_mask, b_mcast_mask, k_count, None, descriptors, b_own)

    def stage_arrivals(self) -> int:
        """Arrivals that complete a stage's worker barrier (every lane of every stage worker), besides the TMA's."""
        return 32 * len(self.STAGE_WORKERS)

    @cute.jit
    def publish_stage(self, worker: cutlass.Constexpr, smem, stage_mbar, idx: Int32, lane: Int32):
        """Stage worker `worker`'s lanes after their stores into stage idx (`smem`: the mainloop's views): fence the
        generic-proxy stores against the wgmma's async-proxy reads, arrive on the stage's worker barrier."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(stage_mbar + idx)

    @cute.jit
    def wait_stage(self, ab_pipeline, state, stage_mbar, k):
        """Wait for stage `state` (tile-local k-tile k): its TMA, and with stage workers their barrier."""
        ab_pipeline.consumer_wait(state)
        if const_expr(len(self.STAGE_WORKERS) > 0):
            cute.arch.mbarrier_wait(stage_mbar + state.index, state.phase)

    @cute.jit
    def mma_tile(
        self,
        ab_pipeline,
        read_state,
        release_state,
        operands,
        acc: cute.Tensor,
        k_count: Int32,
        stage_mbar=None,
        tile=None,
    ):
        """acc = sum over k_count k-tiles (acc is zeroed first; k_count == 0 leaves zeros); `operands` from
        `consumer_operands`, `stage_mbar` the stage workers' barriers, `tile` the schedule's tile (unused here)."""
        tiled_mma, tCrA, tCrB = operands
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        # keep one wgmma batch in flight: release stage k-1 once stage k has been issued
        prologue = cutlass.min(k_count, Int32(1))
        for _k in cutlass.range(prologue, unroll=1):
            self.wait_stage(ab_pipeline, read_state, stage_mbar, _k)
            for kb in cutlass.range_constexpr(num_k_blocks):
                crd = (None, None, kb, read_state.index)
                cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
            warpgroup.commit_group()
            read_state.advance()
        for _k in cutlass.range(prologue, k_count, 1, unroll=1):
            self.wait_stage(ab_pipeline, read_state, stage_mbar, _k)
            for kb in cutlass.range_constexpr(num_k_blocks):
                crd = (None, None, kb, read_state.index)
                cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        warpgroup.wait_group(0)
        for _k in cutlass.range(prologue, unroll=1):
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
        return read_state, release_state


class KGroupedWgmmaMainloop(WgmmaMainloop):
    """The weight-gradient k-loop: K is one expert's token range, loaded from its first token rounded down to a
    k-tile, so its first and last k-tiles may hold the neighbouring experts' tokens. A stage worker (the masker,
    warp 1) zeroes them in A and B (as the reference masks both: a NaN times 0 is NaN) and arrives on the stage's
    worker barrier; the consumers wait for it as well as for the TMA, so no divergent store sits next to their
    wgmmas.
    (k-tiles start on 64-token boundaries: with TMA boxes starting at the expert's first token, e.g. token 300,
    the kernel raised CUDA_ERROR_ILLEGAL_INSTRUCTION on the H200.)"""

    STAGE_WORKERS = ((1,),)  # (warp,): warp 1 of the producer warpgroup (idle in the bf16 mainloop)

    @cute.jit
    def process_stage(self, worker: cutlass.Constexpr, smem, sA, sB, idx: Int32, k: Int32, k_count: Int32, tile_ctx,
                      lane: Int32):
        """Zero A's and B's columns (tokens) outside the expert's range in its first / last k-tile (B's too: a NaN
        or inf of a neighbouring expert's token times A's zero would reach this expert's W); tile_ctx: the
        schedule's tile (`scheduler.Tile`), whose k_head / k_keep are the first valid column of k-tile 0 and the end
        of the valid columns of the last k-tile."""
        head, keep = tile_ctx.k_head, tile_ctx.k_keep
        lo = Int32(0)
        hi = Int32(self.TILE_K)
        if k == 0:
            lo = head
        if k == k_count - 1:
            hi = keep
        if (lo > 0) | (hi < self.TILE_K):
            for i in cutlass.range_constexpr(self.tile_m // 32):
                for c in cutlass.range(self.TILE_K, unroll=1):
                    if (c < lo) | (c >= hi):
                        sA[(lane + 32 * i, c, idx)] = self.ab_dtype(0.0)
            for i in cutlass.range_constexpr(self.tile_n // 32):
                for c in cutlass.range(self.TILE_K, unroll=1):
                    if (c < lo) | (c >= hi):
                        sB[(lane + 32 * i, c, idx)] = self.ab_dtype(0.0)
