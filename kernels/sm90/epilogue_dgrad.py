"""Backward epilogue of the sm90 grouped GEMM (dglu: dswiglu / dgeglu, dsrelu): the FC2 dgrad accumulator fused
with the activation derivative on the saved forward pre-activation C.

Per tile (128 rows x tile_n accumulator columns) and 32-column step s (one accumulator subtile = one GLU block):
  begin   prob of the tile's rows -> smem; the C subtiles of steps 0 and 1 are already on their way (TMA, issued by
          `prefetch_c` before the mainloop) into two load buffers, one mbarrier each;
  visit   wait for step s's C subtile(s) (dsrelu: 1; dglu: gate block 2b and up block 2b + 1), compute per value
          dD = alpha * acc, x = beta * C, D_row = dC (dglu: the gate and the up subtile), the row partial of dprob
          (dD * act(x), summed per thread over the tile) and the column partials of dbias (a warp's 16 rows by
          shuffles, then the 8 warps in fixed order through smem); registers -> smem -> TMA store; once every
          thread has read the load buffer, the store warp refills it with step s + 2's C;
  end     per row: a quad of lanes holds the row's columns: dprob partial of (row, N tile) = fixed-order shuffle
          sum, stored to `dprob_parts (n_parts, m)`; amax per group by `atomicMax` on |x| bits (exact).
The lowering sums the partials in a fixed order (operands.finish_dgrad_outputs): no float atomics, so every output
is bit-identical run to run. Rows past `valid_m` (zero tiles) store zeros everywhere.

A mixin of `GroupedGemmSm90` (kernels/sm90/gemm.py), traced inside the consumer warpgroups' tile loop.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .. import quantize as q8
from ..epilogue import abs_bits, warp_max_i32
from .epilogue_fp8d import EPI_N

C_LOAD_BUFFERS = 2  # C subtiles in flight: step s + 2 is loaded while steps s and s + 1 compute
EPI_WARPS = 8


class DgradEpilogue:
    @cute.jit
    def prefetch_c(self, tma_atom_cin, bSG_sCin, bSG_gCin, cin_bars, is_store_warp, m_tile, n_tile):
        """Store warp, before the tile's mainloop: issue the C loads of steps 0 and 1 (the previous tile's reads of
        both buffers finished before its last step barrier)."""
        if is_store_warp:
            for step in cutlass.range_constexpr(min(C_LOAD_BUFFERS, self.epi_steps)):
                self._load_c_step(tma_atom_cin, bSG_sCin, bSG_gCin, cin_bars, m_tile, n_tile, step)

    @cute.jit
    def _load_c_step(self, tma_atom_cin, bSG_sCin, bSG_gCin, cin_bars, m_tile, n_tile, step: cutlass.Constexpr):
        """Whole store warp: the TMA copy is warp-collective (it elects its issuing lane and ends in a WARPSYNC.ALL,
        so a copy under a one-lane branch never returns); only the expect-tx arrival is one lane's."""
        buf = step % C_LOAD_BUFFERS
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(cin_bars + buf, self.cin_step_bytes)
        for j in cutlass.range_constexpr(self.d_per_step):
            col = (n_tile * self.epi_steps + step) * self.d_per_step + j   # 32-column block of C / D_row
            cute.copy(tma_atom_cin, bSG_gCin[(None, (m_tile, col))], bSG_sCin[(None, buf * self.d_per_step + j)],
                      tma_bar_ptr=cin_bars + buf)

    @cute.jit
    def dgrad_epilogue(
        self, tRS_rAcc, tRS_cD, frag_size: cutlass.Constexpr, alpha, beta, prob_v, sProb, is_compute, ctid,
        r2s_d, tRS_sD, bSG_sD, bSG_gD, tma_atom_d,
        sCin, cin_copy, cin_bars, tma_atom_cin, bSG_sCin, bSG_gCin, sColSum, mDprobParts, mDbiasParts,
        store_pipeline, epi_barrier, is_store_warp, m_tile, n_tile, g, mAmax, fp8, tma_atom_dcol, sD, sZero,
    ):
        rec = self.recipe
        bSG_gDcol, _, sColMax, _, _, norm_const, _, _ = fp8
        zero_addr = None
        if const_expr(self.quant_d):
            zero_addr = sZero.iterator.toint()
        q8.check_fragment_layout(tRS_cD)
        # thread coordinates re-derived per tile from an opaque copy of ctid: otherwise ptxas hoists every address
        # computed from them above the tile loop and holds them across the mainloop (spills next to 128
        # accumulators; the forward epilogue does the same for FP8 D)
        ctid_o = q8.opaque(ctid)
        tRS_cD = r2s_d.get_slice(ctid_o).partition_S(cute.make_identity_tensor(self.epi_tile))
        # C subtiles read with the accumulator's thread-value layout (plain loads: flat index i is the same (row,
        # col) as in the accumulator and D fragments)
        tRS_sCin = cin_copy.get_slice(ctid_o).partition_D(sCin)
        rC = [cute.make_rmem_tensor(tRS_sCin[(None, None, None, 0)].shape, self.cin_dtype)
              for _ in range(self.d_per_step)]
        warp_e = ctid_o // 32
        lane = ctid_o % 32
        r0 = 64 * (warp_e // 4) + 16 * (warp_e % 4) + lane // 4   # the thread's two rows: r0, r0 + 8
        if const_expr(rec.has_prob):
            if ctid < self.tile_m:
                sProb[ctid] = prob_v
        epi_barrier.arrive_and_wait()

        row_sum = [Float32(0.0), Float32(0.0)]
        amax_bits = [Int32(0), Int32(0)]
        # outputs go to their storage dtype as they are computed; amax and the dbias column partials are taken
        # from the fp32 values on the way (keeping two fp32 fragments next to 128 accumulators spilled)
        rD = [cute.make_rmem_tensor(tRS_cD.shape, self.d_dtype) for _ in range(self.d_per_step)]
        # FP8 D: the fp32 values of the step's subtiles stay until their column quantization after the first
        # barrier (the forward FP8 D holds one such fragment too)
        rVal = rDcol = None
        if const_expr(self.quant_d):
            rVal = [cute.make_rmem_tensor(tRS_cD.shape, Float32) for _ in range(self.d_per_step)]
            rDcol = [cute.make_rmem_tensor(tRS_cD.shape, self.d_dtype) for _ in range(self.d_per_step)]
        for step in cutlass.range_constexpr(self.epi_steps):
            lb = step % C_LOAD_BUFFERS
            cute.arch.mbarrier_wait(cin_bars + lb, (step // C_LOAD_BUFFERS) % 2)
            col_sum = [[Float32(0.0)] * 8 for _ in range(self.d_per_step)]
            if const_expr(self.quant_d):
                # FP8 D: every per-thread address of the step (C loads, D / D_col smem stores, SF bytes, column
                # maxima and sums) derived from a fresh thread index. ptxas otherwise computes them once (it sees
                # through `opaque`) and holds them from one use to the next -- the 8-bit stores alone need 8
                # swizzled addresses per buffer, 4 * d_per_step buffers -- and spills next to the accumulators
                ctid_s = q8.fresh(ctid, zero_addr)
                warp_e = ctid_s // 32
                lane = ctid_s % 32
                tRS_sCin = cin_copy.get_slice(ctid_s).partition_D(sCin)
                tRS_sD = r2s_d.get_slice(ctid_s).partition_D(sD)
            for j in cutlass.range_constexpr(self.d_per_step):
                cute.autovec_copy(tRS_sCin[(None, None, None, lb * self.d_per_step + j)], rC[j])
            # ---- visit: derivative per value
            for i in cutlass.range_constexpr(frag_size):
                row = tRS_cD[i][0]
                prob = Float32(1.0)
                if const_expr(rec.has_prob):
                    prob = sProb[row]
                dd = alpha * tRS_rAcc[step * frag_size + i]
                value = Float32(0.0)
                vals = []
                if const_expr(rec.is_glu):
                    x_g = beta * rC[0][i].to(Float32)
                    x_u = beta * rC[1][i].to(Float32)
                    value, d_gate, d_up = rec.dglu(x_g, x_u)
                    if const_expr(rec.glu_alpha is not None):
                        dd = dd * Float32(rec.glu_alpha)
                    scale = dd * prob
                    vals = [scale * d_gate, scale * d_up]
                else:
                    x = beta * rC[0][i].to(Float32)
                    value, dvalue = rec.dsrelu(x)
                    vals = [dd * prob * dvalue]
                for j in cutlass.range_constexpr(self.d_per_step):
                    if const_expr(self.quant_d):
                        rVal[j][i] = vals[j]
                    else:
                        rD[j][i] = vals[j].to(self.d_dtype)
                        self._amax_dbias(vals[j], i, amax_bits, col_sum[j], j)
                row_sum[q8.row_of(i)] = row_sum[q8.row_of(i)] + dd * value
            codes = [None] * self.d_per_step
            for j in cutlass.range_constexpr(self.d_per_step):
                if const_expr(self.quant_d):
                    # amax and the dbias partials from the held fp32 values (the same sums in the same order as
                    # above), after the visit: no column sums live next to the fragments while they are filled
                    for i in cutlass.range_constexpr(frag_size):
                        self._amax_dbias(rVal[j][i], i, amax_bits, col_sum[j], j)
                    # D_row per row of the subtile (= one 32-column block), column maxima
                    codes[j] = self._quantize_d_rows(rVal[j], rD[j], sColMax[(None, None, j)], warp_e, lane,
                                                     norm_const)
                if not is_compute:  # rows past valid_m: zeros (amax and dprob are not stored for them)
                    rD[j].fill(0.0)
                if const_expr(rec.has_dbias):
                    self._column_partials(col_sum[j], is_compute, sColSum, lb, j, warp_e, lane)
            # ---- registers -> smem once the TMA store `epi_stages` steps back has read the buffer
            buf = step % self.epi_stages
            if is_store_warp:
                store_pipeline.producer_acquire()
            epi_barrier.arrive_and_wait()
            if const_expr(step + C_LOAD_BUFFERS < self.epi_steps):
                if is_store_warp:  # every thread has read load buffer lb: refill it
                    self._load_c_step(tma_atom_cin, bSG_sCin, bSG_gCin, cin_bars, m_tile, n_tile,
                                      step + C_LOAD_BUFFERS)
            for j in cutlass.range_constexpr(self.d_per_step):
                if const_expr(self.quant_d):  # D_col per 32-row block (this warp and its partner), SF bytes
                    self._quantize_d_cols(rVal[j], rDcol[j], sColMax[(None, None, j)], codes[j][0], codes[j][1],
                                          is_compute, fp8, m_tile, n_tile, step, g, warp_e, lane, j)
                    cute.copy(r2s_d, rDcol[j], tRS_sD[(None, None, None, self._dcol_buffer(buf, j))])
                cute.copy(r2s_d, rD[j], tRS_sD[(None, None, None, buf * self.d_per_step + j)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if is_store_warp:
                for j in cutlass.range_constexpr(self.d_per_step):
                    col = (n_tile * self.epi_steps + step) * self.d_per_step + j
                    cute.copy(tma_atom_d, bSG_sD[(None, buf * self.d_per_step + j)], bSG_gD[(None, (m_tile, col))])
                    if const_expr(self.quant_d):
                        cute.copy(tma_atom_dcol, bSG_sD[(None, self._dcol_buffer(buf, j))],
                                  bSG_gDcol[(None, (m_tile, col))])
                store_pipeline.producer_commit()
            if const_expr(rec.has_dbias):
                self._store_column_partials(sColSum, lb, mDbiasParts, m_tile, n_tile, step, ctid)

        # ---- end: dprob partials of the thread's rows (quad sum, fixed order), amax
        for h in cutlass.range_constexpr(2):
            s = row_sum[h]
            if not is_compute:
                s = Float32(0.0)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
            if lane % 4 == 0:
                mDprobParts[n_tile, m_tile * self.tile_m + r0 + 8 * h] = s
        if const_expr(rec.compute_amax):
            for j in cutlass.range_constexpr(self.d_per_step):
                bits = warp_max_i32(amax_bits[j])
                if is_compute:
                    if lane == 0:
                        ptr = cute.recast_ptr(mAmax.iterator + g * self.d_per_step + j, dtype=Int32)
                        cute.arch.atomic_max(ptr, bits)

    @cute.jit
    def _amax_dbias(self, v, i: cutlass.Constexpr, amax_bits, col_sum, j: cutlass.Constexpr):
        """Fold output value v (flat fragment index i, subtile j) into amax (its |v| bits) and the column sums."""
        if const_expr(self.recipe.compute_amax):
            amax_bits[j] = cutlass.max(amax_bits[j], abs_bits(v))
        if const_expr(self.recipe.has_dbias):
            col_sum[q8.col_slot(i)] = col_sum[q8.col_slot(i)] + v

    def _dcol_buffer(self, buf: int, j: int) -> int:
        """smem buffer of D_col subtile j of store buffer buf: after the epi_stages * d_per_step D_row buffers."""
        return (self.epi_stages + buf) * self.d_per_step + j

    @cute.jit
    def _column_partials(self, col_sum, is_compute, sColSum, lb, j: cutlass.Constexpr, warp_e, lane):
        """The thread's 8 column sums (its two rows) of one 128 x 32 output subtile -> the warp's 16 rows by
        shuffles (lanes of equal lane % 4 hold the same columns) -> sColSum[col, warp, j, lb]; zero tiles store 0
        (their C rows may hold anything)."""
        for slot in cutlass.range_constexpr(8):
            v = col_sum[slot]
            for d in cutlass.range_constexpr(3):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=4 << d)
            if not is_compute:
                v = Float32(0.0)
            if lane < 4:
                sColSum[(2 * lane + q8.slot_col(slot), warp_e, j, lb)] = v

    @cute.jit
    def _store_column_partials(self, sColSum, lb, mDbiasParts, m_tile, n_tile, step: cutlass.Constexpr, ctid):
        """After the step's second barrier: thread c < 32 * d_per_step sums column c over the 8 warps (fixed
        order) and stores the tile's partial; the buffer lb is rewritten two steps later, after two more
        barriers."""
        if ctid < EPI_N * self.d_per_step:
            j = ctid // EPI_N
            c = ctid % EPI_N
            v = Float32(0.0)
            for w in cutlass.range_constexpr(EPI_WARPS):
                v = v + sColSum[(c, w, j, lb)]
            col = ((n_tile * self.epi_steps + step) * self.d_per_step + j) * EPI_N + c
            if col < self.problem.n_out:
                mDbiasParts[m_tile, col] = v
