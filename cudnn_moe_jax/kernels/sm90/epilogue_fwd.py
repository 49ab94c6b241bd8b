"""Forward epilogue of the sm90 grouped GEMM (quant / srelu / glu): per 32-column step, fused math on the
accumulator -> C / D subtiles (FP8 D: row/column quantization, SFD bytes) -> swizzled smem -> TMA store.

The epilogue is a set of hooks (`forward_hooks`) run by the per-tile driver `run_epilogue` (epilogue.py), which owns
the step loop, the barriers and the store sequence: `_fwd_begin` stages prob / alpha / bias, `_fwd_visit` computes
a step's C / D fragments, `_fwd_finish` the FP8 column quantization between the barriers, `_fwd_writes` /
`_fwd_stores` list the subtiles' smem buffers and global tiles, `_fwd_end` merges amax.

A mixin of `GroupedGemmSm90` (kernels/sm90/gemm.py): it reads the kernel's static attributes (tile shape, recipe,
output dtypes) and is traced inside the consumer warpgroups' tile loop. The K-grouped wgrad stores W through it
(D = alpha * acc), with accumulate_on_output adding the old W first (`_load_old_w`).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm

from .. import quantize as q8
from .epilogue import EpilogueHooks, fold_amax, merge_amax
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
    """The forward epilogue as hooks of `run_epilogue` (epilogue.py): per step, one D subtile (and its one or two
    C subtiles). FP8 D (`quant_d`): D row-quantized per 32 columns (the subtile), D_col per 32 rows (two warps'
    halves combined through smem), SFD_row / SFD_col e8m0 bytes stored from registers (epilogue_fp8d)."""

    def forward_hooks(self) -> EpilogueHooks:
        return EpilogueHooks(begin=self._fwd_begin, visit=self._fwd_visit, finish=self._fwd_finish,
                             writes=self._fwd_writes, stores=self._fwd_stores, end=self._fwd_end)

    @cute.jit
    def _fwd_begin(
        self, acc, tRS_rAcc, tRS_cD, frag_size: cutlass.Constexpr, alpha, prob_v, bias_v, sProb, sBias, sScalars,
        is_compute, ctid,
        r2s_d, tRS_rD, tRS_sD, bSG_sD, bSG_gD, tma_atom_d,
        r2s_c, tRS_rC0, tRS_rC1, tRS_sC, bSG_sC, bSG_gC, tma_atom_c,
        epi_barrier, m_tile, n_tile, g, mAmax, fp8, tma_atom_dcol, sD, sC, old_w=None,
    ):
        """The tile's set-up: prob / alpha / bias staged in smem, per-tile thread coordinates, the old W's first
        step (accumulate_on_output), the amax accumulator."""
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
        return SimpleNamespace(
            tRS_rAcc=tRS_rAcc, tRS_cD=tRS_cD, frag_size=frag_size, alpha=alpha, sProb=sProb, sBias=sBias,
            sScalars=sScalars, is_compute=is_compute, r2s_d=r2s_d, tRS_rD=tRS_rD, tRS_sD=tRS_sD, bSG_sD=bSG_sD,
            bSG_gD=bSG_gD, tma_atom_d=tma_atom_d, r2s_c=r2s_c, tRS_rC0=tRS_rC0, tRS_rC1=tRS_rC1, tRS_sC=tRS_sC,
            bSG_sC=bSG_sC, bSG_gC=bSG_gC, tma_atom_c=tma_atom_c, m_tile=m_tile, n_tile=n_tile, g=g, mAmax=mAmax,
            fp8=fp8, bSG_gDcol=bSG_gDcol, tRS_rDcol=tRS_rDcol, sColMax=sColMax, norm_const=norm_const,
            tma_atom_dcol=tma_atom_dcol, warp_e=warp_e, lane=lane, old_w=old_w, thr_w=thr_w, tWcW=tWcW, rOld=rOld,
            amax_bits=amax_bits, rVal=rVal,
        )

    @cute.jit
    def _fwd_visit(self, step: cutlass.Constexpr, st):
        """The step's math (fp32, one element at a time) -> rVal, C fragments, D (FP8: row-quantized, the warp's
        column maxima to smem); zero tiles: zeros. Returns the row codes (FP8 D) for `_fwd_finish`."""
        recipe = self.recipe
        frag_size = st.frag_size
        tRS_cD, tRS_rAcc, rVal = st.tRS_cD, st.tRS_rAcc, st.rVal
        s0 = step * self.c_per_step
        if const_expr(self.accumulate and step + 1 < self.epi_steps):
            self._load_old_w(st.old_w[0], st.thr_w, st.tWcW, st.rOld[(step + 1) % 2], st.m_tile, st.n_tile, step + 1)
        alpha_s = st.alpha
        if const_expr(self.config.epi_pin):
            # re-read from smem: the step's math then depends on a load issued after the last barrier, so
            # ptxas cannot hoist every step's math above the barriers (less register pressure, less overlap)
            alpha_s = st.sScalars[0]
        for i in cutlass.range_constexpr(frag_size):
            col = tRS_cD[i][1]
            prob = Float32(1.0)
            if const_expr(recipe.has_prob):
                prob = st.sProb[tRS_cD[i][0]]
            if const_expr(self.is_glu):
                bias_g = Float32(0.0)
                bias_u = Float32(0.0)
                if const_expr(recipe.has_bias):
                    bias_g = st.sBias[s0 * EPI_N + col]
                    bias_u = st.sBias[(s0 + 1) * EPI_N + col]
                cg = recipe.c_value(tRS_rAcc[s0 * frag_size + i], alpha_s, bias_g)
                cu = recipe.c_value(tRS_rAcc[(s0 + 1) * frag_size + i], alpha_s, bias_u)
                if const_expr(recipe.has_c):
                    st.tRS_rC0[i] = cg.to(self.c_dtype)
                    st.tRS_rC1[i] = cu.to(self.c_dtype)
                rVal[i] = recipe.d_glu(cg, cu, prob)
            else:
                bias = Float32(0.0)
                if const_expr(recipe.has_bias):
                    bias = st.sBias[s0 * EPI_N + col]
                acc_i = tRS_rAcc[s0 * frag_size + i]
                c = recipe.c_value(acc_i, alpha_s, bias)
                if const_expr(recipe.has_c):
                    st.tRS_rC0[i] = c.to(self.c_dtype)
                rVal[i] = recipe.d_value(acc_i, c, alpha_s, prob, bias)
                if const_expr(self.accumulate):
                    # flat index i is the same (row, col) in both fragments (same thread-value layout)
                    rVal[i] = add_rn(st.rOld[step % 2][i].to(Float32), rVal[i])
            if const_expr(recipe.compute_amax):
                st.amax_bits = fold_amax(st.amax_bits, rVal[i])
        # plain names inside the dynamic `if`: a method called on `st` there would carry all of st through it
        tRS_rD, tRS_rC0, tRS_rC1 = st.tRS_rD, st.tRS_rC0, st.tRS_rC1
        codes = None
        if const_expr(self.quant_d):
            codes = self._quantize_d_rows(rVal, tRS_rD, st.sColMax, st.warp_e, st.lane, st.norm_const)
        else:
            tRS_rD.store(rVal.load().to(self.d_dtype))
        if not st.is_compute:  # rows past valid_m: zeros
            tRS_rD.fill(0.0)
            if const_expr(recipe.has_c):
                tRS_rC0.fill(0.0)
                tRS_rC1.fill(0.0)
        return codes

    @cute.jit
    def _fwd_finish(self, step: cutlass.Constexpr, j: cutlass.Constexpr, st, codes):
        """FP8 D, after the step's first barrier: D_col and the SF bytes (the partner warp's maxima are in smem)."""
        if const_expr(self.quant_d):
            self._quantize_d_cols(st.rVal, st.tRS_rDcol, st.sColMax, codes[0], codes[1], st.is_compute, st.fp8,
                                  st.m_tile, st.n_tile, step, st.g, st.warp_e, st.lane)

    def _fwd_writes(self, step: int, buf: int, j: int, st, codes):
        """(copy, fragment, smem buffer) of the step's subtiles: [D_col,] D, [C (GLU: gate, up)]."""
        if self.quant_d:
            yield st.r2s_d, st.tRS_rDcol, st.tRS_sD[(None, None, None, self.epi_stages + buf)]
        yield st.r2s_d, st.tRS_rD, st.tRS_sD[(None, None, None, buf)]
        if self.recipe.has_c:
            yield st.r2s_c, st.tRS_rC0, st.tRS_sC[(None, None, None, buf * self.c_per_step)]
            if self.is_glu:
                yield st.r2s_c, st.tRS_rC1, st.tRS_sC[(None, None, None, buf * self.c_per_step + 1)]

    def _fwd_stores(self, step: int, buf: int, st):
        """(TMA atom, smem buffer, global tile) of the step's subtiles: D, [D_col], [C]."""
        subtiles_per_tile = self.tile_n // EPI_N
        s0 = step * self.c_per_step
        m_tile, n_tile = st.m_tile, st.n_tile
        yield (st.tma_atom_d, st.bSG_sD[(None, buf)],
               st.bSG_gD[(None, (m_tile, n_tile * (subtiles_per_tile // self.c_per_step) + step))])
        if self.quant_d:
            yield (st.tma_atom_dcol, st.bSG_sD[(None, self.epi_stages + buf)],
                   st.bSG_gDcol[(None, (m_tile, n_tile * (subtiles_per_tile // self.c_per_step) + step))])
        if self.recipe.has_c:
            for j in range(self.c_per_step):
                yield (st.tma_atom_c, st.bSG_sC[(None, buf * self.c_per_step + j)],
                       st.bSG_gC[(None, (m_tile, n_tile * subtiles_per_tile + s0 + j))])

    @cute.jit
    def _fwd_end(self, st):
        if const_expr(self.recipe.compute_amax):
            merge_amax(st.amax_bits, st.mAmax, st.g, st.is_compute)

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
