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

3. `WideRowsMainloop` and its folded-scale and conversion-free variants (`wide_class`; RESULTS run 136): a consumer
lane converting a whole B row; the product's row-wise stage (mainloop_dequant_rows `_convert_stage_hoisted`) grew out
of `FastWideRowsMainloop` with B published late (`wfastp`). (They inherit the product's k-loop: since RESULTS run 138
they release the narrow stage once converted, as it does.)

4. `NullGroupsMainloop` (`null_groups_class`, label "pnull"; RESULTS run 146): the pass-based stage without its
conversion arithmetic (MXFP8's bound, as `wnullabp` is FP4's).

5. `NoNanTestMainloop` (`no_nan_class`, labels "nonan" / "pmin"; RESULTS run 148): the FP8 groups without their NaN
test, and without the folded scale's finiteness test too (the arithmetic floor of a bit-placement conversion).

6. `OldNanTestMainloop` (`old_nan_test_class`, label "oldtest"; RESULTS run 150): the NaN test as before session 28.

7. `FoldAllMainloop` (`fold_all_class`, label "foldall"; not yet measured): every FP8 group on the folded path.

(Branch `lab/screened-stage`, RESULTS run 149: the stage workers screening each FP8 stage instead.)

(RESULTS runs 141-142's `gfold` -- the folded scale in every pass-based group conversion -- and `e32` -- every B
pass on the consumers with the early release -- are the product's since, for FP8 weights beside a bf16 A:
`DequantMainloop.finish_group`, `set_consumer_b`, `releases_early`. Runs 143-144's `FoldCheckMainloop` and
`HoistedPassesMainloop`, measured and not adopted, are in commit f0bef02.)

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


# ------------------------------------------------------------------------------------------------ wide B rows
def wide_class(base, kind: str):
    """3. `base` with every B pass on the consumers, a lane converting one B row's whole stage (`WideRowsMainloop`);
    "wfast": one multiply a pair of A and B where the warp's folded scales allow it, the scales decoded two a word
    (`FastWideRowsMainloop`; run 136's "wfold", B's scales folded one group at a time, is in commit 7e6443a)."""
    if kind.startswith("wnull") or kind.startswith("wfastp"):   # wnull{a,b,ab}[p], wfastp: NULL, LATE_FENCE
        null = kind[5:].rstrip("p") if kind.startswith("wnull") else ""
        return type(base.__name__ + "_" + kind, (FastWideRowsMainloop, base),
                    {"NULL": null, "LATE_FENCE": kind.endswith("p")})
    cls = {"wide": WideRowsMainloop, "wfast": FastWideRowsMainloop}[kind]
    return type(base.__name__ + "_" + kind, (cls, base), {})


@cute.jit
def st_shared_v4(addr: Int32, w: list):
    dq.void_asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", Int32(addr), *[Int32(x) for x in w])


class WideRowsMainloop(md.DequantMainloop):
    """Question: is the consumers' per-stage conversion bound by its per-group overhead? Every B pass is the
    consumers' (hoisted stage), but lane l of consumer warp w converts B row 32 w + l whole: the row's stage codes
    in one (FP4: 32 bytes) or two (FP8: 64) pairs of 16-byte loads, its four SF bytes one 32-bit load, and the
    stage's pair p of its four groups (K slots 8p..8p+7 of the row: one 16-byte chunk of core matrix p) one 16-byte
    store -- 8 stores a row instead of 32 single-word ones, 3 loads instead of 8. Same values in the same slots as
    the default: outputs byte-identical."""

    def set_consumer_b(self, requested) -> None:
        self.consumer_b = self.tile_n // md.ROWS_PER_PASS

    def hoisted(self) -> bool:
        return True

    @cute.jit
    def _b_row_scales(self, sf: Int32, row: Int32, k: Int32, n_tile: Int32) -> list:
        """bf16x2 scales of the row's four groups (0 past N / past K)."""
        fmt = self.FORMAT
        row_ok = n_tile * self.tile_n + row < self.n
        out = []
        for q in cutlass.range_constexpr(md.GROUPS):
            if const_expr(fmt.vec == 16):
                code = (sf >> (8 * q)) & Int32(0xFF)
            else:   # vec 32: stage k holds k-blocks 2 (k % 2), 2 (k % 2) + 1 of its atom
                code = (sf >> ((k & 1) * 16 + 8 * (q // 2))) & Int32(0xFF)
            valid = row_ok & (k * TILE_K + q * dq.GROUP < self.k)
            out.append(dq.scale_bf16x2(code, fmt.sf, valid))
        return out

    @cute.jit
    def _b_row_pairs(self, words: list, q: int, scale2: Int32, fold: cutlass.Constexpr) -> list:
        """Group q's 8 pairs (dequant.convert_group's values; `fold`: scale2 already holds 2^K, one multiply)."""
        fmt = self.FORMAT
        nw = dq.bytes_per_group(fmt.data) // 4
        gw = words[q * nw:(q + 1) * nw]
        if const_expr(fmt.data == dq.E4M3):
            scale2 = dq.group_nan_scale(gw, scale2)
        out = []
        for p in cutlass.range_constexpr(dq.PAIRS):
            if const_expr(fmt.data == dq.E2M1):
                x = dq._fp4_pair(gw[p // 4], p % 4)
            else:
                x = dq.fp8_pair(gw[p // 2], fmt.data, p % 2)
            if const_expr(fold and "b" in getattr(self, "NULL", "")):
                out.append(gw[p % nw] & Int32(0x3F003F00) | Int32(p))
            elif const_expr(fold):
                out.append(dq.mul_bf16x2(x, scale2))
            else:
                out.append(dq.mul_bf16x2(dq.mul_bf16x2(x, dq._i32(dq.bias_bits(fmt.data))), scale2))
        return out

    @cute.jit
    def _store_b_row(self, smem, row: Int32, idx: Int32, words: list, scales: list, fold: cutlass.Constexpr):
        fmt = self.FORMAT
        pairs = [self._b_row_pairs(words, q, scales[q], fold) for q in range(md.GROUPS)]
        base = smem[6].iterator.toint() + ((idx * self.tile_n + (row & ~7)) * (2 * TILE_K // 4) + (row & 7) * 4) * 4
        for p in cutlass.range_constexpr(dq.PAIRS):
            w = [pairs[q][p] for q in range(md.GROUPS)]
            if const_expr(fmt.half == "float16"):
                w = [dq.bf16x2_to_f16x2(x) for x in w]
            st_shared_v4(base + p * 128, w)

    @cute.jit
    def _convert_stage_hoisted(self, frag, a_thread, b_thread, idx: Int32, k: Int32, stage_mbar):
        smem, warp, lane, n_tile = b_thread
        row = warp * 32 + lane
        words, sf = self._b_row_loads(smem, row, idx)
        a_smem, a_row, a_q = a_thread
        a_loaded = []
        if const_expr(self.FORMAT.a_plain):
            self._convert_a(frag, a_thread, idx, k)
        else:
            for half in cutlass.range_constexpr(2):
                a_loaded.append(self.load_group(a_smem, 0, a_row + 8 * half, a_q, idx, k))
        scales = self._b_row_scales(sf, row, k, n_tile)
        self._convert_b_row(smem, row, idx, words, scales)
        self._publish_b_share(b_thread, idx, stage_mbar, every_warp=True)
        if const_expr(not self.FORMAT.a_plain):
            fw = self._fragment_words(frag)[0]
            for half in cutlass.range_constexpr(2):
                self.finish_group(a_loaded[half], cutlass.Boolean(True), self._a_store(fw, half))

    @cute.jit
    def _convert_b_row(self, smem, row: Int32, idx: Int32, words: list, scales: list):
        self._store_b_row(smem, row, idx, words, scales, False)


def _bias(data: str) -> int:
    return dq.E2M1_BIAS if data == dq.E2M1 else dq._FP8[data]["bias"]


def _pow2x2(e: int) -> Int32:
    """bf16x2 bits of 2^e in both halves."""
    return dq._i32(((127 + e) << 7) * 0x10001)


class FastWideRowsMainloop(WideRowsMainloop):
    """`WideRowsMainloop` with 2^K folded into every group's scale, A's and B's, decoded two scales a word (B: from
    the row's SF word; A: the thread's two rows), so each pair takes one multiply; where any folded scale of the
    warp's stage is not finite (scale >= 2^(128 - K), a NaN scale, an e4m3 NaN code) the whole stage takes the
    two-multiply path (warp vote). Outputs byte-identical to the default."""

    LATE_FENCE = False  # publish B after converting A (the fence's store drain behind A's register work)
    NULL = ""           # "a", "b", "ab": that operand's pairs are its code words masked (wrong values: the
    #                     structure's cost without that operand's conversion)

    @cute.jit
    def _fold2(self, codes2: Int32):
        """Two SF codes (low byte of each 16-bit half) -> (bf16x2 of scale * 2^K per half, 'some half is not
        finite' bits)."""
        fmt = self.FORMAT
        kb = _bias(fmt.data)
        if const_expr(fmt.sf == dq.E8M0):
            s2 = codes2 * Int32(128) + dq._i32((kb << 7) * 0x10001)           # biased exponent e + K
            bad = (codes2 + Int32((kb + 1) * 0x10001)) & Int32(0x01000100)     # e + K > 254
        else:
            placed = ((codes2 << 4) & Int32(0x07F007F0)) | ((codes2 << 8) & dq._i32(0x80008000))  # v * 2^-120
            half = (120 + kb) // 2
            s2 = dq.mul_bf16x2(dq.mul_bf16x2(placed, _pow2x2(half)), _pow2x2(120 + kb - half))
            bad = ((s2 & Int32(0x7F807F80)) + Int32(0x00800080)) & dq._i32(0x80008000)   # exponent all ones
        return s2, bad

    @cute.jit
    def _convert_stage_hoisted(self, frag, a_thread, b_thread, idx: Int32, k: Int32, stage_mbar):
        smem, warp, lane, n_tile = b_thread
        fmt = self.FORMAT
        row = warp * 32 + lane
        words, sf = self._b_row_loads(smem, row, idx)
        a_smem, a_row, a_q = a_thread
        a_loaded = []
        if const_expr(fmt.a_plain):
            self._convert_a(frag, a_thread, idx, k)
        else:
            for half in cutlass.range_constexpr(2):
                a_loaded.append(self.load_group(a_smem, 0, a_row + 8 * half, a_q, idx, k))
        # B's folded scales: (word, half) of group q
        if const_expr(fmt.vec == 16):
            b_codes = [dq.prmt(sf, 0x4140), dq.prmt(sf, 0x4342)]
            where = [(0, 0), (0, 1), (1, 0), (1, 1)]
        else:   # vec 32: stage k holds k-blocks 2 (k % 2), 2 (k % 2) + 1 of its atom
            b_codes = [dq.prmt(sf >> ((k & 1) * 16), 0x4140)]
            where = [(0, 0), (0, 0), (0, 1), (0, 1)]
        folds = [self._fold2(c) for c in b_codes]
        bad = folds[0][1]
        for f in folds[1:]:
            bad = bad | f[1]
        row_ok = n_tile * self.tile_n + row < self.n
        b_fold = []
        for q in cutlass.range_constexpr(md.GROUPS):
            w, h = where[q]
            s = dq.prmt(folds[w][0], 0x3232 if h else 0x1010)
            if const_expr(fmt.data == dq.E4M3):
                s = dq.group_nan_scale(words[4 * q:4 * q + 4], s)
                bad = bad | (s & Int32(0x7F80)) + Int32(0x80) & Int32(0x8000)
            b_fold.append(Int32(cutlass.select_(row_ok & (k * TILE_K + q * dq.GROUP < self.k), s, Int32(0))))
        a_fold = []
        if const_expr(not fmt.a_plain):
            s2, a_bad = self._fold2(a_loaded[0][1] | (a_loaded[1][1] << 16))
            bad = bad | a_bad
            a_valid = a_loaded[0][2] < self.k
            for half in cutlass.range_constexpr(2):
                s = dq.prmt(s2, 0x3232 if half else 0x1010)
                if const_expr(fmt.data == dq.E4M3):
                    s = dq.group_nan_scale(a_loaded[half][0], s)
                    bad = bad | (s & Int32(0x7F80)) + Int32(0x80) & Int32(0x8000)
                a_fold.append(Int32(cutlass.select_(a_valid, s, Int32(0))))
        fast = cute.arch.vote_all_sync(bad == Int32(0))
        if fast:
            self._store_b_row(smem, row, idx, words, b_fold, True)
        else:
            self._store_b_row(smem, row, idx, words, self._b_row_scales(sf, row, k, n_tile), False)
        if const_expr(not self.LATE_FENCE):
            self._publish_b_share(b_thread, idx, stage_mbar, every_warp=True)
        if const_expr(not fmt.a_plain):
            fw = self._fragment_words(frag)[0]
            if fast:
                for half in cutlass.range_constexpr(2):
                    gw = a_loaded[half][0]
                    for p in cutlass.range_constexpr(dq.PAIRS):
                        if const_expr(fmt.data == dq.E2M1):
                            x = dq._fp4_pair(gw[p // 4], p % 4)
                        else:
                            x = dq.fp8_pair(gw[p // 2], fmt.data, p % 2)
                        if const_expr("a" in self.NULL):
                            fw[2 * p + half] = gw[p % len(gw)] & Int32(0x3F003F00) | Int32(p)
                        else:
                            fw[2 * p + half] = dq.mul_bf16x2(x, a_fold[half])
            else:
                for half in cutlass.range_constexpr(2):
                    self.finish_group(a_loaded[half], cutlass.Boolean(True), self._a_store(fw, half))
        if const_expr(self.LATE_FENCE):
            self._publish_b_share(b_thread, idx, stage_mbar, every_warp=True)


# ------------------------------------------------------------------------------------------------ null groups
def null_groups_class(base):
    """4. `base` with every pass-based group conversion replaced by a mask of its code words
    (`NullGroupsMainloop`)."""
    return type(base.__name__ + "_pnull", (NullGroupsMainloop, base), {})


class NullGroupsMainloop(md.DequantMainloop):
    """Question (MXFP8, which keeps 8-row passes): what does the pass-based schedule reach without the conversion's
    arithmetic? Each group's 8 pairs are its code words masked to finite bf16 and or-ed with the SF code (wrong
    values, rate only; the loads, the SF byte, the stores, fences, barriers, the early release where the product
    has it, and the wgmmas unchanged): the bound of the schedule, as `wnullabp` is the FP4 row-wise stage's."""

    def set_consumer_b(self, requested) -> None:
        md.DequantMainloop.set_consumer_b(self, None)   # the default (the mark only selects the class)

    @cute.jit
    def finish_group(self, loaded, valid: cutlass.Boolean, store):
        words, code, k0 = loaded
        for p in cutlass.range_constexpr(dq.PAIRS):
            store(p, words[p % len(words)] & Int32(0x3F003F00) | code)


# ------------------------------------------------------------------------------------------------ no NaN test
def no_nan_class(base, kind: str):
    """5. `base` with the group conversions' e4m3 NaN test removed ("nonan") or, also, the folded scale's
    finiteness test and the two-multiply path ("pmin") (`NoNanTestMainloop`)."""
    return type(f"{base.__name__}_{kind}", (NoNanTestMainloop, base), {"KIND": kind})


class NoNanTestMainloop(md.DequantMainloop):
    """Question (MXFP8): what would the pass-based stage reach if the consumers' groups did no e4m3 NaN test (4 words
    masked, incremented and or-ed, then a select: ~11 operations of a group's ~50) -- e.g. with the test done by
    other warps -- and with no finiteness test of the folded scale either (every FP8 group one multiply a pair by
    its folded scale: the arithmetic floor of a bit-placement conversion)? Rate only: exact on finite codes with
    scales below 2^(128 - 120) (the benchmarks' data), wrong for NaN codes and larger scales."""

    KIND = "nonan"

    def set_consumer_b(self, requested) -> None:
        md.DequantMainloop.set_consumer_b(self, None)   # the default (the mark only selects the class)

    @cute.jit
    def finish_group(self, loaded, valid: cutlass.Boolean, store):
        fmt = self.FORMAT
        words, code, k0 = loaded
        valid = valid & (k0 < self.k)
        if const_expr(fmt.data == dq.E2M1):
            md.DequantMainloop.finish_group(self, loaded, valid, store)   # (FP4: unchanged)
        elif const_expr(self.KIND == "pmin"):
            folded, _ = dq.folded_scales2(code, fmt.data, fmt.sf)
            scale2 = Int32(cutlass.select_(valid, dq.prmt(folded, 0x1010), Int32(0)))
            for p in cutlass.range_constexpr(dq.PAIRS):
                store(p, dq.mul_bf16x2(dq.placed_pair(words, fmt.data, p), scale2))
        elif const_expr(not self.releases_early()):
            scale2 = self._nan_scale(words, dq.scale_bf16x2(code, fmt.sf, valid))
            for p in cutlass.range_constexpr(dq.PAIRS):
                x = dq.mul_bf16x2(dq.placed_pair(words, fmt.data, p), dq._i32(dq.bias_bits(fmt.data)))
                store(p, dq.mul_bf16x2(x, scale2))
        else:
            folded, bad = dq.folded_scales2(code, fmt.data, fmt.sf)
            folded = self._nan_scale(words, dq.prmt(folded, 0x1010))
            if (bad == Int32(0)) & ((folded & Int32(0x7F80)) != Int32(0x7F80)):
                scale2 = Int32(cutlass.select_(valid, folded, Int32(0)))
                for p in cutlass.range_constexpr(dq.PAIRS):
                    store(p, dq.mul_bf16x2(dq.placed_pair(words, fmt.data, p), scale2))
            else:
                dq.convert_group(words, fmt.data, dq.scale_bf16x2(code, fmt.sf, valid), store, True)

    @cute.jit
    def _nan_scale(self, words, scale2: Int32) -> Int32:
        """The group's scale: no NaN test here (`OldNanTestMainloop` puts one back)."""
        return scale2


# ------------------------------------------------------------------------------------------------ old NaN test
def old_nan_test_class(base):
    """6. `base` with the folded groups' NaN test as before session 28 (`OldNanTestMainloop`)."""
    return type(base.__name__ + "_oldtest", (OldNanTestMainloop, base), {})


class OldNanTestMainloop(NoNanTestMainloop):
    """The A/B of `dequant.e4m3_nan_bits` (session 28): `NoNanTestMainloop`'s groups with the NaN test of f02d106 put
    back -- each word masked and incremented (its bit 7s flag NaN magnitudes), the group's scale replaced by NaN
    where flagged, then (folded) the test of the overflow flag and of the scale's exponent field: the product's
    `convert_group_folded` and `group_nan_scale` as they were."""

    @cute.jit
    def _nan_scale(self, words, scale2: Int32) -> Int32:
        if const_expr(self.FORMAT.data == dq.E4M3):
            flags = Int32(0)
            for w in words:
                flags = flags | ((w & Int32(0x7F7F7F7F)) + Int32(0x01010101))
            scale2 = Int32(cutlass.select_((flags & dq._i32(0x80808080)) != Int32(0), Int32(0x7FC07FC0), scale2))
        return scale2


# ------------------------------------------------------------------------------------------------ fold all
def fold_all_class(base):
    """7. `base` with every FP8 group on the folded-scale path (`FoldAllMainloop`)."""
    return type(base.__name__ + "_foldall", (FoldAllMainloop, base), {})


class FoldAllMainloop(md.DequantMainloop):
    """Question (MXFP8 with a block-scaled A): with the NaN test or-ed into the fold's flag (one branch a group,
    `dequant.convert_group_folded`), does the folded scale now pay for every FP8 group -- A's in the consumers'
    registers and the stage workers' B passes too, where it lost ~3% with the separate tests (RESULTS run 143)?
    Exact (the product's path for FP8 weights, applied everywhere)."""

    def set_consumer_b(self, requested) -> None:
        md.DequantMainloop.set_consumer_b(self, None)   # the default (the mark only selects the class)

    @cute.jit
    def finish_group(self, loaded, valid: cutlass.Boolean, store):
        fmt = self.FORMAT
        if const_expr(fmt.data == dq.E2M1 or fmt.half == "float16"):
            md.DequantMainloop.finish_group(self, loaded, valid, store)
        else:
            words, code, k0 = loaded
            dq.convert_group_folded(words, fmt.data, code, fmt.sf, valid & (k0 < self.k), store)
