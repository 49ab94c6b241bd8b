"""Dequantizing mainloop of the sm90 grouped GEMM: block-scaled A / B (MXFP8, MXFP4, NVFP4) converted exactly to
bf16 on chip and multiplied by the bf16 wgmma with fp32 accumulation (kernels/dequant.py: why it is exact).

Per A/B stage (TILE_K = 64 logical K):
  producer       TMA of the stage's narrow data (A 128 x 64, B tile_n x 64 codes; FP4 packed, 32 bytes a row) into
                 plain row-major shared memory, and of the SF atoms covering it: one 512-byte atom per 128 rows and
                 4 k-blocks (docs/formats.md#scale-factor-layout; vec 32: two stages share an atom, both load it);
                 SFA travels with A (multicast along the cluster's N), SFB with B;
  stage workers  warps 1-3 of the producer warpgroup convert the stage (A's and B's rows) into a bf16 stage in a
                 K-major layout the bf16 SS wgmma reads (`bf16_stage_layout`), fence it for the async proxy and
                 arrive on the stage's worker barrier. A lane converts one group (16 K elements) of one row: 4
                 lanes a row, 8 rows a pass; one 16- (FP8) or 8-byte (FP4) load, the SF byte, 8 bf16x2 words out;
  consumers      the bf16 mainloop (WgmmaMainloop.mma_tile) on the bf16 stage; with A in registers (the default)
                 they also convert B's first `consumer_b` passes (Config.consumer_b_passes), below (FP4 data
                 beside a block-scaled or 16-bit A, no split: every B row, a row a lane: the row-wise stage,
                 mainloop_dequant_rows.py).

K order: group q of a row holds K 16q..16q+15 of the stage; its pair p (dequant.pair_k) is stored at the bf16
stage's K slots 8p + 2q, 8p + 2q + 1 (K chunk p, word q: one conflict-free 32-bit store per pair). A and B are
permuted alike, so the dot products are the reference's up to summation order. The slot map is also the wgmma
A-fragment order (thread q of a quad holds slots 2q, 2q + 1, 2q + 8, 2q + 9 of each k16), so a consumer thread that
converts A in registers reads one group per row.

Consumer B passes (A in registers). The stage workers alone were the bound (RESULTS run 52: PC sampling of fc1 NVFP4
/ MXFP8: the consumers waited on the worker barrier ~65% of their samples while the busiest worker, 6 passes a
stage, issued at a fraction of its slots, mostly stalled on dependent instructions), and the consumers have issue
slots to spare while their previous stage's wgmmas run. So per stage a consumer warp, after the stage's TMA landed,
converts its B passes (the first `consumer_b` ones, warp w: w, w + 8, ...; the workers take the passes after them),
fences them for the async proxy, syncs the warp, (split B: its lanes bulk-copy them to the other CTA like the
workers') and its lane 0 arrives on the stage's worker barrier (init count: 32 per worker + 1 per converting
consumer warp; the fence-sync-arrive order is a TMA store's). Then it converts its A groups and only then waits for
the worker barrier: A needs only the TMA's data. No cycle: a consumer warp's passes of stage k depend only on stage
k's TMA, which depends on releases of earlier stages.

Valid data only: K past K is zero-filled by the TMA and its scale forced to 0.0; B rows past N likewise (their
SF bytes may be padding or the next expert's), so a NaN padding byte cannot reach a stored output or amax.

Cluster-split B (`split_b`, wherever B is multicast: a 2-CTA cluster along M). Both CTAs of the cluster receive the
same narrow B stage (and its SFB atoms), so each converts only its half: the workers of the CTA with rank_m = r
convert B rows [r * tile_n / 2, (r + 1) * tile_n / 2) into their own bf16 stage (the same conversion and stores),
then copy each finished 8-row group (1 KiB, contiguous in the bf16 stage) to the same place in the other CTA's
bf16 stage with a shared::cta -> shared::cluster bulk copy (`cp.async.bulk ... mbarrier::complete_tx::bytes`, the
async proxy, as the multicast TMA writes B) that signals its bytes on the other CTA's worker barrier of the stage.
Each CTA's worker barrier thus completes when its own workers' lanes arrived (as without the split) and the other
CTA's 16 KiB (tile_n / 2 rows x 128 B) landed: warp 1's first lane adds them with `mbarrier.expect_tx` before it
arrives. The consumers wait on it as before. Why it is safe (the persistent schedule is the same on both CTAs:
same tiles, same k_count, same stage sequence):
  * no write-after-read race: CTA r's workers (and consumer warps) copy into stage s of use i only after their own
    full barrier for use i completed, i.e. after CTA r's producer acquired stage s for use i. That acquire waits on
    CTA r's empty barrier, which counts the releases of the consumer warps of *both* CTAs (gemm.py: consumer_group =
    (cluster_m + cluster_n - 1) * 8 warps; PipelineTmaAsync.consumer_release arrives on every CTA that multicasts
    into the stage), and a consumer releases stage s of use i - 1 only after `wait_group` retired the wgmmas that
    read it (mma_tile_rs). So the other CTA's consumers are done with use i - 1 before the copies of use i start:
    the argument that already lets the other CTA's producer multicast its half of the narrow B into stage s. The
    two CTAs write disjoint rows of each other's stage;
  * the copy's source: this CTA's bf16 stage s is rewritten (use i + 1) only after both CTAs' consumers released
    use i, i.e. after the other CTA's worker barrier of use i completed, i.e. after this copy's complete_tx;
  * no early or lost phase: the other CTA's complete_tx of use i can land before this CTA's expect_tx of use i
    (tx-count goes negative, as with the multicast TMA of the other producer), never before phase i - 1 completed
    (the copy of use i waits for releases of use i - 1, which follow the wait on phase i - 1), and phase i cannot
    complete without warp 1's expect_tx (it precedes that lane's arrival);
  * complete data: the lanes' generic-proxy stores -> fence.proxy.async.shared::cta (each lane) -> bar.warp.sync
    -> the bulk copy (async proxy) reads them; its writes complete_tx the other CTA's barrier, which the consumers
    wait on before their wgmmas (async proxy) read them, as for TMA data;
  * lifetime: a CTA exits after its producer's `producer_tail`, which waits until both CTAs' consumers released
    every stage, i.e. until every copy out of (and into) its shared memory completed.
Tile lists (`sched.by_tiles`) never run block-scaled problems with 2-CTA clusters (the kernel refuses them; their
blocks may load two experts' B unicast) and 1x1 clusters have no peer: the split is off there (`splits_b`).
Discrete weights multicast B through the expert's descriptor like stacked weights: the split applies.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup

from cudnn_moe_jax.formats import SF_ATOM_BYTES, SF_ATOM_KBLOCKS, SF_ATOM_ROWS, sf_atom_byte
from cudnn_moe_jax.operands import half_dtype, has_exact_half

from .. import dequant as dq
from .. import quantize as q8
from .mainloop import WgmmaMainloop, make_ab_smem_layouts
# the stage geometry lives beside the row-wise stage, which needs it: here, the two modules would import each other
from .mainloop_dequant_rows import GROUPS, ROWS_PER_PASS, TILE_K, RowwiseStage  # noqa: F401 (md.GROUPS: lab)
from .mainloop_mxfp8 import sf_atom_tma

WORKERS = ((1,), (2,), (3,))    # (warp of the producer warpgroup,)
CONSUMER_WARPS = 8              # warps of the two consumer warpgroups
_CUTLASS = {dq.E4M3: cutlass.Float8E4M3FN, dq.E5M2: cutlass.Float8E5M2, dq.E2M1: cutlass.Uint8}


@dataclasses.dataclass(frozen=True)
class DequantFormat:
    """The operands of a problem: B's (and A's) data dtype, SF dtype and vec size; `a_half`: A's dtype where A is a
    plain 16-bit operand without scales (weight-only quantization: "bfloat16" or "float16"), else None; `half`: the
    16-bit type of the converted operands and the wgmma -- fp16 beside an fp16 A where it holds every weight exactly
    (operands.has_exact_half: NVFP4; B converted to bf16, then one exact cvt a word), else bf16."""

    data: str
    sf: str
    vec: int
    a_half: Optional[str] = None
    half: str = "bfloat16"

    @classmethod
    def of(cls, problem) -> "DequantFormat":
        half = half_dtype(problem) if has_exact_half(problem) else "bfloat16"
        return cls(problem.ab_dtype, problem.sf_dtype, problem.sf_vec_size, problem.a_dtype, half)

    @property
    def a_plain(self) -> bool:
        """A is a plain 16-bit operand (bf16 or fp16: `half`, `a_split`): no scales, a swizzled stage."""
        return self.a_half is not None

    @property
    def mma_dtype(self):
        return cutlass.Float16 if self.half == "float16" else BFloat16

    @property
    def a_split(self) -> bool:
        """Any other fp16 A: each value is the exact sum of two bf16 parts (hi: its top 8 significant bits, lo: the
        other 3), each multiplied by the dequantized B in its own bf16 wgmma (no 16-bit MMA type holds both that A
        and the dequantized B exactly)."""
        return self.a_half == "float16" and self.half == "bfloat16"

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of a narrow stage."""
        return TILE_K * dq.bytes_per_group(self.data) // dq.GROUP

    @property
    def a_row_bytes(self) -> int:
        return 2 * TILE_K if self.a_plain else self.row_bytes

    def tma(self, operand: int):
        """(element type of the operand's global / shared memory (packed FP4: bytes), TMA box extent along K)."""
        if operand == 0 and self.a_plain:
            return (cutlass.Float16 if self.a_split else BFloat16), TILE_K
        return _CUTLASS[self.data], self.row_bytes


def sf_atoms(tile_m: int, tile_n: int) -> int:
    """SF atom slots per stage: one per 128 rows of A (unused for a bf16 A) and of B."""
    return (tile_m + tile_n) // SF_ATOM_ROWS


def narrow_stage_layout(rows: int, box: int, stages: int):
    """Narrow (FP8 / packed FP4) stages (rows, box bytes, stages), row-major and unswizzled."""
    layout = cute.make_layout((rows, box, stages), stride=(box, 1, rows * box))
    return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, layout)


def bf16_stage_layout(rows: int, stages: int):
    """bf16 stages (rows, 64, stages), K-major without swizzle ("interleaved" wgmma operand): 8 x 8 core matrices
    of 128 contiguous bytes, the 8 K chunks of an 8-row group side by side (1 KiB a group). Element (r, k) sits at
    byte (r // 8) * 1024 + (k // 8) * 128 + (r % 8) * 16 + (k % 8) * 2: a worker's pair p lands at a constant
    offset p * 128 from its row's base, and the 32 lanes of a store (8 rows x 4 words) hit 32 banks."""
    layout = cute.make_layout(((8, rows // 8), (8, TILE_K // 8), stages),
                              stride=((8, 8 * TILE_K), (1, 64), rows * TILE_K))
    return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, layout)


def mainloop_class(problem, config):
    """The dequantizing mainloop for `problem`'s formats and `config.dequant_a` (a subclass binding them: the
    kernel class reads the stage sizes from the class before it picks the stage count)."""
    fmt = DequantFormat.of(problem)
    a_regs = config.dequant_a == "registers"
    if fmt.a_plain and not a_regs:
        raise NotImplementedError("a 16-bit A with block-scaled B needs Config(dequant_a='registers') (the "
                                  "workers' bf16 stage permutes K; a 16-bit A stage is read as TMA stored it)")
    # FP8 B: the stage workers' e4m3 / e5m2 conversion runs faster with 56 registers than with 40 (fc1 MXFP8 485 vs
    # 466 TFLOP/s, RESULTS run 62; FP4 and weight-only NVFP4 unchanged), the consumers keeping 224
    regs = 56 if fmt.data in (dq.E4M3, dq.E5M2) else WgmmaMainloop.PRODUCER_REGS
    return type(f"DequantMainloop_{fmt.data}_{fmt.sf}_{fmt.vec}_{config.dequant_a}", (DequantMainloop,),
                {"FORMAT": fmt, "A_IN_REGISTERS": a_regs, "REGISTER_TIGHT": a_regs, "PRODUCER_REGS": regs})


class DequantMainloop(RowwiseStage, WgmmaMainloop):
    """The mainloop protocol (WgmmaMainloop's docstring) for block-scaled A and B: narrow stages by TMA, the
    bf16 B stage (and with A_IN_REGISTERS False the bf16 A stage) from the stage workers; the consumers convert
    A into the register operand of an RS wgmma (A_IN_REGISTERS, `mma_tile_rs`) or run the bf16 SS k-loop; in the
    row-wise stage (`RowwiseStage`, mainloop_dequant_rows.py) they convert all of B's rows too."""

    TILE_K = TILE_K
    STAGE_WORKERS = WORKERS
    REGISTER_TIGHT = False
    FORMAT: DequantFormat = None
    A_IN_REGISTERS = True

    split_b = False   # cluster-split B conversion (module docstring)
    consumer_b = 0    # B passes the consumer warps convert per stage (A in registers; module docstring); K-grouped:
    #                   none

    def __init__(self, tile_m: int, tile_n: int, stages: int, k: int, n: int, cluster_m: int, cluster_n: int,
                 split_b: bool = False, consumer_b: Optional[int] = 0):
        super().__init__(self.FORMAT.mma_dtype, tile_m, tile_n, stages)   # the wgmma, its swizzled stage layouts
        fmt = self.FORMAT
        self.k, self.n = k, n
        self.k_blocks4 = -(-(-(-k // fmt.vec)) // SF_ATOM_KBLOCKS)   # SF atoms along K (Kb)
        self.stages_per_atom = SF_ATOM_KBLOCKS * fmt.vec // TILE_K
        self.sfb_row_blocks = -(-n // SF_ATOM_ROWS)
        self.cluster_m, self.cluster_n = cluster_m, cluster_n
        self.split_b = split_b and cluster_m == 2
        if self.A_IN_REGISTERS:
            self.set_consumer_b(consumer_b)

    # the consumers' share of B's passes by default: half with the cluster split (8 of a CTA's 16: fc1 / small, RESULTS
    # runs 53-54); without it (1 x 1 clusters, e.g. 128-row groups) three quarters, 24 of 32: e128_fc1 +3..9% over 16
    # on every format, 20 and 28 no better (RESULTS run 128); all 32 for FP4 data beside a block-scaled or 16-bit A (a
    # row a lane, `_convert_stage_hoisted`; RESULTS runs 135-138) and for FP8 weights beside a bf16 A where the narrow
    # stage is then released early (passes; weight-only MXFP8 e128 +7-9% with the folded group scales, run 142)
    UNSPLIT_SHARE = (3, 4)
    HOISTS = True      # the consumers' hoisted stage where they convert every pass (not the K-grouped subclass)

    def set_consumer_b(self, requested: Optional[int]) -> None:
        """The consumers' B passes per stage: `requested` (Config.consumer_b_passes), at most every pass this CTA
        converts; None: half of them with the cluster split, else UNSPLIT_SHARE of them, or all of them (M-grouped)
        for FP4 data beside a block-scaled or 16-bit A (not an fp16 A split in two: the row-wise stage) and for FP8
        data beside a bf16 A with at least 3 stages (`releases_early`; with a block-scaled A, whose groups the
        consumers convert too, it gained nothing: RESULTS run 142)."""
        fmt = self.FORMAT
        b_passes = (self.tile_n // 2 if self.split_b else self.tile_n) // ROWS_PER_PASS
        num, den = (1, 2) if self.split_b else self.UNSPLIT_SHARE
        fp4_rows = fmt.data == dq.E2M1 and not fmt.a_split
        fp8_weights = fmt.data != dq.E2M1 and fmt.a_plain and not fmt.a_split and self.stages >= 3
        if not self.split_b and self.HOISTS and (fp4_rows or fp8_weights):
            num, den = 1, 1
        self.consumer_b = min(b_passes * num // den if requested is None else requested, b_passes)

    @classmethod
    def from_problem(cls, problem, config, ab_dtype, stages: int):
        return cls(config.tile_m, config.tile_n, stages, problem.k, problem.n, config.cluster_m, config.cluster_n,
                   cls.splits_b(problem, config), config.consumer_b_passes)

    @staticmethod
    def splits_b(problem, config) -> bool:
        """The cluster-split B conversion runs wherever B is multicast to both CTAs of a 2-CTA cluster along M: M
        blocks of 2 tiles (m_aligned a multiple of them; tile lists pair tiles of two experts and load B unicast)."""
        return config.cluster_m == 2 and problem.m_aligned % (config.cluster_m * config.tile_m) == 0

    # ------------------------------------------------------------------------------------------ sizes
    @classmethod
    def tx_bytes(cls, ab_dtype, tile_m: int, tile_n: int) -> int:
        """TMA bytes per stage: the A and B tiles and their SF atoms."""
        fmt = cls.FORMAT
        atoms = sf_atoms(tile_m, tile_n) - (tile_m // SF_ATOM_ROWS if fmt.a_plain else 0)
        return tile_m * fmt.a_row_bytes + tile_n * fmt.row_bytes + atoms * SF_ATOM_BYTES

    @classmethod
    def smem_stage_bytes(cls, ab_dtype, tile_m: int, tile_n: int) -> int:
        """Shared memory per stage: the TMA bytes, the bf16 stage(s), the worker barrier."""
        bf16_rows = tile_n if cls.A_IN_REGISTERS else tile_m + tile_n
        unused_sf = tile_m // SF_ATOM_ROWS * SF_ATOM_BYTES if cls.FORMAT.a_plain else 0   # A's SF slot
        return cls.tx_bytes(ab_dtype, tile_m, tile_n) + unused_sf + bf16_rows * TILE_K * 2 + 8

    def tiled_mma(self) -> cute.TiledMma:
        """The 16-bit wgmma (`DequantFormat.half`), A from registers (A_IN_REGISTERS) or shared memory."""
        source = warpgroup.OperandSource.RMEM if self.A_IN_REGISTERS else warpgroup.OperandSource.SMEM
        mma = self.FORMAT.mma_dtype
        return sm90_utils.make_trivial_tiled_mma(mma, mma, cute.nvgpu.OperandMajorMode.K,
                                                 cute.nvgpu.OperandMajorMode.K, Float32, (2, 1, 1),
                                                 tiler_mn=(64, self.tile_n), a_source=source)

    def tma_operands(self):
        """((element type, TMA box K) of A, of B): the narrow stages (a bf16 A: 64 K)."""
        return self.FORMAT.tma(0), self.FORMAT.tma(1)

    def ab_smem_layouts(self):
        """The narrow stages: (rows, box K, stages) row-major, unswizzled (the workers' and consumers' group
        loads are conflict-free: a pass reads whole rows); a bf16 A: the bf16 kernel's 128-byte swizzle (its
        consumers read 32 bytes of a row, 8 rows apart)."""
        out = []
        for operand, rows in enumerate((self.tile_m, self.tile_n)):
            if operand == 0 and self.FORMAT.a_plain:
                out.append(make_ab_smem_layouts(self.FORMAT.tma(0)[0], self.tile_m, self.tile_n, self.stages)[0])
                continue
            out.append(narrow_stage_layout(rows, self.FORMAT.tma(operand)[1], self.stages))
        return tuple(out)

    def bf16_layouts(self):
        return tuple(bf16_stage_layout(rows, self.stages) for rows in (self.tile_m, self.tile_n))

    def smem_fields(self):
        """The SF atoms of each stage (A's, then B's) and the bf16 B (and A) stages."""
        a16, b16 = self.bf16_layouts()
        atoms = sf_atoms(self.tile_m, self.tile_n) * self.stages
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        fields = [("sSF", Align[MemRange[cutlass.Uint8, atoms * SF_ATOM_BYTES], 128]),
                  ("sB16", Align[MemRange[self.FORMAT.mma_dtype, cute.cosize(b16)], 1024])]
        if not self.A_IN_REGISTERS:
            fields.append(("sA16", Align[MemRange[self.FORMAT.mma_dtype, cute.cosize(a16)], 1024]))
        return fields

    @cute.jit
    def smem_tensors(self, storage, tidx: Int32, nthreads: cutlass.Constexpr):
        """(SF atoms (128, 4, atom, stage) u8, bf16 A stages (None with A in registers), bf16 B stages (wgmma
        operand views), the narrow A / B stages and the bf16 A / B stages as flat Int32 words (the converters'
        loads and stores), the SF bytes as a flat u8 tensor)."""
        n_atoms = sf_atoms(self.tile_m, self.tile_n)
        sSF = storage.sSF.get_tensor(cute.make_layout(
            (SF_ATOM_ROWS, SF_ATOM_KBLOCKS, n_atoms, self.stages),
            stride=(1, SF_ATOM_ROWS, SF_ATOM_BYTES, n_atoms * SF_ATOM_BYTES)))
        sf_bytes = cute.make_tensor(storage.sSF.data_ptr(), cute.make_layout(n_atoms * SF_ATOM_BYTES * self.stages))
        return (sSF,) + self.stage_views(storage) + (sf_bytes,)

    @cute.jit
    def stage_views(self, storage):
        """(bf16 A stages (None with A in registers), bf16 B stages (wgmma operand views), the narrow A / B stages
        and the bf16 A / B stages as flat Int32 words)."""
        a16, b16 = self.bf16_layouts()
        sB16 = storage.sB16.get_tensor(b16.outer, swizzle=b16.inner)
        sA16 = None
        mems = [(storage.sA, self.tile_m, self.FORMAT.a_row_bytes), (storage.sB, self.tile_n, self.FORMAT.row_bytes),
                None, (storage.sB16, self.tile_n, 2 * TILE_K)]
        if const_expr(not self.A_IN_REGISTERS):
            sA16 = storage.sA16.get_tensor(a16.outer, swizzle=a16.inner)
            mems[2] = (storage.sA16, self.tile_m, 2 * TILE_K)
        words = [None if m is None else cute.make_tensor(cute.recast_ptr(m[0].data_ptr(), dtype=Int32),
                                                         cute.make_layout(m[1] * m[2] // 4 * self.stages))
                 for m in mems]
        return sA16, sB16, words[0], words[1], words[2], words[3]

    # ------------------------------------------------------------------------------------------ producer
    def scale_tmas(self, tensors, cluster_m: int, cluster_n: int):
        """(atom, tensor) of the SFA TMA (multicast with A along the cluster's N; none for a bf16 A) and the SFB
        TMA (with B)."""
        sfa = (None, None) if self.FORMAT.a_plain else sf_atom_tma(tensors["sfa"], cluster_n)
        return (*sfa, *sf_atom_tma(tensors["sfb"], cluster_m))

    @cute.jit
    def partition_sfa(self, tma_atom_sfa, mSFA, sSF, rank_n):
        """(smem, gmem) SFA TMA partitions over (atom coordinate, stage), multicast along the cluster's N."""
        return cpasync.tma_partition(
            tma_atom_sfa, rank_n, cute.make_layout(self.cluster_n),
            cute.group_modes(sSF[(None, None, 0, None)], 0, 2),
            cute.group_modes(cute.local_tile(mSFA, (SF_ATOM_ROWS, SF_ATOM_KBLOCKS), (None, None)), 0, 2))

    @cute.jit
    def partition_scale_loads(self, tma_atom_sfa, mSFA, tma_atom_sfb, mSFB, smem, rank_m, rank_n):
        """The SFA / SFB TMA partitions over (atom coordinate, stage): one (128, 4) box = one SF atom."""
        sSF = smem[0]
        tile = (SF_ATOM_ROWS, SF_ATOM_KBLOCKS)
        tSAs = tSAg = None
        if const_expr(not self.FORMAT.a_plain):
            tSAs, tSAg = self.partition_sfa(tma_atom_sfa, mSFA, sSF, rank_n)
        gSB = cute.group_modes(cute.local_tile(mSFB, tile, (None, None)), 0, 2)
        tSBs = []  # one destination per B row block of the tile
        for i in cutlass.range_constexpr(self.tile_n // SF_ATOM_ROWS):
            dst, tSBg = cpasync.tma_partition(
                tma_atom_sfb, rank_m, cute.make_layout(self.cluster_m),
                cute.group_modes(sSF[(None, None, 1 + i, None)], 0, 2), gSB)
            tSBs.append(dst)
        return tma_atom_sfa, tSAg, tSAs, tma_atom_sfb, tSBg, tSBs

    @cute.jit
    def load_tile(self, ab_pipeline, prod_state, tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB,
                  a_mcast_mask, b_mcast_mask, k_count: Int32, side_inputs, tile, descriptors=None):
        """k_count stages of tile (m_tile, n_tile, expert g): the narrow A / B boxes and the SF atoms of stage k
        (k-block quad k // stages_per_atom). SFA atoms are (m / 128, Kb), SFB atoms (L, cdiv(N, 128), Kb); a B
        row block past N loads the expert's last one (its rows are masked by the workers). Discrete weights: B and
        SFB through the expert's `descriptors`, g = 0."""
        g = 0 if const_expr(descriptors is not None) else tile.group
        return self.produce_stages(ab_pipeline, prod_state, (tma_atom_a, tAgA, tAsA, tma_atom_b, tBgB, tBsB),
                                   a_mcast_mask, b_mcast_mask, k_count, (side_inputs, tile.m_tile, tile.n_tile, g),
                                   descriptors)

    @cute.jit
    def load_stage_scales(self, scales, bar, k: Int32, s: Int32, a_mcast_mask, b_mcast_mask, descriptors):
        """The SF atoms of stage k (load_tile's per-tile `scales`) on the stage's barrier."""
        (tma_atom_sfa, tSAg, tSAs, tma_atom_sfb, tSBg, tSBs), m_tile, n_tile, g = scales
        b_blocks = self.tile_n // SF_ATOM_ROWS
        kq = k // self.stages_per_atom
        if const_expr(not self.FORMAT.a_plain):
            cute.copy(tma_atom_sfa, tSAg[(None, 0, m_tile * self.k_blocks4 + kq)], tSAs[(None, s)],
                      tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
        for i in cutlass.range_constexpr(b_blocks):
            rb = cutlass.min(n_tile * b_blocks + i, Int32(self.sfb_row_blocks - 1))
            cute.copy(tma_atom_sfb, tSBg[(None, 0, (g * self.sfb_row_blocks + rb) * self.k_blocks4 + kq)],
                      tSBs[i][(None, s)], tma_bar_ptr=bar, mcast_mask=b_mcast_mask,
                      tma_desc_ptr=None if const_expr(descriptors is None) else descriptors.sfb)

    # ------------------------------------------------------------------------------------------ workers
    def stage_arrivals(self) -> int:
        """Every lane of the stage workers, and one per consumer warp that converts B passes."""
        return 32 * len(self.STAGE_WORKERS) + min(self.consumer_b, CONSUMER_WARPS)

    def stage_atoms(self) -> int:
        """SF atom slots of a stage in shared memory (`sf_atoms`)."""
        return sf_atoms(self.tile_m, self.tile_n)

    def consumer_warp_passes(self) -> int:
        """B passes of the consumer warp that converts the most (warp w: passes w, w + 8, ... < consumer_b)."""
        return -(-self.consumer_b // CONSUMER_WARPS)

    def _units(self):
        """Static list of the stage workers' (operand, first row) passes of one stage: A's rows (unless A is
        converted in the consumers' registers), then B's after the consumers' (split B: the first half's; a CTA
        adds its half's first row)."""
        a = [] if self.A_IN_REGISTERS else [(0, r) for r in range(0, self.tile_m, ROWS_PER_PASS)]
        b_rows = self.tile_n // 2 if self.split_b else self.tile_n
        return a + [(1, r) for r in range(self.consumer_b * ROWS_PER_PASS, b_rows, ROWS_PER_PASS)]

    @cute.jit
    def process_stage(self, worker: cutlass.Constexpr, smem, sA, sB, idx: Int32, k: Int32, k_count: Int32, tile_ctx,
                      lane: Int32):
        """Worker `worker` converts its passes (every third) of stage `idx` (tile-local k-tile k) into the bf16
        stage; tile_ctx: the schedule's tile (`scheduler.Tile`: B rows past N are masked). Split B: this CTA's
        half of B's rows (`publish_stage` copies them to the other CTA)."""
        slot = worker[0] - 1
        units = self._units()
        b0 = self.b_base()
        for u in cutlass.range_constexpr(slot, len(units), len(WORKERS)):
            operand, r0 = units[u]
            if const_expr(operand == 1):
                self.convert_row_group(smem, 1, b0 + r0 + (lane >> 2), lane & 3, idx, k, tile_ctx.n_tile)
            else:
                self.convert_row_group(smem, operand, r0 + (lane >> 2), lane & 3, idx, k, tile_ctx.n_tile)

    @cute.jit
    def b_base(self) -> Int32:
        """The first of B's rows this CTA converts: 0, or with split B its half's (rank_m = rank % cluster_m, 2)."""
        b0 = Int32(0)
        if const_expr(self.split_b):
            b0 = (cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) & 1) * (self.tile_n // 2)
        return b0

    @cute.jit
    def copy_to_peer(self, smem, stage_mbar, idx: Int32, row: Int32):
        """Split B: the converted 8-row group at B row `row` of bf16 stage idx (1 KiB, contiguous) to the same place
        in the other CTA's stage, completing its bytes on that CTA's worker barrier of the stage."""
        peer = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) ^ 1
        src = smem[6].iterator.toint() + self.b_pass_bytes(idx, row)
        bulk_copy_to_cluster(mapa_shared(src, peer), src, ROWS_PER_PASS * 2 * TILE_K,
                             mapa_shared((stage_mbar + idx).toint(), peer))

    def b_pass_bytes(self, idx: Int32, row: Int32) -> Int32:
        """Byte offset in the bf16 B stages of the pass that starts at B row `row` of stage idx (K-major: 8 rows)."""
        return (idx * self.tile_n + row) * (2 * TILE_K)

    def b_passes(self, worker) -> list:
        """Split B: the first rows (in this CTA's half) of `worker`'s B passes, in order."""
        slot = worker[0] - 1
        units = self._units()
        return [units[u][1] for u in range(slot, len(units), len(WORKERS)) if units[u][0] == 1]

    @cute.jit
    def publish_stage(self, worker: cutlass.Constexpr, smem, stage_mbar, idx: Int32, lane: Int32):
        """Split B: after the fence, the warp synced, lane j copies the warp's j-th B pass (8 rows, 1 KiB of the
        bf16 stage) to the same place in the other CTA, completing bytes on its worker barrier of stage idx; warp
        1's first lane expects the other CTA's bytes on this CTA's; then every lane arrives (module docstring)."""
        if const_expr(not self.split_b):
            WgmmaMainloop.publish_stage(self, worker, smem, stage_mbar, idx, lane)
        else:
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            passes = self.b_passes(worker)   # (a worker may have none: the consumers' can cover the half)
            first = passes[0] if passes else 0
            if lane < len(passes):
                # the warp's passes step by len(WORKERS) * ROWS_PER_PASS rows (B units are consecutive)
                self.copy_to_peer(smem, stage_mbar, idx, self.b_base() + first + lane * (len(WORKERS) * ROWS_PER_PASS))
            if const_expr(worker[0] == WORKERS[0][0]):
                if lane == 0:
                    cute.arch.mbarrier_expect_tx(stage_mbar + idx, self.tile_n // 2 * 2 * TILE_K)
            cute.arch.mbarrier_arrive(stage_mbar + idx)

    @cute.jit
    def convert_group(self, smem, operand: cutlass.Constexpr, row: Int32, q: Int32, idx: Int32, k: Int32,
                      valid: cutlass.Boolean, store):
        """Group q of row `row` of `operand` (0: A, 1: B) in stage idx (tile-local k-tile k) -> `store(p, pair)`
        for its 8 bf16x2 pairs (dequant.convert_group); `valid` false: zeros (K past K, rows past N)."""
        self.finish_group(self.load_group(smem, operand, row, q, idx, k), valid, store)

    @cute.jit
    def load_group(self, smem, operand: cutlass.Constexpr, row: Int32, q: Int32, idx: Int32, k: Int32):
        """(code words, SF byte, first K) of group q of row `row`: `convert_group`'s shared-memory loads."""
        fmt = self.FORMAT
        sf_bytes = smem[7]
        words = self.group_words(smem, operand, row, q, idx)
        k0 = k * TILE_K + q * dq.GROUP           # first K of the group
        # SF byte: atom (A's, or B's row block) of this stage, row interleave and k-block (formats.sf_atom_byte;
        # shifts and masks: the coordinates are non-negative, and signed // and % cost sign fix-ups)
        atom = 0 if const_expr(operand == 0) else 1 + (row >> 7)
        kb = (k0 >> (fmt.vec.bit_length() - 1)) & (SF_ATOM_KBLOCKS - 1)
        code = Int32(sf_bytes[(idx * self.stage_atoms() + atom) * SF_ATOM_BYTES
                              + sf_atom_byte(row & 31, (row >> 5) & 3, kb)]) & Int32(0xFF)  # (the u8 load sign-extends)
        return words, code, k0

    @cute.jit
    def finish_group(self, loaded, valid: cutlass.Boolean, store):
        """A loaded group (`load_group`) converted, its pairs handed to `store(p, pair)`; a group is part of one row
        of A or B whose every K feeds one output row / column: NaN by group. FP8 data where the consumers convert all
        of B (`releases_early`: FP8 weights) takes the folded scale (`dequant.convert_group_folded`: weight-only
        MXFP8 e128 +6-7%, RESULTS runs 142-143); beside stage workers its finiteness tests cost what it saved (MXFP8
        e128 -3%, run 143), and FP4 groups' fold cost what the pairs saved (run 136): two multiplies there."""
        fmt = self.FORMAT
        words, code, k0 = loaded
        if const_expr(fmt.half == "float16"):
            store = (lambda p, pair, bf16_store=store: bf16_store(p, dq.bf16x2_to_f16x2(pair)))
        valid = valid & (k0 < self.k)
        if const_expr(fmt.data == dq.E2M1 or not self.releases_early()):
            dq.convert_group(words, fmt.data, dq.scale_bf16x2(code, fmt.sf, valid), store, True)
        else:
            dq.convert_group_folded(words, fmt.data, code, fmt.sf, valid, store)

    @cute.jit
    def group_words(self, smem, operand: cutlass.Constexpr, row: Int32, q: Int32, idx: Int32):
        """The 32-bit words of group q of row `row` of the narrow `operand` stage idx (FP8: 4, FP4: 2)."""
        rows = self.tile_m if const_expr(operand == 0) else self.tile_n
        n_words = dq.bytes_per_group(self.FORMAT.data) // 4
        base = (idx * rows + row) * (self.FORMAT.row_bytes // 4) + q * n_words
        words = cute.make_tensor(smem[3 + operand].iterator + base, cute.make_layout(n_words)).load()
        return [words[i] for i in range(n_words)]

    @cute.jit
    def convert_row_group(self, smem, operand: cutlass.Constexpr, row: Int32, q: Int32, idx: Int32, k: Int32,
                          n_tile: Int32):
        """A worker's group: into the bf16 stage of `operand` (`row_group_store`)."""
        valid, store = self.row_group_store(smem, operand, row, q, idx, n_tile)
        self.convert_group(smem, operand, row, q, idx, k, valid, store)

    def row_group_store(self, smem, operand: int, row: Int32, q: Int32, idx: Int32, n_tile: Int32):
        """(valid, store(p, pair)) of a worker's group q of row `row`: B rows past N are not valid; pair p goes to
        the bf16 stage of `operand` (bf16_stage_layout: row group, row in group, word q of K chunk p)."""
        rows = self.tile_m if operand == 0 else self.tile_n
        valid = cutlass.Boolean(True)
        if operand == 1:
            valid = n_tile * self.tile_n + row < self.n
        dst = smem[5 + operand]
        out = (idx * rows + (row & ~7)) * (2 * TILE_K // 4) + (row & 7) * 4 + q

        def store(p, pair):
            dst[out + p * 32] = pair

        return valid, store

    # ------------------------------------------------------------------------------------------ consumer
    @cute.jit
    def consumer_operands(self, tiled_mma, sA, sB, smem, wg: Int32):
        """Consumer warpgroup `wg`: (mma, the SS fragments of the bf16 A stages or, A in registers, the shape of
        its RS fragment, B fragment over the bf16 B stages, smem views)."""
        thr_mma = tiled_mma.get_slice(wg * 128)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(smem[2]))
        if const_expr(not self.A_IN_REGISTERS):
            return tiled_mma, tiled_mma.make_fragment_A(thr_mma.partition_A(smem[1])), tCrB, None
        return tiled_mma, thr_mma.partition_shape_A((self.tile_m, TILE_K)), tCrB, smem

    @cute.jit
    def mma_tile(self, ab_pipeline, read_state, release_state, operands, acc: cute.Tensor, k_count: Int32,
                 stage_mbar=None, tile=None):
        tiled_mma, tCrA, tCrB, smem = operands
        if const_expr(not self.A_IN_REGISTERS):
            return WgmmaMainloop.mma_tile(self, ab_pipeline, read_state, release_state, (tiled_mma, tCrA, tCrB),
                                          acc, k_count, stage_mbar)
        # the two RS fragments (one per stage in flight; an fp16 A: a hi and a lo fragment each) live in the tile's
        # k-loop only: made outside the tile loop they would be loop-carried, i.e. held through the epilogue
        parts = 2 if const_expr(self.FORMAT.a_split) else 1
        frags = tuple(tuple(cute.make_rmem_tensor(tCrA, self.FORMAT.mma_dtype) for _ in range(parts))
                      for _ in range(2))
        return self.mma_tile_rs(ab_pipeline, read_state, release_state, tiled_mma, frags, tCrB, self.a_thread(smem),
                                acc, k_count, stage_mbar, self.b_thread(smem, tile))

    @staticmethod
    @cute.jit
    def a_thread(smem):
        """(smem, the thread's A row r, its quad lane q): the RS fragment holds rows r, r + 8 and K slots 2q,
        2q + 1, 2q + 8, 2q + 9 of each k16. Derived per tile from an opaque thread index: held across the
        epilogue, such values spill (kernels/NOTES.md, REGISTER_TIGHT)."""
        tidx, _, _ = cute.arch.thread_idx()
        t = q8.opaque(tidx - 128)               # consumer thread: warpgroup, warp, lane
        return smem, (t & 0x80) // 2 + (t & 0x60) // 2 + ((t & 31) >> 2), t & 3

    @staticmethod
    @cute.jit
    def b_thread(smem, tile):
        """(smem, consumer warp, lane, the tile's N tile) of this thread for its B passes (`_convert_b_share`), from an
        opaque thread index per tile like `a_thread`."""
        tidx, _, _ = cute.arch.thread_idx()
        t = q8.opaque(tidx - 128)
        return smem, t >> 5, t & 31, tile.n_tile

    @cute.jit
    def _convert_b_share(self, b_thread, idx: Int32, k: Int32, stage_mbar):
        """The consumer warp's B passes of stage idx (warp w: passes w, w + 8, ... < consumer_b of B's, or of this
        CTA's half), converted as a stage worker converts its passes and published like theirs: each lane fences
        its stores for the async proxy, the warp syncs, split B: lane j bulk-copies the warp's j-th pass to the
        other CTA (`publish_stage`), and lane 0 of each converting warp arrives on the stage's worker barrier (the
        fence-sync-arrive order of a TMA store)."""
        smem, warp, lane = b_thread[:3]
        b0 = self.b_base()
        for i in cutlass.range_constexpr(self.consumer_warp_passes()):
            unit = warp + i * CONSUMER_WARPS
            if const_expr(self.consumer_b % CONSUMER_WARPS == 0 and self.consumer_warp_passes() > 1):
                # every warp converts as many passes: no branch, so ptxas interleaves the passes' dependent chains
                # (1 x 1 clusters, RESULTS run 128: MXFP8 e128_fc1 +2-3%, FP4 even; one pass a warp keeps the branch:
                # without it the weight-only fp16-A MXFP8 FP8-D variant spills)
                self.consumer_b_pass(b_thread, b0 + unit * ROWS_PER_PASS, lane, idx, k)
            else:
                if unit < self.consumer_b:
                    self.consumer_b_pass(b_thread, b0 + unit * ROWS_PER_PASS, lane, idx, k)
        self._publish_b_share(b_thread, idx, stage_mbar, b0)

    @cute.jit
    def _publish_b_share(self, b_thread, idx: Int32, stage_mbar, b0=0, every_warp: cutlass.Constexpr = False):
        """The consumer warp's converted B passes of stage idx published (`_convert_b_share`; b0: the first of
        this CTA's B rows, split B only; every_warp: every consumer warp converted passes, no warp test)."""
        smem, warp, lane = b_thread[:3]
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if const_expr(self.split_b):
            unit = warp + lane * CONSUMER_WARPS
            if lane < self.consumer_warp_passes() and unit < self.consumer_b:
                self.copy_to_peer(smem, stage_mbar, idx, b0 + unit * ROWS_PER_PASS)
        if const_expr(every_warp):
            if lane == 0:
                cute.arch.mbarrier_arrive(stage_mbar + idx)
        elif lane == 0 and warp < self.consumer_b:
            cute.arch.mbarrier_arrive(stage_mbar + idx)

    @cute.jit
    def consumer_b_pass(self, b_thread, row0: Int32, lane: Int32, idx: Int32, k: Int32):
        """A consumer lane's share of the B pass at row0 in stage idx: group lane % 4 of row row0 + lane // 4."""
        self.consumer_b_group(b_thread, row0 + (lane >> 2), lane & 3, idx, k)

    @cute.jit
    def consumer_b_group(self, b_thread, row: Int32, q: Int32, idx: Int32, k: Int32):
        """A consumer's B group q of row `row` in stage idx (tile-local k-tile k), as a worker converts it."""
        self.convert_row_group(b_thread[0], 1, row, q, idx, k, b_thread[3])

    @cute.jit
    def _convert_a(self, frag, a_thread, idx: Int32, k: Int32):
        """The thread's A groups of stage idx (rows r, r + 8, group q) -> its RS fragment(s) `frag` (a tuple: one,
        or an fp16 A's hi and lo): register word 2p + half holds pair p of row r + 8 half (the fragment's values
        run (row, k), (row, k+1), (row + 8, k), (row + 8, k+1), then k + 8, per k16; pair p of group q sits at K
        slots 8p + 2q, 8p + 2q + 1)."""
        smem, row, q = a_thread
        parts = self._fragment_words(frag)
        if const_expr(self.FORMAT.a_plain):
            return self._load_plain_a(parts, smem, row, q, idx)
        for half in cutlass.range_constexpr(2):
            self.convert_group(smem, 0, row + 8 * half, q, idx, k, cutlass.Boolean(True),
                               self._a_store(parts[0], half))

    @staticmethod
    def _fragment_words(frag) -> list:
        """The RS fragment(s) `frag` as 32-bit words (pair registers)."""
        return [cute.make_tensor(cute.recast_ptr(f.iterator, dtype=Int32), cute.make_layout(2 * dq.PAIRS))
                for f in frag]

    @staticmethod
    def _a_store(words, half: int):
        """store(p, pair) of the thread's row r + 8 half: register word 2p + half (`_convert_a`)."""
        def store(p, pair):
            words[2 * p + half] = pair

        return store

    @cute.jit
    def _load_plain_a(self, parts: list, smem, row: Int32, q: Int32, idx: Int32):
        """A 16-bit A (weight-only quantization): group q of rows r, r + 8 from the swizzled stage (chunks 2q,
        2q + 1 of a 128-byte row, 16-byte chunk c of row r at c ^ (r % 8)), rearranged into B's pairs: word w of a
        group holds elements 2w, 2w + 1; FP8 B pairs them so (pair p = word p), FP4 B pairs elements e, e + 4
        (dequant.pair_k: the same halves of words w and w + 2). An fp16 A's pairs go to `parts` as their bf16 hi
        and lo (dequant.split_f16x2)."""
        src = smem[3]
        for half in cutlass.range_constexpr(2):
            r = row + 8 * half
            base = (idx * self.tile_m + r) * (2 * TILE_K // 4)
            w = []
            for c in cutlass.range_constexpr(2):
                chunk = (2 * q + c) ^ (r & 7)
                v = cute.make_tensor(src.iterator + base + chunk * 4, cute.make_layout(4)).load()
                w += [v[i] for i in range(4)]
            for p in cutlass.range_constexpr(dq.PAIRS):
                x = w[p]
                if const_expr(self.FORMAT.data == dq.E2M1):
                    e = dq.pair_k(dq.E2M1, p, 0)
                    x = dq.prmt2(w[e // 2], w[e // 2 + 2], 0x7632 if e % 2 else 0x5410)
                if const_expr(self.FORMAT.a_split):
                    parts[0][2 * p + half], parts[1][2 * p + half] = dq.split_f16x2(x)
                else:
                    parts[0][2 * p + half] = x

    def _issue(self, tiled_mma, acc, frag, tCrB, idx: Int32):
        """The k16 wgmmas of one stage with A from the fragment(s) `frag` (an fp16 A: hi, then lo), one commit
        group."""
        warpgroup.fence()
        for kb in range(TILE_K // 16):
            for part in frag:
                cute.gemm(tiled_mma, acc, part[(None, None, kb)], tCrB[(None, None, kb, idx)], acc)
        warpgroup.commit_group()

    @cute.jit
    def mma_tile_rs(self, ab_pipeline, read_state, release_state, tiled_mma, frags, tCrB, a_thread,
                    acc: cute.Tensor, k_count: Int32, stage_mbar, b_thread=None):
        """acc = sum over k_count k-tiles with A converted into registers: per stage wait for its TMA and the
        workers' B, convert the thread's A groups into the free fragment, issue the stage's RS wgmmas, then
        retire the previous stage (one batch stays in flight; its fragment is the other one) and release it
        (`releases_early`: released by `_stage` once converted). k_count is the problem's k-tile count or 0 (a
        zero tile), so its parity is static: the loop runs two stages per iteration, each fragment a fixed set of
        registers (a separate first stage for an odd count)."""
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        early = self.releases_early()
        odd = -(-self.k // TILE_K) % 2
        if const_expr(odd):
            for _k in cutlass.range(cutlass.min(k_count, Int32(1)), unroll=1):
                self._stage(ab_pipeline, read_state, tiled_mma, acc, frags[0], tCrB, a_thread, Int32(0), stage_mbar,
                            b_thread)
                read_state.advance()
                if const_expr(early):
                    release_state.advance()
        for j in cutlass.range(k_count // 2, unroll=1):
            for b in cutlass.range_constexpr(2):
                self._stage(ab_pipeline, read_state, tiled_mma, acc, frags[(b + odd) % 2], tCrB, a_thread,
                            2 * j + b + odd, stage_mbar, b_thread)
                read_state.advance()
                if const_expr(early):
                    release_state.advance()
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(1)       # the previous stage's wgmmas are done: release it
                    if const_expr(b == 0 and not odd):
                        if j > 0:                 # (the tile's first stage has no previous one)
                            ab_pipeline.consumer_release(release_state)
                        release_state = advanced_if(release_state, j > 0)
                    else:
                        ab_pipeline.consumer_release(release_state)
                        release_state.advance()
        if const_expr(early):
            warpgroup.wait_group(0)
            return read_state, release_state
        return read_state, release_last(ab_pipeline, release_state, k_count)

    @cute.jit
    def _stage(self, ab_pipeline, read_state, tiled_mma, acc, frag, tCrB, a_thread, k: Int32, stage_mbar,
               b_thread=None):
        """Wait for stage k's TMA, convert the warp's B passes (`consumer_b`) and the thread's A groups into
        `frag` (A needs only the TMA's data: it converts while the workers finish B), (`releases_early`: release
        the narrow stage), wait for the stage's bf16 B (its worker barrier), issue the stage's RS wgmmas."""
        ab_pipeline.consumer_wait(read_state)
        if const_expr(self.hoisted()):
            self._convert_stage_hoisted(frag, a_thread, b_thread, read_state.index, k, stage_mbar)
        else:
            if const_expr(self.consumer_b > 0):
                self._convert_b_share(b_thread, read_state.index, k, stage_mbar)
            self._convert_a(frag, a_thread, read_state.index, k)
        if const_expr(self.releases_early()):
            ab_pipeline.consumer_release(read_state)
        if const_expr(self.stage_arrivals() > 0):
            cute.arch.mbarrier_wait(stage_mbar + read_state.index, read_state.phase)
        self._issue(tiled_mma, acc, frag, tCrB, read_state.index)


# ------------------------------------------------------------------------------------------------ cluster PTX


@cute.jit
def mapa_shared(addr: Int32, rank: Int32) -> Int32:
    """The shared::cluster address of shared::cta address `addr` in CTA `rank` of the cluster."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(addr).ir_value(), Int32(rank).ir_value()],
                                 "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def bulk_copy_to_cluster(dst: Int32, src: Int32, size: cutlass.Constexpr, mbar: Int32):
    """Bulk copy of `size` bytes from shared::cta address `src` to shared::cluster address `dst` (another CTA's
    shared memory), completing `size` transaction bytes on the mbarrier at shared::cluster address `mbar` (async
    proxy: the source's generic-proxy stores must be fenced before)."""
    llvm.inline_asm(None, [Int32(dst).ir_value(), Int32(src).ir_value(), Int32(mbar).ir_value()],
                    f"cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [$0], [$1], {size}, [$2];",
                    "r,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def release_last(ab_pipeline, release_state, k_count: Int32):
    """After a tile's RS k-loop: wait for its last wgmmas and release its last stage (a zero tile has none)."""
    warpgroup.wait_group(0)
    for _k in cutlass.range(cutlass.min(k_count, Int32(1)), unroll=1):
        ab_pipeline.consumer_release(release_state)
        release_state.advance()
    return release_state


def advanced_if(state, cond):
    """`state` advanced by one stage where `cond` holds (selects, no branch)."""
    nxt = state.clone()
    nxt.advance()
    sel = lambda a, b: Int32(cutlass.select_(cond, a, b))  # noqa: E731
    return pipeline.PipelineState(state.stages, sel(nxt.count, state.count), sel(nxt.index, state.index),
                                  sel(nxt.phase, state.phase))
