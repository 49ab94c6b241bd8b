"""Lab mainloop variants (not product code: a lab bundle build substitutes them, `lab.swapped_weights.patch`).

1. `SwappedWeightsMainloop`: the weight-only forward with the *weights as the register operand*.

Question it answers: on the memory-bound shapes (few rows per expert, e.g. `e128_fc1`: 128 experts x 128 rows), is
the dequantizing mainloop's rate bound by where B's conversion runs? Today the weights (B) are converted by the stage
workers and consumer passes into a bf16 shared-memory stage that an SS wgmma reads; here each consumer thread converts
the weight rows of its own RS wgmma A fragment (D^T = W x^T per tile: the wgmma's M is the tile's 128 weight columns,
its N the tile's 128 tokens, read as the bf16 A stage the TMA wrote), with no stage workers, no bf16 B stage and no
worker barrier.

Rate only: the accumulator holds the tile transposed (acc[i, j] = sum_k W[n0 + i, k] x[m0 + j, k]), which the
unchanged epilogue stores as if it were D's tile, so the stored values are D^T's per 128 x 128 tile (for a plain D:
checkable; the GLU epilogue pairs the wrong columns). The work per element is the real one: the weights are
gathered in natural K order (what x's TMA'd stage needs: thread q of a quad holds K 2q, 2q + 1, 2q + 8, 2q + 9 of
each k16, i.e. byte 4p + q of a packed FP4 row for its pair p, bytes 8p + 2q, 8p + 2q + 1 of an FP8 row) and each
pair takes its own k16 block's scale (natural order: a row's four k16 blocks of a stage have four scales). Not
handled (the e128 shapes have none): weight rows past N, K past K. Tile 128 x 128, 1 x 1 cluster.

Measured (RESULTS runs 127-128): FP4 and FP8 weights in the same ~0.59 ms on e128_fc1, -6% against the default
mainloop for weight-only NVFP4, +4-6% for MXFP8: the per-warp conversion chain, not the worker barrier, is the bound.

2. `BranchPerPassMainloop` (`branch_class`): the consumer B passes each behind a per-warp `if`, as before session 24.

Used by a bundle built with `patch()` applied (the build process only: the device finds the module by problem and
config like any other).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
import cutlass.utils.hopper_helpers as sm90_utils

from cudnn_moe_jax.formats import SF_ATOM_BYTES, sf_atom_byte
from cudnn_moe_jax.kernels import dequant as dq
from cudnn_moe_jax.kernels.sm90 import mainloop_dequant as md

TILE_K = md.TILE_K


def swapped_class(base):
    """The experiment's subclass of a weight-only DequantMainloop class."""
    return type(base.__name__ + "_swapped", (SwappedWeightsMainloop, base), {})


class SwappedWeightsMainloop(md.DequantMainloop):
    STAGE_WORKERS = ()
    A_IN_REGISTERS = True
    REGISTER_TIGHT = True

    def stage_arrivals(self) -> int:
        return 0

    def set_consumer_b(self, requested) -> None:
        self.consumer_b = 0

    @classmethod
    def smem_stage_bytes(cls, ab_dtype, tile_m: int, tile_n: int) -> int:
        return cls.tx_bytes(ab_dtype, tile_m, tile_n) + tile_m // 128 * SF_ATOM_BYTES   # no bf16 stage

    def tiled_mma(self) -> cute.TiledMma:
        """The wgmma's M: the tile's weight columns (registers); its N: the tile's tokens (x's bf16 stage)."""
        mma = self.FORMAT.mma_dtype
        return sm90_utils.make_trivial_tiled_mma(mma, mma, cute.nvgpu.OperandMajorMode.K,
                                                 cute.nvgpu.OperandMajorMode.K, cutlass.Float32, (2, 1, 1),
                                                 tiler_mn=(64, self.tile_m), a_source=warpgroup.OperandSource.RMEM)

    def smem_fields(self):
        atoms = md.sf_atoms(self.tile_m, self.tile_n) * self.stages
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        return [("sSF", Align[MemRange[cutlass.Uint8, atoms * SF_ATOM_BYTES], 128])]

    @cute.jit
    def stage_views(self, storage):
        mems = [(storage.sA, self.tile_m, self.FORMAT.a_row_bytes), (storage.sB, self.tile_n, self.FORMAT.row_bytes)]
        words = [cute.make_tensor(cute.recast_ptr(m[0].data_ptr(), dtype=Int32),
                                  cute.make_layout(m[1] * m[2] // 4 * self.stages)) for m in mems]
        return None, None, words[0], words[1], None, None

    @cute.jit
    def consumer_operands(self, tiled_mma, sA, sB, smem, wg: Int32):
        thr_mma = tiled_mma.get_slice(wg * 128)
        tCrX = tiled_mma.make_fragment_B(thr_mma.partition_B(sA))       # x's bf16 stage as the wgmma's B
        return tiled_mma, thr_mma.partition_shape_A((self.tile_n, TILE_K)), tCrX, smem

    @cute.jit
    def mma_tile(self, ab_pipeline, read_state, release_state, operands, acc: cute.Tensor, k_count: Int32,
                 stage_mbar=None, tile=None):
        tiled_mma, frag_shape, tCrX, smem = operands
        frags = tuple((cute.make_rmem_tensor(frag_shape, self.FORMAT.mma_dtype),) for _ in range(2))
        return self.mma_tile_rs(ab_pipeline, read_state, release_state, tiled_mma, frags, tCrX, self.a_thread(smem),
                                acc, k_count, stage_mbar, None)

    @cute.jit
    def _convert_a(self, frag, a_thread, idx: Int32, k: Int32):
        """The thread's weight rows r, r + 8 of stage idx in natural K order -> its RS fragment (word 2p + half:
        pair p of row r + 8 half, K 8p + 2q, 8p + 2q + 1)."""
        smem, row, q = a_thread
        words = cute.make_tensor(cute.recast_ptr(frag[0].iterator, dtype=Int32), cute.make_layout(2 * dq.PAIRS))
        fmt = self.FORMAT
        n_words = fmt.row_bytes // 4
        for half in cutlass.range_constexpr(2):
            r = row + 8 * half
            src = cute.make_tensor(smem[4].iterator + (idx * self.tile_n + r) * n_words, cute.make_layout(n_words))
            w = src.load()
            scales = self._row_scales(smem, r, idx, k)
            if const_expr(fmt.data == dq.E2M1):
                sel = q | ((q + 4) << 8)        # byte q of the first word -> byte 0, of the second -> byte 2
                for pp in cutlass.range_constexpr(4):
                    t = dq.prmt_dynamic(w[2 * pp], w[2 * pp + 1], sel)
                    lo, hi = dq._fp4_pair(t, 0), dq._fp4_pair(t, 1)
                    for j, x in ((0, dq.prmt2(lo, hi, 0x5410)), (1, dq.prmt2(lo, hi, 0x7632))):
                        p = 2 * pp + j
                        words[2 * p + half] = dq.scale_pair(x, fmt.data, scales[p // 2])
            else:
                sel = (2 * q) | ((2 * q + 1) << 4)   # bytes 2q, 2q + 1 of (w[2p], w[2p + 1]) -> bytes 0, 1
                for p in cutlass.range_constexpr(dq.PAIRS):
                    t = dq.prmt_dynamic(w[2 * p], w[2 * p + 1], sel)
                    words[2 * p + half] = dq.scale_pair(dq.fp8_pair(t, fmt.data, 0), fmt.data, scales[p // 2])

    @cute.jit
    def _row_scales(self, smem, r: Int32, idx: Int32, k: Int32) -> list:
        """bf16x2 scales of row r's four k16 blocks of stage idx (vec 32: two distinct): its SF word of the atom
        (the four k-blocks of a row are one 32-bit word, formats.sf_atom_byte)."""
        fmt = self.FORMAT
        sf_bytes = smem[7]
        off = (idx * self.stage_atoms() + 1 + (r >> 7)) * SF_ATOM_BYTES + sf_atom_byte(r & 31, (r >> 5) & 3, 0)
        word = cute.make_tensor(cute.recast_ptr(sf_bytes.iterator + off, dtype=Int32), cute.make_layout(1))[0]
        if const_expr(fmt.vec == 16):
            return [dq.scale_bf16x2((word >> (8 * j)) & Int32(0xFF), fmt.sf, cutlass.Boolean(True))
                    for j in range(4)]
        # vec 32: stage k holds k-blocks 2 (k % 2), 2 (k % 2) + 1 of its atom
        sh = (k & 1) * 16
        s0 = dq.scale_bf16x2((word >> sh) & Int32(0xFF), fmt.sf, cutlass.Boolean(True))
        s1 = dq.scale_bf16x2((word >> (sh + 8)) & Int32(0xFF), fmt.sf, cutlass.Boolean(True))
        return [s0, s0, s1, s1]


# ------------------------------------------------------------------------------------------------ per-pass branch
def branch_class(base):
    """2. `base` with the consumer warps' B passes each behind `if unit < consumer_b` (the mainloop before the
    passes became straight-line code where every warp converts as many): the A/B of that change in one run."""
    return type(base.__name__ + "_branch", (BranchPerPassMainloop, base), {})


class BranchPerPassMainloop(md.DequantMainloop):
    @cute.jit
    def _convert_b_share(self, b_thread, idx: Int32, k: Int32, stage_mbar):
        smem, warp, lane = b_thread[:3]
        b0 = self.b_base()
        for i in cutlass.range_constexpr(self.consumer_warp_passes()):
            unit = warp + i * md.CONSUMER_WARPS
            if unit < self.consumer_b:
                self.consumer_b_pass(b_thread, b0 + unit * md.ROWS_PER_PASS, lane, idx, k)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if const_expr(self.split_b):
            unit = warp + lane * md.CONSUMER_WARPS
            if lane < self.consumer_warp_passes() and unit < self.consumer_b:
                self.copy_to_peer(smem, stage_mbar, idx, b0 + unit * md.ROWS_PER_PASS)
        if lane == 0 and warp < self.consumer_b:
            cute.arch.mbarrier_arrive(stage_mbar + idx)
