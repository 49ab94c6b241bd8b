"""The dequantizing mainloop of the K-grouped weight gradient: block-scaled A (m_w, T) and B (n_w, T) with their scales
in per-expert segments (docs/formats.md#segmented-layout), converted exactly to bf16 on chip as in the forward
(mainloop_dequant.py, kernels/dequant.py) over the K-grouped schedule (kernels/scheduler.py, wgrad.py).

What differs from the forward's dequantizing mainloop:
  scales    token t of the tile's expert e is scaled by local block L = (t - start_e) // vec of e's segment, at byte
            base_e + ((row // 128) * Kb_e + L // 4) * 512 + sf_row_byte(row, L), base_e = rup(R, 128) * start_e / vec
            (`formats.segment_token_scales`). Segments start at any token, so no atom-aligned TMA view fits them; the
            producer loads per stage, for each 128-row block of A and B, the two SF atoms of the 4-block quads Q0,
            Q0 + 1 the stage's tokens can touch (1 KiB, starting at any 32-bit word: segments start on 4-byte
            boundaries) by one TMA box on the stage's full barrier beside A and B. A TMA box must start on a 16-byte
            boundary of global memory (an unaligned start is an illegal instruction: RESULTS run 152), so the box
            starts at the word below rounded down to 4 words and is 4 words longer (`box_load_word`); the atoms sit
            `box_shift` words into its slot. Past the buffer the TMA reads zeros; of the words it loads beyond the
            expert's own (another segment's, the padding rows', the alignment words), those of quads past the
            expert's last are never read (`block_of` clamps to the expert's blocks) and those of B rows past n_w
            scale only W columns that are never stored (token-contiguous: scaled by 0; token-major: NaN can appear
            there; m_w % 128 == 0 leaves A none). A converter takes byte L % 4 of its row's word (`row_word`) in the
            atom of slot L // 4 - Q0 (`table_word`). No thread writes the table (racecheck reported an earlier
            version's thread-issued cp.async copies against the converters' reads).
  tokens    a stage is 64 tokens from the expert's first token rounded down to 64 (TMA boxes start on 64-token
            boundaries); the tokens of other experts in the first / last stage are zeroed after conversion, in A and
            in B (their codes or scales may be NaN). Where the expert starts inside a 16-token group the group spans
            two scale blocks and its pairs take their own scales. Both run on a "general" path, only in the first /
            last stage of a tile or in tiles whose expert starts off a 16-token boundary; the rest is the forward's
            conversion.
  k-loop    the k-tile count is the expert's (dynamic, any parity): the register-A loop runs pairs of stages and an
            odd last stage after them.
  majors    token-contiguous operands (cuDNN's layout: A (m_w, T), B (n_w, T) with T contiguous, FP4 packed along T)
            as in the forward; or, FP8 only, both token-major (a_major="m", b_major="n": (T, m_w) / (T, n_w) rows as a
            training step stores dY and D_col). A token-major stage is TMA'd MN-major with the 128-byte swizzle; B is
            converted into an MN-major bf16 stage (the bf16 wgmma reads MN-major operands) in passes of 64 rows x 8
            tokens (`convert_mn_pass`: a lane converts 16 rows of one token, one 16-byte load, two 16-byte stores; a
            pass is 1 KiB of the bf16 stage, as a K-major pass of 8 rows x 64 tokens); K in its natural order. A goes
            into the RS fragment (`_convert_a_tokens`: a thread's rows r, r + 8 share a 16-byte chunk of each
            token's line) or, with Config(dequant_a="workers"), into an MN-major bf16 stage like B.
  B passes  with A in registers (either major): with a 2-CTA cluster along M (two W row tiles of one expert, B
            multicast) each CTA converts half of B's passes and bulk-copies them to the other (mainloop_dequant's
            cluster split), and the consumer warps convert the first passes of each stage beside the stage workers
            (its consumer passes: half of the CTA's passes by default, Config.consumer_b_passes), through
            `consumer_b_pass`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cudnn_moe_jax.formats import SF_ATOM_BYTES, SF_ATOM_ROWS, sf_row_byte

from .. import dequant as dq
from .. import quantize as q8
from .mainloop import WgmmaMainloop
from .mainloop_dequant import TILE_K, WORKERS, DequantFormat, DequantMainloop, advanced_if, release_last

SF_SLOTS = 2          # 4-block quads of a segment a stage's tokens can touch
ATOM_WORDS = SF_ATOM_BYTES // 4
BOX_WORDS = SF_SLOTS * ATOM_WORDS   # the scales of a 128-row block in one stage: its two atoms (1 KiB)
TMA_ALIGN_WORDS = 4                 # a TMA box starts on a 16-byte boundary of global memory
BOX_LOAD_WORDS = BOX_WORDS + TMA_ALIGN_WORDS    # the box as loaded: from the aligned word below the atoms
BOX_STRIDE_WORDS = -(-BOX_LOAD_WORDS // 32) * 32   # a box's slot in the table: rounded up to 128 bytes (TMA dst)


def mainloop_class(problem, config):
    """The K-grouped dequantizing mainloop for `problem`'s formats and majors: A in the consumers' registers
    (`config.dequant_a == "registers"`) or converted by the stage workers like B."""
    fmt = DequantFormat.of(problem)
    mn = problem.a_major == "m"
    a_regs = config.dequant_a == "registers"
    name = f"KGroupedDequantMainloop_{fmt.data}_{fmt.sf}_{fmt.vec}_{'mn' if mn else 'k'}_{a_regs}"
    return type(name, (KGroupedDequantMainloop,), {"FORMAT": fmt, "A_IN_REGISTERS": a_regs, "REGISTER_TIGHT": a_regs,
                                                   "TOKEN_MAJOR": mn})


def scale_box_word(rows: int, log_vec: int, start, row_block, kb_n, q0):
    """First 32-bit word of the scale box of 128-row block `row_block`, quads q0 and q0 + 1, in the segment of an
    expert whose first token is `start` (`kb_n` quads; formats._segments: its base is rup(rows, 128) / vec bytes a
    token before it, a whole number of words). Plain integer arithmetic: Python ints (tests) or Int32 (the kernel;
    counted in words, so buffers up to 8 GiB)."""
    return words_per_token(rows, log_vec) * start + (row_block * kb_n + q0) * ATOM_WORDS


def words_per_token(rows: int, log_vec: int) -> int:
    """32-bit words of an operand's segment buffer per token: rup(rows, 128) / vec bytes."""
    return (rows + SF_ATOM_ROWS - 1) // SF_ATOM_ROWS * SF_ATOM_ROWS >> (log_vec + 2)


def box_shift(rows: int, log_vec: int, start):
    """Words between the TMA box's aligned first word (`box_load_word`) and the atoms' first (`scale_box_word`):
    the same for every box of a tile's operand (atoms are whole multiples of 4 words past the segment's base)."""
    per_token = words_per_token(rows, log_vec)
    if per_token % TMA_ALIGN_WORDS == 0:
        return 0
    return (per_token * start) & (TMA_ALIGN_WORDS - 1)


def box_load_word(rows: int, log_vec: int, start, row_block, kb_n, q0):
    """The first word the scale box loads: `scale_box_word` rounded down to a 16-byte boundary."""
    return scale_box_word(rows, log_vec, start, row_block, kb_n, q0) - box_shift(rows, log_vec, start)


def box_row_block(i: int, tile_m: int, tile_n: int, m_tile, n_tile):
    """(operand, 128-row block of that operand) of a tile's scale box i: A's blocks first, then B's."""
    a_blocks = tile_m // SF_ATOM_ROWS
    if i < a_blocks:
        return 0, m_tile * a_blocks + i
    return 1, n_tile * (tile_n // SF_ATOM_ROWS) + i - a_blocks


def row_word(trow):
    """Word of word-table row `trow` (A's rows, then B's) in slot 0 of its stage's table, before the box's shift
    (`table_word` adds it): its 128-row block's box, its word of the atom (`sf_row_byte` / 4). Additive over
    trow's bits: row_word(a + b) = row_word(a) + row_word(b) where a and b share no bit (rows 2j, 2j + 1 of a 32-row
    group are 4 words apart)."""
    return (trow >> 7) * BOX_STRIDE_WORDS + (sf_row_byte(trow, 0) >> 2)


def sf_words_tma(sf: cute.Tensor):
    """The TMA (atom, tensor) of a flat segment SF buffer (uint8; its size a multiple of 512 bytes,
    `formats.sf_segment_bytes`) seen as 64-bit elements: a BOX_LOAD_WORDS box at any 16-byte boundary
    (`box_load_word` / 2; 8-byte elements: a 1040-byte box is 130 of them, within the TMA's 256)."""
    elems = cute.make_tensor(cute.recast_ptr(sf.iterator, dtype=Int64), cute.make_layout((cute.size(sf) // 8,)))
    box = cute.make_layout((BOX_LOAD_WORDS // 2,))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), elems, box, (BOX_LOAD_WORDS // 2,))


@cute.jit
def load_words(ptr, n: cutlass.Constexpr):
    """n (2 or 4) consecutive 32-bit words of shared memory at a 4n-byte aligned `ptr` (one vector load)."""
    v = cute.make_tensor(ptr, cute.make_layout(n)).load()
    return [v[i] for i in range(n)]


@cute.jit
def store_words(ptr, values):
    """Consecutive 32-bit words to shared memory at a 16-byte aligned `ptr` (one vector store)."""
    r = cute.make_rmem_tensor(cute.make_layout(len(values)), Int32)
    for i in cutlass.range_constexpr(len(values)):
        r[i] = values[i]
    cute.make_tensor(ptr, cute.make_layout(len(values))).store(r.load())


class Segment(NamedTuple):
    """The tile's expert as the converters and the producer see it (uniform values)."""

    start: Int32      # first token
    end: Int32
    k_start: Int32    # first token of k-tile 0
    k_head: Int32     # tokens of other experts at the head of k-tile 0
    k_keep: Int32     # tokens of the expert in the last k-tile
    k_count: Int32
    last_block: Int32  # the expert's last local scale block


class Stage(NamedTuple):
    """One stage (tile-local k-tile k) of the tile's expert (uniform values)."""

    tb: Int32         # its first token
    start: Int32
    q0: Int32         # the first of the two quads in the word table
    lo: Int32         # the expert's tokens of the stage: [lo, hi) of 0..63
    hi: Int32
    last_block: Int32
    partial: cutlass.Boolean   # tokens of other experts to zero
    general: cutlass.Boolean   # partial, or the expert starts inside a 16-token group


class KGroupedDequantMainloop(DequantMainloop):
    """The mainloop protocol (WgmmaMainloop's docstring) of the dequantizing K-grouped wgrad (module docstring)."""

    PRODUCER_ARRIVALS = 1        # the TMA's arrive-and-expect-tx (A, B and the scale boxes)
    PRODUCER_REGS = 48
    SMEM_FIXED_BYTES = 1024      # the word table's padding up to the next field's 1 KiB boundary (BOX_STRIDE_WORDS)
    TOKEN_MAJOR = False
    UNSPLIT_SHARE = (1, 2)       # (the forward's three quarters are unmeasured here)
    HOISTS = False               # (its groups are converted by `convert_kgroup`)

    def __init__(self, tile_m: int, tile_n: int, stages: int, m: int, n: int, cluster_m: int, cluster_n: int,
                 consumer_b: Optional[int] = 0):
        WgmmaMainloop.__init__(self, BFloat16, tile_m, tile_n, stages, self.TOKEN_MAJOR, self.TOKEN_MAJOR)
        # A in registers: the forward's cluster-split B (a 2-CTA cluster along M holds two W row tiles of one expert
        # and n_tile, so B is multicast) and consumer B passes (mainloop_dequant), token-contiguous or token-major
        if self.A_IN_REGISTERS:
            self.split_b = cluster_m == 2
            if consumer_b is None and self.TOKEN_MAJOR and self.split_b:
                # measured (RESULTS run 81, fc-step MXFP8): 12 of the CTA's 16 passes 327-332 TFLOP/s, 8 309, 16
                # 317-322 (token-contiguous: 8 416, 12 409, 16 358, so half stays the default there)
                consumer_b = 12
            self.set_consumer_b(consumer_b)
        self.m, self.n = m, n      # W's rows (A's) and columns (B's rows)
        self.cluster_m, self.cluster_n = cluster_m, cluster_n
        if tile_m % SF_ATOM_ROWS or tile_n % SF_ATOM_ROWS:
            raise NotImplementedError("the block-scaled wgrad loads whole 128-row SF atoms: tile_m and tile_n must be "
                                      "multiples of 128")
        self.row_blocks = (tile_m + tile_n) // SF_ATOM_ROWS   # the word table's 128-row blocks: A's, then B's
        self.log_vec = self.FORMAT.vec.bit_length() - 1

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(config.tile_m, config.tile_n, stages, problem.m, problem.n, config.cluster_m, config.cluster_n,
                   config.consumer_b_passes)

    # ------------------------------------------------------------------------------------------ sizes
    @classmethod
    def tx_bytes(cls, ab_dtype, tile_m: int, tile_n: int) -> int:
        """TMA bytes per stage: the narrow A and B tiles and their scale boxes (one per 128-row block)."""
        return (tile_m + tile_n) * cls.FORMAT.row_bytes + (tile_m + tile_n) // SF_ATOM_ROWS * BOX_LOAD_WORDS * 4

    @classmethod
    def smem_stage_bytes(cls, ab_dtype, tile_m: int, tile_n: int) -> int:
        """The narrow tiles and the scale-word table (a BOX_STRIDE_WORDS slot a box), the bf16 B (and A)
        stage(s), the worker barrier."""
        bf16_rows = tile_n if cls.A_IN_REGISTERS else tile_m + tile_n
        table = (tile_m + tile_n) // SF_ATOM_ROWS * BOX_STRIDE_WORDS * 4
        return (tile_m + tile_n) * cls.FORMAT.row_bytes + table + bf16_rows * TILE_K * 2 + 8

    def tiled_mma(self) -> cute.TiledMma:
        """bf16 wgmma: B (and a shared-memory A) K-major, or MN-major for token-major operands; A from registers
        (the RS fragment has one layout)."""
        major = cute.nvgpu.OperandMajorMode.MN if self.TOKEN_MAJOR else cute.nvgpu.OperandMajorMode.K
        source = warpgroup.OperandSource.RMEM if self.A_IN_REGISTERS else warpgroup.OperandSource.SMEM
        a_major = cute.nvgpu.OperandMajorMode.K if self.A_IN_REGISTERS else major
        return sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, a_major, major, cutlass.Float32, (2, 1, 1),
                                                 tiler_mn=(64, self.tile_n), a_source=source)

    def tma_operands(self):
        """((element type, TMA box extent along the token axis) of A, of B): token-major boxes are 64 tokens."""
        if const_expr(self.TOKEN_MAJOR):
            return (self.FORMAT.tma(0)[0], TILE_K), (self.FORMAT.tma(1)[0], TILE_K)
        return self.FORMAT.tma(0), self.FORMAT.tma(1)

    def ab_smem_layouts(self):
        """Token-contiguous: the forward's narrow stages. Token-major (FP8): (rows, 64 tokens, stages), 128 rows of a
        token in one 128-byte line, 64 lines per 128-row block, the 128-byte swizzle (16-byte chunk c of line t at
        c ^ (t % 8): a quarter warp reading one chunk of 8 tokens, or 8 chunks of one token, hits 8 bank groups)."""
        if const_expr(not self.TOKEN_MAJOR):
            return DequantMainloop.ab_smem_layouts(self)
        out = []
        for rows in (self.tile_m, self.tile_n):
            layout = cute.make_layout(((SF_ATOM_ROWS, rows // SF_ATOM_ROWS), TILE_K, self.stages),
                                      stride=((1, SF_ATOM_ROWS * TILE_K), SF_ATOM_ROWS, rows * TILE_K))
            out.append(cute.make_composed_layout(cute.make_swizzle(3, 4, 3), 0, layout))
        return tuple(out)

    def bf16_layouts(self):
        if const_expr(not self.TOKEN_MAJOR):
            return DequantMainloop.bf16_layouts(self)
        return tuple(mn_bf16_stage_layout(rows, self.stages) for rows in (self.tile_m, self.tile_n))

    def smem_fields(self):
        """The scale-word table of each stage (a box per 128-row block) and the bf16 stage(s)."""
        fields = DequantMainloop.smem_fields(self)
        words = BOX_STRIDE_WORDS * self.row_blocks * self.stages
        fields[0] = ("sSF", cute.struct.Align[cute.struct.MemRange[Int32, words], 128])
        return fields

    @cute.jit
    def smem_tensors(self, storage, tidx: Int32, nthreads: cutlass.Constexpr):
        """As the forward's (mainloop_dequant), with the scale-word table (flat Int32) first and its bytes last."""
        n_words = BOX_STRIDE_WORDS * self.row_blocks * self.stages
        words = storage.sSF.get_tensor(cute.make_layout(n_words))
        sf_bytes = cute.make_tensor(cute.recast_ptr(storage.sSF.data_ptr(), dtype=cutlass.Uint8),
                                    cute.make_layout(4 * n_words))
        return (words,) + self.stage_views(storage) + (sf_bytes,)

    # ------------------------------------------------------------------------------------------ schedule
    @cute.jit
    def segment(self, tile) -> Segment:
        """The tile's expert from the schedule's tile (scheduler.Tile: k_start, k_head, k_keep, k_count)."""
        start = tile.k_start + tile.k_head
        end = tile.k_start + (tile.k_count - 1) * TILE_K + tile.k_keep
        last = (end - 1 - start) >> self.log_vec
        return Segment(start, end, tile.k_start, tile.k_head, tile.k_keep, tile.k_count, last)

    @cute.jit
    def stage(self, seg: Segment, k: Int32) -> Stage:
        """Stage k of the tile: its first token, the word table's first quad, the expert's tokens in it."""
        tb = seg.k_start + k * TILE_K
        first = cutlass.min(cutlass.max(tb - seg.start, Int32(0)) >> self.log_vec, seg.last_block)
        lo = Int32(0)
        hi = Int32(TILE_K)
        if k == 0:
            lo = seg.k_head
        if k == seg.k_count - 1:
            hi = seg.k_keep
        partial = (lo > 0) | (hi < TILE_K)
        return Stage(tb, seg.start, first >> 2, lo, hi, seg.last_block, partial, partial | ((seg.start & 15) != 0))

    @cute.jit
    def block_of(self, st: Stage, t: Int32) -> Int32:
        """Local scale block of stage token t (0..63), clamped to the expert's blocks (tokens of other experts take
        a block of their row that the expert has: their values are zeroed, and a NaN scale of that block makes the
        row NaN anyway)."""
        return cutlass.min(cutlass.max(st.tb + t - st.start, Int32(0)) >> self.log_vec, st.last_block)

    def pass_row_word(self, operand: int, row0: Int32, lane: Int32) -> Int32:
        """`row_word` of lane's row row0 + lane // 4 of `operand`'s 8-row pass at row0 (a multiple of 8, so the
        sum splits: the warp-uniform row0's word plus 4 words a row)."""
        return row_word(row0 + (0 if const_expr(operand == 0) else self.tile_m)) + ((lane >> 2) << 2)

    def table_word(self, st: Stage, idx: Int32, block: Int32, rw: Int32, operand: int) -> Int32:
        """Index of the word holding local block `block` of `operand`'s row whose `row_word` is rw in stage idx (in
        the atom of the block's quad, `box_shift` words into the box's slot); the block's byte in it is block % 4."""
        slot = cutlass.min(cutlass.max((block >> 2) - st.q0, 0), SF_SLOTS - 1)
        shift = box_shift(self.m if operand == 0 else self.n, self.log_vec, st.start)
        return idx * self.row_blocks * BOX_STRIDE_WORDS + slot * ATOM_WORDS + rw + shift

    @cute.jit
    def sf_code(self, smem, st: Stage, idx: Int32, rw: Int32, block: Int32, operand: cutlass.Constexpr) -> Int32:
        """The SF byte of local block `block` of `operand`'s row whose `row_word` is rw in stage idx."""
        return Int32(smem[7][self.table_word(st, idx, block, rw, operand) * 4 + (block & 3)]) & Int32(0xFF)

    @staticmethod
    def byte_selector(block: Int32) -> Int32:
        """The permute selector of `row_pair_scales` for local block `block`: byte block % 4 of each word."""
        byte = block & 3
        return byte | ((byte + 4) << 4)

    @staticmethod
    @cute.jit
    def row_pair_scales(w0: Int32, w1: Int32, sel: Int32) -> Int32:
        """The e8m0 scales of one block of two rows (their table words w0, w1; `byte_selector`) as bf16x2, the first
        row in the low half (0x00 -> 2^-127, 0xFF -> NaN)."""
        codes = dq.prmt_dynamic(w0, w1, sel)                                  # bytes 0, 1: the two rows
        return dq.e8m0_bf16x2(dq.prmt(codes, 0x4140))                         # each code in its own half

    # ------------------------------------------------------------------------------------------ producer
    def scale_tmas(self, tensors, cluster_m: int, cluster_n: int):
        """(atom, tensor) of the SFA and SFB scale-box TMAs (`sf_words_tma`; each CTA loads its own boxes)."""
        return (*sf_words_tma(tensors["sfa"]), *sf_words_tma(tensors["sfb"]))

    @cute.jit
    def partition_scale_loads(self, tma_atom_sfa, mSFA, tma_atom_sfb, mSFB, smem, rank_m, rank_n):
        """The TMAs, their 64-bit views and the word table as (box element, 128-row block, stage), 64-bit."""
        slot = BOX_STRIDE_WORDS // 2                     # (64-bit elements, as the TMA loads them)
        table = cute.make_tensor(cute.recast_ptr(smem[0].iterator, dtype=Int64), cute.make_layout(
            (BOX_LOAD_WORDS // 2, self.row_blocks, self.stages), stride=(1, slot, slot * self.row_blocks)))
        return tma_atom_sfa, mSFA, tma_atom_sfb, mSFB, table

    @cute.jit
    def load_tile(self, ab_pipeline, prod_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB,
                  a_mcast_mask, b_mcast_mask, k_count: Int32, side_inputs, tile, descriptors=None):
        """k_count stages of the tile: the narrow A / B boxes and the stage's scale boxes by TMA (`descriptors`:
        None, wgrad has no per-expert weights)."""
        seg = self.segment(tile)
        fmt = self.FORMAT
        kb_n = (((seg.end - seg.start + fmt.vec - 1) >> self.log_vec) + 3) >> 2     # the segment's quads
        return self.produce_stages(ab_pipeline, prod_state, (tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB),
                                   a_mcast_mask, b_mcast_mask, k_count, (side_inputs, tile, seg, kb_n))

    @cute.jit
    def load_stage_scales(self, scales, bar, k: Int32, s: Int32, a_mcast_mask, b_mcast_mask, descriptors):
        """Stage k's scale boxes (load_tile's docstring; its per-tile `scales`): per 128-row block rb of the tile's
        A rows, then B's, the atoms of quads Q0, Q0 + 1 of rb in the expert's segment, at byte base + (rb * kb_n +
        Q0) * 512 (base = rup(rows, 128) / vec bytes a token before the expert's first), from the 16-byte boundary
        at or below it (`box_load_word`)."""
        (tma_atom_sfa, mSFA, tma_atom_sfb, mSFB, table), tile, seg, kb_n = scales
        st = self.stage(seg, k)
        for i in cutlass.range_constexpr(self.row_blocks):
            operand, rb = box_row_block(i, self.tile_m, self.tile_n, tile.m_tile, tile.n_tile)
            atom = tma_atom_sfa if const_expr(operand == 0) else tma_atom_sfb
            mSF = mSFA if const_expr(operand == 0) else mSFB
            rows = self.m if const_expr(operand == 0) else self.n
            word = box_load_word(rows, self.log_vec, seg.start, rb, kb_n, st.q0)
            box = cute.local_tile(cute.domain_offset((word >> 1,), mSF), (BOX_LOAD_WORDS // 2,), (None,))
            dst, src = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                             cute.group_modes(table[(None, i, None)], 0, 1),
                                             cute.group_modes(box, 0, 1))
            cute.copy(atom, src[(None, 0)], dst[(None, s)], tma_bar_ptr=bar)

    # ------------------------------------------------------------------------------------------ converters
    @cute.jit
    def convert_kgroup(self, smem, st: Stage, operand: cutlass.Constexpr, row: Int32, rw: Int32, q: Int32,
                       idx: Int32, valid: cutlass.Boolean, store, general: cutlass.Constexpr):
        """Group q (stage tokens 16q..16q+15) of row `row` of token-contiguous `operand` -> store(p, pair), scaled
        by its block's SF byte from the word table (the row's `row_word` rw; `valid` false: 0.0, B rows past n_w).
        General path: the group may span two blocks (its first `split` tokens in the first), each half of a pair
        takes its token's scale, and tokens outside the stage's [lo, hi) come out zero."""
        fmt = self.FORMAT
        u0 = q * dq.GROUP
        b0 = self.block_of(st, u0)
        s0 = dq.scale_bf16x2(self.sf_code(smem, st, idx, rw, b0, operand), fmt.sf, valid)
        words = self.group_words(smem, operand, row, q, idx)
        if const_expr(not general):
            dq.convert_group(words, fmt.data, s0, store)
        else:
            s1 = dq.scale_bf16x2(self.sf_code(smem, st, idx, rw, cutlass.min(b0 + 1, st.last_block), operand),
                                 fmt.sf, valid)
            split = self.clamp16(st.start + ((b0 + 1) << self.log_vec) - st.tb - u0)
            first = (Int32(1) << split) - 1                                   # bit i: token u0 + i in block b0
            keep = ((Int32(1) << self.clamp16(st.hi - u0)) - 1) & ~((Int32(1) << self.clamp16(st.lo - u0)) - 1)

            def scale_of(p):
                h = [Int32(cutlass.select_(((first >> dq.pair_k(fmt.data, p, e)) & 1) != 0, s0, s1))
                     for e in range(2)]
                return dq.prmt2(h[0], h[1], 0x7610)

            def masked(p, pair):
                m = [Int32(cutlass.select_(((keep >> dq.pair_k(fmt.data, p, e)) & 1) != 0,
                                           dq._i32(0xFFFF << (16 * e)), Int32(0))) for e in range(2)]
                store(p, pair & (m[0] | m[1]))

            dq.convert_group(words, fmt.data, scale_of, masked)

    @staticmethod
    def clamp16(x: Int32) -> Int32:
        return cutlass.min(cutlass.max(x, Int32(0)), Int32(dq.GROUP))

    @cute.jit
    def process_stage(self, worker: cutlass.Constexpr, smem, sA, sB, idx: Int32, k: Int32, k_count: Int32, tile_ctx,
                      lane: Int32):
        """Worker `worker` converts its passes of stage idx (tile-local k-tile k) into the bf16 stage(s). The lane's
        coordinates are re-derived per stage from an opaque lane index: the per-pass addresses do not depend on the
        stage, and hoisted out of the k-loop they spilled the workers' registers."""
        lane = q8.opaque(lane)
        st = self.stage(self.segment(tile_ctx), k)
        if const_expr(self.TOKEN_MAJOR):
            if st.general:
                self.convert_mn_stage(worker, smem, st, idx, lane, True)
            else:
                self.convert_mn_stage(worker, smem, st, idx, lane, False)
        else:
            if st.general:
                self.convert_k_stage(worker, smem, st, idx, lane, tile_ctx.n_tile, True)
            else:
                self.convert_k_stage(worker, smem, st, idx, lane, tile_ctx.n_tile, False)

    @cute.jit
    def convert_k_stage(self, worker: cutlass.Constexpr, smem, st: Stage, idx: Int32, lane: Int32, n_tile: Int32,
                        general: cutlass.Constexpr):
        """The forward's passes (8 rows x 4 groups each, every third pass per worker) over token-contiguous stages;
        B rows past n_w scaled by 0; split B: this CTA's half of B's rows."""
        units = self._units()
        b0 = self.b_base()
        for u in cutlass.range_constexpr(worker[0] - 1, len(units), len(WORKERS)):
            operand, r0 = units[u]
            first = r0 + (b0 if const_expr(operand == 1) else 0)
            row = first + (lane >> 2)
            q = lane & 3
            valid, store = self.row_group_store(smem, operand, row, q, idx, n_tile)
            self.convert_kgroup(smem, st, operand, row, self.pass_row_word(operand, first, lane), q, idx, valid,
                                store, general)

    # token-major (FP8): a pass is 64 rows x 8 tokens (rows 64 (p // 8).., K line group p % 8 of the stage: 1 KiB,
    # contiguous in the MN-major bf16 stage), one 16-row x 1-token group a lane, 32 passes for 256 rows as in the
    # K-major layout, so the worker / consumer shares and the cluster split are the forward's (`_units`)
    @cute.jit
    def convert_mn_stage(self, worker: cutlass.Constexpr, smem, st: Stage, idx: Int32, lane: Int32,
                         general: cutlass.Constexpr):
        """The worker's passes (every third of `_units`) of a token-major stage; split B: this CTA's half."""
        units = self._units()
        b0 = self.b_base()
        for u in cutlass.range_constexpr(worker[0] - 1, len(units), len(WORKERS)):
            operand, r0 = units[u]
            self.convert_mn_pass(smem, st, idx, operand, r0 + (b0 if const_expr(operand == 1) else 0), lane, general)

    @cute.jit
    def convert_mn_pass(self, smem, st: Stage, idx: Int32, operand: cutlass.Constexpr, row0: Int32, lane: Int32,
                        general: cutlass.Constexpr):
        """The token-major pass p = row0 // 8: lane l converts rows 64 (p // 8) + 16 (l // 8) .. + 15 of stage token
        8 (p % 8) + l % 8 (a quarter warp's loads and stores each hit 8 bank groups). Fast path (the expert starts
        on a 16-token boundary and fills the stage): the 8 tokens of a quarter warp lie in one scale block, so lane
        l % 8 = j decodes the scales of rows 2j, 2j + 1 (`lane_pair_scales`) and the quarter warp shares them by
        shuffles; general: each lane decodes its token's 16 scales (`mn_scales`; sharing two blocks' scales by
        shuffles instead spilled the stage workers of Config(dequant_a="workers")) and zeroes other experts'
        tokens."""
        p = row0 >> 3
        r0 = (p >> 3) * 64 + (lane >> 3) * 16
        t = (p & 7) * 8 + (lane & 7)
        if const_expr(general):
            scales = self.mn_scales(smem, st, idx, operand, r0, self.block_of(st, t))
        else:
            mine = self.lane_pair_scales(smem, st, idx, operand, r0, lane, self.block_of(st, (p & 7) * 8))
            scales = [cute.arch.shuffle_sync(mine, (lane & 0x18) | j) for j in range(8)]
        self.convert_mn_token(smem, st, idx, operand, r0, t, scales, general)

    @cute.jit
    def mn_scales(self, smem, st: Stage, idx: Int32, operand: cutlass.Constexpr, r0: Int32, block: Int32):
        """The scales of rows r0..r0+15 (a 16-row chunk of `operand`) in local block `block` as 8 bf16x2 pairs
        (rows 2p, 2p + 1): the chunk's 16 words of the block's atom (4 words apart: one 32-row group), its byte
        picked by a register-selected permute, e8m0 -> bf16 two at a time (0x00 -> 2^-127, 0xFF -> NaN)."""
        base = self.table_word(st, idx, block, row_word(r0 + (0 if const_expr(operand == 0) else self.tile_m)),
                               operand)
        words = [smem[0][base + 4 * j] for j in range(16)]
        sel = self.byte_selector(block)
        return [self.row_pair_scales(words[2 * p], words[2 * p + 1], sel) for p in range(8)]

    @cute.jit
    def lane_pair_scales(self, smem, st: Stage, idx: Int32, operand: cutlass.Constexpr, r0: Int32, lane: Int32,
                         block: Int32) -> Int32:
        """The bf16x2 scales of rows r0 + 2j, r0 + 2j + 1 (j = lane % 8) in local block `block`. The two rows' words
        are 4 apart; lanes 4-7 of a quarter warp read them in the other order, so each of the two loads hits 16
        banks twice (2 wavefronts, not 4), and a swapped selector undoes it."""
        trow = r0 + 2 * (lane & 7) + (0 if const_expr(operand == 0) else self.tile_m)
        w = self.table_word(st, idx, block, row_word(trow), operand)
        swap = (lane >> 2) & 1
        byte = block & 3
        sel = Int32(cutlass.select_(swap != 0, (byte + 4) | (byte << 4), self.byte_selector(block)))
        return self.row_pair_scales(smem[0][w + 4 * swap], smem[0][w + 4 - 4 * swap], sel)

    def b_pass_bytes(self, idx: Int32, row: Int32) -> Int32:
        """Token-major: pass p = row // 8 sits at rows 64 (p // 8).. of K line group p % 8 (mn_bf16_stage_layout;
        `mn_bf16_word` of its first row and token, in bytes, without the general formula's shift and mask:
        tests/test_dequant_split_compile.py checks the two agree)."""
        if const_expr(not self.TOKEN_MAJOR):
            return DequantMainloop.b_pass_bytes(self, idx, row)
        p = row >> 3
        return (idx * self.tile_n * TILE_K + (p & 7) * 8 * self.tile_n + (p >> 3) * 512) * 2

    @cute.jit
    def convert_mn_token(self, smem, st: Stage, idx: Int32, operand: cutlass.Constexpr, r0: Int32, t: Int32,
                         scales, partial: cutlass.Constexpr):
        """Token t (0..63) of rows r0..r0+15 of a token-major stage -> two 16-byte stores into the MN-major bf16
        stage (rows r0..r0+7 and r0+8..r0+15 of K line t); partial: zero where t is another expert's."""
        rows = self.tile_m if const_expr(operand == 0) else self.tile_n
        src = smem[3 + operand]
        line = (idx * rows + (r0 & ~127)) * TILE_K + t * 128          # bytes: the 128-row block's line t
        chunk = ((r0 & 127) >> 4) ^ (t & 7)
        words = load_words(src.iterator + ((line + chunk * 16) >> 2), 4)
        if const_expr(partial):
            keep = Int32(cutlass.select_((t >= st.lo) & (t < st.hi), Int32(-1), Int32(0)))
            words = [w & keep for w in words]
        out = []
        dq.convert_group(words, self.FORMAT.data, lambda p: scales[p], lambda p, pair: out.append(pair))
        at = mn_bf16_word(rows, idx, r0, t)
        for half in cutlass.range_constexpr(2):
            store_words(smem[5 + operand].iterator + at + half * MN_CORE_WORDS, out[4 * half: 4 * half + 4])

    # ------------------------------------------------------------------------------------------ consumer
    @cute.jit
    def mma_tile(self, ab_pipeline, read_state, release_state, operands, acc: cute.Tensor, k_count: Int32,
                 stage_mbar=None, tile=None):
        """A converted by the workers: the bf16 SS k-loop. A in registers: pairs of stages (each fragment a fixed
        register set) and, for an odd count, the last stage after them; the first stage has no previous one to
        release, the odd last one releases the pair loop's last."""
        tiled_mma, tCrA, tCrB, smem = operands
        if const_expr(not self.A_IN_REGISTERS):
            return WgmmaMainloop.mma_tile(self, ab_pipeline, read_state, release_state, (tiled_mma, tCrA, tCrB),
                                          acc, k_count, stage_mbar)
        frags = ((cute.make_rmem_tensor(tCrA, BFloat16),), (cute.make_rmem_tensor(tCrA, BFloat16),))   # 1 part each
        a_thread = self.a_thread(smem) + (self.segment(tile),)
        b_thread = self.b_thread(smem, tile) + (a_thread[3],)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        for j in cutlass.range(k_count // 2, unroll=1):
            for b in cutlass.range_constexpr(2):
                self._stage(ab_pipeline, read_state, tiled_mma, acc, frags[b], tCrB, a_thread, 2 * j + b, stage_mbar,
                            b_thread)
                read_state.advance()
                warpgroup.wait_group(1)           # the previous stage's wgmmas are done: release it
                if const_expr(b == 0):
                    if j > 0:
                        ab_pipeline.consumer_release(release_state)
                    release_state = advanced_if(release_state, j > 0)
                else:
                    ab_pipeline.consumer_release(release_state)
                    release_state.advance()
        for _k in cutlass.range(k_count % 2, unroll=1):
            self._stage(ab_pipeline, read_state, tiled_mma, acc, frags[0], tCrB, a_thread, k_count - 1, stage_mbar,
                        b_thread)
            read_state.advance()
            warpgroup.wait_group(1)
            if k_count > 1:
                ab_pipeline.consumer_release(release_state)
            release_state = advanced_if(release_state, k_count > 1)
        return read_state, release_last(ab_pipeline, release_state, k_count)

    @cute.jit
    def consumer_b_pass(self, b_thread, row0: Int32, lane: Int32, idx: Int32, k: Int32):
        """A consumer lane's share of the B pass at row0 (token-major: `convert_mn_pass`; else the forward's)."""
        if const_expr(not self.TOKEN_MAJOR):
            self.consumer_b_kpass(b_thread, row0, lane, idx, k)
        else:
            st = self.stage(b_thread[4], k)
            if st.general:
                self.convert_mn_pass(b_thread[0], st, idx, 1, row0, lane, True)
            else:
                self.convert_mn_pass(b_thread[0], st, idx, 1, row0, lane, False)

    @cute.jit
    def consumer_b_kpass(self, b_thread, row0: Int32, lane: Int32, idx: Int32, k: Int32):
        """A consumer lane's group of the B pass at row0 (mainloop_dequant's consumer passes) as `convert_k_stage`
        converts it."""
        smem, _, _, n_tile, seg = b_thread
        st = self.stage(seg, k)
        row = row0 + (lane >> 2)
        q = lane & 3
        rw = self.pass_row_word(1, row0, lane)
        valid, store = self.row_group_store(smem, 1, row, q, idx, n_tile)   # (once, before the path split)
        if st.general:
            self.convert_kgroup(smem, st, 1, row, rw, q, idx, valid, store, True)
        else:
            self.convert_kgroup(smem, st, 1, row, rw, q, idx, valid, store, False)

    @cute.jit
    def _convert_a(self, frag, a_thread, idx: Int32, k: Int32):
        """The thread's A groups of stage idx into its RS fragment (`frag`: a 1-tuple, as the forward's), scales
        from the word table; the general path for the first / last stage and unaligned experts."""
        smem, row, q, seg = a_thread
        words = cute.make_tensor(cute.recast_ptr(frag[0].iterator, dtype=Int32), cute.make_layout(2 * dq.PAIRS))
        st = self.stage(seg, k)
        if const_expr(self.TOKEN_MAJOR):
            if st.partial | ((st.start & (self.FORMAT.vec - 1)) != 0):
                self._convert_a_tokens(words, smem, st, row, q, idx, True)
            else:
                self._convert_a_tokens(words, smem, st, row, q, idx, False)
        elif st.general:
            self._convert_a_rows(words, smem, st, row, q, idx, True)
        else:
            self._convert_a_rows(words, smem, st, row, q, idx, False)

    @cute.jit
    def _convert_a_rows(self, words: cute.Tensor, smem, st: Stage, row: Int32, q: Int32, idx: Int32,
                        general: cutlass.Constexpr):
        for half in cutlass.range_constexpr(2):
            def store(p, pair, half=half):
                words[2 * p + half] = pair

            self.convert_kgroup(smem, st, 0, row + 8 * half, row_word(row + 8 * half), q, idx,
                                cutlass.Boolean(True), store, general)

    @cute.jit
    def _convert_a_tokens(self, words: cute.Tensor, smem, st: Stage, row: Int32, q: Int32, idx: Int32,
                          general: cutlass.Constexpr):
        """Token-major A into the RS fragment, K in its natural order (B's token-major bf16 stage has it): word
        2p + half = row r + 8 half at tokens 8p + 2q, 8p + 2q + 1. Rows r and r + 8 are bytes r % 16 and r % 16 + 8
        of one 16-byte chunk of a token's line: one 32-bit load per token and row, a register-selected permute
        pairs two tokens' bytes. Scales: the stage's blocks (fast path: tokens 0..31 in the first, 32..63 in the
        next); general: each token's own block, other experts' tokens zeroed."""
        fmt = self.FORMAT
        src = smem[3]
        byte = row & 3
        sel = byte | ((byte + 4) << 4)
        first = self.block_of(st, Int32(0))
        n_blocks = 3 if const_expr(general) else TILE_K // fmt.vec
        scales = [[dq.scale_bf16x2(self.sf_code(smem, st, idx, row_word(row + 8 * half),
                                                cutlass.min(first + j, st.last_block), 0), fmt.sf,
                                   cutlass.Boolean(True))
                   for j in range(n_blocks)] for half in range(2)]
        for p in cutlass.range_constexpr(dq.PAIRS):
            t0 = 8 * p + 2 * q
            line = [(idx * self.tile_m * TILE_K + t * 128   # A: one 128-row block, a 128-byte line per token
                     + ((((row & 127) >> 4) ^ (t & 7)) << 4) + (row & 15)) >> 2 for t in (t0, t0 + 1)]
            for half in cutlass.range_constexpr(2):
                codes = dq.prmt_dynamic(src[line[0] + 2 * half], src[line[1] + 2 * half], sel)
                x = dq.fp8_pair(codes, fmt.data, 0)
                if const_expr(not general):
                    words[2 * p + half] = dq.scale_pair(x, fmt.data, scales[half][(8 * p) // fmt.vec])
                else:
                    h = [self.pick3(scales[half], self.block_of(st, t0 + e) - first) for e in range(2)]
                    keep = [Int32(cutlass.select_((t0 + e >= st.lo) & (t0 + e < st.hi),
                                                  dq._i32(0xFFFF << (16 * e)), Int32(0))) for e in range(2)]
                    y = dq.scale_pair(x, fmt.data, dq.prmt2(h[0], h[1], 0x7610))
                    words[2 * p + half] = y & (keep[0] | keep[1])

    @staticmethod
    def pick3(s, j: Int32) -> Int32:
        """s[j] of three values, j in 0..2."""
        return Int32(cutlass.select_(j == 0, s[0], cutlass.select_(j == 1, s[1], s[2])))


# ---------------------------------------------------------------------------------------------- token-major bf16
MN_CORE_WORDS = 32     # one 8 x 8 bf16 core matrix: 128 bytes


def mn_bf16_stage_layout(rows: int, stages: int):
    """bf16 stages (rows, 64, stages), MN-major without swizzle (interleaved): 8 x 8 core matrices of 128 contiguous
    bytes (8 rows of one K line per 16 bytes, 8 K lines), row chunks 128 bytes apart (SBO), K chunks rows * 16
    bytes apart (LBO). Element (r, k) sits at byte (r // 8) * 128 + (k % 8) * 16 + (k // 8) * rows * 16 + (r % 8) * 2:
    a quarter warp storing K lines t..t+7 of one row chunk fills one core matrix (8 bank groups)."""
    layout = cute.make_layout(((8, rows // 8), (8, TILE_K // 8), stages),
                              stride=((1, 64), (8, 8 * rows), rows * TILE_K))
    return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, layout)


def mn_bf16_word(rows: int, idx, r0, t):
    """Word offset (of the flat bf16 stages) of rows r0..r0+7 (r0 % 8 == 0) of K line t in stage idx."""
    return (idx * rows * TILE_K + (r0 >> 3) * 64 + (t & 7) * 8 + (t >> 3) * 8 * rows) >> 1
