"""The weight-gradient kernel class of the sm90 grouped GEMM: per-expert W[e] = A[:, T_e] @ B[:, T_e]^T.

The forward class with the K-grouped schedule (`kernels.scheduler.K_GROUPED`) and the token-masking mainloop
(`mainloop.KGroupedWgmmaMainloop`; block-scaled A / B: `mainloop_dequant_wgrad`, exact bf16 conversion on chip with
the scales read from the per-expert segments): output tiles (expert e, M block, N block) of W (L, m_w, n_w), stored
through the forward `quant` epilogue (D = alpha * acc, no prob) into W seen as (L * m_w, n_w): by TMA from shared
memory, an fp32 W accumulated into by its threads from registers (`run_epilogue`). A (m_w, T) and B (n_w, T) are
read from expert e's first token rounded down to a k-tile (any alignment of the offsets): the producer offsets both
TMA coordinate tensors by it per tile, and the mainloop zeroes the neighbouring experts' tokens in the first and
last k-tiles. Token ends are sanitized like the reference's (running max of clip(offsets, 0, T)); an expert with no
token runs no k-tile and stores zeros. Global scales: alpha = gsa[e] * gsb[e] (the two vectors
ride in the launcher's alpha / beta slots). accumulate_on_output: the W input is aliased to the output and the
epilogue adds the old W (forward.py `_load_old_w`).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from cudnn_moe_jax._problem import Epilogue
from cudnn_moe_jax.limits import values_per_byte

from .. import quantize as q8
from ..dequant import st_global_v2
from ..scheduler import K_GROUPED, GroupedTileScheduler
from .epilogue import EpilogueDriver
from .epilogue_fp8d import EPI_N
from .epilogue import adjacent_pairs
from .forward import GroupedGemmSm90Forward
from . import mainloop_dequant_wgrad, mainloop_staged_wgrad
from .mainloop import KGroupedWgmmaMainloop
from .mainloop_gather import TokenSource, kgrouped_class


class GroupedGemmSm90Wgrad(GroupedGemmSm90Forward):
    """`W[e] = alpha_e * A[:, T_e] @ B[:, T_e]^T (+ the old W[e])` for every expert e."""

    # W's stores evict first from L2 (CUTLASS's CacheHintSm90::EVICT_FIRST): written once, W need not push out the
    # operand (staged: workspace) lines other tiles still read. With few tokens per expert W is most of the traffic:
    # H100 +2..+12% (RESULTS runs 160, 162), H200 -1.4..+2.8% (run 163)
    OUTPUT_L2_POLICY = 0x12F0000000000000

    def init_epilogue(self, problem):
        self.accumulate = problem.accumulate
        self.scaled = problem.has_global_scales
        # an fp32 W accumulated into: stored from registers (`run_epilogue`); any other W by TMA
        self.d_from_registers = problem.accumulate and problem.wgrad_dtype == "float32"
        return super().init_epilogue(dataclasses.replace(   # (the quant epilogue's problem gathers nothing)
            problem, op="quant", epilogue=Epilogue(has_prob=False, d_dtype=problem.wgrad_dtype), a_rows=None,
            b_rows=None))

    @cute.jit
    def run_epilogue(self, hooks, setup, ctx, store_pipeline):
        """The driver's TMA stores, but for an fp32 W accumulated into (`d_from_registers`): the forward's `begin` /
        `visit` per 32-column step (alpha * acc + the old W, its loads one step ahead), each step's values stored by
        their threads straight from registers -- no smem buffer to wait for, no barrier per step: +10-16% (H100,
        RESULTS runs 177-178). An fp32 W not accumulated into ran as fast by TMA (0..-4% from registers, run 178);
        a 16-bit W (a word transpose in each quad, 16-byte stores) was mixed: bf16 -2..-10%, staged FP4 W2 +9% on
        e128_a128 but -6..-9% on `small` (run 177)."""
        if const_expr(not self.d_from_registers):
            EpilogueDriver.run_epilogue(self, hooks, setup, ctx, store_pipeline)
        else:
            order = self._pair_order(setup.r2s_d)
            state = hooks.begin(setup, ctx)
            # (row, column) of each value in a subtile, re-derived per tile (not hoisted across the mainloop)
            coords = setup.r2s_d.get_slice(q8.opaque(setup.ctid)).partition_S(
                cute.make_identity_tensor(self.epi_tile))
            for step in cutlass.range_constexpr(self.epi_steps):
                hooks.visit(step, state)
                self._store_w(step, state, coords, order)
            hooks.end(state)

    @cute.jit
    def _store_w(self, step: cutlass.Constexpr, st, coords, order: cutlass.Constexpr):
        """The step's fp32 W values (`st.rVal`; tiles of an expert without tokens: zeros) to W[tile rows, its
        32-column block], a pair of adjacent columns an 8-byte store, row by row and along each row (`order`): each
        store of a quad writes one whole 32-byte sector, its next one the row's next sector (in register order,
        alternating rows, the W2 accumulate row ran only as fast as TMA on e128_a128, run 176; in this order 16%
        faster, run 177). Columns past n_w are not stored (n_w is even: a pair is all in or all out)."""
        ctx = st.ctx
        rVal = st.rVal
        col0 = self.d_block(ctx.n_tile, step) * EPI_N
        base = st.setup.mDout.iterator.toint() + (Int64(ctx.m_tile * self.tile_m) * self.n + col0) * 4
        vals = [rVal[i] for i in range(cute.size(rVal))]
        if const_expr(not isinstance(ctx.is_compute, bool)):   # (the K-grouped schedule's tiles all compute)
            vals = [cutlass.select_(ctx.is_compute, v, Float32(0.0)) for v in vals]
        for i in cutlass.range_constexpr(len(order)):
            j = order[i]
            row, col = coords[j]
            if col0 + col < self.n:
                st_global_v2(base + (Int64(row) * self.n + col) * 4, Float32(vals[j]).bitcast(Int32),
                             Float32(vals[j + 1]).bitcast(Int32))

    def _pair_order(self, r2s_d) -> tuple:
        """Trace time: the first value index of each pair of a thread's subtile values (`adjacent_pairs`), ordered by
        (row, column); NotImplementedError unless the order is the same in every lane of a warp."""
        order = None
        for lane in range(32):
            at = adjacent_pairs(r2s_d.get_slice(lane).partition_S(cute.make_identity_tensor(self.epi_tile)),
                                "fp32 W from registers")
            mine = tuple(sorted(range(0, len(at), 2), key=lambda i: at[i]))
            if order is not None and mine != order:
                raise NotImplementedError("fp32 W from registers: the lanes' values differ in (row, column) order")
            order = mine
        return order

    def epi_stage_candidates(self) -> tuple:
        """16-bit operands: 4 W buffers where they leave 4 A/B stages (a bf16 W). With few tokens per expert a
        tile's mainloop is 2-4 k-tiles and then 8 store steps, each waiting for the TMA store `epi_stages` steps back
        to have read its buffer: the bf16 wgrad +5-7% on `small` and e128_a128, +1% on fc (H200, RESULTS runs
        166-167); gathered operands (the layer's) likewise: its 128e step +3.9% (H100, run 170). Block-scaled
        (staged) wgrads keep 2: mixed there (W1 NVFP4 +5% on `small`, -7% on e128_a128); an fp32 W 2 (4 cost an
        A/B stage). An fp32 W accumulated into, stored from registers, takes the one buffer sD needs to exist (the
        thread layout of the epilogue is derived from it)."""
        if self.d_from_registers:
            return (1,)
        if self.problem.block_scaled:
            return self.EPI_STAGE_CANDIDATES
        return (4, 2)

    def mainloop_class_for(self, problem):
        """bf16 / fp16: the token-masking bf16 mainloop; block-scaled: the K-grouped dequantizing mainloop, or
        staged (converted once into padded bf16 workspaces, then the bf16 mainloop without the masker)."""
        if problem.staged:
            return mainloop_staged_wgrad.mainloop_class(problem)
        if problem.block_scaled:
            return mainloop_dequant_wgrad.mainloop_class(problem, self.config)
        if self.gather_a or self.gather_b:
            return kgrouped_class(self.gather_a, self.gather_b)
        return KGroupedWgmmaMainloop

    def make_scheduler(self, problem):
        """K-grouped; the token count T is dynamic: the kernel reads it from A's shape (load_group_ends; packed FP4
        A is (m_w, T / 2) bytes: two tokens a column); staged, over the padded token ranges of its workspaces."""
        return GroupedTileScheduler(K_GROUPED, self.tile_m, self.tile_n, self.cluster_m, self.cluster_n,
                                    self.num_groups, self.n_blocks, self.tile_k,
                                    m_blocks=problem.m // (self.tile_m * self.cluster_m),
                                    tokens_per_unit=values_per_byte(problem.ab_dtype), padded_tokens=problem.staged)

    def output_operands(self, t):
        """W (L, m_w, n_w) as (L * m_w, n_w): expert e's rows start at e * m_w; the global scales in the alpha /
        beta slots; with accumulation the buffer W is written to holds the old W (input_output_aliases)."""
        d = cute.make_tensor(t["wgrad"].iterator, cute.make_layout((self.num_groups * self.problem.m, self.n),
                                                                  stride=(self.n, 1)))
        return d, t["global_scale_a"], t["global_scale_b"], t["wgrad"] if self.accumulate else None

    @cute.jit
    def tile_alpha(self, g, args):
        alpha = Float32(1.0)
        if const_expr(self.scaled):
            alpha = args.mAlpha[g] * args.mBeta[g]  # gsa[e] * gsb[e], rounded once as the reference's (1 * gsa) * gsb
        return alpha

    @cute.jit
    def rows_and_extent(self, mA, mAIndex, mBIndex):
        """(W's rows m_w, the token count T: A's tokens, or the length of a gathered operand's index)."""
        extent = self.sched.group_extent(mA)
        if const_expr(self.gather_a):
            extent = mAIndex.shape[0]
        elif const_expr(self.gather_b):
            extent = mBIndex.shape[0]
        return mA.shape[0], extent

    @cute.jit
    def gather_source(self, args, cta):
        """(A's TokenSource or None, B's, W's extents (m_w, n_w)) for the gathering mainloop."""
        src_a = TokenSource(args.mA, args.mAIndex) if const_expr(self.gather_a) else None
        src_b = TokenSource(args.mB, args.mBIndex) if const_expr(self.gather_b) else None
        return src_a, src_b, (args.mA.shape[0], args.mB.shape[0])

    def ab_partitions(self, args, cta, rank_m, rank_n):
        """Nothing made once: each tile's K range starts at its expert's first token (`tile_ab`)."""
        return None

    def ab_k_tiles(self, ab):
        return None

    @cute.jit
    def tile_ab(self, ab, tile, args, cta, rank_m, rank_n):
        """(tAgA, tAsA, tBgB, tBsB) of one tile: k-tile k = tokens tile.k_start + tile_k * k (k_start: the expert's
        first token rounded down to tile_k); packed FP4 operands hold two tokens a byte (TMA box: tile_k / 2)."""
        (_, a_box), (_, b_box) = self.mainloop.tma_operands()
        k0 = tile.k_start
        if const_expr(a_box != self.tile_k):
            k0 = tile.k_start // (self.tile_k // a_box)
        gA = gB = None
        if const_expr(not self.gather_a):
            gA = cute.local_tile(cute.domain_offset((0, k0), args.mA), (self.tile_m, a_box), (None, None))
        if const_expr(not self.gather_b):
            gB = cute.local_tile(cute.domain_offset((0, k0), args.mB), (self.tile_n, b_box), (None, None))
        tAsA, tAgA, tBsB, tBgB = self.tma_partitions(args, gA, gB, cta, rank_m, rank_n)
        # a gathered operand (mainloop_gather): the tile's first row / column of W and its stage 0 address
        placement = self.gather_placement(tile, cta)
        if const_expr(self.gather_a):
            tAgA, tAsA = placement[0], placement[1]
        else:
            tAgA = tAgA[(None, tile.m_tile, None)]
        if const_expr(self.gather_b):
            tBgB, tBsB = placement[2], placement[3]
        else:
            tBgB = tBgB[(None, tile.n_tile, None)]
        return tAgA, tAsA, tBgB, tBsB

    @cute.jit
    def gather_placement(self, tile, cta):
        """Where a tile's gathered tokens go: (A's first W row, A's stage 0 address, B's first W column, B's)."""
        return (tile.m_tile * self.tile_m, cta.storage.sA.data_ptr().toint(), tile.n_tile * self.tile_n,
                cta.storage.sB.data_ptr().toint())
