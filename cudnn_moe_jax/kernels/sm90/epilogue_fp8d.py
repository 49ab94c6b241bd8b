"""FP8 D output of the sm90 epilogues, shared by the forward (forward.py) and the backward (dgrad.py) one:
per 128 x 32 subtile of fp32 values, D_row quantized per row (32 columns = the subtile), D_col per column (32 rows
= two warps, combined through the `sColMax` table between the epilogue step's two barriers), and the e8m0 SFD_row /
SFD_col bytes stored from registers (kernels/quantize.py holds the math, docs/formats.md the layouts).

A step calls `_quantize_d_rows` before its first barrier and `_quantize_d_cols` after it (the column maxima of
the partner warp are in smem then; the table is rewritten only after the step's second barrier).

A mixin of the kernel classes' shared body (gemm.GroupedGemmSm90Base): it reads the kernel's static attributes (tile
shape, problem, `rcp_limit`, `discrete_col_sfd`) and its `d_block` (a subtile's place among D's 32-column blocks).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cudnn_moe_jax.formats import sf_atom_byte, sf_atom_start, sf_row_byte

from .. import quantize as q8

EPI_N = 32  # epilogue subtile width = one GLU block = one row-quantization block


class Fp8DOutput:
    @cute.jit
    def _quantize_d_rows(self, rVal, rD, sColMax, warp_e, lane, norm_const):
        """rD <- rVal (16 fp32 of one subtile) row-quantized; the warp's column maxima -> sColMax. Returns the
        e8m0 codes of the thread's two rows."""
        rAbs = [q8.abs_raw(rVal[i]) for i in range(q8.FRAG)]  # shared by the row and column maxima
        code_r0, code_r1 = q8.quantize_rows(rVal, rAbs, rD, self.rcp_limit, norm_const)
        q8.column_partial_max(rAbs, sColMax, warp_e, lane)
        return code_r0, code_r1

    @cute.jit
    def _quantize_d_cols(self, rVal, rDcol, sColMax, code_r0, code_r1, is_compute, fp8, m_tile, n_tile,
                         step: cutlass.Constexpr, g, warp_e, lane, j: cutlass.Constexpr = 0):
        """After the step's first barrier: rDcol <- rVal column-quantized, then the subtile's SF bytes (zero
        tiles: D_col zeros, no SF bytes -- the zeroing kernel wrote 0x00). `j`: which of the step's subtiles
        (the backward dglu stores a gate and an up subtile per step)."""
        mSfdRow, mSfdCol, sEnds, m_rows = fp8.mSfdRow, fp8.mSfdCol, fp8.sEnds, fp8.m_rows
        code_c = q8.quantize_cols(rVal, rDcol, sColMax, warp_e, lane, self.rcp_limit, fp8.norm_const)
        if is_compute:
            self._store_sf_bytes(code_r0, code_r1, code_c, mSfdRow, mSfdCol, sEnds, m_rows,
                                 m_tile, n_tile, step, g, warp_e, lane, j)
        else:
            rDcol.fill(0.0)

    @cute.jit
    def _store_sf_bytes(self, code_r0, code_r1, code_c, mSfdRow, mSfdCol, sEnds, m_rows, m_tile, n_tile,
                        step: cutlass.Constexpr, g, warp_e, lane, j: cutlass.Constexpr = 0):
        """SFD_row bytes of the thread's two rows (quad leaders) and the SFD_col byte of subtile column `lane`
        (the first warp of each 32-row pair), at their byte offsets (cudnn_moe_jax.formats.sf_atom_start /
        sf_row_byte / sf_atom_byte: docs/formats.md#scale-factor-layout, #segmented-layout)."""
        n_out = self.problem.n_out
        col_block = self.d_block(n_tile, step, j)  # D's 32-column block of the subtile
        kb_atoms = (-(-n_out // EPI_N) + 3) // 4
        # this thread's first row in the tile (0..127; = its fragment's row, checked by check_fragment_layout);
        # its second row is r_in + 8
        r_in = q8.first_row(warp_e, lane)
        # a 2-CTA cluster along N over an odd number of N tiles runs one tile wholly past N (it still loads and
        # multicasts its half of A): its blocks lie past the SF buffers' padded width, nothing to store
        in_n = col_block < 4 * kb_atoms
        if (lane % 4 == 0) & in_n:
            row_off = (sf_atom_start((m_tile * self.tile_m) >> 7, col_block >> 2, kb_atoms)
                       + sf_row_byte(r_in, col_block))
            mSfdRow[row_off] = code_r0.to(cutlass.Uint8)
            # r_in % 16 < 8: row r_in + 8 is r0 + 8 of the same 32-row quarter, a constant offset
            mSfdRow[row_off + sf_atom_byte(8, 0, 0)] = code_r1.to(cutlass.Uint8)
        if (warp_e % 2 == 0) & in_n:
            rb32 = ((m_tile * self.tile_m) >> 5) + (r_in >> 5)  # global 32-row block (SFD_col k-block)
            atoms = m_rows // 128
            if const_expr(self.discrete_col_sfd):
                start = Int32(0)
                if g > 0:
                    start = sEnds[g - 1]
                atoms = (sEnds[g] - start) // 128
                rb32 = rb32 - (start >> 5)
            # D_col's scale rows are D's columns (col_block * 32 + lane), its k-blocks D's 32-row blocks
            col_off = sf_atom_start(col_block >> 2, rb32 >> 2, atoms) + sf_atom_byte(lane, col_block & 3, rb32 & 3)
            if const_expr(self.discrete_col_sfd):
                col_off = col_off + 4 * ((n_out + 127) // 128) * start
            mSfdCol[col_off] = code_c.to(cutlass.Uint8)
