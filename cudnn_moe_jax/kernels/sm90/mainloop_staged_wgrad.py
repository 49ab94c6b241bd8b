"""The staged weight gradient (`problem.staged`, wgrad): block-scaled A (m_w, T) and B (n_w, T) with per-expert SF
segments converted once, inside the bf16 K-grouped kernel, beside its GEMM (the forward's staging:
mainloop_staged.py).

Padded token ranges. The converters write A and B in bf16 into workspaces (rows, T + 64 L) (`operands.WORKSPACES`)
where each expert's tokens start on a 64-token boundary and the rest of its last 64 tokens is zero: expert e's
tokens [start_e, end_e) land at [64 P_{e-1}, 64 P_{e-1} + |e|), P_g = sum_{j <= g} ceil(|j| / 64) (the scheduler's
`padded_tokens` ends). So every k-tile holds one expert's tokens: the bf16 K-grouped mainloop runs without its
masker (no stage worker), and a 16-token group of the workspace lies in one expert and, its first token a multiple
of 16 from the expert's first, in one scale block of its segment (`formats.segment_token_scales`: local block
(t - start_e) // vec at byte base_e + ((row // 128) * Kb_e + block // 4) * 512 + sf_row_byte(row, block)).

Jobs: 32 rows x one 512-token chunk of the padded range, A's slabs then B's, chunk by chunk (the schedule walks
every expert's tokens from its first: the first chunks are needed first); a lane converts its 16 padded tokens of
each row (dequant.convert_group, the forward's bit placement, NaN by group: a NaN code in row r of A makes W[e]'s
row r NaN anyway, of B its column). Its expert's tokens start at any token of the codes: where a warp's groups do
not all start on 16 tokens, each lane loads the aligned words around its group and funnel-shifts them (FP8 by
bytes, packed FP4 by nibbles); codes past the expert's end are zeroed before the conversion (the next expert's
NaN codes stay out of the group), the pad after it (a NaN scale times zero) after it. A job publishes its chunk
like the forward's (fence.proxy.async.global, a release add on the flag of its 128-row block of A or B and chunk);
the producer acquires the flags of its tile's A and B blocks before the first stage it loads from each chunk.
Token-contiguous: the producer first raises the frontier word (the furthest chunk any producer has reached), and a
converter holds a job of a chunk more than `lead_chunks` past the frontier until it moves, so the converted chunks
wait in L2, not DRAM, where they are dropped once read. (No deadlock: jobs are taken in chunk order, a job at most
the lead past the frontier never waits, and every chunk holds some expert's tokens, whose tiles raise the frontier
to it.)

Token-major FP8 operands (codes (T, rows): `mainloop_class`) go into token-major workspaces (T + 64 L, rows) that
the bf16 kernel reads MN-major; there a lane converts 16 rows of 4 tokens (`convert_tokens`: each token its own
line, so no shifting; each pair of rows its own scales; NaN per element, a group being 16 rows).

Exact like the XLA route (the same bf16 values and the bf16 kernel): the sums are the reference's up to their
order, which the padding moves against the route's k-tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm

from cudnn_moe_jax.formats import SF_ATOM_BYTES, SF_ATOM_ROWS, cdiv
from cudnn_moe_jax.operands import (STAGED_CHUNK_K, STAGED_FRONTIER, STAGED_TILES_READ,
                                     STAGED_TOKEN_TILE, STAGED_WGRAD_HEADER_WORDS)

from .. import dequant as dq
from ..dequant import ld_global_words
from ..scheduler import count_ends_at_most
from .mainloop import TILE_K, WgmmaMainloop, copy_ab_stage
from .mainloop_dequant_wgrad import KGroupedDequantMainloop
from .mainloop_staged import (BATCH, SLAB, _half_stage_bytes, fence_async_global, ld_global_scalar, ld_shared_v4,
                              nap, publish, raise_to, read_mark, st_shared_word, take_job, wait_flag)

assert STAGED_TOKEN_TILE == TILE_K
# How far the token-contiguous converters may run ahead of the GEMM (`lead_chunks`): a job of chunk c waits until a
# producer has reached chunk c - lead (the frontier). Unbounded, they got so far ahead on 128-token experts that the
# converted chunks left L2 before the GEMM read them (e128 W2 NVFP4 on an H100: L2 hit rate 71% against MXFP8's 82%,
# 0.96 GB read from DRAM where the codes are 84 MB); bounded, e128 FP4 runs +26-32%, `small` W1 +8% (RESULTS runs
# 156-158). The lead covers LEAD_WAVES of the GEMM's tiles (lead 1 on `small`: -8..-14%, the GEMM waits for
# conversions) and two experts' tokens (an expert's chunks are all read from its first wave on). FP8's converters,
# reading twice the bytes a value, did not outrun the GEMM (82% L2 hits unbounded) and lost 1-4% to a lead without the
# slab drops below (run 157); with them the lead pays for FP8 too (e128_a128 W2 MXFP8 -19%, run 188).
LEAD_WAVES = 1.5
# A converted slab is dropped from L2 once every tile that reads it has (`discard.global.L2`: its lines are
# invalidated, not written back). Kept, the whole bf16 workspace reached DRAM when L2 evicted it: the NVFP4 W2 wgrad on
# e128_a128 wrote 1.22 GB where its W is 1.07 (RESULTS run 185; dropped: 1.18 GB and -10%, run 188). The converters
# wait near the GEMM (the lead) and drop slabs while they wait (token-major ones run unbounded and keep theirs). A
# consumer counts each tile it has read on its expert's word (`tiles_read`); a chunk is read when every
# expert with tokens in it has all its tiles counted.


def frontier_word(header: Int64) -> Int64:
    """The address of the frontier word in the flags buffer at `header`."""
    return header + STAGED_FRONTIER * 4


@cute.jit
def count_read_if(pred, addr: Int64):
    """A relaxed add of 1 to the word at `addr` where `pred` holds: the reads it counts have completed (their data is
    in shared memory), so nothing needs ordering before it (a release add put a MEMBAR.ALL.GPU in every consumer
    thread after every tile)."""
    dq.void_asm("{ .reg .pred p; setp.ne.b32 p, $0, 0; @p red.relaxed.gpu.global.add.u32 [$1], 1; }", "r,l",
                Int32(pred), Int64(addr))


@cute.jit
def discard_line(addr: Int64):
    """Invalidate the 128-byte L2 line at `addr` (128-aligned) without writing it back."""
    dq.void_asm("discard.global.L2 [$0], 128;", "l", Int64(addr))


@cute.jit
def funnel_right(lo: Int32, hi: Int32, shift: Int32) -> Int32:
    """The low 32 bits of (hi:lo) >> shift (0..31)."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(lo).ir_value(), Int32(hi).ir_value(),
                                                   Int32(shift).ir_value()],
                                 "shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def low_bits_mask(bits: Int32, width: cutlass.Constexpr) -> Int32:
    """Ones in the low `bits` (0..width) bits of a word."""
    return Int32(cutlass.select_(bits >= width, Int32(-1), (Int32(1) << bits) - 1))


class TokenGroup(NamedTuple):
    """A lane's 16 padded tokens of a chunk (per job: every row of its slab shares them)."""

    live: cutlass.Boolean   # inside the padded range (else nothing is stored)
    token: Int32            # the codes' token of the first (0 where none is valid)
    valid: Int32            # tokens of the expert, 0..16 (the rest is padding)
    block: Int32            # the local scale block of the expert's segment
    quads: Int32            # Kb_e: 4-block quads of the segment
    start: Int32            # the expert's first token (its segment's base)


def mainloop_class(problem):
    """The staged wgrad's mainloop for `problem`'s majors (token-major: the converters' shared scratch)."""
    if problem.a_major != "m":
        return StagedKGroupedMainloop
    return type("StagedKGroupedMainloop_token_major", (StagedKGroupedMainloop,),
                {"TOKEN_MAJOR": True, "SMEM_FIXED_BYTES": SLAB * 4 * len(StagedKGroupedMainloop.CONVERT_WARPS)})


class StagedKGroupedMainloop(WgmmaMainloop):
    """The bf16 K-grouped mainloop over the padded workspaces (module docstring): no masker, the converter warps,
    the producer's chunk waits."""

    STAGE_WORKERS = ()
    CONVERT_WARPS = (1, 2, 3)
    PRODUCER_REGS = 56          # as the forward's converters (mainloop_staged)
    TOKEN_MAJOR = False         # FP8 (T, rows) codes and workspaces, MN-major stages (`mainloop_class`)
    smem_stage_bytes = staticmethod(_half_stage_bytes)   # bf16 stages, whatever the codes' width
    tx_bytes = staticmethod(_half_stage_bytes)

    def __init__(self, problem, config, stages: int):
        super().__init__(BFloat16, config.tile_m, config.tile_n, stages, self.TOKEN_MAJOR, self.TOKEN_MAJOR)
        self.data, self.sf_dtype, self.vec = problem.ab_dtype, problem.sf_dtype, problem.sf_vec_size
        self.fp4 = problem.ab_dtype == dq.E2M1
        self.log_vec = self.vec.bit_length() - 1
        self.m, self.n, self.num_groups = problem.m, problem.n, problem.num_groups
        self.a_blocks, self.b_blocks = cdiv(problem.m, SF_ATOM_ROWS), cdiv(problem.n, SF_ATOM_ROWS)
        self.a_slabs, self.b_slabs = cdiv(problem.m, SLAB), cdiv(problem.n, SLAB)
        self.cta_tiles = problem.num_groups * cdiv(problem.m, config.tile_m) * cdiv(problem.n, config.tile_n)
        self.cluster_size = config.cluster_m * config.cluster_n
        # the CTA tiles of an expert (the scheduler's cluster tiles, each CTA of a cluster one), and whether read
        # slabs are dropped from L2
        self.expert_tiles = (problem.m // (config.tile_m * config.cluster_m) * config.cluster_m
                             * cdiv(cdiv(problem.n, config.tile_n), config.cluster_n) * config.cluster_n)
        self.discards = not self.TOKEN_MAJOR

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(problem, config, stages)

    def smem_fields(self):
        """Token-major: each converter warp's 32 shared words (its rows' SF words, exchanged)."""
        if not self.TOKEN_MAJOR:
            return []
        return [("sScratch", cute.struct.Align[cute.struct.MemRange[Int32, SLAB * len(self.CONVERT_WARPS)], 16])]

    @cute.jit
    def smem_tensors(self, storage, tidx: Int32, nthreads: cutlass.Constexpr):
        """The scratch's shared address (token-major), else None."""
        if const_expr(not self.TOKEN_MAJOR):
            return None
        return storage.sScratch.data_ptr().toint()

    def tma_sources(self, t):
        """(A, B) the TMA reads: the padded bf16 workspaces (m_w, T + 64 L), (n_w, T + 64 L)."""
        return t["staged_a"], t["staged_b"]

    def scale_tmas(self, tensors, cluster_m: int, cluster_n: int):
        """No scale TMA: the converters read the SF segments (KernelArgs.mSFA / mSFB) as memory."""
        return None, tensors["sfa"], None, tensors["sfb"]

    def producer_inputs(self, args, smem, rank_m, rank_n):
        return args.mStagedBFlags

    # ------------------------------------------------------------------------------------------ producer
    @cute.jit
    def load_tile(self, ab_pipeline, prod_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, a_mcast_mask,
                  b_mcast_mask, k_count: Int32, side_inputs=None, tile=None, descriptors=None, b_own=None):
        """The tile's k-tiles (its expert's padded range from tile.k_start), each after the flags of its chunk the
        first time the tile reads from it (`side_inputs`: the flag words)."""
        header = side_inputs.iterator.toint()
        prod_state.reset_count()
        for _k in cutlass.range(k_count, unroll=1):
            k = prod_state.count
            token = tile.k_start + k * TILE_K
            if (k == 0) | (token % STAGED_CHUNK_K == 0):
                self.wait_chunk(header, tile, token // STAGED_CHUNK_K)
            ab_pipeline.producer_acquire(prod_state)
            bar = ab_pipeline.producer_get_barrier(prod_state)
            copy_ab_stage(tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, bar, k, prod_state.index, a_mcast_mask,
                          b_mcast_mask)
            ab_pipeline.producer_commit(prod_state)
            prod_state.advance()
        return prod_state

    @cute.jit
    def wait_chunk(self, header: Int64, tile, c: Int32):
        """Wait for chunk c of the tile's 128-row blocks of A (4 slabs each: m_w % 128 == 0) and of B."""
        if const_expr(self.discards):
            if cute.arch.lane_idx() == 0:
                raise_to(frontier_word(header), c)
        first = self.chunk_flags(c)
        for h in cutlass.range_constexpr(self.tile_m // SF_ATOM_ROWS):
            block = tile.m_tile * (self.tile_m // SF_ATOM_ROWS) + h
            wait_flag(header + (first + block) * 4, Int32(SF_ATOM_ROWS // SLAB))
        for h in cutlass.range_constexpr(self.tile_n // SF_ATOM_ROWS):
            block = tile.n_tile * (self.tile_n // SF_ATOM_ROWS) + h
            if block < self.b_blocks:
                slabs = cutlass.min(Int32(SF_ATOM_ROWS // SLAB),
                                    (Int32(self.n) - block * SF_ATOM_ROWS + SLAB - 1) // SLAB)
                wait_flag(header + (first + self.a_blocks + block) * 4, slabs)
        fence_async_global()

    # ------------------------------------------------------------------------------------------ consumers
    def tiles_read(self, args, ctid: Int32, tile):
        """Consumer thread 0 after a tile's mainloop: the tile's stages have all landed in shared memory (their full
        barriers), so it counts the tile on its expert's word. (Inlined: a jit call here broke the tile loop.)"""
        if self.discards:
            count_read_if(ctid == 0, args.mStagedBFlags.iterator.toint() + (STAGED_TILES_READ + tile.group) * 4)

    # ------------------------------------------------------------------------------------------ converters
    @cute.jit
    def convert(self, args, cta):
        """A converter warp: jobs from the counter until the padded range's are done (module docstring)."""
        lane = cute.arch.lane_idx()
        header = args.mStagedBFlags.iterator.toint()
        padded = cta.sValid[1] * TILE_K
        converter = cute.arch.make_warp_uniform(cute.arch.warp_idx()) - self.CONVERT_WARPS[0]   # (of the CTA's)
        scratch = None
        if const_expr(self.TOKEN_MAJOR):
            scratch = cta.ml_smem + converter * (SLAB * 4)
        per_chunk = Int32(self.a_slabs + self.b_slabs)
        chunks = (padded + STAGED_CHUNK_K - 1) // STAGED_CHUNK_K
        jobs = chunks * per_chunk
        lead = self.lead_chunks(padded, chunks) if self.discards else None
        unit = Int32(0)   # (discards) this warp's next slab to drop (`discard_mine`)
        if const_expr(self.discards):
            x, y, z = cute.arch.block_idx()
            gx, gy, _ = cute.arch.grid_dim()
            unit = (x + gx * (y + gy * z)) * len(self.CONVERT_WARPS) + converter
        j = take_job(header, lane)
        while j < jobs:
            c = j // per_chunk
            r = j - c * per_chunk
            if const_expr(self.discards):
                while c > read_mark(frontier_word(header)) + lead:
                    unit = self.discard_mine(args, cta.sEnds, padded, jobs, per_chunk, lane, unit)
                    nap()
            block = Int32(0)
            if r < self.a_slabs:
                self.convert_job(args.mCodesA, args.mSFA, args.mStagedA, self.m, r * SLAB, c, lane, cta.sEnds, padded,
                                 scratch)
                block = r * SLAB // SF_ATOM_ROWS
            else:
                row0 = (r - self.a_slabs) * SLAB
                self.convert_job(args.mCodesB, args.mSFB, args.mStagedB, self.n, row0, c, lane, cta.sEnds, padded,
                                 scratch)
                block = self.a_blocks + row0 // SF_ATOM_ROWS
            fence_async_global()
            cute.arch.sync_warp()
            if lane == 0:
                flag = self.chunk_flags(c) + block
                publish(header + flag * 4)
            j = take_job(header, lane)
        if const_expr(self.discards):   # what is read by now (the last chunks' slabs stay: L2 writes them back)
            self.discard_mine(args, cta.sEnds, padded, jobs, per_chunk, lane, unit)

    @cute.jit
    def discard_mine(self, args, sEnds, padded: Int32, jobs: Int32, per_chunk: Int32, lane: Int32,
                     unit: Int32) -> Int32:
        """Drop from L2, in order from `unit`, this converter warp's slabs of the chunks every reader has read
        (`chunk_read`), never waiting; returns its next slab. The GPU's converter warps take the slabs (the
        conversion jobs' order) in turn: warp w of CTA i slab W i + w and every W x CTAs-th after it (W converter
        warps a CTA) -- no claims: one counter claimed slab by slab serialized them (10x slower, RESULTS run 187),
        and each slab's 256 lines by one warp (a chunk's 40960 on e128_a128's W2) spread over all of them."""
        gx, gy, gz = cute.arch.grid_dim()
        step = len(self.CONVERT_WARPS) * gx * gy * gz
        header = args.mStagedBFlags.iterator.toint()
        go = unit < jobs
        while go:
            c = unit // per_chunk
            go = self.chunk_read(header, sEnds, padded, c)
            if go:
                self.discard_slab(args, unit - c * per_chunk, c, padded, lane)
                unit = unit + step
                go = unit < jobs
        return unit

    @cute.jit
    def chunk_read(self, header: Int64, sEnds, padded: Int32, c: Int32):
        """Whether every expert with padded tokens in chunk c has counted all its tiles read (`tiles_read`; the
        experts' padded k-tile ranges are consecutive, so those are the owners of its first and last k-tile and the
        ones between)."""
        tiles = STAGED_CHUNK_K // TILE_K
        L = self.num_groups
        tile_ends = cute.make_tensor(sEnds.iterator + L, cute.make_layout(L))
        e = count_ends_at_most(tile_ends, c * tiles, L)
        last = cutlass.min(count_ends_at_most(tile_ends, cutlass.min((c + 1) * tiles, padded // TILE_K) - 1, L),
                           Int32(L - 1))
        read = e <= last
        while read & (e <= last):
            read = read_mark(header + (STAGED_TILES_READ + e) * 4) >= self.expert_tiles   # (relaxed: an acquire
            # load invalidates the SM's L1, CCTL.IVALL, and these are polled)
            e = e + 1
        return read

    @cute.jit
    def discard_slab(self, args, r: Int32, c: Int32, padded: Int32, lane: Int32):
        """Drop slab r of chunk c (its 32 rows' tokens [512 c, min(512 (c + 1), padded))): lane i row i's whole
        128-byte lines in that range (a line shared with the next or last chunk, or across a row's end, stays)."""
        in_a = r < self.a_slabs
        row = cutlass.select_(in_a, r * SLAB, (r - self.a_slabs) * SLAB) + lane
        rows = cutlass.select_(in_a, Int32(self.m), Int32(self.n))
        base = cutlass.select_(in_a, args.mStagedA.iterator.toint(), args.mStagedB.iterator.toint())
        if row < rows:   # (A's and B's workspaces hold the same padded token count: one row length)
            start = base + Int64(row) * (Int64(args.mStagedA.shape[1]) * 2)
            hi = start + Int64(cutlass.min((c + 1) * STAGED_CHUNK_K, padded)) * 2
            line = (start + Int64(c) * (STAGED_CHUNK_K * 2) + 127) & Int64(-128)
            for i in cutlass.range_constexpr(STAGED_CHUNK_K * 2 // 128):
                if line + (i + 1) * 128 <= hi:
                    discard_line(line + i * 128)

    def chunk_flags(self, c: Int32) -> Int64:
        """The index of chunk c's first flag word (A's 128-row blocks, then B's; operands.staged_b_flag_words)."""
        return Int64(STAGED_WGRAD_HEADER_WORDS + self.num_groups) + Int64(c) * (self.a_blocks + self.b_blocks)

    @cute.jit
    def lead_chunks(self, padded: Int32, chunks: Int32) -> Int32:
        """The converters' lead over the frontier, in chunks (at least 1): the chunks LEAD_WAVES waves of the
        GEMM's tiles span (LEAD_WAVES x CTAs x chunks / tiles), or two experts' padded tokens if more."""
        _, _, clusters = cute.arch.grid_dim()
        scaled = int(LEAD_WAVES * 16)     # LEAD_WAVES in 1/16ths: integer arithmetic
        by_waves = (scaled * clusters * self.cluster_size * chunks + 16 * self.cta_tiles - 1) // (16 * self.cta_tiles)
        by_experts = (2 * padded + self.num_groups * STAGED_CHUNK_K - 1) // (self.num_groups * STAGED_CHUNK_K)
        return cutlass.max(cutlass.max(by_waves, by_experts), Int32(1))

    @cute.jit
    def convert_job(self, mCodes, mSF, mOut, rows_total: cutlass.Constexpr, row0: Int32, c: Int32, lane: Int32,
                    sEnds, padded: Int32, scratch):
        """Rows row0 .. row0 + 32 of an operand in chunk c of the padded range (`scratch`: the warp's shared
        words, token-major)."""
        if const_expr(self.TOKEN_MAJOR):
            self.convert_tokens(mCodes, mSF, mOut, rows_total, row0, c, lane, sEnds, padded, scratch)
        else:
            self.convert_slab(mCodes, mSF, mOut, rows_total, row0, c, lane, self.token_group(sEnds, padded, c, lane))

    @cute.jit
    def expert_range(self, sEnds, tp: Int32):
        """(first token, first padded k-tile, token count) of the expert of padded token tp: a binary search over
        the padded k-tile ends sEnds[L + g] (the last expert past the range)."""
        L = self.num_groups
        tile_ends = cute.make_tensor(sEnds.iterator + L, cute.make_layout(L))
        e = cutlass.min(count_ends_at_most(tile_ends, tp // TILE_K, L), Int32(L - 1))
        start = Int32(0)
        first = Int32(0)
        if e > 0:
            start = sEnds[e - 1]
            first = sEnds[L + e - 1]
        return start, first, sEnds[e] - start

    @cute.jit
    def token_group(self, sEnds, padded: Int32, c: Int32, lane: Int32) -> TokenGroup:
        """Lane `lane`'s group of chunk c (token-contiguous): its expert and where its tokens are in the codes and
        the expert's SF segment."""
        tp = c * STAGED_CHUNK_K + lane * dq.GROUP
        start, first, length = self.expert_range(sEnds, tp)
        local = tp - first * TILE_K
        live = tp < padded
        valid = cutlass.min(cutlass.max(length - local, Int32(0)), Int32(dq.GROUP))
        valid = cutlass.select_(live, valid, Int32(0))
        token = cutlass.select_(valid > 0, start + local, Int32(0))
        quads = (((length + self.vec - 1) >> self.log_vec) + 3) >> 2
        return TokenGroup(live, token, valid, local >> self.log_vec, quads, start)

    @cute.jit
    def convert_slab(self, mCodes, mSF, mOut, rows_total: cutlass.Constexpr, row0: Int32, c: Int32, lane: Int32,
                     g: TokenGroup):
        """Rows row0 .. row0 + 32 (< rows_total) of an operand in chunk c: the lanes' groups into the workspace.
        Warp-uniform variants: groups all on 16-token starts or not (`general`), any of them short (`masked`)."""
        general = cute.arch.vote_any_sync((g.token & (dq.GROUP - 1)) != 0)
        masked = cute.arch.vote_any_sync(g.live & (g.valid < dq.GROUP))
        if general:
            if masked:
                self.convert_rows(mCodes, mSF, mOut, rows_total, row0, c, lane, g, True, True)
            else:
                self.convert_rows(mCodes, mSF, mOut, rows_total, row0, c, lane, g, True, False)
        else:
            if masked:
                self.convert_rows(mCodes, mSF, mOut, rows_total, row0, c, lane, g, False, True)
            else:
                self.convert_rows(mCodes, mSF, mOut, rows_total, row0, c, lane, g, False, False)

    @cute.jit
    def convert_rows(self, mCodes, mSF, mOut, rows_total: cutlass.Constexpr, row0: Int32, c: Int32, lane: Int32,
                     g: TokenGroup, general: cutlass.Constexpr, masked: cutlass.Constexpr):
        rows = cutlass.min(Int32(SLAB), Int32(rows_total) - row0)
        row_bytes = mCodes.shape[1]                      # packed FP4: T / 2
        out_row = Int64(mOut.shape[1]) * 2               # bytes of a workspace row
        codes = mCodes.iterator.toint() + Int64(row0) * row_bytes
        out = mOut.iterator.toint() + Int64(row0) * out_row + Int64(c * STAGED_CHUNK_K + lane * dq.GROUP) * 2
        # the SF byte of (row0 + i, the group's block): the slab lies in one 128-row block and one 32-row quarter
        rows_pad = cdiv(rows_total, SF_ATOM_ROWS) * SF_ATOM_ROWS
        sf_off = (Int64(rows_pad >> self.log_vec) * g.start
                  + Int64((row0 >> 7) * g.quads + (g.block >> 2)) * SF_ATOM_BYTES + ((row0 >> 5) & 3) * 4
                  + (g.block & 3))
        sf_size = Int64(cute.size(mSF))
        sf = mSF.iterator.toint()
        batch = BATCH[self.fp4] // (2 if general else 1)
        for i0 in cutlass.range(0, SLAB, batch, unroll=1):
            loaded = []
            for u in cutlass.range_constexpr(batch):
                i = cutlass.min(i0 + u, rows - 1)
                off = sf_off + i * 16
                ok = off < sf_size
                loaded.append((self.load_codes(codes + Int64(i) * row_bytes, row_bytes, g.token, general),
                               ld_global_scalar(sf + cutlass.select_(ok, off, Int64(0))), ok))
            for u in cutlass.range_constexpr(batch):
                raw, code, ok = loaded[u]
                words = self.place_codes(raw, g.token, g.valid, general, masked)
                scale = dq.scale_bf16x2(cutlass.select_(ok, code, Int32(0)), self.sf_dtype, cutlass.Boolean(True))
                pairs = [Int32(0)] * dq.PAIRS

                def keep(p, pair, pairs=pairs):
                    pairs[p] = pair

                dq.convert_group(words, self.data, scale, keep, True)
                if g.live & (i0 + u < rows):
                    self.store_group(pairs, out + Int64(i0 + u) * out_row, g.valid, masked)

    @cute.jit
    def load_codes(self, row: Int64, row_bytes: Int32, token: Int32, general: cutlass.Constexpr) -> list:
        """The group's code words: aligned, one vector load (FP8: 16 bytes, FP4: 8); general, the aligned words
        that cover it (FP8: 5, FP4: 3; past the row's end the last word again: only tokens past T, zeroed)."""
        if const_expr(not general):
            return ld_global_words(row + (token // 2 if const_expr(self.fp4) else token), 2 if self.fp4 else 4)
        last = row_bytes // 4 - 1
        first = token // 8 if const_expr(self.fp4) else token // 4
        return [ld_global_scalar(row + Int64(cutlass.min(first + w, last)) * 4, "b32")
                for w in range(3 if self.fp4 else 5)]

    @cute.jit
    def place_codes(self, raw: list, token: Int32, valid: Int32, general: cutlass.Constexpr,
                    masked: cutlass.Constexpr) -> list:
        """The group's codes in 4 (FP8) / 2 (FP4) words, first token in the low bits (general: the loaded words
        funnel-shifted by the token's place in its word); masked: codes past `valid` tokens zeroed."""
        per_word = 8 if const_expr(self.fp4) else 4       # tokens a word holds
        bits = 32 // per_word
        words = raw
        if const_expr(general):
            shift = (token % per_word) * bits
            words = [funnel_right(raw[w], raw[w + 1], shift) for w in range(len(raw) - 1)]
        if const_expr(masked):
            words = [words[w] & low_bits_mask(cutlass.min(cutlass.max(valid - per_word * w, Int32(0)),
                                                          Int32(per_word)) * bits, 32)
                     for w in range(len(words))]
        return words

    @cute.jit
    def convert_tokens(self, mCodes, mSF, mOut, rows_total: cutlass.Constexpr, row0: Int32, c: Int32, lane: Int32,
                       sEnds, padded: Int32, scratch: Int32):
        """Token-major FP8 (codes and workspace (T, rows)): per 64-token step of chunk c (one expert's), lane
        (quad q = lane // 2, half h = lane % 2) converts rows row0 + 16 h .. + 16 of the step's tokens 4q .. 4q + 3,
        16 bytes each; each pair of rows takes its own two scales (`row_pair_scales`) and e4m3 NaN per element (a
        group is 16 rows: no group decode); tokens past the expert's end are stored as zeros. The steps' experts are
        found once (lane s searches step s's); a step's 64 tokens lie in one 4-block quad of the expert's segment, so
        each lane loads one SF word (its row's quad) and the warp exchanges them through its shared `scratch`."""
        q, h = lane >> 1, lane & 1
        r0 = row0 + 16 * h
        r_load = cutlass.min(r0, Int32(rows_total - 16))        # a half past the rows loads the last ones
        rows_pad = cdiv(rows_total, SF_ATOM_ROWS) * SF_ATOM_ROWS
        sf_size = Int64(cute.size(mSF))
        sf = mSF.iterator.toint()
        codes = mCodes.iterator.toint() + r_load
        out = mOut.iterator.toint() + Int64(r0) * 2
        steps = STAGED_CHUNK_K // TILE_K
        starts, firsts, lengths = self.expert_range(sEnds, c * STAGED_CHUNK_K + cutlass.min(lane, Int32(steps - 1))
                                                    * TILE_K)
        for step in cutlass.range(steps, unroll=1):
            tp0 = c * STAGED_CHUNK_K + step * TILE_K
            start = cute.arch.shuffle_sync(starts, step)
            first = cute.arch.shuffle_sync(firsts, step)
            length = cute.arch.shuffle_sync(lengths, step)
            if tp0 < padded:
                base = tp0 - first * TILE_K
                quads = (((length + self.vec - 1) >> self.log_vec) + 3) >> 2
                r = row0 + lane
                off = (Int64(rows_pad >> self.log_vec) * start
                       + Int64((r >> 7) * quads + (base >> (self.log_vec + 2))) * SF_ATOM_BYTES
                       + (r & 31) * 16 + ((r >> 5) & 3) * 4)
                ok = (r < rows_total) & (off + 4 <= sf_size)
                word = ld_global_scalar(sf + cutlass.select_(ok, off, Int64(0)), "b32")
                local = base + 4 * q
                loaded = []     # the codes' loads issued with the SF word's, before the exchange waits for it
                for j in cutlass.range_constexpr(4):
                    valid = local + j < length
                    token = start + cutlass.select_(valid, local + j, Int32(0))
                    loaded.append((ld_global_words(codes + Int64(token) * rows_total, 4), valid))
                cute.arch.sync_warp()                           # the previous step's reads are done
                st_shared_word(scratch + lane * 4, Int32(cutlass.select_(ok, word, Int32(0))))
                cute.arch.sync_warp()
                words = []
                for i in cutlass.range_constexpr(4):
                    words += ld_shared_v4(scratch + (16 * h + 4 * i) * 4)
                sel = KGroupedDequantMainloop.byte_selector(local >> self.log_vec)
                scales = [KGroupedDequantMainloop.row_pair_scales(words[2 * p], words[2 * p + 1], sel)
                          for p in range(dq.PAIRS)]
                for j in cutlass.range_constexpr(4):
                    raw, valid = loaded[j]
                    pairs = [Int32(0)] * dq.PAIRS

                    def keep(p, pair, pairs=pairs, valid=valid):
                        pairs[p] = Int32(cutlass.select_(valid, pair, Int32(0)))

                    dq.convert_group(raw, self.data, lambda p: scales[p], keep)
                    if r0 < rows_total:
                        dst = out + Int64(tp0 + 4 * q + j) * (rows_total * 2)
                        dq.st_global_v4(dst, pairs[:4])
                        dq.st_global_v4(dst + 16, pairs[4:])

    @cute.jit
    def store_group(self, pairs: list, dst: Int64, valid: Int32, masked: cutlass.Constexpr):
        """A group's 8 pairs in natural token order (32 bytes at `dst`); masked: tokens past `valid` zero."""
        if const_expr(self.fp4):   # pair p = elements (8 (p // 4) + p % 4, + 4): back to natural order
            pairs = [dq.prmt2(pairs[4 * h + 2 * (q % 2)], pairs[4 * h + 2 * (q % 2) + 1],
                              0x7632 if q >= 2 else 0x5410) for h in range(2) for q in (0, 1, 2, 3)]
        if const_expr(masked):
            pairs = [pairs[p] & low_bits_mask(cutlass.min(cutlass.max(valid - 2 * p, Int32(0)), Int32(2)) * 16, 32)
                     for p in range(dq.PAIRS)]
        dq.st_global_v4(dst, pairs[:4])
        dq.st_global_v4(dst + 16, pairs[4:])
