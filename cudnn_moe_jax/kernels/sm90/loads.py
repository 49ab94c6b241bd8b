"""The load side of the sm90 grouped-GEMM kernel (gemm.py's roles in warpgroup 0): the producer warp's TMA loads of
A / B (and the mainloop's own per-stage copies), the stage workers that rework a loaded stage, and, with gathered
operands (mainloop_gather), the row gatherers that copy their share of each stage's gathered rows / tokens. A mixin
of `gemm.GroupedGemmSm90Base`: `args` are its KernelArgs, `cta` its CtaSetup; the M-grouped partitions are here,
the K-grouped wgrad overrides `ab_partitions` / `tile_ab` / `rows_and_extent` / `gather_source` /
`gather_placement` (wgrad.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .mainloop_gather import GatherSource


class OperandLoads:
    """The load-side roles and the operand partitions they use (module docstring)."""

    @cute.jit
    def _cluster_coord(self):
        """(rank_m, rank_n) of this CTA in its cluster (cluster dims (cm, cn, 1): rank = x + cm * y)."""
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return rank % self.cluster_m, rank // self.cluster_m

    @cute.jit
    def _mcast_masks(self, rank_m, rank_n):
        """TMA multicast masks of this CTA: A goes to its cluster row (along N), B to its column (along M)."""
        cta_layout = cute.make_layout((self.cluster_m, self.cluster_n, 1))
        a_mcast_mask = 0
        if const_expr(self.cluster_n > 1):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout, (rank_m, rank_n, 0), mode=1)
        b_mcast_mask = 0
        if const_expr(self.cluster_m > 1):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout, (rank_m, rank_n, 0), mode=0)
        return a_mcast_mask, b_mcast_mask

    @cute.jit
    def producer(self, args, cta):
        """Warp 0: TMA loads for every compute tile of this CTA (A multicast along the cluster's N, B along M;
        block-scaled mainloops: their scale factors travel with A / B)."""
        rank_m, rank_n = self._cluster_coord()
        ab = self.ab_partitions(args, cta, rank_m, rank_n)
        a_mcast_mask, b_mcast_mask = self._mcast_masks(rank_m, rank_n)
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        if const_expr(self.gather_a or self.gather_b):   # what the gathering mainloop reads its rows from
            side_inputs = self.gather_source(args, cta)
        else:   # scale partitions; staged: the chunks' ready flags
            side_inputs = self.mainloop.producer_inputs(args, cta.ml_smem, rank_m, rank_n)
        work = self.sched.work(cta.sValid, cta.m_rows, self.ab_k_tiles(ab))
        t = work.first
        while t < work.total:
            tile = self.sched.tile(t, work, cta.sEnds, rank_m, rank_n)
            tAgA, tAsA, tBgB, tBsB = self.tile_ab(ab, tile, args, cta, rank_m, rank_n)
            descriptors, weights = None, tile.group
            if const_expr(self.discrete):  # the expert's own B / SFB, at expert index 0 of its descriptors
                descriptors, weights = self.expert_table.acquire(args.mExpertDescriptors, tile.group), 0
            b_own = {}
            if const_expr(self.pairs_groups()):
                # tile lists: the block's tiles may use two groups' B; then each CTA loads its whole B tile itself
                b_own = dict(b_own=(ab[5][(None, tile.n_tile, None, weights)], ab[4], tile.mcast_b,
                                    Int32(1) << (rank_m + self.cluster_m * rank_n)))
            prod_state = self.mainloop.load_tile(
                cta.ab_pipeline, prod_state, args.tma_atom_a, tAgA, tAsA, args.tma_atom_b, tBgB, tBsB,
                a_mcast_mask, b_mcast_mask, tile.k_count, side_inputs, tile, descriptors, **b_own,
            )
            t += work.stride
        cta.ab_pipeline.producer_tail(prod_state)

    @cute.jit
    def tma_partitions(self, args, gA, gB, cta, rank_m, rank_n):
        """(tAsA, tAgA, tBsB, tBgB): A's TMA multicast along the cluster's N, B's along M (gathered A: none)."""
        tAsA = tAgA = tBsB = tBgB = None
        if const_expr(not self.gather_a):
            tAsA, tAgA = cpasync.tma_partition(
                args.tma_atom_a, rank_n, cute.make_layout(self.cluster_n), cute.group_modes(cta.sA, 0, 2),
                cute.group_modes(gA, 0, 2))
        if const_expr(not self.gather_b):
            tBsB, tBgB = cpasync.tma_partition(
                args.tma_atom_b, rank_m, cute.make_layout(self.cluster_m), cute.group_modes(cta.sB, 0, 2),
                cute.group_modes(gB, 0, 2))
        return tAsA, tAgA, tBsB, tBgB

    @cute.jit
    def ab_partitions(self, args, cta, rank_m, rank_n):
        """M-grouped: the producer's A / B TMA partitions, made once (every tile reads the whole K; tile lists:
        A's is re-made per tile, from the tile's first row). Tile lists with a 2-CTA cluster along M also the
        other CTA's half of the B tile (`mcast_b` False: each CTA loads both halves)."""
        # (bM, bK, RestM, RestK) / (bN, bK, RestN, RestK, L); bK: the TMA box (packed FP4: K / 2 bytes)
        (_, a_box_k), (_, b_box_k) = self.mainloop.tma_operands()
        gA = None if const_expr(self.gather_a) else cute.local_tile(args.mA, (self.tile_m, a_box_k), (None, None))
        gB = cute.local_tile(args.mB, (self.tile_n, b_box_k), (None, None, None))
        parts = self.tma_partitions(args, gA, gB, cta, rank_m, rank_n)
        if const_expr(self.pairs_groups()):
            tBsB_other, tBgB_other = cpasync.tma_partition(
                args.tma_atom_b, 1 - rank_m, cute.make_layout(self.cluster_m), cute.group_modes(cta.sB, 0, 2),
                cute.group_modes(gB, 0, 2))
            parts = parts + (tBsB_other, tBgB_other)
        return parts

    @cute.jit
    def rows_and_extent(self, mA, mAIndex, mBIndex):
        """(A's rows as the schedule counts them, the extent the group ends index): M-grouped, A's rows (gathered
        A: a_index's length, the GEMM's rows)."""
        if const_expr(self.gather_a):
            return mAIndex.shape[0], mAIndex.shape[0]
        return mA.shape[0], self.sched.group_extent(mA)

    @cute.jit
    def gather_source(self, args, cta):
        """What the gathering mainloop's producer reads (mainloop_gather.GatherSource)."""
        return GatherSource(args.mA, args.mAIndex, cta.m_rows)

    def pairs_groups(self) -> bool:
        """Tile lists with a 2-CTA cluster along M: the two tiles of a block may use two groups' B."""
        return self.sched.by_tiles and self.cluster_m > 1

    def ab_k_tiles(self, ab):
        """M-grouped: the k-tiles of a compute tile as the producer counts them (A's partition: K as A's shape
        says; gathered A: the problem's K)."""
        if self.gather_a:
            return -(-self.problem.k // self.tile_k)
        return cute.size(ab[1], mode=[2])

    @cute.jit
    def tile_ab(self, ab, tile, args, cta, rank_m, rank_n):
        """M-grouped: (tAgA, tAsA, tBgB, tBsB) of one tile: its A rows and B[group], over K (tile lists: A from
        the tile's first row; TMA loads may start at any row, rows past m read as zeros; discrete weights: the
        expert's own B, index 0 of its descriptor)."""
        tAsA, tAgA, tBsB, tBgB = ab[:4]
        group = 0 if const_expr(self.discrete) else tile.group
        if const_expr(self.gather_a):   # mainloop_gather: the tile's first row and A's stage 0 address
            row0, sa_base = self.gather_placement(tile, cta)
            return row0, sa_base, tBgB[(None, tile.n_tile, None, group)], tBsB
        if const_expr(self.sched.by_tiles):
            (_, a_box_k), _ = self.mainloop.tma_operands()
            gA = cute.local_tile(cute.domain_offset((tile.row0, 0), args.mA), (self.tile_m, a_box_k), (None, None))
            tAsA, tAgA = cpasync.tma_partition(
                args.tma_atom_a, rank_n, cute.make_layout(self.cluster_n), cute.group_modes(cta.sA, 0, 2),
                cute.group_modes(gA, 0, 2))
            return tAgA[(None, 0, None)], tAsA, tBgB[(None, tile.n_tile, None, group)], tBsB
        return tAgA[(None, tile.m_tile, None)], tAsA, tBgB[(None, tile.n_tile, None, group)], tBsB

    @cute.jit
    def row_gatherer(self, args, cta, slot: cutlass.Constexpr):
        """A warp of the producer warpgroup that copies gathered rows / tokens (mainloop_gather's GATHER_WARPS,
        warp slot `slot`): its share of every stage the producer loads (same schedule), beside the producer warp's."""
        rank_m, rank_n = self._cluster_coord()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        src = self.gather_source(args, cta)
        work = self.sched.work(cta.sValid, cta.m_rows, self.ab_k_tiles(None))
        t = work.first
        while t < work.total:
            tile = self.sched.tile(t, work, cta.sEnds, rank_m, rank_n)
            state = self.mainloop.gather_rows(cta.ab_pipeline, state, src, self.gather_placement(tile, cta), tile,
                                              slot)
            t += work.stride

    @cute.jit
    def gather_placement(self, tile, cta):
        """Where a tile's gathered A rows go: (its first row, A's stage 0 shared address)."""
        row0 = tile.row0 if const_expr(self.sched.by_tiles) else tile.m_tile * self.tile_m
        return row0, cta.storage.sA.data_ptr().toint()

    @cute.jit
    def stage_worker(self, cta, worker: cutlass.Constexpr):
        """A stage worker of the mainloop (MXFP8: a scale decoder; wgrad: the token masker; the dequantizing
        converters): for every stage the producer loads (same schedule), once its TMA landed,
        `mainloop.process_stage` reworks it in shared memory; then `mainloop.publish_stage` fences the
        generic-proxy stores against the wgmma's async-proxy reads and arrives on the stage's worker barrier(s)."""
        lane = cute.arch.lane_idx()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        rank_m, rank_n = self._cluster_coord()
        work = self.sched.work(cta.sValid, cta.m_rows)
        t = work.first
        while t < work.total:
            tile = self.sched.tile(t, work, cta.sEnds, rank_m, rank_n)
            k_count = tile.k_count
            for k in cutlass.range(k_count, unroll=1):
                cta.ab_pipeline.consumer_wait(state)
                self.mainloop.process_stage(worker, cta.ml_smem, cta.sA, cta.sB, state.index, k, k_count, tile, lane)
                self.mainloop.publish_stage(worker, cta.ml_smem, cta.stage_mbar, state.index, lane)
                state.advance()
            t += work.stride
