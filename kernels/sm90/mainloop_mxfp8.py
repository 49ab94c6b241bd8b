"""MXFP8 (block-scaled FP8) mainloop of the sm90 grouped GEMM: FP8 wgmma per 32-wide K block + scale promotion.

Hopper has no block-scaled MMA (SEMANTICS §10). For every 32-wide K block `kb` each consumer warpgroup runs one
FP8 wgmma (m64 n128 k32, e4m3/e5m2, K-major) into a fresh fp32 *partial* accumulator P and folds it into the
real accumulator: `acc += P * (sfa[m, kb] * sfb[n, kb])`. The e8m0 scales are powers of two, so the scale product
and `P * s` are exact and the FFMA rounds once: the same as accumulating the exact dequantized products in fp32
(only the summation order differs from the reference).

Pipeline per CTA (stage = 128 K elements = 4 scale blocks = one 512-byte SF atom per 128 rows, SEMANTICS §2.3):
  producer warp   TMA: A (128 x 128 B), B[g] (128 x 128 B), the SFA atom and the SFB atom of the stage (512 B each,
                  contiguous in the packed layout), all on the stage's mbarrier; SFA multicast with A, SFB with B;
  decoder warp    waits for the stage, turns the 1024 e8m0 bytes into fp32 2^(e-127) (NaN for 0xFF, 0.0 for
                  K blocks past K), plus a per-kb flag "all 128 B scales equal", and arrives on the stage's decode
                  barrier -- once per CTA instead of once per consumer thread (that decode cost ~1 extra
                  instruction per accumulator element per kb);
  consumers       two warpgroups x 64 rows: per kb, issue the wgmma of kb+1 into the other partial accumulator,
                  wait for kb's, promote it (overlap: the tensor core runs kb+1 under kb's FP32 work).

Register budget (per consumer thread): acc 64 + two partials 2 x 64 = 192 fp32 of 232, hence tile_n = 128.
Promotion cost: 2 FP32 instructions per accumulator element per kb (scale product FMUL + FFMA) -- the FP32 issue
rate, not the tensor core, bounds this kernel -- and 1 (FFMA with a per-row scale) when the tile's 128 B scales of
the kb are all equal (flag from the decoder; warp-uniform branch).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

TILE_K = 128  # fp8: 128 B per row = one SW128 atom = 4 scale blocks
SF_VEC = 32
KB_PER_STAGE = TILE_K // SF_VEC
SF_ATOM_ROWS = 128  # one 512-byte SF atom: 128 rows x 4 k-blocks
SF_ATOM_BYTES = 512
DEC_FLOATS = SF_ATOM_ROWS * KB_PER_STAGE  # decoded fp32 A scales per stage: (4 kb, 128 rows)
# decoded B scales per K block: the 32 columns of accumulator quad q (c = 2q + v0 + 8j) contiguous (one 16-byte load
# = columns of j, j+1), quads 36 floats apart so that the 4 quads' loads hit different banks
DEC_B_QUAD = 36
DEC_B_KB = 4 * DEC_B_QUAD
DEC_B_FLOATS = KB_PER_STAGE * DEC_B_KB


def dec_b_pos(c: int) -> int:
    """Position of tile column c (0..127) in one K block's decoded B scales."""
    return ((c % 8) // 2) * DEC_B_QUAD + (c // 8) * 2 + c % 2


def ab_stage_bytes(ab_dtype, tile_m: int, tile_n: int) -> int:
    """TMA bytes per stage: A + B tiles and the two SF atoms."""
    return (tile_m + tile_n) * TILE_K * ab_dtype.width // 8 + 2 * SF_ATOM_BYTES


def smem_stage_bytes(ab_dtype, tile_m: int, tile_n: int) -> int:
    """Shared memory per stage: TMA bytes + decoded fp32 scales (A and B) + flag word + 2 mbarriers."""
    return ab_stage_bytes(ab_dtype, tile_m, tile_n) + (DEC_FLOATS + DEC_B_FLOATS) * 4 + 4 + 2 * 8


def sf_view(sf: cute.Tensor) -> cute.Tensor:
    """A packed SF buffer (L, Rb, Kb, 32, 4, 4) uint8 seen as (128, 4 * L*Rb*Kb) column-major: column block `a`
    (4 columns = 512 bytes) is SF atom `a = (l*Rb + rb)*Kb + kb4`, so a (128, 4) TMA box loads one atom."""
    atoms = sf.shape[0] * sf.shape[1] * sf.shape[2]
    return cute.make_tensor(sf.iterator, cute.make_layout((SF_ATOM_ROWS, KB_PER_STAGE * atoms),
                                                          stride=(1, SF_ATOM_ROWS)))


class Mxfp8Mainloop:
    """Producer / decoder / consumer k-loops of one output tile (128 x 128) with per-32 e8m0 scales."""

    def __init__(self, ab_dtype, tile_m: int, tile_n: int, stages: int, k: int, fast_path: bool = False):
        if tile_m != 128 or tile_n != 128:
            raise NotImplementedError("the MXFP8 mainloop runs 128 x 128 tiles (two 64 x 128 warpgroups)")
        self.ab_dtype = ab_dtype
        self.fast_path = fast_path
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.stages = stages
        self.k_tiles = -(-k // TILE_K)
        self.nkb = -(-k // SF_VEC)
        # valid K blocks of the last stage (the rest read zero-filled data and get scale 0.0)
        self.last_kbs = self.nkb - KB_PER_STAGE * (self.k_tiles - 1)

    # ------------------------------------------------------------------------------------------ layouts
    @staticmethod
    def make_tiled_mma(ab_dtype, tile_n: int) -> cute.TiledMma:
        return sm90_utils.make_trivial_tiled_mma(
            ab_dtype, ab_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (2, 1, 1), tiler_mn=(64, tile_n))

    @staticmethod
    def make_ab_smem_layouts(ab_dtype, tile_m: int, tile_n: int, stages: int):
        layouts = []
        for rows in (tile_m, tile_n):
            atom = warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, ab_dtype, TILE_K), ab_dtype)
            layouts.append(cute.tile_to_shape(atom, (rows, TILE_K, stages), order=(0, 1, 2)))
        return tuple(layouts)

    def sf_smem_layout(self):
        return cute.make_layout((SF_ATOM_ROWS, KB_PER_STAGE, self.stages),
                                stride=(1, SF_ATOM_ROWS, SF_ATOM_BYTES))

    def make_sf_tma(self, sf: cute.Tensor, num_multicast: int):
        op = cpasync.CopyBulkTensorTileG2SMulticastOp() if num_multicast > 1 else cpasync.CopyBulkTensorTileG2SOp()
        return cpasync.make_tiled_tma_atom(
            op, sf_view(sf), cute.slice_(self.sf_smem_layout(), (None, None, 0)), (SF_ATOM_ROWS, KB_PER_STAGE),
            num_multicast=num_multicast)

    # ------------------------------------------------------------------------------------------ producer
    @cute.jit
    def load_tile(
        self, ab_pipeline, prod_state,
        tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB,
        tma_atom_sfa, tSAg, tSAs, sfa_atom0: Int32,
        tma_atom_sfb, tSBg, tSBs, sfb_atom0: Int32,
        a_mcast_mask, b_mcast_mask, k_count: Int32,
    ):
        """k_count stages of one tile; SF atom of stage k: `*_atom0 + k` (one atom per 128 rows per stage)."""
        prod_state.reset_count()
        for _k in cutlass.range(k_count, unroll=1):
            ab_pipeline.producer_acquire(prod_state)
            bar = ab_pipeline.producer_get_barrier(prod_state)
            k = prod_state.count
            s = prod_state.index
            cute.copy(tma_atom_a, tAgA[(None, k)], tAsA[(None, s)], tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
            cute.copy(tma_atom_b, tBgB[(None, k)], tBsB[(None, s)], tma_bar_ptr=bar, mcast_mask=b_mcast_mask)
            cute.copy(tma_atom_sfa, tSAg[(None, 0, sfa_atom0 + k)], tSAs[(None, s)], tma_bar_ptr=bar,
                      mcast_mask=a_mcast_mask)
            cute.copy(tma_atom_sfb, tSBg[(None, 0, sfb_atom0 + k)], tSBs[(None, s)], tma_bar_ptr=bar,
                      mcast_mask=b_mcast_mask)
            ab_pipeline.producer_commit(prod_state)
            prod_state.advance()
        return prod_state

    # ------------------------------------------------------------------------------------------ decoder
    @cute.jit
    def decode_stage(self, sRaw32: cute.Tensor, sDecA: cute.Tensor, sDecB: cute.Tensor, sFlags: cute.Tensor,
                     idx: Int32, last: cutlass.Boolean, lane: Int32):
        """Warp-collective decode of one stage's SF atoms.

        sRaw32: (4 words, 32 lanes, 2 operands, stages) Int32 view of the raw atoms -- lane l's 16 bytes are
        rows (A) / columns (B) l + 32 i, i = 0..3, each word holding k-blocks 0..3 (§2.3 atom layout);
        sDecA: (4 kb, 128 rows, stages) f32; sDecB: flat f32, stage s / block j / column c at
        s * DEC_B_FLOATS + j * DEC_B_KB + dec_b_pos(c); sFlags: (stages,) Int32, bit j set when all 128 B scales of
        k-block j are equal.
        """
        wa = sRaw32[(None, lane, 0, idx)].load()
        wb = sRaw32[(None, lane, 1, idx)].load()
        b0 = cute.arch.shuffle_sync(wb[0], offset=0)
        flags = Int32(0)
        keep_tail = Int32(cutlass.select_(last, Int32(0), Int32(-1)))  # K blocks past K: scale 0.0
        rowA = cute.make_rmem_tensor((KB_PER_STAGE,), Float32)
        for i in cutlass.range_constexpr(4):
            for j in cutlass.range_constexpr(KB_PER_STAGE):
                keep = Int32(-1)
                if const_expr(j >= self.last_kbs):
                    keep = keep_tail
                rowA[j] = (_e8m0_f32_bits((wa[i] >> (8 * j)) & Int32(0xFF)) & keep).bitcast(Float32)
                # column c = lane + 32 i -> dec_b_pos(c) = ((lane % 8) // 2) * 36 + (lane // 8 + 4 i) * 2 + lane % 2
                pos = ((lane % 8) // 2) * DEC_B_QUAD + (lane // 8) * 2 + lane % 2 + 8 * i
                sDecB[idx * DEC_B_FLOATS + j * DEC_B_KB + pos] = (
                    _e8m0_f32_bits((wb[i] >> (8 * j)) & Int32(0xFF)) & keep).bitcast(Float32)
            sDecA[(None, lane + 32 * i, idx)].store(rowA.load())
        for j in cutlass.range_constexpr(KB_PER_STAGE):
            diff = ((wb[0] ^ b0) | (wb[1] ^ b0) | (wb[2] ^ b0) | (wb[3] ^ b0)) & Int32(0xFF << (8 * j))
            if cute.arch.vote_all_sync(diff == Int32(0)):
                flags = flags | Int32(1 << j)
        if lane == 0:
            sFlags[idx] = flags

    # ------------------------------------------------------------------------------------------ consumer
    @cute.jit
    def wait_stage(self, ab_pipeline, state, dec_mbar):
        ab_pipeline.consumer_wait(state)
        cute.arch.mbarrier_wait(dec_mbar + state.index, state.phase)

    @cute.jit
    def promote(self, acc: cute.Tensor, P: cute.Tensor, sa0: Float32, sa1: Float32, sDecB4: cute.Tensor,
                idx: Int32, kb: cutlass.Constexpr, quad: Int32, uniform: Int32):
        """acc += P * sfa[row] * sfb[col, kb] (exact scale products; one rounding per element).

        acc/P: the (2, 2, 16) accumulator fragment (flat i = v0 + 2*v1 + 4*j: row + 8*v1, col 2*quad + v0 + 8*j);
        sDecB4: (4, 8, 4 quads, 4 kb, stages) f32 view of the decoded B scales: [(e, t, quad, kb, s)] = column
        2*quad + e % 2 + 8*(2t + e // 2) (see dec_b_pos).
        """
        if const_expr(self.fast_path) and uniform != Int32(0):
            sb = sDecB4[(0, 0, 0, kb, idx)]  # column 0: all columns are equal
            s0 = sa0 * sb
            s1 = sa1 * sb
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + P[i] * (s0 if (i // 2) % 2 == 0 else s1)
        else:
            for t in cutlass.range_constexpr(cute.size(acc) // 8):
                sb = sDecB4[(None, t, quad, kb, idx)].load()
                for e in cutlass.range_constexpr(4):
                    j = 2 * t + e // 2
                    v0 = e % 2
                    for v1 in cutlass.range_constexpr(2):
                        i = v0 + 2 * v1 + 4 * j
                        acc[i] = acc[i] + P[i] * ((sa0 if v1 == 0 else sa1) * sb[e])

    @cute.jit
    def mma_stage(self, ab_pipeline, dec_mbar, read_state, tiled_mma, acc, P0, P1, tCrA, tCrB, sDecA, sDecB4,
                  sFlags, row0: Int32, quad: Int32, prefetch_next: cutlass.Constexpr):
        """One stage: its kb 0 wgmma (into P0) is already in flight. With `prefetch_next`, the next stage's kb 0
        wgmma is issued (into P0) before this stage's last block is promoted."""
        idx = read_state.index
        sa_r0 = sDecA[(None, row0, idx)].load()
        sa_r1 = sDecA[(None, row0 + 8, idx)].load()
        flags = sFlags[idx]
        for kb in cutlass.range_constexpr(KB_PER_STAGE):
            Pc = P0 if kb % 2 == 0 else P1
            Pn = P1 if kb % 2 == 0 else P0
            if const_expr(kb < KB_PER_STAGE - 1):
                warpgroup.fence()
                cute.gemm(tiled_mma, Pn, tCrA[(None, None, kb + 1, idx)], tCrB[(None, None, kb + 1, idx)], Pn)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
            elif const_expr(prefetch_next):
                nxt = read_state.clone()
                nxt.advance()
                self.wait_stage(ab_pipeline, nxt, dec_mbar)
                warpgroup.fence()
                cute.gemm(tiled_mma, Pn, tCrA[(None, None, 0, nxt.index)], tCrB[(None, None, 0, nxt.index)], Pn)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
            else:
                warpgroup.wait_group(0)
            self.promote(acc, Pc, sa_r0[kb], sa_r1[kb], sDecB4, idx, kb, quad, (flags >> kb) & Int32(1))

    @cute.jit
    def mma_tile(self, ab_pipeline, dec_mbar, read_state, release_state, tiled_mma: cute.TiledMma,
                 acc: cute.Tensor, P0: cute.Tensor, P1: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                 sDecA: cute.Tensor, sDecB4: cute.Tensor, sFlags: cute.Tensor, row0: Int32, quad: Int32,
                 k_count: Int32):
        """acc = promoted sum over k_count stages (zeros when k_count == 0). One wgmma per 32-wide K block into
        P0/P1 alternately; block kb+1 (also across stages) is issued before kb is promoted."""
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        if k_count > 0:
            self.wait_stage(ab_pipeline, read_state, dec_mbar)
            warpgroup.fence()
            cute.gemm(tiled_mma, P0, tCrA[(None, None, 0, read_state.index)],
                      tCrB[(None, None, 0, read_state.index)], P0)
            warpgroup.commit_group()
            for _s in cutlass.range(k_count - 1, unroll=1):
                self.mma_stage(ab_pipeline, dec_mbar, read_state, tiled_mma, acc, P0, P1, tCrA, tCrB, sDecA, sDecB4,
                               sFlags, row0, quad, True)
                ab_pipeline.consumer_release(release_state)
                release_state.advance()
                read_state.advance()
                # Retire the prefetched wgmma before the loop's back-edge: ptxas (13.x) cannot follow a wgmma in
                # flight across a back-edge into the next iteration's promotion and then serializes *every*
                # wgmma of the kernel (C7514). It has run under the last promotion, so the wait costs ~nothing.
                warpgroup.wait_group(0)
            self.mma_stage(ab_pipeline, dec_mbar, read_state, tiled_mma, acc, P0, P1, tCrA, tCrB, sDecA, sDecB4,
                           sFlags, row0, quad, False)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        return read_state, release_state


@cute.jit
def _e8m0_f32_bits(e: Int32) -> Int32:
    """Bits of fp32 2^(e-127) for an e8m0 code: e = 0 -> 0.0 (only ever multiplies zero data in practice),
    e = 255 -> quiet NaN ((e + 1) has bit 8 set only for e = 255)."""
    return (e << 23) | (((e + 1) << 14) & Int32(0x400000))
