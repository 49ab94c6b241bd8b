"""MXFP8 (block-scaled FP8) mainloop of the sm90 grouped GEMM: per 32-wide K block, an FP8 wgmma for the data and a
bf16 wgmma for the scale products, folded with one FFMA per accumulator element.

Hopper has no block-scaled MMA (docs/numerics.md#sm90-kernels). For every 32-wide K block `kb` each consumer warpgroup runs
  P = A[:, kb] . B[:, kb]^T              FP8 wgmma m64 n128 k32 (e4m3/e5m2, fp32 partial accumulator)
  S = sfa[:, kb] (x) sfb[:, kb]          bf16 wgmma m64 n128 k16 of two scale operands (below): the rank-1 matrix
                                         of scale products, delivered by the tensor core in the accumulator layout
  acc = fma(P, S, acc)                   one FFMA per element
The e8m0 scales are powers of two and bf16 has fp32's exponent range, so S is exact, and so are P * S; the FFMA
rounds once: the same as accumulating the exact dequantized products in fp32 (only the order differs).

Why a wgmma for S (measured on the H200): computing S on the FP32 pipe costs an FMUL per element,
and each thread needs 32 distinct fp32 column scales per block (32 lanes x 4 B per shared-memory wavefront:
256 wavefronts per block per SM, next to the wgmma operand reads and TMA writes of the same shared memory). That
delivery bounded the FMUL + FFMA kernel at 367 TFLOP/s on fc1 (612 with the scale loads made free). The S wgmma
costs tensor time equal to the data wgmma's (64 cycles per warpgroup per block) and 6 KB of operand reads, and no
thread loads a scale. Taking half the tile's scale products from the FP32 pipe again (fp32 scales decoded into
conflict-free shared memory, FMUL + FFMA) measured 29% slower on fc1.

Scale operands (bf16, K-major, no swizzle: "interleaved" 8 x 16-byte core matrices of 128 B), per stage:
  A' (dense) per 8-row group: chunks [D Z]; row r of D = (sfa[r, 0..3], 0, 0, 0, 0), Z = zeros. Every block
     reads the same A' (k = 0..15 = D then Z);
  B' (one-hot) per 8-row group: chunks [c0 c1 c2 c3 Z]; row n of cj = sfb[n, j] at k = j, zeros elsewhere.
     Block j reads cj and c(j+1) (or Z) as its two K chunks.
So S[r, n] = sum_k A'[r, k] B'_j[k, n] = sfa[r, j] * sfb[n, j] exactly: every other term is 0 * (a scale of the
same row r or column n, or 0). A NaN scale (e8m0 0xFF) can reach other blocks of its own row / column only,
which the reference makes NaN anyway. 14 KB per stage; the zeros are written once per CTA; per stage the decoder
warps write one 8-byte row of A' per row and 4 bf16 of B' per column.

Pipeline per CTA (stage = 128 K elements = 4 scale blocks = one 512-byte SF atom per 128 rows, docs/formats.md#scale-factor-layout):
  producer warp   TMA: A (128 x 128 B), B[g] (128 x 128 B), the SFA atom and the SFB atom of the stage (512 B each,
                  contiguous in the packed layout), all on the stage's mbarrier; SFA multicast with A, SFB with B;
  decoder warps   (1: A', 2-3: B') wait for the stage, write the e8m0 bytes as bf16 2^(e-127) (NaN for 0xFF, 0.0
                  for e = 0 and for K blocks past K) into A' / B', fence them for the async proxy and arrive on the
                  stage's decode barrier;
  consumers       two warpgroups x 64 rows: per block and 64-column part (Config.mx_n_parts, default 2), both
                  wgmmas (one commit group), then wait for the oldest part, fold it, issue it for the next block.

Measured (H200, fc1 MXFP8 SwiGLU, device-timed): 490 TFLOP/s with one decoder warp and
26 KB of scale operands per stage; 597-600 with this layout and 2-3 decoder warps; 620-631 with two column parts
(the default; fc2 557-575). Where the time goes (ptxas deletes a wgmma whose result is never read, so
timing variants must keep P and S alive): the scale wgmma costs the data wgmma's tensor time, 2 x 128 cycles per
block and CTA (~950 TFLOP/s ceiling at 1.75 GHz); without any tensor work the TMA / decode pipeline and the
epilogue run at 1252, with the fold's FFMAs added 966; the data wgmma with acc += P 759; the full kernel 624.
ncu PC sampling: FFMAs hold 56% of the consumer k-loop samples ("dispatch" stalls); moving S to other register
banks changed nothing (607-627). Four column parts (A / A' read four times per block): 473, shared-memory bound;
two stages per k-loop iteration: 578.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cudnn_moe_jax.formats import SF_ATOM_BYTES, SF_ATOM_ROWS  # one SF atom: 128 rows x 4 k-blocks

from .mainloop import WgmmaMainloop

TILE_K = 128  # fp8: 128 B per row = one SW128 atom = 4 scale blocks
SF_VEC = 32
KB_PER_STAGE = TILE_K // SF_VEC
CHUNK = 64  # bf16 elements of one core matrix (8 rows x 16 B)
SA_GROUP = 2 * CHUNK  # A' per 8-row group: [D Z]
SB_GROUP = (KB_PER_STAGE + 1) * CHUNK  # B' per 8-row group: [c0 c1 c2 c3 Z]
SA_STAGE = SF_ATOM_ROWS // 8 * SA_GROUP  # bf16 elements per stage
SB_STAGE = SF_ATOM_ROWS // 8 * SB_GROUP
# (warp of the producer warpgroup, operand 0 = A' / 1 = B', row quarters i: rows lane + 32 i) -- decode_stage
DECODER_WARPS = ((1, 0, (0, 1, 2, 3)), (2, 1, (0, 1)), (3, 1, (2, 3)))


def ab_stage_bytes(ab_dtype, tile_m: int, tile_n: int) -> int:
    """TMA bytes per stage: A + B tiles and the two SF atoms."""
    return (tile_m + tile_n) * TILE_K * ab_dtype.width // 8 + 2 * SF_ATOM_BYTES


def smem_stage_bytes(ab_dtype, tile_m: int, tile_n: int) -> int:
    """Shared memory per stage: TMA bytes + the bf16 scale operands A' / B' + 2 mbarriers."""
    return ab_stage_bytes(ab_dtype, tile_m, tile_n) + (SA_STAGE + SB_STAGE) * 2 + 2 * 8


def scale_operand_layouts(stages: int):
    """(A', B') smem layouts ((8 rows, 16 groups), (8, 2 K chunks), kb, stage) in bf16 elements (module docstring;
    A' is the same for every block: kb stride 0)."""
    sw = cute.make_swizzle(0, 4, 3)  # "interleaved" (no swizzle) wgmma operand
    a = cute.make_layout(((8, SF_ATOM_ROWS // 8), (8, 2), KB_PER_STAGE, stages),
                         stride=((8, SA_GROUP), (1, CHUNK), 0, SA_STAGE))
    b = cute.make_layout(((8, SF_ATOM_ROWS // 8), (8, 2), KB_PER_STAGE, stages),
                         stride=((8, SB_GROUP), (1, CHUNK), CHUNK, SB_STAGE))
    return cute.make_composed_layout(sw, 0, a), cute.make_composed_layout(sw, 0, b)


def sf_atom_tma(sf: cute.Tensor, num_multicast: int):
    """The TMA (atom, tensor) of a packed SF buffer that loads one 512-byte SF atom per (128, 4) box of `sf_view`
    (multicast to `num_multicast` CTAs)."""
    op = cpasync.CopyBulkTensorTileG2SMulticastOp() if num_multicast > 1 else cpasync.CopyBulkTensorTileG2SOp()
    atom_layout = cute.make_layout((SF_ATOM_ROWS, KB_PER_STAGE), stride=(1, SF_ATOM_ROWS))
    return cpasync.make_tiled_tma_atom(op, sf_view(sf), atom_layout, (SF_ATOM_ROWS, KB_PER_STAGE),
                                       num_multicast=num_multicast)


def sf_view(sf: cute.Tensor) -> cute.Tensor:
    """A packed SF buffer (L, Rb, Kb, 32, 4, 4) uint8 seen as (128, 4 * L*Rb*Kb) column-major: column block `a`
    (4 columns = 512 bytes) is SF atom `a = (l*Rb + rb)*Kb + kb4`, so a (128, 4) TMA box loads one atom."""
    atoms = sf.shape[0] * sf.shape[1] * sf.shape[2]
    return cute.make_tensor(sf.iterator, cute.make_layout((SF_ATOM_ROWS, KB_PER_STAGE * atoms),
                                                          stride=(1, SF_ATOM_ROWS)))


class Mxfp8Mainloop:
    """Producer / decoder / consumer k-loops of one output tile (128 x 128) with per-32 e8m0 scales."""

    PRODUCER_ARRIVALS = 1

    def __init__(self, ab_dtype, tile_m: int, tile_n: int, stages: int, k: int, n_parts: int = 1, n: int = 128,
                 cluster_m: int = 1, cluster_n: int = 1):
        if n_parts not in (1, 2, 4):
            raise ValueError("n_parts must be 1, 2 or 4")
        self.n_parts = n_parts
        if tile_m != 128 or tile_n != 128:
            raise NotImplementedError("the MXFP8 mainloop runs 128 x 128 tiles (two 64 x 128 warpgroups)")
        self.ab_dtype = ab_dtype
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.stages = stages
        self.k_tiles = -(-k // TILE_K)
        self.nkb = -(-k // SF_VEC)
        # valid K blocks of the last stage (the rest read zero-filled data and get scale 0.0)
        self.last_kbs = self.nkb - KB_PER_STAGE * (self.k_tiles - 1)
        self.sfb_row_blocks = -(-n // SF_ATOM_ROWS)  # SF atoms per expert along N
        self.cluster_m, self.cluster_n = cluster_m, cluster_n

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(ab_dtype, config.tile_m, config.tile_n, stages, problem.k, config.mx_n_parts, problem.n,
                   config.cluster_m, config.cluster_n)

    # ------------------------------------------------------------------------------------------ layouts
    # the mainloop protocol of the kernel class (mainloop.WgmmaMainloop's docstring)
    TILE_K = TILE_K
    smem_stage_bytes = staticmethod(smem_stage_bytes)
    tx_bytes = staticmethod(ab_stage_bytes)

    def tiled_mma(self) -> cute.TiledMma:
        return self.make_tiled_mma(self.ab_dtype, self.tile_n)

    def ab_smem_layouts(self):
        return self.make_ab_smem_layouts(self.ab_dtype, self.tile_m, self.tile_n, self.stages)

    def scale_layouts(self):
        return scale_operand_layouts(self.stages)

    def tma_operands(self):
        return (self.ab_dtype, TILE_K), (self.ab_dtype, TILE_K)

    # the decoder warps (stage workers): a stage's bf16 scale operands are ready once all their lanes arrived
    STAGE_WORKERS = DECODER_WARPS
    REGISTER_TIGHT = True  # acc + the data and scale-product partials: 192 of the consumers' 232 registers
    PRODUCER_REGS = WgmmaMainloop.PRODUCER_REGS
    publish_stage = WgmmaMainloop.publish_stage   # fence the decoded scales, arrive
    stage_arrivals = WgmmaMainloop.stage_arrivals
    tma_sources = WgmmaMainloop.tma_sources       # A and B as given
    CONVERT_WARPS = WgmmaMainloop.CONVERT_WARPS   # none
    SMEM_FIXED_BYTES = WgmmaMainloop.SMEM_FIXED_BYTES
    producer_inputs = WgmmaMainloop.producer_inputs   # its scale partitions

    def smem_fields(self):
        """Raw SF atoms of each stage, then the bf16 scale operands A' / B'."""
        sa_layout, sb_layout = self.scale_layouts()
        return [("sSF", cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, 2 * SF_ATOM_BYTES * self.stages], 1024]),
                ("sSA", cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sa_layout)], 128]),
                ("sSB", cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sb_layout)], 128])]

    @cute.jit
    def smem_tensors(self, storage, tidx: Int32, nthreads: cutlass.Constexpr):
        """(raw SF atoms (128, 4, operand, stage) u8, A', B' operand tensors, their Int16 views, the raw atoms as
        (4 words, 32 lanes, operand, stage) Int32): A' / B' are zeroed here by every thread."""
        sa_layout, sb_layout = self.scale_layouts()
        sSA, sSB, sSA16, sSB16 = self.scale_operands(storage.sSA, storage.sSB, sa_layout, sb_layout, tidx, nthreads)
        sSF = storage.sSF.get_tensor(cute.make_layout(
            (SF_ATOM_ROWS, KB_PER_STAGE, 2, self.stages),
            stride=(1, SF_ATOM_ROWS, SF_ATOM_BYTES, 2 * SF_ATOM_BYTES)))
        sRaw32 = cute.make_tensor(cute.recast_ptr(sSF.iterator, dtype=Int32), cute.make_layout(
            (4, 32, 2, self.stages), stride=(1, 4, SF_ATOM_BYTES // 4, 2 * SF_ATOM_BYTES // 4)))
        return sSF, sSA, sSB, sSA16, sSB16, sRaw32

    def scale_tmas(self, tensors, cluster_m: int, cluster_n: int):
        """(atom, tensor) of the SFA TMA (multicast with A along the cluster's N) and the SFB TMA (with B)."""
        return (*sf_atom_tma(tensors["sfa"], cluster_n), *sf_atom_tma(tensors["sfb"], cluster_m))

    @staticmethod
    def make_tiled_mma(ab_dtype, tile_n: int) -> cute.TiledMma:
        return sm90_utils.make_trivial_tiled_mma(
            ab_dtype, ab_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (2, 1, 1), tiler_mn=(64, tile_n))

    @staticmethod
    def make_scale_tiled_mma(tile_n: int) -> cute.TiledMma:
        """The bf16 m64 n{tile_n} k16 wgmma of the scale products (same thread -> accumulator map as the data
        wgmma of the same N)."""
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (2, 1, 1), tiler_mn=(64, tile_n))

    @staticmethod
    def make_ab_smem_layouts(ab_dtype, tile_m: int, tile_n: int, stages: int):
        layouts = []
        for rows in (tile_m, tile_n):
            atom = warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, ab_dtype, TILE_K), ab_dtype)
            layouts.append(cute.tile_to_shape(atom, (rows, TILE_K, stages), order=(0, 1, 2)))
        return tuple(layouts)

    # ------------------------------------------------------------------------------------------ producer
    @cute.jit
    def partition_scale_loads(self, tma_atom_sfa, mSFA, tma_atom_sfb, mSFB, smem, rank_m, rank_n):
        """The SFA / SFB TMA partitions: (128, 4, 1, atoms), one (128, 4) box = one 512-byte SF atom; SFA travels
        with A (multicast along the cluster's N), SFB with B."""
        sSF = smem[0]
        gSA = cute.local_tile(mSFA, (SF_ATOM_ROWS, KB_PER_STAGE), (None, None))
        gSB = cute.local_tile(mSFB, (SF_ATOM_ROWS, KB_PER_STAGE), (None, None))
        tSAs, tSAg = cpasync.tma_partition(
            tma_atom_sfa, rank_n, cute.make_layout(self.cluster_n),
            cute.group_modes(sSF[(None, None, 0, None)], 0, 2), cute.group_modes(gSA, 0, 2))
        tSBs, tSBg = cpasync.tma_partition(
            tma_atom_sfb, rank_m, cute.make_layout(self.cluster_m),
            cute.group_modes(sSF[(None, None, 1, None)], 0, 2), cute.group_modes(gSB, 0, 2))
        return tma_atom_sfa, tSAg, tSAs, tma_atom_sfb, tSBg, tSBs

    @cute.jit
    def load_tile(
        self, ab_pipeline, prod_state,
        tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB,
        a_mcast_mask, b_mcast_mask, k_count: Int32, side_inputs, tile, descriptors=None,
    ):
        """k_count stages of one tile (m_tile, n_tile, expert g of the schedule's tile); SF atom of stage k: the
        tile's first atom + k (one atom per 128 rows per stage): SFA (m/128, Kb) atoms, SFB (L, cdiv(N,128), Kb)
        atoms. Discrete weights: B and SFB through the expert's `descriptors`, g = 0."""
        g = 0 if const_expr(descriptors is not None) else tile.group
        sfa_atom0 = tile.m_tile * self.k_tiles
        sfb_atom0 = (g * self.sfb_row_blocks + tile.n_tile) * self.k_tiles
        ab_copies = (tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB)
        return WgmmaMainloop.produce_stages(self, ab_pipeline, prod_state, ab_copies, a_mcast_mask, b_mcast_mask,
                                            k_count, (side_inputs, sfa_atom0, sfb_atom0), descriptors)

    @cute.jit
    def load_stage_scales(self, scales, bar, k: Int32, s: Int32, a_mcast_mask, b_mcast_mask, descriptors):
        """The SF atoms of stage k (load_tile's per-tile `scales`) on the stage's barrier."""
        (tma_atom_sfa, tSAg, tSAs, tma_atom_sfb, tSBg, tSBs), sfa_atom0, sfb_atom0 = scales
        cute.copy(tma_atom_sfa, tSAg[(None, 0, sfa_atom0 + k)], tSAs[(None, s)], tma_bar_ptr=bar,
                  mcast_mask=a_mcast_mask)
        cute.copy(tma_atom_sfb, tSBg[(None, 0, sfb_atom0 + k)], tSBs[(None, s)], tma_bar_ptr=bar,
                  mcast_mask=b_mcast_mask,
                  tma_desc_ptr=None if const_expr(descriptors is None) else descriptors.sfb)

    # ------------------------------------------------------------------------------------------ decoder
    @staticmethod
    @cute.jit
    def scale_operands(mem_a, mem_b, sa_layout, sb_layout, tid: Int32, nthreads: cutlass.Constexpr):
        """(A', B') as wgmma operand tensors and as flat Int16 views for the decoder, zeroed by all threads once
        per CTA (the decoder only ever writes the scale elements). The caller's CTA barrier follows."""
        sSA = mem_a.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sSB = mem_b.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        flat = []
        for mem, layout in ((mem_a, sa_layout), (mem_b, sb_layout)):
            flat.append(cute.make_tensor(cute.recast_ptr(mem.data_ptr(), dtype=cutlass.Int16),
                                         cute.make_layout(cute.cosize(layout))))
            words = cute.make_tensor(cute.recast_ptr(mem.data_ptr(), dtype=Int32),
                                     cute.make_layout(cute.cosize(layout) // 2))
            for i in cutlass.range(tid, cute.size(words), nthreads, unroll=1):
                words[i] = Int32(0)
        cute.arch.fence_proxy("async.shared", space="cta")  # the wgmma reads them through the async proxy
        return sSA, sSB, flat[0], flat[1]

    @cute.jit
    def process_stage(self, worker: cutlass.Constexpr, smem, sA, sB, idx: Int32, k: Int32, k_count: Int32, tile_ctx,
                      lane: Int32):
        """Stage worker `worker` = (warp, operand, row quarters) of DECODER_WARPS: decode its part of the stage."""
        _, operand, quarters = worker
        self.decode_stage(smem[5], smem[3 + operand], operand, quarters, idx, k == self.k_tiles - 1, lane)

    @cute.jit
    def decode_stage(self, sRaw32: cute.Tensor, sS16: cute.Tensor, operand: cutlass.Constexpr,
                     quarters: cutlass.Constexpr, idx: Int32, last: cutlass.Boolean, lane: Int32):
        """Warp-collective: rows `lane + 32 i` (i in `quarters`) of one stage's SF atom of `operand` (0: A, 1: B) ->
        their bf16 scale elements in A' / B'. The decode is on the consumers' critical path (one warp for both
        operands measured -20%): warp 1 writes A' (one 8-byte store per row), warps 2 and 3
        half of B' each (four 2-byte stores per column).

        sRaw32: (4 words, 32 lanes, 2 operands, stages) Int32 view of the raw atoms -- lane l's 16 bytes are
        rows (A) / columns (B) l + 32 i, i = 0..3, each word holding k-blocks 0..3 (atom layout, docs/formats.md#scale-factor-layout);
        sS16: flat Int16 view of A' (operand 0) or B' (operand 1)."""
        group, stage = (SA_GROUP, SA_STAGE) if operand == 0 else (SB_GROUP, SB_STAGE)
        w = sRaw32[(None, lane, operand, idx)].load()
        keep_tail = Int32(cutlass.select_(last, Int32(0), Int32(-1)))  # K blocks past K: scale 0.0
        for i in quarters:
            r = lane + 32 * i
            row = idx * stage + (r // 8) * group + (r % 8) * 8
            bf = cute.make_rmem_tensor((KB_PER_STAGE,), cutlass.Int16)
            for j in cutlass.range_constexpr(KB_PER_STAGE):
                keep = Int32(-1)
                if const_expr(j >= self.last_kbs):
                    keep = keep_tail
                bf[j] = cutlass.Int16((_e8m0_f32_bits((w[i] >> (8 * j)) & Int32(0xFF)) & keep) >> 16)
            if const_expr(operand == 0):
                # dense row of A': the 4 blocks' scales at k = 0..3, one 8-byte store
                dst = cute.make_tensor(sS16.iterator + row, cute.make_layout(KB_PER_STAGE))
                dst.store(bf.load())
            else:
                for j in cutlass.range_constexpr(KB_PER_STAGE):
                    sS16[row + j * CHUNK + j] = bf[j]

    # ------------------------------------------------------------------------------------------ consumer
    @cute.jit
    def consumer_operands(self, tiled_mma, sA, sB, smem, wg: Int32):
        """(data mma, scale mma, tCrA, tCrB, tCrSA, tCrSB, P, S) of consumer warpgroup `wg`: the data partial P and
        the scale products S share the accumulator layout; with `n_parts` > 1 both are per column part (tuples of
        part-size P / S; the data mma and its A / B fragments are the part-wide ones), while acc keeps the tile's."""
        sSA, sSB = smem[1], smem[2]
        thr_mma = tiled_mma.get_slice(wg * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        mma_n = self.tile_n // self.n_parts
        data_mma = tiled_mma
        if const_expr(self.n_parts > 1):
            data_mma = Mxfp8Mainloop.make_tiled_mma(self.ab_dtype, mma_n)
            thr_data = data_mma.get_slice(wg * 128)
            tCrA = data_mma.make_fragment_A(thr_data.partition_A(sA))
            tCrB = data_mma.make_fragment_B(thr_data.partition_B(sB))
        scale_mma = Mxfp8Mainloop.make_scale_tiled_mma(mma_n)
        thr_scale = scale_mma.get_slice(wg * 128)
        tCrSA = scale_mma.make_fragment_A(thr_scale.partition_A(sSA))
        tCrSB = scale_mma.make_fragment_B(thr_scale.partition_B(sSB))
        part = thr_scale.partition_shape_C((self.tile_m, mma_n))
        P = cute.make_rmem_tensor(part, Float32)
        S = cute.make_rmem_tensor(part, Float32)
        if const_expr(self.n_parts > 1):
            P = tuple(cute.make_rmem_tensor(part, Float32) for _ in range(self.n_parts))
            S = tuple(cute.make_rmem_tensor(part, Float32) for _ in range(self.n_parts))
        return data_mma, scale_mma, tCrA, tCrB, tCrSA, tCrSB, P, S

    @cute.jit
    def wait_stage(self, ab_pipeline, state, dec_mbar, k=None):
        ab_pipeline.consumer_wait(state)
        cute.arch.mbarrier_wait(dec_mbar + state.index, state.phase)

    @cute.jit
    def mma_tile(self, ab_pipeline, read_state, release_state, operands, acc: cute.Tensor, k_count: Int32,
                 dec_mbar, tile=None):
        """acc = sum over k_count stages of P * S per 32-wide K block (zeros when k_count == 0); `operands` from
        `consumer_operands`, `dec_mbar` the decoder warps' stage barriers.

        No wgmma stays in flight across a stage: acc + P + S fill 192 of the 232 registers. n_parts == 1: both
        warpgroups issue their pairs together and fold together (the tensor core idles during the folds; making
        them take turns measured slower, 561 / 568 vs 597-600 TFLOP/s on fc1). n_parts > 1:
        mma_tile_parts.
        """
        tiled_mma, scale_mma, tCrA, tCrB, tCrSA, tCrSB, P, S = operands
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        scale_mma.set(warpgroup.Field.ACCUMULATE, False)
        if const_expr(self.n_parts > 1):
            return self.mma_tile_parts(ab_pipeline, dec_mbar, read_state, release_state, tiled_mma, scale_mma, acc,
                                       P, S, tCrA, tCrB, tCrSA, tCrSB, k_count)
        for _s in cutlass.range(k_count, unroll=1):
            self.wait_stage(ab_pipeline, read_state, dec_mbar)
            idx = read_state.index
            for kb in cutlass.range_constexpr(KB_PER_STAGE):
                warpgroup.fence()
                cute.gemm(tiled_mma, P, tCrA[(None, None, kb, idx)], tCrB[(None, None, kb, idx)], P)
                cute.gemm(scale_mma, S, tCrSA[(None, None, 0, kb, idx)], tCrSB[(None, None, 0, kb, idx)], S)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                fold(acc, P, S, 0)
            ab_pipeline.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        return read_state, release_state

    @cute.jit
    def issue_part(self, tiled_mma, scale_mma, P, S, tCrA, tCrB, tCrSA, tCrSB, h: cutlass.Constexpr,
                   kb: cutlass.Constexpr, idx: Int32):
        """Data + scale wgmma of column part h of block kb, one commit group."""
        warpgroup.fence()
        # B / B' of the part keep a unit N mode (gemm wants A and B of equal rank)
        cute.gemm(tiled_mma, P[h], tCrA[(None, None, kb, idx)], cute.append_ones(tCrB[(None, h, kb, idx)]), P[h])
        cute.gemm(scale_mma, S[h], tCrSA[(None, None, 0, kb, idx)], cute.append_ones(tCrSB[(None, h, 0, kb, idx)]),
                  S[h])
        warpgroup.commit_group()

    @cute.jit
    def mma_tile_parts(self, ab_pipeline, dec_mbar, read_state, release_state, tiled_mma, scale_mma, acc, P, S,
                       tCrA, tCrB, tCrSA, tCrSB, k_count: Int32):
        """`n_parts` > 1 (Config.mx_n_parts): the block's wgmmas per column part (m64 n(128 / parts)), so a part is
        folded while the others are on the tensor core: issue every part of the stage's first block; per block and
        part: wait for it, fold it, issue it for the next block. Same 192 registers (parts of P / S); each part
        re-reads the A / A' operand. The stage is drained at its end: no wgmma in flight across the stage loop's
        back-edge (ptxas would serialize every wgmma). Two stages per iteration (the second one waited for while
        the first one's last block computes; half the drains) measured slower: 578 vs 620 TFLOP/s on fc1.
        acc's values are the parts' in order (wgmma C layout: value v0 + 2 v1 + 4 j is column 2 quad + v0 + 8 j,
        so part h holds columns h * 128 / parts onwards)."""
        for _s in cutlass.range(k_count, unroll=1):
            read_state, release_state = self.stage_parts(
                ab_pipeline, dec_mbar, read_state, release_state, tiled_mma, scale_mma, acc, P, S, tCrA, tCrB, tCrSA,
                tCrSB)
        return read_state, release_state

    def stage_parts(self, ab_pipeline, dec_mbar, read_state, release_state, tiled_mma, scale_mma, acc, P, S,
                    tCrA, tCrB, tCrSA, tCrSB):
        """One stage, pipelined part by part (mma_tile_parts); returns both states advanced (the caller's loop
        carries them). Plain Python, traced inline into the caller's loop body."""
        nh = cute.size(P[0])
        parts = self.n_parts
        self.wait_stage(ab_pipeline, read_state, dec_mbar)
        idx = read_state.index
        read_state.advance()
        for h in range(parts):
            self.issue_part(tiled_mma, scale_mma, P, S, tCrA, tCrB, tCrSA, tCrSB, h, 0, idx)
        for kb in range(KB_PER_STAGE):
            last = kb == KB_PER_STAGE - 1
            for h in range(parts):
                # groups issued after part h: the later parts of this block, and (not last) the earlier parts of
                # the next
                warpgroup.wait_group(parts - 1 - h if last else parts - 1)
                fold(acc, P[h], S[h], h * nh)
                if not last:
                    self.issue_part(tiled_mma, scale_mma, P, S, tCrA, tCrB, tCrSA, tCrSB, h, kb + 1, idx)
        # every wgmma reading this stage has retired (its last block is folded)
        ab_pipeline.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state


def fold(acc, P, S, base: int):
    """acc[base + i] += P[i] * S[i] for every value of one part (plain Python, traced inline)."""
    for i in range(cute.size(P)):
        acc[base + i] = acc[base + i] + P[i] * S[i]


@cute.jit
def _e8m0_f32_bits(e: Int32) -> Int32:
    """Bits of fp32 2^(e-127) for an e8m0 code: e = 0 -> 0.0 (only ever multiplies zero data in practice),
    e = 255 -> quiet NaN ((e + 1) has bit 8 set only for e = 255)."""
    return (e << 23) | (((e + 1) << 14) & Int32(0x400000))
