"""The dgrad kernel class of the sm90 grouped GEMM (dglu: dswiglu / dgeglu, dsrelu): the FC2 dgrad accumulator fused
with the activation derivative on the saved forward pre-activation C. The shared body (gemm.py) with the M-grouped
schedule, the bf16 / fp16 mainloop and this epilogue; besides the shared body's it sets up C's TMA load ring (two
buffers, one mbarrier each), the dbias column-sum table and the partial-sum outputs.

Per tile (128 rows x tile_n accumulator columns) and 32-column step s (one accumulator subtile = one GLU block), as
hooks (`epilogue_hooks`) of the driver `run_epilogue` (epilogue.py), which owns the step loop and the store sequence:
  begin   prob of the tile's rows -> smem; the C subtiles of steps 0 and 1 are already on their way (TMA, issued by
          `prefetch_c` before the mainloop) into two load buffers, one mbarrier each;
  visit   wait for step s's C subtile(s) (`_wait_c`; dsrelu: 1; dglu: gate block 2b and up block 2b + 1; an FP8 C
          is widened exactly: fp8 -> fp16 per pair, fp16 -> fp32 per value), compute per value dD = alpha * acc,
          x = beta * C, D_row = dC (dglu: the gate and the up subtile), the row partial of dprob (dD * act(x),
          summed per thread over the tile) and the column partials of dbias (a warp's 16 rows by shuffles -> smem);
  refill  after the step's first barrier every thread has read the load buffer: the store warp refills it with
          step s + 2's C (`_refill_c`); finish / writes / stores: FP8 column quantization, the D_row (D_col)
          subtiles -> smem -> TMA store (or, where that buys an A/B stage, from registers: `run_epilogue`);
          after_store: the 8 warps' dbias partials summed in fixed order -> global;
  end     per row: a quad of lanes holds the row's columns: dprob partial of (row, N tile) = fixed-order shuffle
          sum, stored to `dprob_parts (n_parts, m)`; amax per group by `atomicMax` on |x| bits (exact).
The lowering sums the partials in a fixed order (operands.finish_dgrad_outputs): no float atomics, so every output
is bit-identical run to run. Rows past `valid_m` (zero tiles) store zeros everywhere.
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
from ..epilogue import DgradRecipe
from .epilogue import (EpilogueDriver, EpilogueHooks, fold_amax, fold_row_sum, merge_amax, row_kept, row_pairs,
                       store_row_chunk, store_row_partials)
from .epilogue_fp8d import EPI_N
from .gemm import DTYPES, GroupedGemmSm90Base, Store, TileContext

C_LOAD_BUFFERS = 2  # C subtiles in flight: step s + 2 is loaded while steps s and s + 1 compute
EPI_WARPS = 8


class CLoads(NamedTuple):
    """The dgrad's own epilogue state (`EpilogueSetup.op`): C's load ring (smem buffers, thread-value copy, TMA
    partitions, mbarriers), the dbias column-sum table, the partial-sum outputs, the zero word (FP8 D)."""

    sCin: Any
    cin_copy: Any
    cin_bars: Any
    tma_atom_cin: Any
    bSG_sCin: Any
    bSG_gCin: Any
    mCin: Any
    sColSum: Any
    mDprobParts: Any
    mDbiasParts: Any
    sZero: Any


class GroupedGemmSm90Dgrad(GroupedGemmSm90Base):
    """`dC[r, :] = act'(beta * C[r, :]) * alpha * (dD[r, :] @ B[g(r)]^T)` for the rows of every group (dglu: per
    step a gate and an up subtile of D_row), with the dprob / dbias partials and amax."""

    # 32-bit C and D_row: two store buffers would leave < 2 A/B stages, so one may be chosen
    EPI_STAGE_CANDIDATES = (2, 1)

    def init_epilogue(self, problem):
        self.recipe = DgradRecipe(problem)
        epi = problem.epilogue
        self.cin_dtype = DTYPES[epi.c_dtype]
        self.d_per_step = 2 if self.recipe.is_glu else 1  # C is an input; each step stores d_per_step subtiles
        self.cin_step_bytes = self.tile_m * EPI_N * self.cin_dtype.width // 8 * self.d_per_step
        if (self.tile_n // EPI_N) % (2 * C_LOAD_BUFFERS):  # the C-load mbarrier phases repeat per tile
            raise NotImplementedError(f"dgrad epilogue needs tile_n % {2 * C_LOAD_BUFFERS * EPI_N} == 0")
        return epi

    def _choose_stages(self, cfg):
        """The body's choice, unless D stored from registers (no D buffers, `_store_d_rows`) buys an A/B stage:
        the FP4 dglu then gets 4 A/B stages instead of 3 (its C ring and two D buffers leave 3; the fc2 forward
        on 3 stages instead of its 4 runs 12% slower on `small`, RESULTS run 194)."""
        epi_stages, ab = GroupedGemmSm90Base._choose_stages(self, cfg)
        if cfg.epi_stages is None and cfg.ab_stages is None and self._d_storable_from_registers():
            ab_registers = self._smem_fit(0)
            if min(ab_registers, 4) > min(ab, 4):
                self.d_from_registers = True
                return 1, min(ab_registers, 8)
        return epi_stages, ab

    @property
    def d_smem(self) -> bool:
        """D has shared-memory buffers unless stored from registers."""
        return not self.d_from_registers

    def _d_storable_from_registers(self) -> bool:
        """A 16-bit D without FP8 / FP4 quantization whose rows are whole 16-byte chunks (`store_row_chunk`)."""
        return (not self.quant_d and not self.fp4_d and self.d_dtype.width == 16
                and self.problem.n_out % 8 == 0)

    def epilogue_smem_bytes(self, epi_stages: int) -> int:
        """D_row (FP8: + D_col) subtiles per step (none when stored from registers: epi_stages 0), C load buffers,
        the dbias column partials (only with dbias: an MXFP8 dglu then fits 3 A/B stages beside one D buffer, not
        2), alignment, FP8 D's per-warp column maxima of each subtile."""
        epi = self.tile_m * EPI_N * self.d_per_step * (epi_stages * self._d_bytes()
                                                       + C_LOAD_BUFFERS * self.cin_dtype.width // 8) + 2048
        if self.recipe.has_dbias:
            epi += 4 * EPI_N * EPI_WARPS * self.d_per_step * C_LOAD_BUFFERS
        if self.quant_d:
            epi += 4 * EPI_N * 8 * self.d_per_step + 1024
        return epi

    def epilogue_operands(self, t):
        """C's TMA load and its ring's layout (C_LOAD_BUFFERS buffers of d_per_step subtiles)."""
        cin_layout = sm90_utils.make_smem_layout_epi(self.cin_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile,
                                                     C_LOAD_BUFFERS * self.d_per_step)
        tma_atom_cin, tma_cin = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), t["c"], cute.slice_(cin_layout, (None, None, 0)), self.epi_tile
        )
        return {"tma_atom_cin": tma_atom_cin, "mCin": tma_cin, "cin_layout": cin_layout}

    def epilogue_smem_fields(self, args):
        """After sD: the mainloop's own shared memory, FP8 D's column maxima, C's load ring and its mbarriers, the
        dbias column sums (with dbias), FP8 D's zero word."""
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        fields = self.mainloop.smem_fields() + self.col_max_field()
        fields += [("cin_mbar", MemRange[cutlass.Int64, C_LOAD_BUFFERS]),
                   ("sCin", Align[MemRange[self.cin_dtype, cute.cosize(args.cin_layout)], 1024])]
        if self.recipe.has_dbias:
            fields.append(("col_sum", Align[MemRange[Float32, EPI_N * EPI_WARPS * self.d_per_step * C_LOAD_BUFFERS],
                                            16]))
        if self.quant_d:
            fields.append(("zero", MemRange[Int32, 4]))  # 0, read per step by q8.fresh
        return fields

    @cute.jit
    def init_epilogue_barriers(self, storage, warp_idx):
        """One mbarrier per C load buffer: the store warp's lane 0 arrives with the expected bytes."""
        cin_bars = storage.cin_mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(C_LOAD_BUFFERS):
                    cute.arch.mbarrier_init(cin_bars + s, 1)
        cute.arch.mbarrier_init_fence()
        return cin_bars

    @cute.jit
    def init_epilogue_smem(self, storage, tidx):
        """FP8 D: the zero word q8.fresh reads."""
        sZero = None
        if const_expr(self.quant_d):
            sZero = storage.zero.get_tensor(cute.make_layout(4))
            if tidx == 0:
                sZero[0] = Int32(0)
        return sZero

    def col_max_shape(self):
        return (EPI_N, 8, self.d_per_step)

    @cute.jit
    def op_epilogue_setup(self, args, cta, tiled_copy_acc, ctid) -> CLoads:
        storage = cta.storage
        cin_layout = args.cin_layout
        sCin = storage.sCin.get_tensor(cin_layout.outer, swizzle=cin_layout.inner)
        sColSum = None
        if const_expr(self.recipe.has_dbias):
            sColSum = storage.col_sum.get_tensor(cute.make_layout((EPI_N, EPI_WARPS, self.d_per_step,
                                                                   C_LOAD_BUFFERS)))
        cin_copy = cute.make_tiled_copy_S(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.cin_dtype),
                                          tiled_copy_acc)
        bSG_sCin, bSG_gCin = cpasync.tma_partition(
            args.tma_atom_cin, 0, cute.make_layout(1), cute.group_modes(sCin, 0, 2),
            cute.zipped_divide(args.mCin, self.epi_tile)
        )
        return CLoads(sCin, cin_copy, cta.epi_mbar, args.tma_atom_cin, bSG_sCin, bSG_gCin, args.mCin, sColSum,
                      args.mDprobParts, args.mDbiasParts, cta.sZero)

    @cute.jit
    def tile_context(self, tile, args, setup) -> TileContext:
        """alpha and beta of the tile's group, prob of this thread's row; issues the tile's first C loads."""
        ctid = setup.ctid
        g = tile.group
        alpha = args.mAlpha[g]
        prob_v = self.tile_prob(tile, args, ctid)
        beta = args.mBeta[g]
        op = setup.op
        tile_row = tile.m_tile
        if const_expr(self.sched.by_tiles):
            tile_row = tile.row0
        self.prefetch_c(op.tma_atom_cin, op.bSG_sCin, op.bSG_gCin, op.sCin, op.mCin, op.cin_bars,
                        setup.is_store_warp, tile_row, tile.n_tile)
        return TileContext(tile.out_m_tile, tile.n_tile, g, tile.is_compute, alpha, prob_v, Float32(0.0), beta,
                           tile.row0, tile.rows)

    @cute.jit
    def prefetch_c(self, tma_atom_cin, bSG_sCin, bSG_gCin, sCin, mCin, cin_bars, is_store_warp, tile_row, n_tile):
        """Store warp, before the tile's mainloop: issue the C loads of steps 0 and 1 (the previous tile's reads of
        both buffers finished before its last step barrier)."""
        if is_store_warp:
            for step in cutlass.range_constexpr(min(C_LOAD_BUFFERS, self.epi_steps)):
                self._load_c_step(tma_atom_cin, bSG_sCin, bSG_gCin, sCin, mCin, cin_bars, tile_row, n_tile, step)

    @cute.jit
    def _load_c_step(self, tma_atom_cin, bSG_sCin, bSG_gCin, sCin, mCin, cin_bars, tile_row, n_tile,
                     step: cutlass.Constexpr):
        """Whole store warp: the TMA copy is warp-collective (it elects its issuing lane and ends in a WARPSYNC.ALL,
        so a copy under a one-lane branch never returns); only the expect-tx arrival is one lane's. `tile_row`:
        the M tile (tile lists: the tile's first row; its rows past the group end or past m load but are never
        stored)."""
        buf = step % C_LOAD_BUFFERS
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(cin_bars + buf, self.cin_step_bytes)
        for j in cutlass.range_constexpr(self.d_per_step):
            col = self.d_block(n_tile, step, j)   # 32-column block of C / D_row
            if const_expr(self.sched.by_tiles):
                gC = self.tile_at_row(tma_atom_cin, sCin, mCin, tile_row, col)
            else:
                gC = bSG_gCin[(None, (tile_row, col))]
            cute.copy(tma_atom_cin, gC, bSG_sCin[(None, buf * self.d_per_step + j)], tma_bar_ptr=cin_bars + buf)

    @cute.jit
    def _wait_c(self, step: cutlass.Constexpr, cin_bars):
        """Visit of step s: wait for its C subtile(s) in load buffer s % 2 (each buffer's phase flips per use;
        the phases repeat per tile because epi_steps % 4 == 0)."""
        cute.arch.mbarrier_wait(cin_bars + step % C_LOAD_BUFFERS, (step // C_LOAD_BUFFERS) % 2)

    @cute.jit
    def _refill_c(self, step: cutlass.Constexpr, st):
        """After step s's first barrier every thread has read load buffer s % 2: the store warp refills it with
        step s + 2's C."""
        if const_expr(step + C_LOAD_BUFFERS < self.epi_steps):
            op, ctx = st.op, st.ctx
            tile_row = ctx.m_tile
            if const_expr(self.sched.by_tiles):
                tile_row = ctx.row0
            if st.setup.is_store_warp:
                self._load_c_step(op.tma_atom_cin, op.bSG_sCin, op.bSG_gCin, op.sCin, op.mCin, op.cin_bars, tile_row,
                                  ctx.n_tile, step + C_LOAD_BUFFERS)

    @cute.jit
    def run_epilogue(self, hooks, setup, ctx, store_pipeline):
        """The driver's TMA stores, or with D from registers (`d_from_registers`): the step's D_row subtiles leave
        from registers (`_store_d_rows`, before the barrier: their fragments die before the dbias sums, which
        otherwise spilled a word), then one barrier per step, after which every thread has read the step's C buffer
        (the store warp refills it) and the warps' dbias partials are in smem (`after_store` sums them)."""
        if const_expr(not self.d_from_registers):
            EpilogueDriver.run_epilogue(self, hooks, setup, ctx, store_pipeline)
        else:
            state = hooks.begin(setup, ctx)
            rows = row_pairs(setup.r2s_d, self.epi_tile, "dgrad D from registers")
            for step in cutlass.range_constexpr(self.epi_steps):
                hooks.visit(step, state)
                self._store_d_rows(step, state, rows)
                setup.epi_barrier.arrive_and_wait()
                hooks.refill(step, state)
                hooks.after_store(step, state)
            hooks.end(state)

    @cute.jit
    def _store_d_rows(self, step: cutlass.Constexpr, st, rows):
        """The step's D_row subtiles (`st.rD`, 16-bit; zero tiles: zeros) to D[tile rows, their 32-column blocks]:
        each row's four value pairs of a lane, transposed in its quad, one 16-byte store (`store_row_chunk`).
        Columns past n_out are not stored (n_out % 8 == 0: a chunk is all in or all out), nor rows past a clipped
        tile's `rows`."""
        ctx = st.ctx
        n_out = self.problem.n_out
        row0 = ctx.m_tile * self.tile_m
        if const_expr(self.sched.by_tiles):
            row0 = ctx.row0
        base = st.setup.mDout.iterator.toint() + Int64(row0) * n_out * 2
        q = st.lane % 4
        for j in cutlass.range_constexpr(self.d_per_step):
            col0 = self.d_block(ctx.n_tile, step, j) * EPI_N
            words = cute.recast_tensor(st.rD[j], Int32)
            for h in cutlass.range_constexpr(len(rows)):
                pairs = rows[h]
                row = st.tRS_cD[pairs[0]][0]
                ok = col0 + 8 * q < n_out
                if const_expr(self.sched.clipped):
                    ok = ok & (row < ctx.rows)
                addr = base + (Int64(row) * n_out + col0 + 8 * q) * 2
                store_row_chunk(addr, [words[i // 2] for i in pairs], q, ok)

    def epilogue_hooks(self) -> EpilogueHooks:
        return EpilogueHooks(begin=self._dgrad_begin, visit=self._dgrad_visit, writes=self._dgrad_writes,
                             stores=self._dgrad_stores, end=self._dgrad_end, blocks=self.d_per_step,
                             refill=self._refill_c, finish=self._dgrad_finish, after_store=self._dgrad_after_store)

    @cute.jit
    def _dgrad_begin(self, setup, ctx):
        """The tile's set-up: per-tile thread coordinates, prob staged in smem, the reductions' zeros and the
        step fragments (the C loads of steps 0 and 1 were issued before the mainloop by `prefetch_c`)."""
        rec = self.recipe
        op = setup.op
        ctid = setup.ctid
        sProb, prob_v = setup.sProb, ctx.prob
        zero_addr = None
        if const_expr(self.quant_d):
            zero_addr = op.sZero.iterator.toint()
        q8.check_fragment_layout(setup.tRS_cD)
        # thread coordinates re-derived per tile from an opaque copy of ctid: otherwise ptxas hoists every address
        # computed from them above the tile loop and holds them across the mainloop (spills next to 128
        # accumulators; the forward epilogue does the same for FP8 D)
        ctid_o = q8.opaque(ctid)
        tRS_cD = setup.r2s_d.get_slice(ctid_o).partition_S(cute.make_identity_tensor(self.epi_tile))
        # C subtiles read with the accumulator's thread-value layout (plain loads: flat index i is the same (row,
        # col) as in the accumulator and D fragments)
        tRS_sCin = op.cin_copy.get_slice(ctid_o).partition_D(op.sCin)
        rC = [cute.make_rmem_tensor(tRS_sCin[(None, None, None, 0)].shape, self.cin_dtype)
              for _ in range(self.d_per_step)]
        # FP8 C: widened to fp16 per fragment (one unpack per pair of columns; exact for e4m3 and e5m2), each
        # value to fp32 as it is used (exact)
        rCh = rC
        if const_expr(self.cin_dtype.width == 8):
            rCh = [cute.make_rmem_tensor(tRS_sCin[(None, None, None, 0)].shape, cutlass.Float16)
                   for _ in range(self.d_per_step)]
        warp_e = ctid_o // 32
        lane = ctid_o % 32
        r0 = q8.first_row(warp_e, lane)   # the thread's two rows: r0, r0 + 8
        if const_expr(rec.has_prob):
            if ctid < self.tile_m:
                sProb[ctid] = prob_v
        setup.epi_barrier.arrive_and_wait()

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
        return SimpleNamespace(
            setup=setup, ctx=ctx, op=op, fp8=setup.fp8, tRS_cD=tRS_cD, tRS_sD=setup.tRS_sD, zero_addr=zero_addr,
            tRS_sCin=tRS_sCin, rC=rC, rCh=rCh, warp_e=warp_e, lane=lane, r0=r0, row_sum=row_sum,
            amax_bits=amax_bits, rD=rD, rVal=rVal, rDcol=rDcol,
        )

    @cute.jit
    def _dgrad_visit(self, step: cutlass.Constexpr, st):
        """Wait for the step's C, the derivative per value -> D_row fragments (FP8: fp32 values, then
        row-quantized), folding amax, the dprob row sums and the dbias column sums; the dbias column partials of
        the warp -> smem. Returns the row codes (FP8 D) for `_dgrad_finish`."""
        rec = self.recipe
        setup, ctx, op = st.setup, st.ctx, st.op
        frag_size = setup.frag_size
        tRS_cD, rC, rD, rVal = st.tRS_cD, st.rC, st.rD, st.rVal
        lb = step % C_LOAD_BUFFERS
        self._wait_c(step, op.cin_bars)
        col_sum = [[Float32(0.0)] * 8 for _ in range(self.d_per_step)]
        if const_expr(self.quant_d):
            # FP8 D: every per-thread address of the step (C loads, D / D_col smem stores, SF bytes, column
            # maxima and sums) derived from a fresh thread index. ptxas otherwise computes them once (it sees
            # through `opaque`) and holds them from one use to the next -- the 8-bit stores alone need 8
            # swizzled addresses per buffer, 4 * d_per_step buffers -- and spills next to the accumulators.
            # The end of the tile uses the last step's lane.
            ctid_s = q8.fresh(setup.ctid, st.zero_addr)
            st.warp_e = ctid_s // 32
            st.lane = ctid_s % 32
            st.tRS_sCin = op.cin_copy.get_slice(ctid_s).partition_D(op.sCin)
            st.tRS_sD = setup.r2s_d.get_slice(ctid_s).partition_D(setup.sD)
        for j in cutlass.range_constexpr(self.d_per_step):
            cute.autovec_copy(st.tRS_sCin[(None, None, None, lb * self.d_per_step + j)], rC[j])
            if const_expr(self.cin_dtype.width == 8):
                st.rCh[j].store(rC[j].load().to(cutlass.Float16))
        rC = st.rCh   # the values below read the widened copy (a 16 / 32-bit C: the loaded fragments themselves)
        # ---- derivative per value
        for i in cutlass.range_constexpr(frag_size):
            row = tRS_cD[i][0]
            prob = Float32(1.0)
            if const_expr(rec.has_prob):
                prob = setup.sProb[row]
            dd = ctx.alpha * setup.tRS_rAcc[step * frag_size + i]
            value = Float32(0.0)
            vals = []
            if const_expr(rec.is_glu):
                x_g = ctx.beta * rC[0][i].to(Float32)
                x_u = ctx.beta * rC[1][i].to(Float32)
                value, d_gate, d_up = rec.dglu(x_g, x_u)
                if const_expr(rec.output_scale is not None):
                    dd = dd * Float32(rec.output_scale)
                scale = dd * prob
                vals = [scale * d_gate, scale * d_up]
            else:
                x = ctx.beta * rC[0][i].to(Float32)
                value, dvalue = rec.dact(x)
                vals = [dd * prob * dvalue]
            for j in cutlass.range_constexpr(self.d_per_step):
                if const_expr(self.quant_d):
                    rVal[j][i] = vals[j]
                else:
                    rD[j][i] = vals[j].to(self.d_dtype)
                    v = vals[j]
                    if const_expr(self.sched.clipped):   # rows past the group end: kept out of amax and dbias
                        v = row_kept(v, st.r0 + 8 * q8.row_of(i), ctx.rows)
                    self._amax_dbias(v, i, st.amax_bits, col_sum[j], j)
            fold_row_sum(st.row_sum, i, dd * value)
        codes = [None] * self.d_per_step
        for j in cutlass.range_constexpr(self.d_per_step):
            if const_expr(self.quant_d):
                # amax and the dbias partials from the held fp32 values (the same sums in the same order as
                # above), after the visit: no column sums live next to the fragments while they are filled
                for i in cutlass.range_constexpr(frag_size):
                    self._amax_dbias(rVal[j][i], i, st.amax_bits, col_sum[j], j)
                # D_row per row of the subtile (= one 32-column block), column maxima
                codes[j] = self._quantize_d_rows(rVal[j], rD[j], st.fp8.sColMax[(None, None, j)], st.warp_e, st.lane,
                                                 st.fp8.norm_const)
            if not ctx.is_compute:  # rows past valid_m: zeros (amax and dprob are not stored for them)
                rD[j].fill(0.0)
            if const_expr(rec.has_dbias):
                self._column_partials(col_sum[j], ctx.is_compute, op.sColSum, lb, j, st.warp_e, st.lane)
        return codes

    @cute.jit
    def _dgrad_finish(self, step: cutlass.Constexpr, j: cutlass.Constexpr, st, codes):
        """FP8 D, after the first barrier: D_col of subtile j per 32-row block (this warp and its partner), SF
        bytes."""
        if const_expr(self.quant_d):
            fp8, ctx = st.fp8, st.ctx
            self._quantize_d_cols(st.rVal[j], st.rDcol[j], fp8.sColMax[(None, None, j)], codes[j][0], codes[j][1],
                                  self.owns_rows(ctx), fp8, ctx.m_tile, ctx.n_tile, step, ctx.group, st.warp_e,
                                  st.lane, j)

    def _dgrad_writes(self, step: int, buf: int, j: int, st, codes):
        """(copy, fragment, smem buffer) of subtile j: [D_col,] D_row."""
        if self.quant_d:
            yield st.setup.r2s_d, st.rDcol[j], st.tRS_sD[(None, None, None, self._dcol_buffer(buf, j))]
        yield st.setup.r2s_d, st.rD[j], st.tRS_sD[(None, None, None, buf * self.d_per_step + j)]

    def _dgrad_stores(self, step: int, buf: int, st):
        """The step's subtiles (`gemm.Store`): per subtile D_row[, D_col]."""
        setup = st.setup
        for j in range(self.d_per_step):
            col = self.d_block(st.ctx.n_tile, step, j)
            yield Store(setup.tma_atom_d, setup.bSG_sD, setup.sD, buf * self.d_per_step + j, setup.bSG_gD, setup.mD,
                        setup.mDout, col)
            if self.quant_d:
                yield Store(st.fp8.tma_atom_dcol, setup.bSG_sD, setup.sD, self._dcol_buffer(buf, j),
                            st.fp8.bSG_gDcol, st.fp8.mDcol, None, col)

    @cute.jit
    def _dgrad_after_store(self, step: cutlass.Constexpr, st):
        if const_expr(self.recipe.has_dbias):
            if const_expr(not self.sched.by_tiles):
                self._store_column_partials(st.op.sColSum, step % C_LOAD_BUFFERS, st.op.mDbiasParts, st.ctx.m_tile,
                                            st.ctx.n_tile, step, st.setup.ctid)
            else:   # one partial per list tile (row = its list index); zero and masked tiles store none
                sColSum, parts, m_tile, n_tile, ctid = (st.op.sColSum, st.op.mDbiasParts, st.ctx.m_tile,
                                                        st.ctx.n_tile, st.setup.ctid)
                if st.ctx.is_compute & (st.ctx.rows > 0):
                    self._store_column_partials(sColSum, step % C_LOAD_BUFFERS, parts, m_tile, n_tile, step, ctid)

    @cute.jit
    def _dgrad_end(self, st):
        """dprob partials of the thread's rows (quad sum, fixed order), amax per subtile kind (dglu: gate, up)."""
        ctx = st.ctx
        store_row_partials(st.row_sum, ctx.is_compute, st.lane, st.r0, st.op.mDprobParts, ctx.m_tile, ctx.n_tile,
                           self.tile_m, ctx.row0, ctx.rows)
        if const_expr(self.recipe.compute_amax):
            for j in cutlass.range_constexpr(self.d_per_step):
                merge_amax(st.amax_bits[j], st.setup.mAmax, ctx.group, self.owns_rows(ctx), st.lane, j,
                           self.d_per_step)

    @cute.jit
    def _amax_dbias(self, v, i: cutlass.Constexpr, amax_bits, col_sum, j: cutlass.Constexpr):
        """Fold output value v (flat fragment index i, subtile j) into amax (its |v| bits) and the column sums."""
        if const_expr(self.recipe.compute_amax):
            amax_bits[j] = fold_amax(amax_bits[j], v)
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
        order) and stores the tile's partial (row m_tile of the partials); the buffer lb is rewritten two steps
        later, after two more barriers."""
        if ctid < EPI_N * self.d_per_step:
            j = ctid // EPI_N
            c = ctid % EPI_N
            v = Float32(0.0)
            for w in cutlass.range_constexpr(EPI_WARPS):
                v = v + sColSum[(c, w, j, lb)]
            col = self.d_block(n_tile, step, j) * EPI_N + c
            if col < self.problem.n_out:
                mDbiasParts[m_tile, col] = v
