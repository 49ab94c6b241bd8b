"""Staged block-scaled operands: converted once, inside the GEMM kernel, beside it (`problem.staged`).

The on-chip dequantizing mainloop (mainloop_dequant) converts each B tile once per M block that reads it; with many
rows per expert that repeated conversion is its bound, and a conversion by XLA before the bf16 kernel costs a serial
pass over the operands (~0.27 ms of fc1's 1.6 ms for MXFP8). Here the producer warpgroup's idle warps 1-3 convert
the operands exactly to bf16 (dequant.convert_group: the on-chip mainloop's bit placement) into global workspaces
(`operands.WORKSPACES`: staged_a (m, K), staged_b (L, N, K)) while the consumers already multiply: the bf16
mainloop (WgmmaMainloop, TMA from the workspaces) runs unchanged, and only the producer warp waits, per 512-wide K
chunk of a tile, for that chunk's ready flags.

Jobs: 32 rows x one K chunk of A (an expert's rows) or of B[e] (N rows; experts without rows have no B jobs); a
lane converts one 16-wide group of a row (FP8: a 16-byte load, FP4: 8 bytes, its SF byte from the MMA-tiled layout)
into 32 bytes of bf16 in natural K order. Warps take jobs from a global counter in need order -- expert by expert,
within an expert chunk by chunk, A's slabs before B's -- so the first experts' chunks are ready first. A job publishes
its chunk by fence.proxy.async.global (its generic stores, read next by the TMA's async proxy) and a release add on
the chunk's flag (A: per 128-row tile, counting its 4 slabs; B: per expert and 128-row block, counting the block's
slabs). The producer acquires the flags of a chunk (ld.acquire.gpu spin) and fences the async proxy before its TMA
loads.

The job counter and the flags are zeroed by a small kernel launched before the GEMM (gemm.launch). Pacing the
converters to the producers' progress (a job taken only within a few (expert, chunk) steps of the furthest one a
producer waits for) measured no faster than this burst (RESULTS run 111): the kernel runs at the board's power limit,
so its time follows the conversion's energy, not when it is spent.

Exact like the XLA route (cudnn_moe_jax._dequant_first): the same bf16 values (an FP8 / FP4 code times its scale,
rounded once below 2^-126), the same bf16 kernel and schedule, so the same sums: outputs bit-identical to the route.
Beside an fp16 A (weight-only, weights fp16 holds exactly: NVFP4) B is converted to fp16 and the fp16 kernel runs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm

from cudnn_moe_jax.formats import SF_ATOM_BYTES, SF_ATOM_ROWS, cdiv, sf_atom_byte, sf_atom_start
from cudnn_moe_jax.operands import STAGED_CHUNK_K, STAGED_HEADER_WORDS, half_dtype

from .. import dequant as dq
from .mainloop import TILE_K, WgmmaMainloop, ab_stage_bytes, copy_ab_stage

SLAB = 32                                # rows per job
BATCH = {False: 4, True: 8}              # rows whose codes a lane loads before converting them (FP8, FP4)
STAGES_PER_CHUNK = STAGED_CHUNK_K // TILE_K


def _asm(ret, code: str, constraints: str, *args):
    return llvm.inline_asm(ret, [a.ir_value() for a in args], code, constraints, has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def ld_global_words(addr: Int64, n: cutlass.Constexpr):
    """n (2 or 4) 32-bit words at a 8 / 16-byte aligned global address, through the read-only path."""
    i32 = Int32.mlir_type
    outs = ", ".join(f"${i}" for i in range(n))
    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * n), [Int64(addr).ir_value()],
                          f"ld.global.nc.v{n}.b32 {{{outs}}}, [${n}];", ",".join(["=r"] * n) + ",l",
                          has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(i32, res, [k])) for k in range(n)]


@cute.jit
def ld_global_byte(addr: Int64) -> Int32:
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int64(addr).ir_value()], "ld.global.nc.u8 $0, [$1];", "=r,l",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def next_job(addr: Int64) -> Int32:
    """The job counter's old value, incremented by one (relaxed: a job's data is published by its flag)."""
    return Int32(_asm(Int32.mlir_type, "atom.global.add.u32 $0, [$1], 1;", "=r,l", Int64(addr)))


@cute.jit
def publish(addr: Int64):
    _asm(None, "red.release.gpu.global.add.u32 [$0], 1;", "l", Int64(addr))


@cute.jit
def acquire(addr: Int64) -> Int32:
    return Int32(_asm(Int32.mlir_type, "ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", Int64(addr)))


@cute.jit
def fence_async_global():
    _asm(None, "fence.proxy.async.global;", "")


@cute.jit
def wait_flag(addr: Int64, target: Int32):
    while acquire(addr) < target:
        pass


def _half_stage_bytes(ab_dtype, tile_m: int, tile_n: int) -> int:
    return ab_stage_bytes(cutlass.BFloat16, tile_m, tile_n)   # bf16 or fp16: 2 bytes an element


class StagedMainloop(WgmmaMainloop):
    """The bf16 mainloop over the staged workspaces, the converter warps and the producer's chunk waits."""

    CONVERT_WARPS = (1, 2, 3)
    PRODUCER_REGS = 56          # the converters hold a batch of groups' words (mainloop_dequant's FP8 workers: 56)
    smem_stage_bytes = staticmethod(_half_stage_bytes)
    tx_bytes = staticmethod(_half_stage_bytes)

    def __init__(self, problem, tile_m: int, tile_n: int, stages: int):
        self.f16 = half_dtype(problem) == "float16"   # beside an fp16 A: the converted B in fp16
        super().__init__(cutlass.Float16 if self.f16 else cutlass.BFloat16, tile_m, tile_n, stages)
        self.data = problem.ab_dtype
        self.sf_dtype, self.vec = problem.sf_dtype, problem.sf_vec_size
        self.stage_a = problem.a_dtype is None
        self.n, self.k, self.num_groups = problem.n, problem.k, problem.num_groups
        self.k_chunks = cdiv(problem.k, STAGED_CHUNK_K)
        self.n_blocks = cdiv(problem.n, SF_ATOM_ROWS)         # B's 128-row blocks (flags, SF row blocks)
        self.kb_atoms = cdiv(cdiv(problem.k, problem.sf_vec_size), 4)
        self.row_bytes = problem.k // 2 if problem.ab_dtype == dq.E2M1 else problem.k

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(problem, config.tile_m, config.tile_n, stages)

    def tma_sources(self, t):
        """(A, B) the TMA reads: the 16-bit workspaces (a 16-bit A of weight-only quantization as given); staged_b
        (L, N, K) seen as the kernel's (N, K, L)."""
        sb = t["staged_b"]
        b = cute.make_tensor(sb.iterator, cute.make_layout((self.n, self.k, self.num_groups),
                                                           stride=(self.k, 1, self.n * self.k)))
        return (t["staged_a"] if self.stage_a else t["a"]), b

    def scale_tmas(self, tensors, cluster_m: int, cluster_n: int):
        """No scale TMA: the converters read SFA / SFB (KernelArgs.mSFA / mSFB) as memory."""
        return None, tensors["sfa"], None, tensors["sfb"]

    # ------------------------------------------------------------------------------------------ producer
    @cute.jit
    def load_tile(self, ab_pipeline, prod_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, a_mcast_mask,
                  b_mcast_mask, k_count: Int32, side_inputs=None, tile=None, descriptors=None, b_own=None):
        """The bf16 producer's k-loop, waiting before each chunk's first stage for that chunk's flags
        (`side_inputs` = the staged args: (A flags, B flags))."""
        a_flags, b_flags = side_inputs
        prod_state.reset_count()
        for _k in cutlass.range(k_count, unroll=1):
            k = prod_state.count
            if k % STAGES_PER_CHUNK == 0:
                self.wait_chunk(a_flags, b_flags, tile, k // STAGES_PER_CHUNK)
            ab_pipeline.producer_acquire(prod_state)
            bar = ab_pipeline.producer_get_barrier(prod_state)
            copy_ab_stage(tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB, bar, k, prod_state.index, a_mcast_mask,
                          b_mcast_mask)
            ab_pipeline.producer_commit(prod_state)
            prod_state.advance()
        return prod_state

    @cute.jit
    def wait_chunk(self, a_flags, b_flags, tile, c: Int32):
        """Wait for the tile's flags of chunk c."""
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
        row0, per_chunk = self.expert_jobs(cta.sEnds, Int32(0))
        j = self.take_job(counter, lane)
        e, e_first, row0, per_chunk = self.walk(cta.sEnds, j, Int32(0), Int32(0), row0, per_chunk)
        while e < self.num_groups:
            c = (j - e_first) // per_chunk
            self.run_job(args, e, row0, per_chunk, c, j - e_first - c * per_chunk, lane)
            j = self.take_job(counter, lane)
            e, e_first, row0, per_chunk = self.walk(cta.sEnds, j, e, e_first, row0, per_chunk)

    @cute.jit
    def run_job(self, args, e: Int32, row0: Int32, per_chunk: Int32, c: Int32, r: Int32, lane: Int32):
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
                              c, lane)
            flag = header + Int64(STAGED_HEADER_WORDS + (e * self.n_blocks + n0 // SF_ATOM_ROWS) * self.k_chunks
                                  + c) * 4
        fence_async_global()
        cute.arch.sync_warp()
        if lane == 0:
            publish(flag)

    @cute.jit
    def take_job(self, counter: Int64, lane: Int32) -> Int32:
        j = Int32(0)
        if lane == 0:
            j = next_job(counter)
        return cute.arch.shuffle_sync(j, 0)

    @cute.jit
    def convert_slab(self, mCodes, mSF, mOut, row0: Int32, e: Int32, rows: Int32, c: Int32, lane: Int32):
        """Rows row0 .. row0 + rows of expert e (A: e = 0, rows of A) in K chunk c: lane l converts group l of each
        row (K 512 c + 16 l .. + 16) from its codes and SF byte into bf16."""
        k0 = c * STAGED_CHUNK_K + lane * dq.GROUP
        if k0 < self.k:
            fp4 = const_expr(self.data == dq.E2M1)
            nbytes = dq.bytes_per_group(self.data)
            kb = k0 // self.vec
            e_rows = Int64(e) * self.n                       # rows of the experts before e (A: none)
            sf_base = mSF.iterator.toint() + Int64(e) * (self.n_blocks * self.kb_atoms * SF_ATOM_BYTES)
            codes = mCodes.iterator.toint() + (e_rows + row0) * self.row_bytes + (k0 // 2 if fp4 else k0)
            out = mOut.iterator.toint() + ((e_rows + row0) * self.k + k0) * 2
            for i0 in cutlass.range(0, SLAB, BATCH[fp4], unroll=1):
                # the batch's loads first, so BATCH rows' codes are in flight at once (a row past `rows` reloads
                # the last row and stores nothing)
                loaded = []
                for u in cutlass.range_constexpr(BATCH[fp4]):
                    i = cutlass.min(i0 + u, rows - 1)
                    row = row0 + i
                    sf_off = sf_atom_start(row >> 7, kb >> 2, self.kb_atoms) + sf_atom_byte(row & 31, (row >> 5) & 3,
                                                                                          kb & 3)
                    loaded.append((ld_global_words(codes + Int64(i) * self.row_bytes, nbytes // 4),
                                   ld_global_byte(sf_base + sf_off)))
                for u in cutlass.range_constexpr(BATCH[fp4]):
                    words, code = loaded[u]
                    scale = dq.scale_bf16x2(code, self.sf_dtype, cutlass.Boolean(True))
                    pairs = [Int32(0)] * dq.PAIRS

                    def keep(p, pair, pairs=pairs):
                        pairs[p] = pair

                    dq.convert_group(words, self.data, scale, keep)
                    if const_expr(fp4):   # pair p = elements (8 (p // 4) + p % 4, + 4): back to natural order
                        pairs = [dq.prmt2(pairs[4 * h + 2 * (q % 2)], pairs[4 * h + 2 * (q % 2) + 1],
                                          0x7632 if q >= 2 else 0x5410)
                                 for h in range(2) for q in (0, 1, 2, 3)]
                    if const_expr(self.f16):
                        pairs = [dq.bf16x2_to_f16x2(w) for w in pairs]
                    if i0 + u < rows:
                        dst = out + Int64(i0 + u) * (self.k * 2)
                        dq.st_global_v4(dst, pairs[:4])
                        dq.st_global_v4(dst + 16, pairs[4:])
