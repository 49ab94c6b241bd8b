"""Forward epilogue of the sm90 grouped GEMM (quant / srelu / glu): per 32-column step, fused math on the
accumulator -> C / D subtiles (FP8 D: row/column quantization, SFD bytes) -> swizzled smem -> TMA store.

A mixin of `GroupedGemmSm90` (kernels/sm90/gemm.py): it reads the kernel's static attributes (tile shape, recipe,
output dtypes) and is traced inside the consumer warpgroups' tile loop. The K-grouped wgrad stores W through it
(D = alpha * acc), with accumulate_on_output adding the old W first (`_load_old_w`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm

from .. import quantize as q8
from ..epilogue import abs_bits, warp_max_i32
from .epilogue_fp8d import EPI_N  # epilogue subtile width = one GLU block


@cute.jit
def add_rn(a: Float32, b: Float32) -> Float32:
    """a + b rounded on its own: an explicit `.rn` keeps ptxas from contracting it with the product feeding it into
    one FFMA (measured: alpha * acc + old W became FFMA), so the result is the reference's fl(fl(alpha*acc) + W)."""
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Float32(a).ir_value(), Float32(b).ir_value()],
        "add.rn.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


class ForwardEpilogue:
    @cute.jit
    def epilogue(
        self, acc, tRS_rAcc, tRS_cD, frag_size: cutlass.Constexpr, alpha, prob_v, bias_v, sProb, sBias, sScalars,
        is_compute, ctid,
        r2s_d, tRS_rD, tRS_sD, bSG_sD, bSG_gD, tma_atom_d,
        r2s_c, tRS_rC0, tRS_rC1, tRS_sC, bSG_sC, bSG_gC, tma_atom_c,
        store_pipeline, epi_barrier, is_store_warp, m_tile, n_tile, g, mAmax, fp8, tma_atom_dcol, sD, sC,
        old_w=None,
    ):
        """Fused epilogue of one tile: per step, one D subtile (and its one or two C subtiles).

        FP8 D (`quant_d`): D row-quantized per 32 columns (the subtile), D_col per 32 rows (two warps' halves
        combined through smem), SFD_row / SFD_col e8m0 bytes stored from registers (epilogue_fp8d)."""
        recipe = self.recipe
        bSG_gDcol, tRS_rDcol, sColMax, _, _, norm_const, _, _ = fp8
        # thread coordinates re-derived per tile from an opaque copy: otherwise every address computed from them is
        # hoisted above the tile loop and held across the MXFP8 mainloop (192 accumulator registers) -> spills
        warp_e = lane = None
        if const_expr(self.quant_d or self.mainloop_class.REGISTER_TIGHT):
            ctid_o = q8.opaque(ctid)
            warp_e = ctid_o // 32
            lane = ctid_o % 32
            # non-stmatrix smem stores (8-bit / 32-bit outputs) need 8 swizzled addresses per buffer: recomputed
            # per tile instead of held across the MXFP8 mainloop
            tRS_sD = r2s_d.get_slice(ctid_o).partition_D(sD)
            if const_expr(recipe.has_c):
                tRS_sC = r2s_c.get_slice(ctid_o).partition_D(sC)
        # stage per-row prob and per-column bias in smem (previous tile's readers passed its last barrier)
        if const_expr(recipe.has_prob):
            if ctid < self.tile_m:
                sProb[ctid] = prob_v
        if ctid == 0:
            sScalars[0] = alpha
        if const_expr(recipe.has_bias):
            if ctid < self.tile_n:
                sBias[ctid] = bias_v
        epi_barrier.arrive_and_wait()

        # wgrad accumulate_on_output: W = old W + alpha * acc, added in fp32 and rounded once to W's dtype, as the
        # reference. The old values come by plain global loads in the accumulator's thread-value layout, one step
        # ahead of the math that adds them, so their latency hides under a step's math and stores. Chosen over a
        # TMA load ring in shared memory (the dgrad's C): no smem (a 128 x 32 fp32 buffer pair is 32 KB, an A/B
        # stage), no mbarriers, no store-warp protocol; W is read once, 1/K of the tile's A/B traffic.
        thr_w = tWcW = None
        rOld = [None, None]
        if const_expr(self.accumulate):
            thr_w = old_w[1].get_slice(q8.opaque(ctid))  # per tile, like the FP8-D addresses: not hoisted
            tWcW = thr_w.partition_D(cute.make_identity_tensor(self.epi_tile))
            if const_expr(cute.size(tWcW) != frag_size):
                raise NotImplementedError("old-W fragment does not match the accumulator fragment")
            rOld = [cute.make_rmem_tensor(tWcW.shape, self.d_dtype) for _ in range(2)]
            self._load_old_w(old_w[0], thr_w, tWcW, rOld[0], m_tile, n_tile, 0)

        amax_bits = Int32(0)
        rVal = cute.make_rmem_tensor(tRS_cD.shape, Float32)
        for step in cutlass.range_constexpr(self.epi_steps):
            s0 = step * self.c_per_step
            if const_expr(self.accumulate and step + 1 < self.epi_steps):
                self._load_old_w(old_w[0], thr_w, tWcW, rOld[(step + 1) % 2], m_tile, n_tile, step + 1)
            alpha_s = alpha
            if const_expr(self.config.epi_pin):
                # re-read from smem: the step's math then depends on a load issued after the last barrier, so
                # ptxas cannot hoist every step's math above the barriers (less register pressure, less overlap)
                alpha_s = sScalars[0]
            # ---- math (fp32), one element at a time
            for i in cutlass.range_constexpr(frag_size):
                col = tRS_cD[i][1]
                prob = Float32(1.0)
                if const_expr(recipe.has_prob):
                    prob = sProb[tRS_cD[i][0]]
                if const_expr(self.is_glu):
                    bias_g = Float32(0.0)
                    bias_u = Float32(0.0)
                    if const_expr(recipe.has_bias):
                        bias_g = sBias[s0 * EPI_N + col]
                        bias_u = sBias[(s0 + 1) * EPI_N + col]
                    cg = recipe.c_value(tRS_rAcc[s0 * frag_size + i], alpha_s, bias_g)
                    cu = recipe.c_value(tRS_rAcc[(s0 + 1) * frag_size + i], alpha_s, bias_u)
                    if const_expr(recipe.has_c):
                        tRS_rC0[i] = cg.to(self.c_dtype)
                        tRS_rC1[i] = cu.to(self.c_dtype)
                    rVal[i] = recipe.d_glu(cg, cu, prob)
                else:
                    bias = Float32(0.0)
                    if const_expr(recipe.has_bias):
                        bias = sBias[s0 * EPI_N + col]
                    acc_i = tRS_rAcc[s0 * frag_size + i]
                    c = recipe.c_value(acc_i, alpha_s, bias)
                    if const_expr(recipe.has_c):
                        tRS_rC0[i] = c.to(self.c_dtype)
                    rVal[i] = recipe.d_value(acc_i, c, alpha_s, prob, bias)
                    if const_expr(self.accumulate):
                        # flat index i is the same (row, col) in both fragments (same thread-value layout)
                        rVal[i] = add_rn(rOld[step % 2][i].to(Float32), rVal[i])
                if const_expr(recipe.compute_amax):
                    amax_bits = cutlass.max(amax_bits, abs_bits(rVal[i]))
            if const_expr(self.quant_d):
                code_r0, code_r1 = self._quantize_d_rows(rVal, tRS_rD, sColMax, warp_e, lane, norm_const)
            else:
                tRS_rD.store(rVal.load().to(self.d_dtype))
            if not is_compute:  # rows past valid_m: zeros
                tRS_rD.fill(0.0)
                if const_expr(recipe.has_c):
                    tRS_rC0.fill(0.0)
                    tRS_rC1.fill(0.0)
            # ---- registers -> smem, once the TMA store `epi_stages` steps back has read this buffer. (Measured:
            # one barrier per step with the store warp draining the previous store first was 8-13% slower.)
            buf = step % self.epi_stages
            if is_store_warp:
                store_pipeline.producer_acquire()
            epi_barrier.arrive_and_wait()
            if const_expr(self.quant_d):
                self._quantize_d_cols(rVal, tRS_rDcol, sColMax, code_r0, code_r1, is_compute, fp8, m_tile, n_tile,
                                      step, g, warp_e, lane)
                cute.copy(r2s_d, tRS_rDcol, tRS_sD[(None, None, None, self.epi_stages + buf)])
            cute.copy(r2s_d, tRS_rD, tRS_sD[(None, None, None, buf)])
            if const_expr(recipe.has_c):
                cute.copy(r2s_c, tRS_rC0, tRS_sC[(None, None, None, buf * self.c_per_step)])
                if const_expr(self.is_glu):
                    cute.copy(r2s_c, tRS_rC1, tRS_sC[(None, None, None, buf * self.c_per_step + 1)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            # ---- smem -> global (TMA clips columns past N)
            if is_store_warp:
                subtiles_per_tile = self.tile_n // EPI_N
                cute.copy(
                    tma_atom_d,
                    bSG_sD[(None, buf)],
                    bSG_gD[(None, (m_tile, n_tile * (subtiles_per_tile // self.c_per_step) + step))],
                )
                if const_expr(self.quant_d):
                    cute.copy(
                        tma_atom_dcol,
                        bSG_sD[(None, self.epi_stages + buf)],
                        bSG_gDcol[(None, (m_tile, n_tile * (subtiles_per_tile // self.c_per_step) + step))],
                    )
                if const_expr(recipe.has_c):
                    for j in cutlass.range_constexpr(self.c_per_step):
                        cute.copy(
                            tma_atom_c,
                            bSG_sC[(None, buf * self.c_per_step + j)],
                            bSG_gC[(None, (m_tile, n_tile * subtiles_per_tile + s0 + j))],
                        )
                store_pipeline.producer_commit()

        if const_expr(recipe.compute_amax):
            amax_bits = warp_max_i32(amax_bits)
            if is_compute:
                if cute.arch.lane_idx() == 0:
                    ptr = cute.recast_ptr(mAmax.iterator + g, dtype=Int32)
                    cute.arch.atomic_max(ptr, amax_bits)

    @cute.jit
    def _load_old_w(self, mW, thr_w, tWcW, rOld, m_tile, n_tile, step: cutlass.Constexpr):
        """rOld = this thread's old W values of 32-column subtile `step` of W tile (m_tile, n_tile) (W seen as
        (L * m_w, n_w): rows always inside, m_w % 128 == 0); columns past N read nothing (their stores are clipped
        by the TMA)."""
        col0 = (n_tile * self.epi_steps + step) * EPI_N
        # 64-bit element offset: L * m_w * n_w may pass 2^31
        base = mW.iterator + (cutlass.Int64(m_tile * self.tile_m) * self.n + col0)
        tWgW = thr_w.partition_D(cute.make_tensor(base, cute.make_layout(self.epi_tile, stride=(self.n, 1))))
        for i in cutlass.range_constexpr(cute.size(rOld)):
            rOld[i] = self.d_dtype(0.0)
            if col0 + tWcW[i][1] < self.n:
                rOld[i] = tWgW[i]
