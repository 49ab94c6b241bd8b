"""Staged block-scaled operands: converted once, inside the GEMM kernel, beside it (`problem.staged`).

The on-chip dequantizing mainloop (mainloop_dequant) converts each B tile once per M block that reads it; with many
rows per expert that repeated conversion is its bound, and a conversion by XLA before the bf16 kernel costs a serial
pass over the operands (~0.27 ms of fc1's 1.6 ms for MXFP8). Here the producer warpgroup's idle warps 1-3 convert
the weights exactly to bf16 (dequant.convert_group: the on-chip mainloop's bit placement) into a global workspace
(`operands.WORKSPACES`: staged_b (L, N, K)) while the consumers already multiply; only the producer warp waits, per
512-wide K chunk of a tile, for that chunk's ready flags. A block-scaled A goes one of two ways
(`operands.staged_a_in_registers`, `Config.dequant_a`):
  "registers"  (StagedBMainloop) the producer loads A's codes and SF atoms by TMA as on chip and the consumers
               convert their A groups into the RS wgmma's register operand, once per N tile: no A workspace. B is
               then written in the on-chip K slot order (pair p of group q at slots 8p + 2q, 8p + 2q + 1 of each
               64-wide stage), so both operands are permuted alike;
  "workspace"  (StagedMainloop) the converters also write A once into staged_a (m, K) in natural K order and the
               16-bit mainloop (WgmmaMainloop, TMA from the workspaces) runs unchanged (also every 16-bit A).
Per N tile the registers cost one conversion of A's stage and save reading a bf16 A stage; the workspace writes A
once for all N tiles (RESULTS runs 118-119: the registers win up to N 4096 measured, lose at 7168).

Jobs: 32 rows x one K chunk of A (an expert's rows; "workspace") or of B[e] (N rows; experts without rows have no B
jobs); a lane converts one 16-wide group of a row (FP8: a 16-byte load, FP4: 8 bytes, its SF byte from the MMA-tiled
layout) into 32 bytes of bf16. Warps take jobs from a global counter in need order -- expert by expert, within an
expert chunk by chunk, A's slabs before B's -- so the first experts' chunks are ready first. A job publishes its
chunk by fence.proxy.async.global (its generic stores, read next by the TMA's async proxy) and a release add on the
chunk's flag (A: per 128-row tile, counting its 4 slabs; B: per expert and 128-row block, counting the block's
slabs). The producer acquires the flags of a chunk (ld.acquire.gpu spin) and fences the async proxy before its TMA
loads.

The job counter and the flags are zeroed by a small kernel launched before the GEMM (gemm.launch). Pacing the
converters to the producers' progress (a job taken only within a few (expert, chunk) steps of the furthest one a
producer waits for) measured no faster than this burst (RESULTS run 111): the kernel runs at the board's power limit,
so its time follows the conversion's energy, not when it is spent.

Exact like the XLA route (cudnn_moe_jax._dequant_first): the same bf16 values (an FP8 / FP4 code times its scale,
rounded once below 2^-126) and the same bf16 wgmma with fp32 accumulation, so the reference's sums up to their
order; "workspace" keeps the route's K order and schedule (outputs bit-identical to the route), "registers" sums
each stage in the slot order. Beside an fp16 A (weight-only, weights fp16 holds exactly: NVFP4) B is converted to
fp16 and the fp16 kernel runs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm

from cudnn_moe_jax.formats import SF_ATOM_BYTES, SF_ATOM_ROWS, cdiv, sf_atom_byte, sf_atom_start
from cudnn_moe_jax.operands import STAGED_CHUNK_K, STAGED_HEADER_WORDS, half_dtype

from .. import dequant as dq
from ..dequant import ld_global_words
from .mainloop import TILE_K, WgmmaMainloop, ab_stage_bytes, copy_ab_stage, make_ab_smem_layouts
from .mainloop_dequant import DequantFormat, DequantMainloop, narrow_stage_layout
from .mainloop_mxfp8 import sf_atom_tma

SLAB = 32                                # rows per job
BATCH = {False: 4, True: 8}              # rows whose codes a lane loads before converting them (FP8, FP4)
STAGES_PER_CHUNK = STAGED_CHUNK_K // TILE_K
SCRATCH_ROW_BYTES = 4 * 256              # a converter warp's scratch for one row of a chunk (B in the K slot order)


def _asm(ret, code: str, constraints: str, *args):
    return llvm.inline_asm(ret, [a.ir_value() for a in args], code, constraints, has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def ld_global_scalar(addr: Int64, kind: cutlass.Constexpr = "u8") -> Int32:
    """A byte ("u8", zero-extended) or a 32-bit word ("b32") at a global address, through the read-only path."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int64(addr).ir_value()], f"ld.global.nc.{kind} $0, [$1];",
                                 "=r,l", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def next_job(addr: Int64) -> Int32:
    """The job counter's old value, incremented by one (relaxed: a job's data is published by its flag)."""
    return Int32(_asm(Int32.mlir_type, "atom.global.add.u32 $0, [$1], 1;", "=r,l", Int64(addr)))


@cute.jit
def take_job(counter: Int64, lane: Int32) -> Int32:
    """The warp's next job (lane 0 takes it from the counter, every lane gets it)."""
    j = Int32(0)
    if lane == 0:
        j = next_job(counter)
    return cute.arch.shuffle_sync(j, 0)


@cute.jit
def publish(addr: Int64):
    _asm(None, "red.release.gpu.global.add.u32 [$0], 1;", "l", Int64(addr))


@cute.jit
def acquire(addr: Int64) -> Int32:
    return Int32(_asm(Int32.mlir_type, "ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", Int64(addr)))


@cute.jit
def raise_to(addr: Int64, value: Int32):
    """The word at `addr` becomes max(word, value) (relaxed: a progress mark, no data behind it)."""
    _asm(None, "red.relaxed.gpu.global.max.u32 [$0], $1;", "l,r", Int64(addr), Int32(value))


@cute.jit
def read_mark(addr: Int64) -> Int32:
    """A word other CTAs raise (`raise_to`), read past L1."""
    return Int32(_asm(Int32.mlir_type, "ld.relaxed.gpu.global.u32 $0, [$1];", "=r,l", Int64(addr)))


@cute.jit
def nap():
    _asm(None, "nanosleep.u32 500;", "")


@cute.jit
def fence_async_global():
    _asm(None, "fence.proxy.async.global;", "")


@cute.jit
def wait_flag(addr: Int64, target: Int32):
    while acquire(addr) < target:
        pass


@cute.jit
def st_shared_word(addr: Int32, w: Int32):
    _asm(None, "st.shared.b32 [$0], $1;", "r,r,~{memory}", Int32(addr), Int32(w))


@cute.jit
def ld_shared_v4(addr: Int32) -> list:
    i32 = Int32.mlir_type
    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [Int32(addr).ir_value()],
                          "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(i32, res, [k])) for k in range(4)]


def _half_stage_bytes(ab_dtype, tile_m: int, tile_n: int) -> int:
    return ab_stage_bytes(cutlass.BFloat16, tile_m, tile_n)   # bf16 or fp16: 2 bytes an element


def mainloop_class(problem, config):
    """The staged mainloop of `problem` under `config.dequant_a`: "workspace" converts a block-scaled A once like B
    (StagedMainloop; also every problem with a 16-bit A), "registers" leaves A to the consumers' RS fragment and
    stages B in the on-chip K slot order (StagedBMainloop, a subclass binding the format)."""
    if problem.a_dtype is not None or config.dequant_a == "workspace":
        return StagedMainloop
    if config.dequant_a != "registers":
        raise NotImplementedError("a staged block-scaled A is converted in the consumers' registers or once into a "
                                  "workspace (Config.dequant_a 'registers' or 'workspace')")
    if problem.k % TILE_K:
        raise NotImplementedError(f"staged B in the K slot order needs K % {TILE_K} == 0 (the order permutes "
                                  "within a 64-wide stage; Config(dequant_a='workspace') takes K tails)")
    fmt = DequantFormat.of(problem)
    return type(f"StagedBMainloop_{fmt.data}_{fmt.sf}_{fmt.vec}", (StagedBMainloop,), {"FORMAT": fmt})


class StagedConverters:
    """The converter warps of a staged mainloop (module docstring: jobs, flags) and the producer's chunk waits;
    mixed into a mainloop class that calls `init_staged`. B's bf16 rows are written in the on-chip K slot order
    through the warp's shared `scratch` where the mainloop has one (StagedBMainloop), else in natural K order."""

    CONVERT_WARPS = (1, 2, 3)
    PRODUCER_REGS = 56          # the converters hold a batch of groups' words (mainloop_dequant's FP8 workers: 56)

    def init_staged(self, problem, stage_a: bool):
        self.f16 = half_dtype(problem) == "float16"   # beside an fp16 A: the converted B in fp16
        self.data = problem.ab_dtype
        self.sf_dtype, self.vec = problem.sf_dtype, problem.sf_vec_size
        self.stage_a = stage_a
        self.n, self.k, self.num_groups = problem.n, problem.k, problem.num_groups
        self.k_chunks = cdiv(problem.k, STAGED_CHUNK_K)
        self.n_blocks = cdiv(problem.n, SF_ATOM_ROWS)         # B's 128-row blocks (flags, SF row blocks)
        self.kb_atoms = cdiv(cdiv(problem.k, problem.sf_vec_size), 4)
        self.row_bytes = problem.k // 2 if problem.ab_dtype == dq.E2M1 else problem.k

    @staticmethod
    def scratch(smem):
        """The converter warp's shared scratch address (B in the K slot order), else None."""
        return None

    @cute.jit
    def wait_chunk(self, a_flags, b_flags, tile, c: Int32):
        """Wait for the tile's flags of chunk c (A's where A is staged)."""
        header = b_flags.iterator.toint()
        if const_expr(self.stage_a):
            wait_flag(a_flags.iterator.toint() + Int64(tile.m_tile * self.k_chunks + c) * 4,
                      Int32(SF_ATOM_ROWS // SLAB))
        for h in cutlass.range_constexpr(self.tile_n // SF_ATOM_ROWS):
            rb = tile.n_tile * (self.tile_n // SF_ATOM_ROWS) + h
            if rb < self.n_blocks:
                slabs = cutlass.min(Int32(SF_ATOM_ROWS // SLAB),
                                    (Int32(self.n) - rb * SF_ATOM_ROWS + SLAB - 1) // SLAB)
                flag = STAGED_HEADER_WORDS + (tile.group * self.n_blocks + rb) * self.k_chunks + c
                wait_flag(header + Int64(flag) * 4, slabs)
        fence_async_global()

    @cute.jit
    def load_tile(self, ab_pipeline, prod_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, a_mcast_mask,
                  b_mcast_mask, k_count: Int32, side_inputs=None, tile=None, descriptors=None, b_own=None):
        """The producer's k-loop: before a chunk's first stage its flags (`producer_inputs`: (flags, SFA loads or
        None)), then per stage the TMA of A and B and, with A in registers, A's SF atom."""
        flags, sfa = side_inputs
        prod_state.reset_count()
        for _k in cutlass.range(k_count, unroll=1):
            k = prod_state.count
            if k % STAGES_PER_CHUNK == 0:
                self.wait_chunk(flags[0], flags[1], tile, k // STAGES_PER_CHUNK)
            ab_pipeline.producer_acquire(prod_state)
            bar = ab_pipeline.producer_get_barrier(prod_state)
            s = prod_state.index
            copy_ab_stage(tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, bar, k, s, a_mcast_mask, b_mcast_mask)
            if const_expr(sfa is not None):
                tma_atom_sfa, tSAg, tSAs = sfa
                atom = tile.m_tile * self.k_blocks4 + k // self.stages_per_atom
                cute.copy(tma_atom_sfa, tSAg[(None, 0, atom)], tSAs[(None, s)], tma_bar_ptr=bar,
                          mcast_mask=a_mcast_mask)
            ab_pipeline.producer_commit(prod_state)
            prod_state.advance()
        return prod_state

    # ------------------------------------------------------------------------------------------ converters
    @cute.jit
    def expert_jobs(self, sEnds, e: Int32):
        """(first row of A, jobs per K chunk) of expert e: its A slabs (staged A) and, if it has rows, B's."""
        row0 = Int32(0)
        if e > 0:
            row0 = sEnds[e - 1]
        rows = sEnds[e] - row0
        per_chunk = Int32(0)
        if rows > 0:
            per_chunk = Int32(cdiv(self.n, SLAB))
            if const_expr(self.stage_a):
                per_chunk += rows // SLAB
        return row0, per_chunk

    @cute.jit
    def walk(self, sEnds, j: Int32, e: Int32, e_first: Int32, row0: Int32, per_chunk: Int32):
        """The expert walk advanced to job j: (expert, its first job, its first row of A, its jobs per chunk);
        expert = num_groups past the last job."""
        while e < self.num_groups and j >= e_first + Int32(self.k_chunks) * per_chunk:
            e_first += Int32(self.k_chunks) * per_chunk
            e += 1
            if e < self.num_groups:
                row0, per_chunk = self.expert_jobs(sEnds, e)
        return e, e_first, row0, per_chunk

    @cute.jit
    def convert(self, args, cta):
        """A converter warp: jobs from the counter until none is left (module docstring)."""
        lane = cute.arch.lane_idx()
        counter = args.mStagedBFlags.iterator.toint()
        scratch = self.scratch(cta.ml_smem)
        row0, per_chunk = self.expert_jobs(cta.sEnds, Int32(0))
        j = take_job(counter, lane)
        e, e_first, row0, per_chunk = self.walk(cta.sEnds, j, Int32(0), Int32(0), row0, per_chunk)
        while e < self.num_groups:
            c = (j - e_first) // per_chunk
            self.run_job(args, e, row0, per_chunk, c, j - e_first - c * per_chunk, lane, scratch)
            j = take_job(counter, lane)
            e, e_first, row0, per_chunk = self.walk(cta.sEnds, j, e, e_first, row0, per_chunk)

    @cute.jit
    def run_job(self, args, e: Int32, row0: Int32, per_chunk: Int32, c: Int32, r: Int32, lane: Int32, scratch):
        """Job r of expert e's chunk c (its A slabs, then B's), converted and published."""
        header = args.mStagedBFlags.iterator.toint()
        e_a = per_chunk - Int32(cdiv(self.n, SLAB))
        flag = Int64(0)
        if const_expr(self.stage_a):
            if r < e_a:
                a_row = row0 + r * SLAB
                self.convert_slab(args.mCodesA, args.mSFA, args.mStagedA, a_row, Int32(0), Int32(SLAB), c, lane)
                flag = args.mStagedAFlags.iterator.toint() + Int64((a_row // SF_ATOM_ROWS) * self.k_chunks + c) * 4
        if r >= e_a:
            n0 = (r - e_a) * SLAB
            self.convert_slab(args.mCodesB, args.mSFB, args.mStagedB, n0, e, cutlass.min(Int32(SLAB), self.n - n0),
                              c, lane, scratch)
            flag = header + Int64(STAGED_HEADER_WORDS + (e * self.n_blocks + n0 // SF_ATOM_ROWS) * self.k_chunks
                                  + c) * 4
        fence_async_global()
        cute.arch.sync_warp()
        if lane == 0:
            publish(flag)

    @cute.jit
    def convert_slab(self, mCodes, mSF, mOut, row0: Int32, e: Int32, rows: Int32, c: Int32, lane: Int32,
                     scratch=None):
        """Rows row0 .. row0 + rows of expert e (A: e = 0, rows of A) in K chunk c: lane l converts group l of each
        row (K 512 c + 16 l .. + 16) from its codes and SF byte into bf16; `scratch` (B in the K slot order): the
        warp's shared scratch the quad's pairs are regrouped through (`store_slots`). A lane past K loads the
        chunk's last group and stores nothing (every lane reaches the scratch's warp syncs)."""
        fp4 = const_expr(self.data == dq.E2M1)
        k0 = c * STAGED_CHUNK_K + lane * dq.GROUP
        live = k0 < self.k
        kl = cutlass.min(k0, Int32(self.k - dq.GROUP))
        nbytes = dq.bytes_per_group(self.data)
        kb = kl // self.vec
        e_rows = Int64(e) * self.n                       # rows of the experts before e (A: none)
        sf_base = mSF.iterator.toint() + Int64(e) * (self.n_blocks * self.kb_atoms * SF_ATOM_BYTES)
        codes = mCodes.iterator.toint() + (e_rows + row0) * self.row_bytes + (kl // 2 if fp4 else kl)
        out = mOut.iterator.toint() + ((e_rows + row0) * self.k + kl) * 2
        for i0 in cutlass.range(0, SLAB, BATCH[fp4], unroll=1):
            # the batch's loads first, so BATCH rows' codes are in flight at once (a row past `rows` reloads the
            # last row and stores nothing)
            loaded = []
            for u in cutlass.range_constexpr(BATCH[fp4]):
                i = cutlass.min(i0 + u, rows - 1)
                row = row0 + i
                sf_off = sf_atom_start(row >> 7, kb >> 2, self.kb_atoms) + sf_atom_byte(row & 31, (row >> 5) & 3,
                                                                                      kb & 3)
                loaded.append((ld_global_words(codes + Int64(i) * self.row_bytes, nbytes // 4),
                               ld_global_scalar(sf_base + sf_off)))
            for u in cutlass.range_constexpr(BATCH[fp4]):
                words, code = loaded[u]
                scale = dq.scale_bf16x2(code, self.sf_dtype, cutlass.Boolean(True))
                pairs = [Int32(0)] * dq.PAIRS

                def keep(p, pair, pairs=pairs):
                    pairs[p] = pair

                dq.convert_group(words, self.data, scale, keep, True)   # a row of an M-grouped operand
                dst = out + Int64(i0 + u) * (self.k * 2)
                store = live & (i0 + u < rows)
                if const_expr(scratch is not None):
                    self.store_slots(scratch + (u % 2) * SCRATCH_ROW_BYTES, pairs, dst, lane, store)
                else:
                    self.store_natural(pairs, dst, store)

    @cute.jit
    def store_natural(self, pairs: list, dst: Int64, store: cutlass.Boolean):
        """A lane's group in natural K order (32 bytes at `dst`; an fp16 B: each word converted)."""
        if const_expr(self.data == dq.E2M1):   # pair p = elements (8 (p // 4) + p % 4, + 4): back to natural order
            pairs = [dq.prmt2(pairs[4 * h + 2 * (q % 2)], pairs[4 * h + 2 * (q % 2) + 1],
                              0x7632 if q >= 2 else 0x5410) for h in range(2) for q in (0, 1, 2, 3)]
        if const_expr(self.f16):
            pairs = [dq.bf16x2_to_f16x2(w) for w in pairs]
        if store:
            dq.st_global_v4(dst, pairs[:4])
            dq.st_global_v4(dst + 16, pairs[4:])

    @cute.jit
    def store_slots(self, buf: Int32, pairs: list, dst: Int64, lane: Int32, store: cutlass.Boolean):
        """A row's groups in the on-chip K slot order: lane l holds group q = l % 4 of the 64-wide stage s = l // 4
        (pair p for slots 8p + 2q, 8p + 2q + 1: word 4p + q of the stage's 128-byte line). The quad regroups them
        through `buf` (256 words; word w of line s at 32 s + (w ^ 4 s): conflict-free both ways), then lane q
        stores 16-byte chunks q and q + 4 of its line (pair q's and pair q + 4's words of the four groups)."""
        s, q = lane >> 2, lane & 3
        line = buf + s * 128
        for p in cutlass.range_constexpr(dq.PAIRS):
            st_shared_word(line + (((4 * p) ^ (4 * s)) + q) * 4, pairs[p])
        cute.arch.sync_warp()
        line_out = dst - q * (dq.GROUP * 2)              # the stage's 128 bytes of the row
        for h in cutlass.range_constexpr(2):
            chunk = q + 4 * h
            w = ld_shared_v4(line + ((4 * chunk) ^ (4 * s)) * 4)
            if store:
                dq.st_global_v4(line_out + chunk * 16, w)


class StagedMainloop(StagedConverters, WgmmaMainloop):
    """The 16-bit mainloop over the staged workspaces (A's too where A is block-scaled), the converter warps and
    the producer's chunk waits."""

    smem_stage_bytes = staticmethod(_half_stage_bytes)
    tx_bytes = staticmethod(_half_stage_bytes)

    def __init__(self, problem, tile_m: int, tile_n: int, stages: int):
        self.init_staged(problem, stage_a=problem.a_dtype is None)
        super().__init__(cutlass.Float16 if self.f16 else cutlass.BFloat16, tile_m, tile_n, stages)

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(problem, config.tile_m, config.tile_n, stages)

    def tma_sources(self, t):
        """(A, B) the TMA reads: the 16-bit workspaces (a 16-bit A of weight-only quantization as given)."""
        return (t["staged_a"] if self.stage_a else t["a"]), staged_b_view(t, self.n, self.k, self.num_groups)

    def scale_tmas(self, tensors, cluster_m: int, cluster_n: int):
        """No scale TMA: the converters read SFA / SFB (KernelArgs.mSFA / mSFB) as memory."""
        return None, tensors["sfa"], None, tensors["sfb"]

    def producer_inputs(self, args, smem, rank_m, rank_n):
        """(the chunks' ready flags (A's, B's), no scale loads)."""
        return (args.mStagedAFlags, args.mStagedBFlags), None


def staged_b_view(t, n: int, k: int, num_groups: int):
    """staged_b (L, N, K) seen as the kernel's (N, K, L)."""
    sb = t["staged_b"]
    return cute.make_tensor(sb.iterator, cute.make_layout((n, k, num_groups), stride=(k, 1, n * k)))


class StagedBMainloop(StagedConverters, DequantMainloop):
    """B staged, A converted by the consumers: the converter warps write B's bf16 rows in the on-chip K slot
    order (pair p of group q at slots 8p + 2q, 8p + 2q + 1 of each 64-wide stage: the dequantizing mainloop's
    order, `store_slots`), the producer loads by TMA A's codes and SF atoms (as on chip) and B's bf16 stage (after
    its chunk flags, into the 16-bit kernel's swizzled stage), and the consumers convert their A groups into the RS
    fragment (DequantMainloop.mma_tile_rs) -- no A workspace, no stage workers. A and B are permuted alike within
    each stage, so the sums are the reference's up to their order (not the workspace route's order)."""

    STAGE_WORKERS = ()
    REGISTER_TIGHT = True
    A_IN_REGISTERS = True
    SMEM_FIXED_BYTES = len(StagedConverters.CONVERT_WARPS) * 2 * SCRATCH_ROW_BYTES

    def __init__(self, problem, config, stages: int):
        DequantMainloop.__init__(self, config.tile_m, config.tile_n, stages, problem.k, problem.n, config.cluster_m,
                                 config.cluster_n)
        self.init_staged(problem, stage_a=False)

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(problem, config, stages)

    @classmethod
    def tx_bytes(cls, ab_dtype, tile_m: int, tile_n: int) -> int:
        """A's codes and SF atoms, B's bf16 stage."""
        return tile_m * cls.FORMAT.row_bytes + tile_m // SF_ATOM_ROWS * SF_ATOM_BYTES + tile_n * TILE_K * 2

    smem_stage_bytes = tx_bytes

    def stage_atoms(self) -> int:
        return self.tile_m // SF_ATOM_ROWS

    def tma_operands(self):
        return self.FORMAT.tma(0), (cutlass.BFloat16, TILE_K)

    def tma_sources(self, t):
        return t["a"], staged_b_view(t, self.n, self.k, self.num_groups)

    def ab_smem_layouts(self):
        """A's narrow stages as on chip, B's the 16-bit kernel's swizzled K-major stages."""
        return (narrow_stage_layout(self.tile_m, self.FORMAT.row_bytes, self.stages),
                make_ab_smem_layouts(cutlass.BFloat16, self.tile_m, self.tile_n, self.stages)[1])

    def smem_fields(self):
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        return [("sSF", Align[MemRange[cutlass.Uint8, self.stage_atoms() * self.stages * SF_ATOM_BYTES], 128]),
                ("sScratch", Align[MemRange[Int32, self.SMEM_FIXED_BYTES // 4], 16])]

    @cute.jit
    def smem_tensors(self, storage, tidx: Int32, nthreads: cutlass.Constexpr):
        """DequantMainloop's views (no bf16 stages) and the converters' scratch address."""
        n_atoms = self.stage_atoms()
        atom_stride = n_atoms * SF_ATOM_BYTES
        sSF = storage.sSF.get_tensor(cute.make_layout((SF_ATOM_ROWS, 4, n_atoms, self.stages),
                                                      stride=(1, SF_ATOM_ROWS, SF_ATOM_BYTES, atom_stride)))
        sf_bytes = cute.make_tensor(storage.sSF.data_ptr(), cute.make_layout(n_atoms * SF_ATOM_BYTES * self.stages))
        words_a = cute.make_tensor(cute.recast_ptr(storage.sA.data_ptr(), dtype=Int32),
                                   cute.make_layout(self.tile_m * self.FORMAT.row_bytes // 4 * self.stages))
        return sSF, None, None, words_a, None, None, None, sf_bytes, storage.sScratch.data_ptr().toint()

    @staticmethod
    @cute.jit
    def scratch(smem):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        return smem[8] + (warp - StagedConverters.CONVERT_WARPS[0]) * (2 * SCRATCH_ROW_BYTES)

    def scale_tmas(self, tensors, cluster_m: int, cluster_n: int):
        """SFA by TMA with A (multicast along the cluster's N); SFB read as memory by the converters."""
        return (*sf_atom_tma(tensors["sfa"], cluster_n), None, tensors["sfb"])

    @cute.jit
    def producer_inputs(self, args, smem, rank_m, rank_n):
        """((no A flags, B's chunk flags), the SFA TMA partition over (atom coordinate, stage))."""
        tSAs, tSAg = self.partition_sfa(args.tma_atom_sfa, args.mSFA, smem[0], rank_n)
        return (None, args.mStagedBFlags), (args.tma_atom_sfa, tSAg, tSAs)

    @cute.jit
    def consumer_operands(self, tiled_mma, sA, sB, smem, wg: Int32):
        """(mma, the shape of the thread's RS fragment, B fragment over the swizzled bf16 stages, smem views)."""
        thr_mma = tiled_mma.get_slice(wg * 128)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        return tiled_mma, thr_mma.partition_shape_A((self.tile_m, TILE_K)), tCrB, smem
