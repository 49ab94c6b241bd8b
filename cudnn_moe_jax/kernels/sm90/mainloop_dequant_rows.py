"""The consumers' row-wise stage of the dequantizing mainloop (mainloop_dequant.py): FP4 data beside a block-scaled
or 16-bit A (not an fp16 A split in two) without the cluster split (1 x 1 clusters), where the consumer warps convert
every one of B's rows (kernels/NOTES.md, "FP4 data beside a block-scaled or 16-bit A at 1 x 1").

Lane l of consumer warp w converts B row 32 w + l whole -- its 32 code bytes in two 16-byte loads, its four SF bytes
in one word, and pair p of its four groups (K slots 8p..8p + 7, one 16-byte chunk of core matrix p of the bf16 stage)
in one 16-byte store: 3 loads and 8 stores a row where 4 lanes of a pass made 8 and 32. Every load of the stage comes
first (ptxas keeps a shared-memory load behind an earlier store, so group-by-group conversion serialized the groups'
load latencies), B is published after A's conversion (the fence's wait for the stores overlaps A's register work),
and the narrow stage is released as soon as the warp published its B (`releases_early`, which FP8 passes share where
the consumers convert all of B). FP8 rows (64 bytes) would hold 16 code words a lane: they keep passes.

`RowwiseStage` is a mixin of `mainloop_dequant.DequantMainloop` (FORMAT, HOISTS, split_b, consumer_b and the shared
A-group and publication helpers come from it). The stage geometry both modules use (TILE_K, GROUPS, ROWS_PER_PASS)
is defined here so that mainloop_dequant imports this module and never the reverse (no import cycle).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cudnn_moe_jax.formats import SF_ATOM_BYTES, sf_atom_byte

from .. import dequant as dq

TILE_K = 64
GROUPS = TILE_K // dq.GROUP     # groups per stage row
ROWS_PER_PASS = 32 // GROUPS    # rows a warp converts per pass


class RowwiseStage:
    """The consumers' row-wise stage (module docstring): whether it runs (`converts_all_b`, `hoisted`,
    `releases_early`) and the stage itself (`_convert_stage_hoisted` and its B-row loads, scales and stores)."""

    def converts_all_b(self) -> bool:
        """The consumers convert every one of B's passes (M-grouped, no split: `set_consumer_b`)."""
        return self.HOISTS and not self.split_b and self.consumer_b == self.tile_n // ROWS_PER_PASS

    def hoisted(self) -> bool:
        """The consumers convert every one of B's rows of FP4 data: a lane a row, every load of the stage first
        (`_convert_stage_hoisted`). (FP8 rows, 64 bytes, would hold 16 code words a lane: they keep passes.)"""
        return self.converts_all_b() and self.FORMAT.data == dq.E2M1

    def releases_early(self) -> bool:
        """Whether a consumer warp releases narrow stage k as soon as it published the stage's B, not after the
        stage's wgmmas retired: wherever the consumers convert every one of B's passes (no split; the row-wise stage,
        or FP8 passes: `set_consumer_b`) and there are at least 3 stages. The producer then refills the stage while
        they run (e128_fc1 FP4 +6%, RESULTS run 138; weight-only MXFP8 with folded scales +7-9%, run 142). Nothing
        reads the narrow data after the conversion (A is in registers, B in the bf16 stage), and the bf16 B stage of
        k is rewritten only by stage k + S's conversion -- no stage worker writes it --, which a warp starts after
        the worker barrier of k + S - 1: after every consumer warp of both warpgroups published k + S - 1, i.e. after
        its `wait_group(1)` retired wgmma(k + S - 3) -- wgmma(k) where S >= 3. The stage workers (idle here) arrive
        for k + S only once every consumer released k, which each does after its own arrival for k, so the worker
        barrier's phases cannot mix."""
        return self.converts_all_b() and self.stages >= 3

    @cute.jit
    def _convert_stage_hoisted(self, frag, a_thread, b_thread, idx: Int32, k: Int32, stage_mbar):
        """The consumers' stage where they convert every B row (`hoisted`): lane l of consumer warp w converts B row
        32 w + l whole -- its codes in 16-byte loads, its four SF bytes in one word, pair p of its four groups (K
        slots 8p..8p + 7: one 16-byte chunk of core matrix p) in one 16-byte store -- and the thread's A groups
        into the fragment, then B's stores are published. Every shared-memory load comes first (ptxas keeps a load
        behind an earlier store, so converting group by group serialized their latencies). Where every folded
        scale (`dequant.folded_scales2`) of the warp's B rows, and apart from them of its A groups, is finite, a
        pair takes one multiply, else two (`dequant.scale_pair`): a warp-uniform branch each."""
        smem, warp, lane, n_tile = b_thread
        fmt = self.FORMAT
        row = warp * 32 + lane
        words, sf = self._b_row_loads(smem, row, idx)
        a_loaded = []
        if const_expr(fmt.a_plain):
            self._convert_a(frag, a_thread, idx, k)
        else:
            for half in cutlass.range_constexpr(2):
                a_loaded.append(self.load_group(a_thread[0], 0, a_thread[1] + 8 * half, a_thread[2], idx, k))
        if const_expr(not fmt.a_plain):   # A's folded scales first: their decode overlaps B's work (RESULTS run 137)
            a_folded, a_bad = dq.folded_scales2(a_loaded[0][1] | (a_loaded[1][1] << 16), fmt.data, fmt.sf)
            a_fast = cute.arch.vote_all_sync(a_bad == Int32(0))
        b_scales, b_fast = self._b_row_scales(sf, row, k, n_tile)
        nw = dq.bytes_per_group(fmt.data) // 4
        b_groups = [words[q * nw:(q + 1) * nw] for q in range(GROUPS)]
        base = smem[6].iterator.toint() + ((idx * self.tile_n + (row & ~7)) * (2 * TILE_K // 4) + (row & 7) * 4) * 4
        if b_fast:
            self._store_b_row(base, b_groups, [cutlass.select_(v, f, Int32(0)) for _, f, v in b_scales], True)
        else:
            self._store_b_row(base, b_groups, [dq.scale_bf16x2(c, fmt.sf, v) for c, _, v in b_scales], False)
        if const_expr(not fmt.a_plain):
            fw = self._fragment_words(frag)[0]
            if a_fast:
                valid = a_loaded[0][2] < self.k
                for half in cutlass.range_constexpr(2):
                    scale2 = Int32(cutlass.select_(valid, dq.prmt(a_folded, 0x3232 if half else 0x1010), Int32(0)))
                    for p in cutlass.range_constexpr(dq.PAIRS):
                        fw[2 * p + half] = dq.mul_bf16x2(dq.placed_pair(a_loaded[half][0], fmt.data, p), scale2)
            else:
                for half in cutlass.range_constexpr(2):
                    self.finish_group(a_loaded[half], cutlass.Boolean(True), self._a_store(fw, half))
        # published after A's conversion: the fence's wait for the B stores overlaps A's work (+2%, RESULTS run 136)
        self._publish_b_share(b_thread, idx, stage_mbar, every_warp=True)

    @cute.jit
    def _b_row_loads(self, smem, row: Int32, idx: Int32):
        """(B row `row`'s code words in stage idx, its SF word: byte j holds k-block j of the row's atom quad)."""
        n_words = self.FORMAT.row_bytes // 4
        codes = cute.make_tensor(smem[4].iterator + (idx * self.tile_n + row) * n_words,
                                 cute.make_layout(n_words)).load()
        off = (idx * self.stage_atoms() + 1 + (row >> 7)) * SF_ATOM_BYTES + sf_atom_byte(row & 31, (row >> 5) & 3, 0)
        sf = cute.make_tensor(cute.recast_ptr(smem[7].iterator + off, dtype=Int32), cute.make_layout(1))[0]
        return [codes[i] for i in range(n_words)], sf

    @cute.jit
    def _b_row_scales(self, sf: Int32, row: Int32, k: Int32, n_tile: Int32):
        """(group q's SF code -> (its folded bf16x2 scale, valid: not past N or K), whether every folded scale of the
        warp's rows is finite). Vec 16: the SF word's bytes are the groups' codes; vec 32: bytes 2 (k % 2) (groups
        0, 1) and 2 (k % 2) + 1 (groups 2, 3)."""
        fmt = self.FORMAT
        if const_expr(fmt.vec == 16):
            codes2, where = [dq.prmt(sf, 0x4140), dq.prmt(sf, 0x4342)], ((0, 0), (0, 1), (1, 0), (1, 1))
        else:
            codes2, where = [dq.prmt(sf >> ((k & 1) * 16), 0x4140)], ((0, 0), (0, 0), (0, 1), (0, 1))
        folds = [dq.folded_scales2(c, fmt.data, fmt.sf) for c in codes2]
        row_ok = n_tile * self.tile_n + row < self.n
        out = []
        for q in cutlass.range_constexpr(GROUPS):
            w, h = where[q]
            out.append((codes2[w] >> (16 * h) & Int32(0xFF), dq.prmt(folds[w][0], 0x3232 if h else 0x1010),
                        row_ok & (k * TILE_K + q * dq.GROUP < self.k)))
        return out, cute.arch.vote_all_sync((folds[0][1] | folds[-1][1]) == Int32(0))

    @cute.jit
    def _store_b_row(self, base: Int32, groups: list, scales: list, folded: cutlass.Constexpr):
        """A B row's four groups converted (`folded`: one multiply a pair by the folded scales) and stored: pair p of
        the groups as one 16-byte word quad at shared address base + 128 p."""
        fmt = self.FORMAT
        for p in cutlass.range_constexpr(dq.PAIRS):
            w = []
            for q in cutlass.range_constexpr(GROUPS):
                x = dq.placed_pair(groups[q], fmt.data, p)
                x = dq.mul_bf16x2(x, scales[q]) if const_expr(folded) else dq.scale_pair(x, fmt.data, scales[q])
                w.append(dq.bf16x2_to_f16x2(x) if const_expr(fmt.half == "float16") else x)
            dq.st_shared_v4(base + p * 128, w)
