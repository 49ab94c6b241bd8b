"""FP4 D output of the sm90 forward epilogue: packed e2m1 codes, two a byte (docs/formats.md#fp4-d-outputs).

Two users: the MXFP4 D of quant / srelu / glu (e8m0 scales per 32 columns = the subtile's row, plus D_col per 32
rows, transposed and packed along the tokens, with SFD_col: the FP8 D rules of epilogue_fp8d with e2m1 codes), and
the NVFP4 D of glu_hadamard_quant (e4m3 scales per 16 columns, `sfd`, no D_col). kernels/quantize.py holds the math.

Shared memory: D's buffers are plain row-major (128, 16)-byte tiles (a step's 32 columns packed), D_col's
(32, 64)-byte tiles (the step's 32 columns x 128 tokens, transposed), 2048 bytes each, TMA-stored like FP8 D's
(epi_stages D buffers, then as many D_col buffers). A thread writes its two rows' packed words after a quad
transpose (`q8.row_words`: one 32-bit store per row, the 8 rows x 4 lanes of a warp hit 32 banks) and its 8 D_col
bytes after one shuffle with the lane holding the neighbouring tokens (`q8.col_token_bytes`).

A mixin of the kernel classes' shared body (gemm.GroupedGemmSm90Base), like epilogue_fp8d's Fp8DOutput.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from cudnn_moe_jax.formats import sf_atom_start, sf_row_byte

from .. import quantize as q8
from .epilogue_fp8d import EPI_N

FP4_ROW_BYTES = EPI_N // 2                 # a step's 32 columns, packed
FP4_TILE_BYTES = 128 * FP4_ROW_BYTES       # one D (128 rows) or D_col (32 columns x 128 tokens) buffer
NVFP4_VEC = 16


class Fp4DOutput:
    # ------------------------------------------------------------------------------------------ host
    def fp4_d_tmas(self, d, d_col):
        """(smem layout of D's buffers, D's TMA atom and tensor, D_col's (None without D_col)): (128, 16)-byte D
        boxes, (32, 64)-byte D_col boxes of the transposed (N_out, m / 2) D_col, from plain row-major tiles."""
        buffers = self.epi_stages * (2 if self.quant_d else 1)
        d_layout = cute.make_layout((self.tile_m, FP4_ROW_BYTES, buffers), stride=(FP4_ROW_BYTES, 1, FP4_TILE_BYTES))
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), d, cute.slice_(d_layout, (None, None, 0)), self.d_tile)
        tma_atom_dcol = tma_dcol = None
        if const_expr(self.quant_d):
            tma_atom_dcol, tma_dcol = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), d_col, cute.make_layout(self.dcol_tile, stride=(self.tile_m // 2, 1)),
                self.dcol_tile)
        return d_layout, tma_atom_d, tma_d, tma_atom_dcol, tma_dcol

    @property
    def dcol_tile(self):
        """FP4 D_col's box: a step's 32 columns x the tile's 128 tokens (64 bytes)."""
        return (EPI_N, self.tile_m // 2)

    # ------------------------------------------------------------------------------------------ device
    @cute.jit
    def fp4_dcol_partition(self, sD, tma_atom_dcol, mDcol):
        """(smem, global) TMA partitions of FP4 D_col: its buffers follow D's in sD."""
        sDcol = cute.make_tensor(sD.iterator + self.epi_stages * FP4_TILE_BYTES, cute.make_layout(
            (EPI_N, self.tile_m // 2, self.epi_stages), stride=(self.tile_m // 2, 1, FP4_TILE_BYTES)))
        return cpasync.tma_partition(tma_atom_dcol, 0, cute.make_layout(1), cute.group_modes(sDcol, 0, 2),
                                     cute.zipped_divide(mDcol, self.dcol_tile))

    @cute.jit
    def fp4_thread_views(self, sD, warp_e, lane):
        """This thread's smem destinations in buffer 0 (per tile, from the opaque thread coordinates): its two rows'
        D words (rows r0, r0 + 8, byte columns 4q..4q+3) and, with D_col, its 8 D_col bytes (columns 2q + the
        slot offsets, the token pair `q8.col_token_bytes` gives it)."""
        r0 = q8.first_row(warp_e, lane)
        q = lane % 4
        words = cute.make_tensor(cute.recast_ptr(sD.iterator, dtype=Int32) + r0 * (FP4_ROW_BYTES // 4) + q,
                                 cute.make_layout(2, stride=8 * FP4_ROW_BYTES // 4))
        col_bytes = None
        if const_expr(self.quant_d):
            pair = (r0 + 7 * (r0 & 1)) >> 1
            col_bytes = cute.make_tensor(
                sD.iterator + self.epi_stages * FP4_TILE_BYTES + 2 * q * (self.tile_m // 2) + pair,
                cute.make_layout((2, 2, 2), stride=(self.tile_m // 2, 8 * self.tile_m // 2, 16 * self.tile_m // 2)))
        return words, col_bytes

    @cute.jit
    def fp4_rows(self, rVal, rAbs, norm_const, lane):
        """Row quantization of the step's 16 values: (the thread's two packed D words, its rows' scale codes
        [row][block]). MXFP4: one e8m0 block per row (`rcp_limit` of e2m1); NVFP4: two e4m3 blocks of 16."""
        nvfp4 = self.fp4_vec == NVFP4_VEC
        nib, codes = q8.row_block_codes(rVal, rAbs, self.fp4_vec, nvfp4, self.rcp_limit, norm_const)
        return q8.row_words(nib, lane), codes

    @cute.jit
    def fp4_cols(self, rVal, sColMax, warp_e, lane, norm_const):
        """FP4 D_col after the step's first barrier: (this thread's 8 transposed D_col bytes, the e8m0 code of
        column `lane`) by the column rule (`q8.col_scaled`, 32-row blocks of two warps)."""
        code, rY = q8.col_scaled(rVal, sColMax, warp_e, lane, self.rcp_limit, norm_const)
        return q8.col_token_bytes([q8.e2m1_code(rY[i]) for i in range(q8.FRAG)], lane), code

    @cute.jit
    def fp4_store_smem(self, words, col_bytes, dst_words, dst_cols, buf: cutlass.Constexpr):
        """The step's packed D words (and D_col bytes) -> buffer `buf` (the views of `fp4_thread_views`)."""
        d = cute.make_tensor(dst_words.iterator + buf * (FP4_TILE_BYTES // 4), dst_words.layout)
        for h in cutlass.range_constexpr(2):
            d[h] = words[h]
        if const_expr(dst_cols is not None):
            c = cute.make_tensor(dst_cols.iterator + buf * FP4_TILE_BYTES, dst_cols.layout)
            for s in cutlass.range_constexpr(8):
                c[s] = col_bytes[s].to(cutlass.Uint8)

    @cute.jit
    def store_nvfp4_sf(self, codes, mSfd, m_tile, n_tile, step: cutlass.Constexpr, warp_e, lane):
        """NVFP4 D's e4m3 scale bytes (vec 16: blocks 2b, 2b + 1 of the step's 32 columns) of the thread's two
        rows, by the quad's first lane, at their `sfd` offsets (sf_rows layout, docs/formats.md)."""
        n_out = self.problem.n_out
        kb_atoms = (-(-n_out // NVFP4_VEC) + 3) // 4
        col_block = self.d_block(n_tile, step)
        r_in = q8.first_row(warp_e, lane)
        if (lane % 4 == 0) & (col_block < 2 * kb_atoms):
            for h in cutlass.range_constexpr(2):
                row = m_tile * self.tile_m + r_in + 8 * h
                for blk in cutlass.range_constexpr(2):
                    kb = 2 * col_block + blk
                    mSfd[sf_atom_start(row >> 7, kb >> 2, kb_atoms) + sf_row_byte(row, kb)] = \
                        codes[h][blk].to(cutlass.Uint8)
