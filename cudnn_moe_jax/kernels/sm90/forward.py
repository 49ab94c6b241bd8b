"""The forward kernel class of the sm90 grouped GEMM (quant / srelu / glu): the shared body (gemm.py) with the
M-grouped schedule, the bf16 / fp16 or MXFP8 mainloop and the forward epilogue.

Per 32-column step the epilogue does the fused math on the accumulator -> C / D subtiles (FP8 D: row/column
quantization, SFD bytes) -> swizzled smem -> TMA store. It is a set of hooks (`epilogue_hooks`) run by the per-tile
driver `run_epilogue` (epilogue.py), which owns the step loop, the barriers and the store sequence: `_fwd_begin`
stages prob / alpha / bias, `_fwd_visit` computes a step's C / D fragments, `_fwd_finish` the FP8 column
quantization between the barriers, `_fwd_writes` / `_fwd_stores` list the subtiles' smem buffers and global tiles,
`_fwd_end` merges amax. What this class sets up besides the shared body's: C's TMA store and staging buffers.

The K-grouped wgrad (wgrad.py) stores W through this epilogue (D = alpha * acc), with accumulate_on_output adding
the old W first (`_load_old_w`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from .. import quantize as q8
from ..dequant import ld_global_words
from ..epilogue import EpilogueRecipe
from .epilogue import EpilogueHooks, adjacent_pairs, fold_amax, merge_amax, row_kept
from .epilogue_fp8d import EPI_N  # epilogue subtile width = one GLU block
from .gemm import GroupedGemmSm90Base, Store, TileContext


class CStores(NamedTuple):
    """The forward's own epilogue state (`EpilogueSetup.op`): C's register->smem copy, fragments (GLU: gate and
    up), staging buffers and TMA store partition; `old_w`: (the old D, its thread-value copy) when accumulating;
    `extra`: a subclass's own (the Hadamard op's outputs)."""

    r2s_c: Any
    tRS_rC0: Any
    tRS_rC1: Any
    tRS_sC: Any
    bSG_sC: Any
    bSG_gC: Any
    tma_atom_c: Any
    mC: Any
    mCout: Any
    sC: Any
    old_w: Any
    extra: Any = None


class GroupedGemmSm90Forward(GroupedGemmSm90Base):
    """`D[r, :] = epilogue(A[r, :] @ B[g(r)]^T)` for the rows of every group. Per step one D subtile (and its one
    or two C subtiles). FP8 D (`quant_d`): D row-quantized per 32 columns (the subtile), D_col per 32 rows (two
    warps' halves combined through smem), SFD_row / SFD_col e8m0 bytes stored from registers (epilogue_fp8d)."""

    accumulate = False  # D = old D + the epilogue's value (wgrad's accumulate_on_output)

    def init_epilogue(self, problem):
        self.recipe = EpilogueRecipe(problem)
        self.is_glu = self.recipe.is_glu
        self.c_per_step = 2 if self.is_glu else 1  # GLU: a step reads a gate/up pair of accumulator subtiles
        return problem.epilogue

    def epilogue_smem_bytes(self, epi_stages: int) -> int:
        """D (FP8: and D_col) and C store buffers, FP8 D's per-warp column maxima (+ alignment)."""
        epi = self.tile_m * EPI_N * epi_stages * (
            self._d_bytes() + (self.c_per_step * self.c_dtype.width // 8 if self.c_dtype else 0))
        if self.quant_d:
            epi += 4 * EPI_N * 8 + 1024
        return epi

    def epilogue_operands(self, t):
        """C's TMA store and its staging layout (epi_stages buffers of c_per_step subtiles)."""
        if not self.recipe.has_c:
            return {}
        c_layout = sm90_utils.make_smem_layout_epi(self.c_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile,
                                                   self.epi_stages * self.c_per_step)
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), t["c"], cute.slice_(c_layout, (None, None, 0)), self.epi_tile
        )
        return {"tma_atom_c": tma_atom_c, "mC": tma_c, "c_layout": c_layout}

    def epilogue_smem_fields(self, args):
        """After sD: C's staging buffers, the mainloop's own shared memory, FP8 D's column maxima."""
        fields = []
        if self.recipe.has_c:
            fields.append(("sC", cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(args.c_layout)],
                                                   1024]))
        return fields + self.mainloop.smem_fields() + self.col_max_field()

    @cute.jit
    def op_epilogue_setup(self, args, cta, tiled_copy_acc, ctid) -> CStores:
        r2s_c = tRS_sC = tRS_rC0 = tRS_rC1 = bSG_sC = bSG_gC = sC = None
        if const_expr(self.recipe.has_c):
            c_layout = args.c_layout
            sC = cta.storage.sC.get_tensor(c_layout.outer, swizzle=c_layout.inner)
            r2s_c = cute.make_tiled_copy_S(
                sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.c_dtype, Float32), tiled_copy_acc
            )
            thr_r2s_c = r2s_c.get_slice(ctid)
            tRS_sC = thr_r2s_c.partition_D(sC)
            # same TV layout as D's copy, so flat index i is the same (row, col) in both fragments; only the
            # split into atom/rest modes differs between stmatrix (16-bit) and plain stores (32-bit)
            c_frag_shape = thr_r2s_c.partition_S(cute.make_identity_tensor(self.epi_tile)).shape
            tRS_rC0 = cute.make_rmem_tensor(c_frag_shape, self.c_dtype)
            tRS_rC1 = cute.make_rmem_tensor(c_frag_shape, self.c_dtype)
            bSG_sC, bSG_gC = cpasync.tma_partition(
                args.tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                cute.zipped_divide(args.mC, self.epi_tile)
            )
        old_w = None
        if const_expr(self.accumulate):
            # the old W, read with the accumulator's thread-value layout (plain loads, as the dgrad's C)
            old_w = (args.mWold, cute.make_tiled_copy_S(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.d_dtype), tiled_copy_acc))
        return CStores(r2s_c, tRS_rC0, tRS_rC1, tRS_sC, bSG_sC, bSG_gC, args.tma_atom_c, args.mC, args.mCout, sC,
                       old_w)

    @cute.jit
    def tile_alpha(self, g, args):
        return args.mAlpha[g]

    @cute.jit
    def tile_context(self, tile, args, setup) -> TileContext:
        """alpha of the tile's group, prob of this thread's row, bias of its column."""
        ctid = setup.ctid
        g = tile.group
        alpha = self.tile_alpha(g, args)
        prob_v = self.tile_prob(tile, args, ctid)
        bias_v = Float32(0.0)
        if const_expr(self.recipe.has_bias):
            col = tile.n_tile * self.tile_n + ctid
            if ctid < self.tile_n and col < self.n:
                bias_v = args.mBias[g, col].to(Float32)
        return TileContext(tile.out_m_tile, tile.n_tile, g, tile.is_compute, alpha, prob_v, bias_v, None, tile.row0,
                           tile.rows)

    def epilogue_hooks(self) -> EpilogueHooks:
        return EpilogueHooks(begin=self._fwd_begin, visit=self._fwd_visit, finish=self._fwd_finish,
                             writes=self._fwd_writes, stores=self._fwd_stores, end=self._fwd_end)

    @cute.jit
    def _fwd_begin(self, setup, ctx):
        """The tile's set-up: prob / alpha / bias staged in smem, per-tile thread coordinates, the old W's first
        step (accumulate_on_output), the amax accumulator."""
        recipe = self.recipe
        op = setup.op
        ctid = setup.ctid
        sProb, sBias, sScalars = setup.sProb, setup.sBias, setup.sScalars
        prob_v, bias_v = ctx.prob, ctx.bias
        tRS_sD, tRS_sC = setup.tRS_sD, op.tRS_sC
        # thread coordinates re-derived per tile from an opaque copy: otherwise every address computed from them is
        # hoisted above the tile loop and held across the MXFP8 mainloop (192 accumulator registers) -> spills
        warp_e = lane = None
        fp4_views = (None, None)
        if const_expr(self.quant_d or self.fp4_d or self.mainloop_class.REGISTER_TIGHT):
            ctid_o = q8.opaque(ctid)
            warp_e = ctid_o // 32
            lane = ctid_o % 32
            # non-stmatrix smem stores (8-bit / 32-bit outputs) need 8 swizzled addresses per buffer: recomputed
            # per tile instead of held across the MXFP8 mainloop
            if const_expr(self.fp4_d):
                fp4_views = self.fp4_thread_views(setup.sD, warp_e, lane)
            else:
                tRS_sD = setup.r2s_d.get_slice(ctid_o).partition_D(setup.sD)
            if const_expr(recipe.has_c):
                tRS_sC = op.r2s_c.get_slice(ctid_o).partition_D(op.sC)
        # stage per-row prob and per-column bias in smem (previous tile's readers passed its last barrier)
        if const_expr(recipe.has_prob):
            if ctid < self.tile_m:
                sProb[ctid] = prob_v
        if ctid == 0:
            sScalars[0] = ctx.alpha
        if const_expr(recipe.has_bias):
            if ctid < self.tile_n:
                sBias[ctid] = bias_v
        setup.epi_barrier.arrive_and_wait()

        # wgrad accumulate_on_output: W = old W + alpha * acc, added in fp32 and rounded once to W's dtype, as the
        # reference. The old values come by plain global loads in the accumulator's thread-value layout, one step
        # ahead of the math that adds them, so their latency hides under a step's math and stores. Chosen over a
        # TMA load ring in shared memory (the dgrad's C): no smem (a 128 x 32 fp32 buffer pair is 32 KB, an A/B
        # stage), no mbarriers, no store-warp protocol; W is read once, 1/K of the tile's A/B traffic.
        thr_w = tWcW = None
        rOld = [None, None]
        if const_expr(self.accumulate):
            thr_w = op.old_w[1].get_slice(q8.opaque(ctid))  # per tile, like the FP8-D addresses: not hoisted
            tWcW = thr_w.partition_D(cute.make_identity_tensor(self.epi_tile))
            if const_expr(cute.size(tWcW) != setup.frag_size):
                raise NotImplementedError("old-W fragment does not match the accumulator fragment")
            if const_expr(self.d_dtype.width == 32):
                self._check_old_w_pairs(op.old_w[1])
            rOld = [cute.make_rmem_tensor(tWcW.shape, self.d_dtype) for _ in range(2)]
            self._load_old_w(op.old_w[0], thr_w, tWcW, rOld[0], ctx.m_tile, ctx.n_tile, 0)

        amax_bits = Int32(0)
        rVal = cute.make_rmem_tensor(setup.tRS_cD.shape, Float32)
        return SimpleNamespace(setup=setup, ctx=ctx, op=op, fp8=setup.fp8, tRS_sD=tRS_sD, tRS_sC=tRS_sC,
                               warp_e=warp_e, lane=lane, thr_w=thr_w, tWcW=tWcW, rOld=rOld, amax_bits=amax_bits,
                               rVal=rVal, fp4_views=fp4_views)

    @cute.jit
    def _fwd_visit(self, step: cutlass.Constexpr, st):
        """The step's math (fp32, one element at a time) -> rVal, C fragments, D (FP8: row-quantized, the warp's
        column maxima to smem); zero tiles: zeros. Returns the row codes (FP8 D) for `_fwd_finish`."""
        recipe = self.recipe
        setup, op = st.setup, st.op
        frag_size = setup.frag_size
        tRS_cD, tRS_rAcc, rVal = setup.tRS_cD, setup.tRS_rAcc, st.rVal
        s0 = step * self.c_per_step
        if const_expr(self.accumulate and step + 1 < self.epi_steps):
            self._load_old_w(op.old_w[0], st.thr_w, st.tWcW, st.rOld[(step + 1) % 2], st.ctx.m_tile, st.ctx.n_tile,
                             step + 1)
        alpha = st.ctx.alpha
        for i in cutlass.range_constexpr(frag_size):
            col = tRS_cD[i][1]
            prob = Float32(1.0)
            if const_expr(recipe.has_prob):
                prob = setup.sProb[tRS_cD[i][0]]
            if const_expr(self.is_glu):
                bias_g = Float32(0.0)
                bias_u = Float32(0.0)
                if const_expr(recipe.has_bias):
                    bias_g = setup.sBias[s0 * EPI_N + col]
                    bias_u = setup.sBias[(s0 + 1) * EPI_N + col]
                cg = recipe.c_value(tRS_rAcc[s0 * frag_size + i], alpha, bias_g)
                cu = recipe.c_value(tRS_rAcc[(s0 + 1) * frag_size + i], alpha, bias_u)
                if const_expr(recipe.has_c):
                    op.tRS_rC0[i] = cg.to(self.c_dtype)
                    op.tRS_rC1[i] = cu.to(self.c_dtype)
                rVal[i] = recipe.d_glu(cg, cu, prob)
            else:
                bias = Float32(0.0)
                if const_expr(recipe.has_bias):
                    bias = setup.sBias[s0 * EPI_N + col]
                acc_i = tRS_rAcc[s0 * frag_size + i]
                c = recipe.c_value(acc_i, alpha, bias)
                if const_expr(recipe.has_c):
                    op.tRS_rC0[i] = c.to(self.c_dtype)
                rVal[i] = recipe.d_value(acc_i, c, alpha, prob, bias)
                if const_expr(self.accumulate):
                    # flat index i is the same (row, col) in both fragments (same thread-value layout)
                    rVal[i] = q8.add_rn(st.rOld[step % 2][i].to(Float32), rVal[i])
            if const_expr(recipe.compute_amax):
                if const_expr(self.sched.clipped):
                    st.amax_bits = fold_amax(st.amax_bits, row_kept(rVal[i], tRS_cD[i][0], st.ctx.rows))
                else:
                    st.amax_bits = fold_amax(st.amax_bits, rVal[i])
        # plain names inside the dynamic `if`: a method called on `st` there would carry all of st through it
        tRS_rD, tRS_rC0, tRS_rC1 = setup.tRS_rD, op.tRS_rC0, op.tRS_rC1
        codes = None
        if const_expr(self.fp4_d):
            codes = self._fp4_visit(st)
        elif const_expr(self.quant_d):
            codes = self._quantize_d_rows(rVal, tRS_rD, st.fp8.sColMax, st.warp_e, st.lane, st.fp8.norm_const)
        else:
            tRS_rD.store(rVal.load().to(self.d_dtype))
        if not st.ctx.is_compute:  # rows past valid_m: zeros
            tRS_rD.fill(0.0)
            if const_expr(recipe.has_c):
                tRS_rC0.fill(0.0)
                tRS_rC1.fill(0.0)
        return codes

    @cute.jit
    def _fp4_visit(self, st):
        """FP4 D before the step's first barrier: zero tiles quantize zeros; the row codes packed into the thread's
        two D words, its rows' scale codes; MXFP4: the warp's column maxima -> smem."""
        rVal = st.rVal
        if not st.ctx.is_compute:  # rows past valid_m (the accumulator holds another tile's values)
            rVal.fill(0.0)
        rAbs = [q8.abs_raw(rVal[i]) for i in range(q8.FRAG)]
        words, codes = self.fp4_rows(rVal, rAbs, st.fp8.norm_const, st.lane)
        if const_expr(self.quant_d):
            q8.column_partial_max(rAbs, st.fp8.sColMax, st.warp_e, st.lane)
        return words, codes

    @cute.jit
    def _fp4_finish(self, step: cutlass.Constexpr, st, frags):
        """FP4 D after the step's first barrier: MXFP4 D_col (transposed) and the SFD_row / SFD_col bytes of
        compute tiles (the zeroing kernel wrote 0x00), or NVFP4's sfd bytes (every tile: a zero tile's are 0x00);
        then the packed D (D_col) into the step's smem buffer."""
        fp8, ctx = st.fp8, st.ctx
        words, codes = frags
        col_bytes = None
        if const_expr(self.quant_d):
            col_bytes, code_c = self.fp4_cols(st.rVal, fp8.sColMax, st.warp_e, st.lane, fp8.norm_const)
            # plain names inside the dynamic `if` (the module's rule)
            code_r0, code_r1, mSfdRow, mSfdCol, sEnds, m_rows = codes[0][0], codes[1][0], fp8.mSfdRow, \
                fp8.mSfdCol, fp8.sEnds, fp8.m_rows
            m_tile, n_tile, g, warp_e, lane = ctx.m_tile, ctx.n_tile, ctx.group, st.warp_e, st.lane
            if ctx.is_compute:
                self._store_sf_bytes(code_r0, code_r1, code_c, mSfdRow, mSfdCol, sEnds, m_rows, m_tile, n_tile,
                                     step, g, warp_e, lane)
        else:
            self.store_nvfp4_sf(codes, fp8.mSfdRow, ctx.m_tile, ctx.n_tile, step, st.warp_e, st.lane)
        self.fp4_store_smem(words, col_bytes, st.fp4_views[0], st.fp4_views[1], step % self.epi_stages)

    @cute.jit
    def _fwd_finish(self, step: cutlass.Constexpr, j: cutlass.Constexpr, st, codes):
        """FP8 D, after the step's first barrier: D_col and the SF bytes (the partner warp's maxima are in smem);
        FP4 D: `_fp4_finish`."""
        if const_expr(self.fp4_d):
            self._fp4_finish(step, st, codes)
        elif const_expr(self.quant_d):
            fp8, ctx = st.fp8, st.ctx
            self._quantize_d_cols(st.rVal, fp8.tRS_rDcol, fp8.sColMax, codes[0], codes[1], self.owns_rows(ctx),
                                  fp8, ctx.m_tile, ctx.n_tile, step, ctx.group, st.warp_e, st.lane)

    def _fwd_writes(self, step: int, buf: int, j: int, st, codes):
        """(copy, fragment, smem buffer) of the step's subtiles: [D_col,] D, [C (GLU: gate, up)]."""
        setup, op = st.setup, st.op
        if not self.fp4_d:  # FP4 D is written by `_fp4_finish`
            if self.quant_d:
                yield setup.r2s_d, st.fp8.tRS_rDcol, st.tRS_sD[(None, None, None, self.epi_stages + buf)]
            yield setup.r2s_d, setup.tRS_rD, st.tRS_sD[(None, None, None, buf)]
        if self.recipe.has_c:
            yield op.r2s_c, op.tRS_rC0, st.tRS_sC[(None, None, None, buf * self.c_per_step)]
            if self.is_glu:
                yield op.r2s_c, op.tRS_rC1, st.tRS_sC[(None, None, None, buf * self.c_per_step + 1)]

    def _fwd_stores(self, step: int, buf: int, st):
        """The step's subtiles (`gemm.Store`): D, [D_col], [C]."""
        setup, op = st.setup, st.op
        subtiles_per_tile = self.tile_n // EPI_N
        s0 = step * self.c_per_step
        n_tile = st.ctx.n_tile
        yield Store(setup.tma_atom_d, setup.bSG_sD, setup.sD, buf, setup.bSG_gD, setup.mD, setup.mDout,
                    self.d_block(n_tile, step))
        if self.quant_d and self.fp4_d:  # transposed (N_out, m / 2): coordinates (column block, row tile)
            yield Store(st.fp8.tma_atom_dcol, st.fp8.bSG_sDcol, None, buf, st.fp8.bSG_gDcol, st.fp8.mDcol, None,
                        self.d_block(n_tile, step), transposed=True)
        elif self.quant_d:
            yield Store(st.fp8.tma_atom_dcol, setup.bSG_sD, setup.sD, self.epi_stages + buf, st.fp8.bSG_gDcol,
                        st.fp8.mDcol, None, self.d_block(n_tile, step))
        if self.recipe.has_c:
            for j in range(self.c_per_step):
                yield Store(op.tma_atom_c, op.bSG_sC, op.sC, buf * self.c_per_step + j, op.bSG_gC, op.mC,
                            op.mCout, n_tile * subtiles_per_tile + s0 + j)

    @cute.jit
    def _fwd_end(self, st):
        if const_expr(self.recipe.compute_amax):
            merge_amax(st.amax_bits, st.setup.mAmax, st.ctx.group, self.owns_rows(st.ctx))

    @cute.jit
    def _load_old_w(self, mW, thr_w, tWcW, rOld, m_tile, n_tile, step: cutlass.Constexpr):
        """rOld = this thread's old W values of 32-column subtile `step` of W tile (m_tile, n_tile) (W seen as
        (L * m_w, n_w): rows always inside, m_w % 128 == 0); columns past N read nothing. An fp32 W: a pair of
        adjacent columns (values 2j, 2j + 1: `_check_old_w_pairs`) one 8-byte load (one load a value was 6-10%
        slower, H100, RESULTS run 182); a 16-bit W: one load a value (pairs in 4-byte loads were 8-10% slower)."""
        col0 = self.d_block(n_tile, step) * EPI_N
        if const_expr(self.d_dtype.width == 32):
            # 64-bit offsets: L * m_w * n_w may pass 2^31
            base = mW.iterator.toint() + (Int64(m_tile * self.tile_m) * self.n + col0) * 4
            for i in cutlass.range_constexpr(0, cute.size(rOld), 2):
                row, col = tWcW[i]
                rOld[i] = Float32(0.0)
                rOld[i + 1] = Float32(0.0)
                if col0 + col < self.n:   # (n_w is even: a pair is all in or all out)
                    words = ld_global_words(base + (Int64(row) * self.n + col) * 4, 2, coherent=True)
                    rOld[i] = words[0].bitcast(Float32)
                    rOld[i + 1] = words[1].bitcast(Float32)
        else:
            base = mW.iterator + (Int64(m_tile * self.tile_m) * self.n + col0)
            tWgW = thr_w.partition_D(cute.make_tensor(base, cute.make_layout(self.epi_tile, stride=(self.n, 1))))
            for i in cutlass.range_constexpr(cute.size(rOld)):
                rOld[i] = self.d_dtype(0.0)
                if col0 + tWcW[i][1] < self.n:
                    rOld[i] = tWgW[i]

    def _check_old_w_pairs(self, thr_copy):
        """Trace time: the old W's thread-value layout (the accumulator's) holds pairs of adjacent columns in every
        lane (`_load_old_w` loads an fp32 W's as one)."""
        for lane in range(32):
            adjacent_pairs(thr_copy.get_slice(lane).partition_D(cute.make_identity_tensor(self.epi_tile)), "old W")

