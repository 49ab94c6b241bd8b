"""The sm90 kernel class of `grouped_gemm_glu_hadamard_quant`: the forward kernel (forward.py) with its activation
epilogue (a GLU of the table or sReLU, bias, glu options; C; amax of the fp32 activation output D), D as bf16 or
NVFP4 (epilogue_fp4d: e4m3 scales per 16 columns, `sfd`), and the optional 16-wide Hadamard output (the "RHT",
docs/ops.md#grouped_gemm_glu_hadamard_quant): rowwise (per 16 columns of a row of bf16(D); bf16, or NVFP4 + `sfrht`)
or colwise (per 16 tokens of a column; NVFP4 in per-expert transposed segments + segmented `sfrht`).

Where the 16-vectors live. In the accumulator fragment a thread holds, per 32-column step, 2 rows x 8 columns
(columns 2q + {0, 1, 8, 9, 16, 17, 24, 25} of rows r, r + 8, q = lane % 4): a row's 16-column block is spread over
the 4 lanes of a quad (4 values each), a column's 16-token block over 8 lanes of a warp (2 values each). A
transform in the fragment would take 2 shuffle stages per value for a row block (bits 1-2 of the column index are
lane bits) and 3 for a column block, and the NVFP4 quantization after it another quad or 8-lane max and scattered
nibbles. Instead each step stages bf16(D) (the transform's input, exactly) in shared memory -- one stmatrix per 8
columns into a 128 x 32 tile with an 80-byte row pitch (conflict-free for the stmatrix rows and for 16-byte row
reads) -- between the step's two barriers, and after the second barrier (`after_store`) each of the 256 threads
takes exactly one 16-vector: rowwise thread t holds row t % 128, columns 16 (t // 128) .. + 15 (two 16-byte loads);
colwise thread t holds column t % 32, tokens 16 (t // 32) .. + 15 (16 two-byte loads, a warp reads whole rows).
Then everything is in-thread: the transform (the default H16 / 4 as a 4-stage butterfly: 64 adds, then x 1/4,
exact; a user matrix as 256 FMAs in a loop over the inputs, P^T's columns broadcast from shared memory), the NVFP4
block (max, e4m3 scale,
e2m1 codes, 8 packed bytes) and the stores: 8 bytes (NVFP4) or 32 bytes (bf16) of a row, or 8 consecutive bytes of
the column's token run in its expert's transposed segment, straight to global memory, plus one scale byte. Cost per
step and thread: 8 stmatrix words written, 2 (rowwise) or 16 (colwise) shared loads, 80 FP ops (default H), ~16 x 15
for the codes; no shuffles. The stage needs no double buffer: it is written after a step's first barrier, which
every thread reaches only after reading the previous step's stage.

Every byte of the NVFP4 outputs is written by the kernel (zero tiles write the zeros of rows past valid_m: the
colwise output's and its scales' bytes past the last expert as one more segment [valid_m, m)), so no zeroing
kernel runs before it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.tensor_utils import LayoutEnum

from cudnn_moe_jax.formats import sf_atom_start, sf_row_byte
from cudnn_moe_jax.limits import FP4

from .. import quantize as q8
from ..dequant import st_global_v2, st_global_v4
from .epilogue import EpilogueHooks
from .epilogue_fp8d import EPI_N
from .forward import GroupedGemmSm90Forward

RHT = 16            # the transform's block (and NVFP4's scale block)
STAGE_PITCH = 40    # bf16 per staged row: 80 bytes
H_SCALE = 0.25      # the default matrix H16 / 4: a butterfly of +-1 entries, then this exact factor


class HadamardOutputs(NamedTuple):
    """The Hadamard op's epilogue state (forward.CStores.extra): the stage, its register->smem copy and bf16
    fragment, the user matrix (transposed) in smem, the outputs and their encode scale, the group ends."""

    r2s_h: Any
    rH: Any
    sH: Any
    sP: Any
    mRht: Any
    mSfrht: Any
    rht_norm_const: Any
    sEnds: Any
    m_rows: Any


# ------------------------------------------------------------------------------------------------ PTX helpers


@cute.jit
def ld_shared_v4(addr: Int32):
    """Four 32-bit words at a 16-byte aligned shared address."""
    i32 = Int32.mlir_type
    res = llvm.inline_asm(
        llvm.StructType.get_literal([i32, i32, i32, i32]), [Int32(addr).ir_value()],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(i32, res, [k])) for k in range(4)]


@cute.jit
def bf16x2(lo: Float32, hi: Float32) -> Int32:
    """RNE bf16 of (lo, hi) packed: lo in the low half."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Float32(hi).ir_value(), Float32(lo).ir_value()], "cvt.rn.bf16x2.f32 $0, $1, $2;",
        "=r,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


# ------------------------------------------------------------------------------------------------ the kernel class


class GroupedGemmSm90Hadamard(GroupedGemmSm90Forward):
    """The forward kernel with the Hadamard op's outputs: C, D (bf16 or NVFP4 + sfd), amax, and the RHT output."""

    # the RHT stage (10 KiB) beside two store buffers leaves 3 A/B stages (FP4 inputs: 4 without the RHT output);
    # one buffer keeps the 4th, which the dequantizing mainloop needs (benchmarks/RESULTS.md, run 76)
    EPI_STAGE_CANDIDATES = (2, 1)

    def init_epilogue(self, problem):
        epi = super().init_epilogue(problem)
        self.rht = epi.rht                         # None | "rowwise" | "colwise"
        self.rht_fp4 = epi.rht_dtype == FP4
        self.user_matrix = epi.has_hadamard
        return epi

    def epilogue_smem_bytes(self, epi_stages: int) -> int:
        """The forward's, the bf16 stage (+ alignment) and the user matrix."""
        extra = 0
        if self.rht is not None:
            extra = self.tile_m * STAGE_PITCH * 2 + 16 + (RHT * RHT * 4 + 16 if self.user_matrix else 0)
        return super().epilogue_smem_bytes(epi_stages) + extra

    def epilogue_operands(self, t):
        """C's TMA store (the forward's); NVFP4 D's scales as mSfdRow (flat), the RHT output, its scales, their
        encode scale and the user matrix."""
        ops = super().epilogue_operands(t)

        def flat(x):
            return None if x is None else cute.make_tensor(x.iterator, cute.make_layout(cute.size(x)))

        ops.update(mSfdRow=flat(t["sfd"]), mRht=t["rht"], mSfrht=flat(t["sfrht"]),
                   mRhtNormConst=t["rht_norm_const"], mHadamard=t["hadamard"])
        return ops

    def epilogue_smem_fields(self, args):
        fields = super().epilogue_smem_fields(args)
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        if self.rht is not None:
            fields.append(("h_stage", Align[MemRange[cutlass.BFloat16, self.tile_m * STAGE_PITCH], 16]))
            if self.user_matrix:
                fields.append(("h_matrix", Align[MemRange[Float32, RHT * RHT], 16]))
        return fields

    @cute.jit
    def op_epilogue_setup(self, args, cta, tiled_copy_acc, ctid):
        """The forward's state with the Hadamard op's (`HadamardOutputs`): the stage and its copy, the user matrix
        (read into smem here; first read after the first tile's epilogue barriers)."""
        c = super().op_epilogue_setup(args, cta, tiled_copy_acc, ctid)
        r2s_h = rH = sH = sP = rht_nc = None
        if const_expr(self.rht is not None):
            sH = cta.storage.h_stage.get_tensor(cute.make_layout((self.tile_m, EPI_N), stride=(STAGE_PITCH, 1)))
            r2s_h = cute.make_tiled_copy_S(
                sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, cutlass.BFloat16, Float32), tiled_copy_acc)
            rH = cute.make_rmem_tensor(
                r2s_h.get_slice(ctid).partition_S(cute.make_identity_tensor(self.epi_tile)).shape, cutlass.BFloat16)
            if const_expr(self.user_matrix):     # P^T: column o of P is a contiguous 64-byte row
                sP = cta.storage.h_matrix.get_tensor(cute.make_layout((RHT, RHT), stride=(RHT, 1)))
                sP[(ctid % RHT, ctid // RHT)] = args.mHadamard[(ctid // RHT, ctid % RHT)]
            if const_expr(self.rht_fp4):
                rht_nc = args.mRhtNormConst[0]
        return c._replace(extra=HadamardOutputs(r2s_h, rH, sH, sP, args.mRht, args.mSfrht, rht_nc, cta.sEnds,
                                                cta.m_rows))

    def epilogue_hooks(self) -> EpilogueHooks:
        hooks = super().epilogue_hooks()
        if self.rht is None:
            return hooks
        return hooks._replace(begin=self._h_begin, writes=self._h_writes, after_store=self._rht)

    @cute.jit
    def _h_begin(self, setup, ctx):
        """The forward's tile set-up; the stage's per-thread stmatrix addresses from a per-tile opaque thread index
        (as D's, forward._fwd_begin)."""
        st = self._fwd_begin(setup, ctx)
        h = setup.op.extra
        st.tRS_sH = h.r2s_h.get_slice(q8.opaque(setup.ctid)).partition_D(h.sH)
        return st

    def _h_writes(self, step: int, buf: int, j: int, st, codes):
        """The forward's subtiles, then bf16(D) into the stage (D's own bf16 fragment when D is bf16)."""
        yield from self._fwd_writes(step, buf, j, st, codes)
        h = st.op.extra
        frag = st.setup.tRS_rD
        if self.fp4_d:
            h.rH.store(st.rVal.load().to(cutlass.BFloat16))
            frag = h.rH
        yield h.r2s_h, frag, st.tRS_sH

    # ------------------------------------------------------------------------------------------ the RHT
    @cute.jit
    def _rht(self, step: cutlass.Constexpr, st):
        """After the step's second barrier: this thread's 16-vector of the staged bf16(D) -> transform -> output
        (module docstring)."""
        h, ctx = st.op.extra, st.ctx
        t = q8.opaque(st.setup.ctid)
        col_block = self.d_block(ctx.n_tile, step)
        n_out = self.problem.n_out
        # plain names: inside the dynamic `if`s below no state object may appear (epilogue.py)
        mRht, mSfrht, nc, sEnds, m_rows = h.mRht, h.mSfrht, h.rht_norm_const, h.sEnds, h.m_rows
        if const_expr(self.rht == "rowwise"):
            row = t % self.tile_m
            half = t // self.tile_m
            if const_expr(self.user_matrix):
                y = self._user_transform(h.sH, h.sP, row, half * RHT, 0, 1)
            else:
                base = h.sH.iterator.toint() + (row * STAGE_PITCH + half * RHT) * 2
                x = []
                for chunk in cutlass.range_constexpr(2):
                    for w in ld_shared_v4(base + 16 * chunk):
                        x += [(w << 16).bitcast(Float32), (w & Int32(-65536)).bitcast(Float32)]
                y = self._hadamard16(x)
            col0 = col_block * EPI_N + half * RHT
            grow = ctx.m_tile * self.tile_m + row
            if col0 < n_out:
                self._store_row_vector(y, mRht, mSfrht, nc, grow, col0)
        else:
            col = t % EPI_N
            tb = t // EPI_N
            if const_expr(self.user_matrix):
                y = self._user_transform(h.sH, h.sP, tb * RHT, col, 1, 0)
            else:
                y = self._hadamard16([h.sH[(tb * RHT + i, col)].to(Float32) for i in range(RHT)])
            n = col_block * EPI_N + col
            g, is_compute, t0 = ctx.group, ctx.is_compute, ctx.m_tile * self.tile_m + tb * RHT
            if n < n_out:
                self._store_col_vector(y, mRht, mSfrht, nc, sEnds, m_rows, g, is_compute, n, t0)

    @cute.jit
    def _hadamard16(self, x: list):
        """out_o = sum_i x_i H16[o, i] / 4, H16[i][o] = (-1)^popcount(i & o): the Walsh-Hadamard transform by
        butterflies (4 stages of 16 adds), then the exact factor 1/4."""
        x = list(x)
        for bit in (1, 2, 4, 8):
            for i in cutlass.range_constexpr(RHT):
                if const_expr(i & bit == 0):
                    a, b = x[i], x[i | bit]
                    x[i], x[i | bit] = a + b, a - b
        return [v * Float32(H_SCALE) for v in x]

    @cute.jit
    def _user_transform(self, sH, sPt, r0, c0, dr: cutlass.Constexpr, dc: cutlass.Constexpr):
        """out_o = sum_i x_i P[o, i] for a user matrix P (P^T in smem, `op_epilogue_setup`), x_i = the staged
        sH[r0 + i dr, c0 + i dc], by a loop over i that is not unrolled: x_i and column i of P (four 16-byte
        broadcast loads) come from shared memory per iteration, only the 16 sums stay in registers (unrolled,
        the 256 matrix words were loaded ahead and spilled)."""
        acc = cute.make_rmem_tensor(RHT, Float32)
        acc.fill(0.0)
        base = sPt.iterator.toint()
        for i in cutlass.range(RHT, unroll=1):
            xi = sH[(r0 + i * dr, c0 + i * dc)].to(Float32)
            for chunk in cutlass.range_constexpr(4):
                p = ld_shared_v4(base + (i * RHT + 4 * chunk) * 4)
                for o in cutlass.range_constexpr(4):
                    acc[4 * chunk + o] = acc[4 * chunk + o] + xi * p[o].bitcast(Float32)
        return [acc[o] for o in range(RHT)]

    @cute.jit
    def _nvfp4_vector(self, y: list, norm_const):
        """NVFP4 of one 16-vector (one scale block): (two words of 8 packed e2m1 codes, element 2j in the low
        nibble of byte j; the e4m3 scale code)."""
        amax = Int32(0)
        for v in y:
            amax = cutlass.max(amax, q8.abs_raw(v))
        code, scale = q8.nvfp4_code_scale(q8.flush_bits(amax), norm_const)
        words = [Int32(0), Int32(0)]
        for i in cutlass.range_constexpr(RHT):
            words[i // 8] = words[i // 8] | (q8.e2m1_code(q8.mul_ftz(y[i], scale)) << (4 * (i % 8)))
        return words, code

    @cute.jit
    def _store_row_vector(self, y: list, mRht, mSfrht, norm_const, grow, col0):
        """Rowwise: columns col0 .. + 15 of row `grow`: bf16 (32 bytes), or NVFP4 (8 bytes) + its scale byte
        (sfrht: the sf_rows layout of (m, N_out), vec 16)."""
        n_out = self.problem.n_out
        if const_expr(self.rht_fp4):
            words, code = self._nvfp4_vector(y, norm_const)
            st_global_v2(mRht.iterator.toint() + Int64(grow) * (n_out // 2) + col0 // 2, words[0], words[1])
            kb = col0 // RHT
            kb_atoms = (n_out // RHT + 3) // 4
            mSfrht[sf_atom_start(grow >> 7, kb >> 2, kb_atoms) + sf_row_byte(grow, kb)] = code.to(cutlass.Uint8)
        else:
            addr = mRht.iterator.toint() + (Int64(grow) * n_out + col0) * 2
            words = [bf16x2(y[2 * k], y[2 * k + 1]) for k in range(RHT // 2)]
            st_global_v4(addr, words[:4])
            st_global_v4(addr + 16, words[4:])

    @cute.jit
    def _store_col_vector(self, y: list, mRht, mSfrht, norm_const, sEnds, m_rows, g, is_compute, n, t0):
        """Colwise: tokens t0 .. + 15 of column n, NVFP4: 8 bytes of row n of its expert's transposed segment
        (N_out, T_g) at byte N_out * start_g / 2, and their scale byte in the segmented sfrht (vec 16). A zero tile
        (rows past valid_m) writes into the segment [valid_m, m): the zeros that follow the last expert."""
        n_out = self.problem.n_out
        start = Int32(0)
        if g > 0:
            start = sEnds[g - 1]
        end = sEnds[g]
        if not is_compute:
            start = sEnds[self.num_groups - 1]
            end = m_rows
        words, code = self._nvfp4_vector(y, norm_const)
        seg_tokens = end - start
        off = Int64(start) * (n_out // 2) + Int64(n) * (seg_tokens // 2) + (t0 - start) // 2
        st_global_v2(mRht.iterator.toint() + off, words[0], words[1])
        j = (t0 - start) // RHT                                   # the segment's k-block (vec 16)
        sf = (sf_atom_start(n >> 7, j >> 2, seg_tokens // (4 * RHT)) + sf_row_byte(n, j)
              + ((n_out + 127) // 128) * 128 * (start // RHT))
        mSfrht[sf] = code.to(cutlass.Uint8)
