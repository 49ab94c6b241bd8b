"""The bf16 / fp16 wgmma mainloops with gathered operands: the M-grouped ops' A rows (`a_index`: row r of the GEMM
reads row a_index[r] of A (T, K), a zero row where the index is outside [0, T) or r is past A's m rows;
`GatheredAMainloop`) and the weight gradient's token-major A / B tokens (`a_index` / `b_index`;
`KGroupedGatherMainloop`). An MoE layer then reads its tokens straight from x and dY, without permuted copies.

No TMA box gathers rows on sm_90, so the producer warpgroup copies A by `cp.async` of 16 bytes (B keeps its TMA;
the stage's full barrier counts the TMA's arrive-and-expect-tx, now of B's bytes only, and the lanes' arrivals
through `cp.async.mbarrier.arrive.noinc`: `PRODUCER_ARRIVALS`). A k-tile of a 128-row tile is 128 rows x 128 bytes;
each of the warpgroup's four warps copies 32 of the rows (one warp issuing all of them ran fc1 ~1.5x slower than
the TMA-loaded kernel, RESULTS run 96), a warp instruction four whole rows (lane = 8 * row + chunk, so each row's
128 bytes come in one coalesced request). Chunk c of tile row r lands where the 128-byte-swizzled TMA would have
put it, byte r * 128 + ((c ^ (r % 8)) << 4) of the stage (the swizzle is a function of the shared address; stages
are 1024-byte aligned), so the consumers' wgmma descriptors are the bf16 mainloop's. A warp reads its rows' indices
once per tile, one per lane, and passes them to the issuing lanes by shuffles.

cp.async writes complete through the mbarrier the consumers already wait on; the wgmma reads them after that wait
with no proxy fence, as sm_90 kernels that fill wgmma operands by cp.async do (FlashAttention-3's Q and paged K/V).
A multicast along N (cluster_n 2) would need the gathered rows in the other CTA's shared memory too: gathered A
runs cluster_n 1 (B's multicast along M is unchanged).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64, const_expr
from cutlass._mlir.dialects import llvm

from .mainloop import TILE_K, KGroupedWgmmaMainloop, WgmmaMainloop

CHUNK_BYTES = 16
ROW_BYTES = 128            # one k-tile of a bf16 / fp16 row: 64 values, one swizzle row
CHUNKS = ROW_BYTES // CHUNK_BYTES
ROWS_PER_COPY = 32 // CHUNKS  # tile rows one warp instruction copies


@cute.jit
def cp_async_16(dst: Int32, src: Int64, src_bytes: Int32):
    """cp.async of 16 bytes from global `src` to shared address `dst`, through L2 only (.cg: a row is read once per
    N tile, L1 would not keep it); `src_bytes` 0 writes zeros."""
    llvm.inline_asm(None, [Int32(dst).ir_value(), Int64(src).ir_value(), Int32(src_bytes).ir_value()],
                    "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class GatherSource(NamedTuple):
    """What the producer gathers from (the kernel's `gather_source`)."""

    a: cute.Tensor        # A (T, K) in global memory
    index: cute.Tensor    # a_index (m,) int32
    m_rows: Int32         # m


class GatheredAMainloop(WgmmaMainloop):
    """The mainloop protocol (WgmmaMainloop's docstring) with A gathered by the producer warpgroup's four warps
    (module docstring): warp w copies tile rows 32 w .. 32 w + 31 of every stage, warp 0 (`load_tile`, beside B's
    TMA) and warps 1-3 (`gather_rows`, the kernel's `row_gatherer` role) alike. `load_tile` gets the tile's first row
    in place of A's TMA partition, the shared address of A's stage 0 in place of its smem partition, and the
    `GatherSource` as `side_inputs`."""

    ROW_WARPS = 4
    GATHER_WARPS = (1, 2, 3)       # beside warp 0: slots 1-3
    PRODUCER_ARRIVALS = 1 + 32 * ROW_WARPS

    def __init__(self, ab_dtype, tile_m: int, tile_n: int, stages: int, k: int, b_mn: bool = False):
        super().__init__(ab_dtype, tile_m, tile_n, stages, b_mn=b_mn)
        assert tile_m == 32 * self.ROW_WARPS
        self.k = k
        self.a_stage_bytes = tile_m * ROW_BYTES

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(ab_dtype, config.tile_m, config.tile_n, stages, problem.k, problem.b_major == "n")

    @staticmethod
    def tx_bytes(ab_dtype, tile_m: int, tile_n: int) -> int:
        """The TMA's bytes of a stage: B only (A arrives by cp.async)."""
        return tile_n * TILE_K * ab_dtype.width // 8

    @cute.jit
    def warp_rows(self, src: GatherSource, row0: Int32, warp: Int32, lane: Int32, sa_base: Int32):
        """Per tile: what warp `warp` needs to copy its 32 rows of each stage -- the index of its row 32 warp + lane
        (-1: a zero row, outside [0, T) or past m), A's base address and row stride, the lane's chunk and row of each
        copy, its destination offsets."""
        r = row0 + 32 * warp + lane
        v = Int32(-1)
        if r < src.m_rows:
            v = src.index[r]
        index = cutlass.select_((v >= 0) & (v < src.a.shape[0]), v, Int32(-1))
        chunk = lane % CHUNKS
        sub = lane // CHUNKS          # the row of a copy's four this lane copies
        # (r % 8) of row 4 j + sub is 4 (j % 2) + sub: two destination offsets per lane
        dst = [sa_base + (32 * warp + sub) * ROW_BYTES + ((chunk ^ (4 * parity + sub)) * CHUNK_BYTES)
               for parity in range(2)]
        # 32-bit row stride in bytes (K < 2^30), so that each address is one 32 x 32 -> 64-bit multiply-add
        row_bytes = Uint32(src.a.layout.stride[0] * (self.ab_dtype.width // 8))
        return src.a.iterator.toint(), row_bytes, index, chunk, sub, dst[0], dst[1]

    @cute.jit
    def copy_rows(self, rows, k: Int32, s: Int32, bar):
        """Stage k of this warp's 32 rows (`warp_rows`) by cp.async into stage s, then each lane's arrival on the
        stage's full barrier once its copies landed."""
        base, row_bytes, index, chunk, sub, dst_even, dst_odd = rows
        col = k * TILE_K + chunk * (CHUNK_BYTES * 8 // self.ab_dtype.width)
        col_ok = col < self.k     # K % 8 == 0: a chunk is all inside K or all past it
        # a chunk past K reads A's first bytes (with src-size 0: none) instead of its own column
        base_k = base + Int64(cutlass.select_(col_ok, col, Int32(0)) * (self.ab_dtype.width // 8))
        stage = s * self.a_stage_bytes
        for j in cutlass.range_constexpr(32 // ROWS_PER_COPY):
            v = cute.arch.shuffle_sync(index, j * ROWS_PER_COPY + sub)
            ok = (v >= 0) & col_ok
            row = Uint64(Uint32(cutlass.select_(ok, v, Int32(0))))
            dst = (dst_even if j % 2 == 0 else dst_odd) + stage + j * ROWS_PER_COPY * ROW_BYTES
            cp_async_16(dst, base_k + Int64(row * Uint64(row_bytes)), cutlass.select_(ok, Int32(CHUNK_BYTES),
                                                                                       Int32(0)))
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    @cute.jit
    def load_tile(self, ab_pipeline, prod_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, a_mcast_mask,
                  b_mcast_mask, k_count: Int32, side_inputs=None, tile=None, descriptors=None, b_own=None):
        """k_count stages of one tile: B by TMA, A's first 32 rows by cp.async (`tAgA`: the tile's first row;
        `tAsA`: the shared address of A's stage 0; `side_inputs`: the GatherSource)."""
        rows = self.warp_rows(side_inputs, tAgA, Int32(0), cute.arch.lane_idx(), tAsA)
        return self.produce_stages(ab_pipeline, prod_state, (None, None, None, tma_atom_b, tBgB, tBsB),
                                   a_mcast_mask, b_mcast_mask, k_count, rows, descriptors, b_own)

    @cute.jit
    def load_stage_scales(self, scales, bar, k: Int32, s: Int32, a_mcast_mask, b_mcast_mask, descriptors):
        """The producer warp's rows of stage k (load_tile's per-tile `scales`)."""
        self.copy_rows(scales, k, s, bar)

    @cute.jit
    def gather_rows(self, ab_pipeline, state, src: GatherSource, placement, tile, slot: cutlass.Constexpr):
        """Warp `slot` (1-3) of the producer warpgroup: its 32 rows of the tile's stages (`placement`: the tile's
        first row, A's stage 0 address), each stage once the consumers released it (the empty barrier; the producer
        warp sets the stage's TMA bytes)."""
        rows = self.warp_rows(src, placement[0], Int32(slot), cute.arch.lane_idx(), placement[1])
        state.reset_count()
        for _k in cutlass.range(tile.k_count, unroll=1):
            ab_pipeline.sync_object_empty.wait(state.index, state.phase)
            self.copy_rows(rows, state.count, state.index, ab_pipeline.producer_get_barrier(state))
            state.advance()
        return state


class TokenSource(NamedTuple):
    """A gathered token-major wgrad operand (the kernel's `gather_source`): its memory and its token index."""

    x: cute.Tensor        # (rows, T_src) token-major: token t's rows contiguous at t * rows
    index: cute.Tensor    # (T,) int32: token t of the GEMM reads token index[t] of x


def kgrouped_class(gather_a: bool, gather_b: bool):
    """The K-grouped gathering mainloop with A and / or B gathered (token-major operands)."""
    return type(f"KGroupedGatherMainloop_{int(gather_a)}{int(gather_b)}", (KGroupedGatherMainloop,),
                {"GATHER": (gather_a, gather_b)})


class KGroupedGatherMainloop(KGroupedWgmmaMainloop):
    """The weight gradient's mainloop with its token-major A and / or B gathered along the tokens (the wgrad's
    `a_index` / `b_index`: an MoE layer's x and dY read in token order, not as permuted copies).

    A stage of a gathered operand is 64 tokens x tile_rows values, M / N-major: token t's tile_rows values are one
    contiguous run of its row in memory. Warps 0, 2 and 3 of the producer warpgroup (warp 1 is the masker) copy them
    by 16-byte cp.async, a warp instruction one token (tile_rows 256: 32 chunks) or two (128), instruction j of a
    stage by warp slot j % 3, to where the MN-major 128-byte-swizzled TMA box would have put them: chunk c of token t
    at byte (c // 8) * 8192 + (t // 8) * 1024 + (t % 8) * 128 + (((c ^ t) % 8) << 4) (8 x 64 atoms of 1 KiB, K
    first). Each warp loads the 64 token indices of a stage one stage ahead (two a lane) and passes them by shuffles;
    tokens past T and indices outside [0, T_src) read zeros, and the masker zeroes the other experts' tokens as for a
    TMA-loaded stage. A gathered operand is never multicast: gathered A runs 2-CTA clusters along M only (B
    multicast), gathered B along N only (A multicast)."""

    GATHER = (False, False)
    # the producer warp keeps the TMA partitions, the gathered operands' addresses and four token indices: 40
    # registers spill
    PRODUCER_REGS = 56
    GATHER_WARPS = (2, 3)          # beside warp 0 (slot 0): slots 1, 2
    SLOTS = 1 + len(GATHER_WARPS)
    PRODUCER_ARRIVALS = 1 + 32 * SLOTS

    def __init__(self, ab_dtype, tile_m: int, tile_n: int, stages: int, a_mn: bool, b_mn: bool):
        super().__init__(ab_dtype, tile_m, tile_n, stages, a_mn, b_mn)
        self.stage_bytes = (tile_m * TILE_K * ab_dtype.width // 8, tile_n * TILE_K * ab_dtype.width // 8)

    @classmethod
    def tx_bytes(cls, ab_dtype, tile_m: int, tile_n: int) -> int:
        """The TMA's bytes of a stage: the operands not gathered."""
        return sum(rows * TILE_K * ab_dtype.width // 8
                   for rows, gathered in zip((tile_m, tile_n), cls.GATHER) if not gathered)

    @cute.jit
    def _stage_indices(self, src, token0: Int32, lane: Int32):
        """The indices of tokens token0 + lane and token0 + lane + 32 of a gathered operand (-1: a zero token;
        both -1 for an operand not gathered, `src` None)."""
        out = [Int32(-1), Int32(-1)]
        if const_expr(src is not None):
            for half in cutlass.range_constexpr(2):
                t = token0 + lane + 32 * half
                v = Int32(-1)
                if t < src.index.shape[0]:
                    v = src.index[t]
                out[half] = cutlass.select_((v >= 0) & (v < src.x.shape[1]), v, Int32(-1))
        return out[0], out[1]

    @cute.jit
    def _copy_tokens(self, src: TokenSource, indices, rows: int, mn0: Int32, extent: Int32, stage: Int32,
                     lane: Int32, slot: cutlass.Constexpr):
        """Warp slot `slot`'s share of one stage of a gathered operand: tile `rows` values from row mn0 (of
        `extent`) of the stage's 64 tokens into the MN-major stage at shared address `stage`."""
        chunks = rows * self.ab_dtype.width // 8 // CHUNK_BYTES        # of one token
        per_copy = 32 // chunks                                         # tokens a warp instruction copies
        chunk = lane % chunks
        sub = lane // chunks
        col = mn0 + chunk * (CHUNK_BYTES * 8 // self.ab_dtype.width)
        col_ok = col < extent    # extent % 8 == 0: a chunk is all inside or all past it
        base = src.x.iterator.toint() + Int64(cutlass.select_(col_ok, col, Int32(0)) * (self.ab_dtype.width // 8))
        token_bytes = Uint32(src.x.layout.stride[1] * (self.ab_dtype.width // 8))
        lane_dst = stage + (chunk // 8) * 8192
        for j in cutlass.range_constexpr(TILE_K // per_copy):
            if const_expr(j % self.SLOTS == slot):
                t = j * per_copy + sub
                v = cute.arch.shuffle_sync(indices[(j * per_copy) // 32], (j * per_copy) % 32 + sub)
                ok = (v >= 0) & col_ok
                row = Uint64(Uint32(cutlass.select_(ok, v, Int32(0))))
                dst = lane_dst + (t // 8) * 1024 + (t % 8) * ROW_BYTES + (((chunk ^ t) % 8) * CHUNK_BYTES)
                cp_async_16(dst, base + Int64(row * Uint64(token_bytes)),
                            cutlass.select_(ok, Int32(CHUNK_BYTES), Int32(0)))

    @cute.jit
    def _gather_stage(self, src, placement, a_idx, b_idx, s: Int32, lane: Int32, slot: cutlass.Constexpr, bar):
        """Warp slot `slot`'s copies of stage s of the gathered operands, then its lanes' arrivals on the stage's
        full barrier."""
        sources, extents = (src[0], src[1]), src[2]
        firsts, bases = (placement[0], placement[2]), (placement[1], placement[3])
        indices = (a_idx, b_idx)
        for i in cutlass.range_constexpr(2):
            if const_expr(self.GATHER[i]):
                self._copy_tokens(sources[i], indices[i], (self.tile_m, self.tile_n)[i], firsts[i], extents[i],
                                  bases[i] + s * self.stage_bytes[i], lane, slot)
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    @cute.jit
    def _stage_loop(self, ab_pipeline, state, src, placement, tile, slot: cutlass.Constexpr, tma=None):
        """The k-loop of one tile for warp slot `slot` (0: the producer warp, which also issues the TMA of the
        operands not gathered, `tma` = (atom A, tAgA, tAsA, atom B, tBgB, tBsB, masks))."""
        lane = cute.arch.lane_idx()
        # the current stage's indices, two a lane and operand (loop-carried scalars; -1 where not gathered)
        a0, a1 = self._stage_indices(src[0], tile.k_start, lane)
        b0, b1 = self._stage_indices(src[1], tile.k_start, lane)
        state.reset_count()
        for _k in cutlass.range(tile.k_count, unroll=1):
            k = state.count
            s = state.index
            if const_expr(slot == 0):
                ab_pipeline.producer_acquire(state)
                bar = ab_pipeline.producer_get_barrier(state)
                atom_a, gA, sA, atom_b, gB, sB, a_mask, b_mask = tma
                if const_expr(not self.GATHER[0]):
                    cute.copy(atom_a, gA[(None, k)], sA[(None, s)], tma_bar_ptr=bar, mcast_mask=a_mask)
                if const_expr(not self.GATHER[1]):
                    cute.copy(atom_b, gB[(None, k)], sB[(None, s)], tma_bar_ptr=bar, mcast_mask=b_mask)
            else:
                ab_pipeline.sync_object_empty.wait(state.index, state.phase)
                bar = ab_pipeline.producer_get_barrier(state)
            # the next stage's indices now, so their latency hides under this stage's copies
            next_token = tile.k_start + (k + 1) * TILE_K
            na0, na1 = self._stage_indices(src[0], next_token, lane)
            nb0, nb1 = self._stage_indices(src[1], next_token, lane)
            self._gather_stage(src, placement, (a0, a1), (b0, b1), s, lane, slot, bar)
            if const_expr(slot == 0):
                ab_pipeline.producer_commit(state)
            state.advance()
            a0, a1, b0, b1 = na0, na1, nb0, nb1
        return state

    @cute.jit
    def load_tile(self, ab_pipeline, prod_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, a_mcast_mask,
                  b_mcast_mask, k_count: Int32, side_inputs=None, tile=None, descriptors=None, b_own=None):
        """k_count stages of the tile (warp 0): the operands not gathered by TMA, slot 0's share of the gathered
        ones by cp.async (a gathered operand's `tXgX` is the tile's first row / column of W, `tXsX` the shared
        address of its stage 0; `side_inputs`: (TokenSource of A or None, of B or None, W's extents (m_w, n_w)))."""
        return self._stage_loop(ab_pipeline, prod_state, side_inputs, (tAgA, tAsA, tBgB, tBsB), tile, 0,
                                (tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, a_mcast_mask, b_mcast_mask))

    @cute.jit
    def gather_rows(self, ab_pipeline, state, src, placement, tile, slot: cutlass.Constexpr):
        """Warp slot `slot` (1, 2: warps 2, 3) of the tile's stages: its share of the gathered tokens, each stage
        once the consumers released it (the producer warp sets the stage's TMA bytes)."""
        return self._stage_loop(ab_pipeline, state, src, placement, tile, slot)
