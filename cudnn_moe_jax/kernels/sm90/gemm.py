"""The shared body of the sm90 grouped-GEMM kernel classes: one persistent, warp-specialized kernel.

The op kinds are thin subclasses (kernel.py picks one per problem): `GroupedGemmSm90Forward` (forward.py: quant /
srelu / glu), `GroupedGemmSm90Dgrad` (dgrad.py: dglu / dsrelu), `GroupedGemmSm90Wgrad` (wgrad.py). Each composes
a mainloop (mainloop.py / mainloop_mxfp8.py), a schedule (`kernels.scheduler`, M- or K-grouped) and a set of
epilogue hooks run by the per-tile driver (epilogue.py), and says which tensors it sets up. This body holds no
op-kind test: what differs is a method of the op's class (the "composition" section below; the M-grouped schedule
and the bf16 / MXFP8 mainloop choice are the defaults, which wgrad overrides).

Roles (the load side -- producer, stage workers, row gatherers -- in loads.py; 384 threads, one CTA per SM,
clusters of `cluster_m` x `cluster_n` CTAs; grid (cm, cn, clusters)):
  warpgroup 0, warp 0   `producer`: TMA loads of A (128 x 64) and B[g] (tile_n x 64, multicast to the cluster)
                        and their SF atoms into an `ab_stages`-deep mbarrier pipeline;
  warpgroup 0, warps 1-3 `stage_worker`s of the mainloop: the dequantizing converters (narrow B -> bf16 stage,
                        mainloop_dequant), MXFP8 scale decoders (mainloop_mxfp8), the wgrad token masker (warp 1);
                        or `row_gatherer`s: with gathered operands (mainloop_gather) they copy their share of the
                        gathered rows / tokens of each stage by cp.async, beside the producer warp;
  warpgroups 1-2        `consumer`: wgmma over the tile (each warpgroup 64 rows x tile_n), then the epilogue
                        (`run_epilogue` with the op's hooks): fused math per 32-column subtile -> swizzled smem ->
                        TMA store (the first consumer warp issues the stores; `epi_stages` buffers keep stores in
                        flight under the next subtile). FP8 D: row/column quantization of each subtile, e8m0 bytes
                        stored from registers (kernels/quantize.py); the SF outputs are zeroed by a small kernel
                        launched first.
The schedule (which tile, which expert) is run independently by every role. Rows past `valid_m` are written as
zeros by the epilogue ("zero tiles"): XLA outputs are uninitialised. amax, when requested, is zeroed by a one-block
kernel launched just before the GEMM in the same call, then merged with per-warp `atomicMax` on the bit patterns of
|D| (exact, so deterministic).

Launcher arguments: the stream, then `operands.launcher_operands` (the one table; `_unpack` names them). `m` is
dynamic (one module serves every m % m_aligned == 0: every routing of that alignment); wgrad's T likewise.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from cudnn_moe_jax.formats import rcp_limit
from cudnn_moe_jax.limits import FP4, FP8_DTYPES
from cudnn_moe_jax.operands import expert_descriptor_operands

from .. import quantize as q8
from ..scheduler import M_GROUPED, GroupedTileScheduler
from . import mainloop_dequant
from . import mainloop_mxfp8 as mx
from .config import H200_4CTA_CLUSTERS, SMEM_CAPACITY, Config, default_config, supports
from .epilogue import EpilogueDriver
from .epilogue_fp4d import Fp4DOutput
from .epilogue_fp8d import EPI_N, Fp8DOutput
from .experts import BUILD_THREADS, DescriptorTable
from .experts import templates as expert_templates
from .mainloop import WgmmaMainloop, consumer_regs
from .loads import OperandLoads
from .mainloop_gather import GatheredAMainloop
from . import mainloop_staged
from .operands import unpack

DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
    "float4_e2m1fn": cutlass.Uint8,  # packed two a byte
}

EPI_BARRIER_ID = 1
NUM_THREADS = 384


class KernelArgs(NamedTuple):
    """The kernel's parameters in launch order (absent ones None): the order is the parameters' layout in the
    kernel's constant bank."""

    tiled_mma: Any
    tma_atom_a: Any
    mA: Any
    tma_atom_b: Any
    mB: Any
    tma_atom_c: Any      # forward: C store
    mC: Any
    tma_atom_d: Any
    mD: Any
    mOffsets: Any
    mAlpha: Any          # wgrad: gsa
    mProb: Any
    mBias: Any
    mAmax: Any
    a_layout: Any
    b_layout: Any
    c_layout: Any
    d_layout: Any
    tma_atom_sfa: Any
    mSFA: Any
    tma_atom_sfb: Any
    mSFB: Any
    tma_atom_dcol: Any
    mDcol: Any
    mSfdRow: Any
    mSfdCol: Any
    mNormConst: Any
    tma_atom_cin: Any    # dgrad: C loads
    mCin: Any
    cin_layout: Any
    mBeta: Any           # dgrad: beta; wgrad: gsb
    mDprobParts: Any
    mDbiasParts: Any
    mWold: Any           # wgrad with accumulation: the old W
    mDout: Any           # clipped tiles (m_aligned < tile_m): D (D_row) as memory, for their row-clipped stores
    mCout: Any           # the same of the forward's C
    mExpertDescriptors: Any  # discrete weights: the per-expert TMA descriptor table (experts.py)
    mAIndex: Any         # gathered A (mainloop_gather): a_index, the A row of each GEMM row (wgrad: A's token)
    mBIndex: Any         # wgrad's gathered B: b_index, B's token of each token
    mRht: Any            # glu_hadamard_quant: the Hadamard output, its scales, their encode scale, a user matrix
    mSfrht: Any
    mRhtNormConst: Any
    mHadamard: Any
    mCodesA: Any         # staged (mainloop_staged): the block-scaled codes the converters read, their bf16
    mCodesB: Any         # workspaces and ready flags
    mStagedA: Any
    mStagedAFlags: Any
    mStagedB: Any
    mStagedBFlags: Any


class CtaSetup(NamedTuple):
    """What the kernel sets up once per CTA for its roles."""

    storage: Any
    ab_pipeline: Any
    stage_mbar: Any      # the stage workers' per-stage barriers (None without stage workers)
    epi_mbar: Any        # the op's epilogue barriers (dgrad: C loads)
    sZero: Any           # dgrad with FP8 D: a zero word (q8.fresh)
    sEnds: Any           # the sanitized group ends
    sValid: Any
    m_rows: Any          # A's rows
    ml_smem: Any         # the mainloop's shared-memory views
    sA: Any
    sB: Any


class Fp8Setup(NamedTuple):
    """FP8 / FP4 D outputs (epilogue_fp8d, epilogue_fp4d): D_col store partition, column-maxima table, SF outputs
    (the Hadamard op's NVFP4 D: its `sfd` as mSfdRow, no D_col)."""

    tma_atom_dcol: Any
    bSG_gDcol: Any
    mDcol: Any
    tRS_rDcol: Any
    sColMax: Any
    mSfdRow: Any
    mSfdCol: Any
    norm_const: Any
    sEnds: Any
    m_rows: Any
    bSG_sDcol: Any = None  # FP4 D_col's own smem partition (FP8 D_col shares D's)


class EpilogueSetup(NamedTuple):
    """The consumer's epilogue state built once per kernel: register / smem partitions of the accumulator and D,
    D's TMA store, staging smem, `fp8` (FP8 D) and `op` (the op kind's own: forward.CStores, dgrad.CLoads)."""

    ctid: Any            # thread index in the consumer warpgroups
    acc: Any
    tRS_rAcc: Any        # the accumulator retiled as D's register->smem copy source
    tRS_cD: Any          # (row, col) of each fragment value in a 128 x 32 subtile
    frag_size: Any       # values per thread per subtile (Python int)
    r2s_d: Any
    tRS_rD: Any
    tRS_sD: Any
    bSG_sD: Any
    bSG_gD: Any
    tma_atom_d: Any
    mD: Any              # D's TMA view (tile lists: each tile's store partition starts at its first row)
    mDout: Any           # clipped tiles: D as memory
    sD: Any
    sProb: Any
    sBias: Any
    sScalars: Any
    epi_barrier: Any
    is_store_warp: Any
    mAmax: Any
    fp8: Any
    op: Any


class TileContext(NamedTuple):
    """What the epilogue hooks get per tile."""

    m_tile: Any          # output tile row (wgrad: W[e]'s rows start at e * m_w); tile lists: the list index
    n_tile: Any
    group: Any
    is_compute: Any      # False: a zero tile (rows past valid_m)
    alpha: Any
    prob: Any            # this thread's row's prob (ctid < tile_m)
    bias: Any            # this thread's column's bias (ctid < tile_n)
    beta: Any            # dgrad: x = beta * C
    row0: Any = None     # tile lists: the tile's first row
    rows: Any = None     # tile lists: rows to store (and fold into the reductions), 0..tile_m


class Store(NamedTuple):
    """One output subtile of an epilogue step (`EpilogueHooks.stores`): staged in buffer `buf` of the staging
    tensor `smem` (TMA partition `bSG_s`), stored by `tma_atom` to 32-column block `col` of the TMA view `mX`
    (partition `bSG_g`); `out`: the output as memory, for row-clipped stores (None unless tiles are clipped)."""

    tma_atom: Any
    bSG_s: Any
    smem: Any
    buf: Any
    bSG_g: Any
    mX: Any
    out: Any
    col: Any
    transposed: bool = False   # a transposed output (FP4 D_col, (N_out, m / 2)): TMA tile (col, row tile)


class GroupedGemmSm90Base(OperandLoads, EpilogueDriver, Fp8DOutput, Fp4DOutput):
    """The body every op kind shares: host-side layout choices, the launcher, the kernel and its warp roles."""

    # epilogue buffers tried per store (the most A/B stages win, then the most buffers)
    EPI_STAGE_CANDIDATES = (2,)
    d_from_registers = False   # D stored by its threads from registers, not by TMA from smem (the wgrad's fp32 W)
    d_smem = True              # D has shared-memory buffers (sD; the dgrad's are gone when it stores from registers)
    d_per_step = 1  # output subtiles per epilogue step (dglu: gate and up)
    c_per_step = 1  # accumulator subtiles per epilogue step (glu: gate and up)

    def __init__(self, problem, config: Optional[Config] = None):
        reason = supports(problem)
        if reason is not None:
            raise NotImplementedError(reason)
        self.problem = problem
        self.config = cfg = config if config is not None else default_config(problem)
        self.ab_dtype = DTYPES[problem.ab_dtype]
        self.a_mn, self.b_mn = problem.a_major == "m", problem.b_major == "n"  # M / N-contiguous operands
        # A's rows (wgrad: A's / B's tokens) through a_index / b_index (mainloop_gather): never multicast
        self.gather_a, self.gather_b = problem.a_rows is not None, problem.b_rows is not None
        if (self.gather_a and cfg.cluster_n != 1) or (self.gather_b and cfg.cluster_m != 1):
            raise NotImplementedError("a gathered operand is not multicast: gathered A (a_index) runs cluster_n 1, "
                                      "gathered B (b_index) cluster_m 1")
        self.tile_m, self.tile_n, self.cluster_m, self.cluster_n = cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n
        self.cluster_size = self.cluster_m * self.cluster_n
        self.n, self.num_groups = problem.n, problem.num_groups
        # discrete weights: expert e's B / SFB through its own TMA descriptor (experts.py)
        self.discrete = problem.discrete_weights
        self.expert_table = DescriptorTable(self.num_groups, expert_descriptor_operands(problem))
        self.n_tiles = -(-problem.n // self.tile_n)
        self.n_blocks = -(-self.n_tiles // self.cluster_n)  # cluster tiles along N
        self.max_clusters = cfg.num_sms // self.cluster_size
        if self.cluster_size == 4:
            self.max_clusters = min(self.max_clusters, H200_4CTA_CLUSTERS)
        epi = self.init_epilogue(problem)
        self.d_dtype = DTYPES[epi.d_dtype]
        self.c_dtype = DTYPES[epi.c_dtype] if self.recipe.has_c else None
        self.bias_dtype = DTYPES[epi.bias_dtype] if epi.has_bias else None
        # FP8 / FP4 D: SFD row/col outputs
        self.quant_d = epi.generate_sfd
        self.discrete_col_sfd = epi.discrete_col_sfd
        self.rcp_limit = rcp_limit(epi.d_dtype) if self.quant_d else None  # float32(1 / q_max) of FP8 / FP4 D
        # FP4 D (epilogue_fp4d): packed two a byte; MXFP4 (vec 32, with D_col) or the Hadamard op's NVFP4 (vec 16)
        self.fp4_d = epi.d_dtype == FP4
        self.fp4_vec = 32 if self.quant_d else 16
        # epilogue steps per tile: one 32-column block of D each (d_per_step subtiles), from c_per_step accumulator
        # subtiles
        self.epi_steps = self.tile_n // EPI_N // self.c_per_step
        self.epi_tile = (self.tile_m, EPI_N)
        self.d_tile = (self.tile_m, EPI_N // 2) if self.fp4_d else self.epi_tile  # D's TMA box (FP4: packed)
        # D's register fragment (FP4: codes are made in the 8-bit fragment layout, then packed)
        self.d_frag_dtype = cutlass.Float8E4M3FN if self.fp4_d else self.d_dtype
        self.mainloop_class = self.mainloop_class_for(problem)
        self.tile_k = self.mainloop_class.TILE_K
        self.sched = self.make_scheduler(problem)
        if self.sched.by_tiles and problem.block_scaled:
            raise NotImplementedError("block-scaled inputs with a 2-CTA cluster along M need m_aligned % 256 == 0 "
                                      "(the MXFP8 mainloop multicasts B and its scales to both tiles of a block)")
        self.epi_stages, self.ab_stages = self._choose_stages(cfg)
        self.mainloop = self.mainloop_class.from_problem(problem, cfg, self.ab_dtype, self.ab_stages)
        self.stage_arrivals = self.mainloop.stage_arrivals()   # on a stage's worker barrier, besides the TMA's

    # ------------------------------------------------------------------------------------------ composition
    # What an op kind's class defines (the first group has no default).
    def init_epilogue(self, problem):
        """Set `recipe`, `d_per_step` / `c_per_step` and the op's own attributes; return the Epilogue of the stored
        outputs (their dtypes)."""
        raise NotImplementedError

    def epilogue_smem_bytes(self, epi_stages: int) -> int:
        """Shared memory of the epilogue with `epi_stages` store buffers (the A/B stage fit)."""
        raise NotImplementedError

    def epi_stage_candidates(self) -> tuple:
        """Epilogue buffers to try per store (`_choose_stages`: the most A/B stages up to 4 win, then the most
        buffers); called after `mainloop_class_for`."""
        return self.EPI_STAGE_CANDIDATES

    def epilogue_smem_fields(self, args):
        """The SharedStorage fields after sD, in offset order (the mainloop's `smem_fields()` among them)."""
        raise NotImplementedError

    def op_epilogue_setup(self, args, cta, tiled_copy_acc, ctid):
        """The op's part of the consumer's epilogue state (`EpilogueSetup.op`), built once per kernel."""
        raise NotImplementedError

    def tile_context(self, tile, args, setup):
        """The tile's `TileContext` (loaded before its mainloop, so the latency hides under it)."""
        raise NotImplementedError

    def epilogue_hooks(self):
        """The op's `EpilogueHooks` for `run_epilogue`."""
        raise NotImplementedError

    def mainloop_class_for(self, problem):
        """Block-scaled inputs: exact dequantization to bf16 on chip (mainloop_dequant), or with the opt-in
        `Config.mxfp8_wgmma` MXFP8 through FP8 wgmma + a scale-product wgmma per 32-wide K block (mainloop_mxfp8);
        else bf16 / fp16."""
        if self.gather_a:
            return GatheredAMainloop
        if problem.staged:
            return mainloop_staged.mainloop_class(problem, self.config)
        if not problem.block_scaled:
            return WgmmaMainloop
        if not self.config.mxfp8_wgmma:
            return mainloop_dequant.mainloop_class(problem, self.config)
        if problem.ab_dtype not in FP8_DTYPES or problem.a_dtype is not None:
            raise NotImplementedError("Config.mxfp8_wgmma takes MXFP8 (FP8 A and B) inputs only")
        return mx.Mxfp8Mainloop

    def make_scheduler(self, problem):
        """M-grouped: groups are row ranges of A and the output (the forward and dgrad schedule)."""
        return GroupedTileScheduler(M_GROUPED, self.tile_m, self.tile_n, self.cluster_m, self.cluster_n,
                                    self.num_groups, self.n_blocks, self.tile_k,
                                    k_tiles=-(-problem.k // self.tile_k), group_m=self.config.group_m,
                                    m_aligned=problem.m_aligned)

    @cute.jit
    def tile_prob(self, tile, args: KernelArgs, ctid):
        """prob of this thread's row of the tile (threads ctid < tile_m; tile lists: the tile's `rows` rows), else
        1."""
        prob_v = Float32(1.0)
        if const_expr(self.recipe.has_prob):
            if const_expr(not self.sched.by_tiles):
                if ctid < self.tile_m:
                    prob_v = args.mProb[tile.m_tile * self.tile_m + ctid]
            else:
                if ctid < tile.rows:
                    prob_v = args.mProb[tile.row0 + ctid]
        return prob_v

    def d_block(self, n_tile, step: int, j: int = 0):
        """D's 32-column block of output subtile j of epilogue step `step` of N tile n_tile."""
        return (n_tile * self.epi_steps + step) * self.d_per_step + j

    # ------------------------------------------------------------------------------------------ host
    def _smem_fit(self, epi_stages: int) -> int:
        """A/B stages that fit next to `epi_stages` epilogue buffers (exact layout of SharedStorage)."""
        header = 16 * 8 + 4 * self.sched.ends_words() + 32 + 4 * (self.tile_m + self.tile_n)  # mbarriers (<= 8 ..
        header = -(-header // 1024) * 1024  # sA/sB/sC/sD are 1024-aligned, each a multiple of 1 KiB
        fixed = header + self.epilogue_smem_bytes(epi_stages) + self.mainloop_class.SMEM_FIXED_BYTES
        stage = self.mainloop_class.smem_stage_bytes(self.ab_dtype, self.tile_m, self.tile_n)
        return (SMEM_CAPACITY - fixed) // stage

    def _d_bytes(self) -> int:
        """Bytes per element of D's smem buffers (FP8 D: D and D_col; FP4: half a byte each, rounded up)."""
        if self.fp4_d:
            return 1
        return self.d_dtype.width // 8 * (2 if self.quant_d else 1)

    def _choose_stages(self, cfg: Config):
        candidates = [cfg.epi_stages] if cfg.epi_stages is not None else list(self.epi_stage_candidates())
        candidates = [s for s in candidates if self.epi_steps % s == 0]
        if not candidates:
            raise NotImplementedError(f"epi_stages must divide the {self.epi_steps} epilogue steps of a tile")
        if cfg.ab_stages is not None:
            ok = [s for s in candidates if self._smem_fit(s) >= cfg.ab_stages]
            if not ok or cfg.ab_stages < 2:
                raise NotImplementedError(f"{cfg.ab_stages} A/B stages do not fit in shared memory")
            return ok[0], cfg.ab_stages
        # the most A/B stages (capped at 4: deeper buys nothing measurable), then the most epilogue buffers
        best = max(candidates, key=lambda s: (min(self._smem_fit(s), 4), s))
        ab = min(self._smem_fit(best), 8)
        if ab < 2:
            raise NotImplementedError("not even 2 A/B stages fit in shared memory")
        return best, ab

    @property
    def cache_key(self):
        return ("GroupedGemmSm90", self.problem, self.config)

    def _unpack(self, tensors):
        """Launcher tensors by name (the operand table's, `operands.unpack`); absent ones None."""
        return unpack(self.problem, tensors, self.config)

    def output_operands(self, t):
        """(D, alpha, beta, the old D to add to) tensors of the launch (absent ones None)."""
        return t["d"], t["alpha"], t["beta"], None

    def epilogue_operands(self, t):
        """Op kind: its epilogue's own TMA atoms, tensors and smem layouts, as KernelArgs fields (a dict)."""
        return {}

    @cute.jit
    def launch(self, stream: cuda.CUstream, *tensors):
        t = self._unpack(tensors)
        experts = None
        if const_expr(self.discrete):  # the TMA atoms are made from expert 0's buffers: the descriptors' template
            t, experts = expert_templates(t, self.num_groups)
        a, b = self.mainloop.tma_sources(t)
        m_rows = self.rows_and_extent(a, t["a_index"], t["b_index"])[0]
        d, m_alpha, m_beta, m_wold = self.output_operands(t)

        tiled_mma = self.mainloop.tiled_mma()
        a_layout, b_layout = self.mainloop.ab_smem_layouts()
        (a_dtype, a_box_k), (b_dtype, b_box_k) = self.mainloop.tma_operands()
        tma_atom_a, tma_a = None, a   # gathered A: the producer reads A's rows itself
        if const_expr(not self.gather_a):
            a_op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_n > 1
                    else cpasync.CopyBulkTensorTileG2SOp())
            tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
                a_op, a, cute.slice_(a_layout, (None, None, 0)), (self.tile_m, a_box_k), num_multicast=self.cluster_n
            )
        tma_atom_b, tma_b = None, b
        if const_expr(not self.gather_b):
            b_op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_m > 1
                    else cpasync.CopyBulkTensorTileG2SOp())
            tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
                b_op, b, cute.slice_(b_layout, (None, None, 0)), (self.tile_n, b_box_k), num_multicast=self.cluster_m
            )
        tma_atom_sfa, tma_sfa, tma_atom_sfb, tma_sfb = self.mainloop.scale_tmas(t, self.cluster_m, self.cluster_n)
        # buffers [0, epi_stages * d_per_step) hold D (D_row), FP8 D: as many after them D_col (one partition
        # serves both)
        tma_atom_dcol = tma_dcol = mSfdRow = mSfdCol = None
        if const_expr(self.fp4_d):
            d_layout, tma_atom_d, tma_d, tma_atom_dcol, tma_dcol = self.fp4_d_tmas(d, t["d_col"])
        else:
            d_layout = sm90_utils.make_smem_layout_epi(self.d_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile,
                                                       self.epi_stages * self.d_per_step * (2 if self.quant_d else 1))
            tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), d, cute.slice_(d_layout, (None, None, 0)), self.epi_tile
            )
        if const_expr(self.quant_d):
            if const_expr(not self.fp4_d):
                tma_atom_dcol, tma_dcol = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), t["d_col"], cute.slice_(d_layout, (None, None, 0)),
                    self.epi_tile
                )
            mSfdRow = cute.make_tensor(t["sfd_row"].iterator, cute.make_layout(cute.size(t["sfd_row"])))
            mSfdCol = cute.make_tensor(t["sfd_col"].iterator, cute.make_layout(cute.size(t["sfd_col"])))
        args = dict.fromkeys(KernelArgs._fields)
        args.update(
            tiled_mma=tiled_mma, tma_atom_a=tma_atom_a, mA=tma_a, tma_atom_b=tma_atom_b, mB=tma_b,
            tma_atom_d=tma_atom_d, mD=tma_d, mOffsets=t["padded_offsets"], mAlpha=m_alpha, mProb=t["prob"],
            mBias=t["bias"], mAmax=t["amax"], a_layout=a_layout, b_layout=b_layout, d_layout=d_layout,
            tma_atom_sfa=tma_atom_sfa, mSFA=tma_sfa, tma_atom_sfb=tma_atom_sfb, mSFB=tma_sfb,
            tma_atom_dcol=tma_atom_dcol, mDcol=tma_dcol, mSfdRow=mSfdRow, mSfdCol=mSfdCol,
            mNormConst=t["norm_const"], mBeta=m_beta, mDprobParts=t["dprob_parts"], mDbiasParts=t["dbias_parts"],
            mWold=m_wold, mExpertDescriptors=t["expert_descriptors"], mAIndex=t["a_index"],
            mBIndex=t["b_index"],
        )
        if const_expr(self.problem.staged):
            args.update(mCodesA=t["a"], mCodesB=t["b"], mStagedA=t["staged_a"], mStagedAFlags=t["staged_a_flags"],
                        mStagedB=t["staged_b"], mStagedBFlags=t["staged_b_flags"])
        # a group's last tile stores its rows by plain stores; an fp32 W is stored so whole (d_from_registers)
        if const_expr(self.sched.clipped or self.d_from_registers):
            args.update(mDout=d, mCout=t.get("c") if self.recipe.has_c else None)
        args.update(self.epilogue_operands(t))
        args = KernelArgs(**args)

        # field order = offsets
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        fields = [("ab_mbar", MemRange[cutlass.Int64, self.ab_stages * 2])]
        if const_expr(self.stage_arrivals > 0):  # MXFP8: decoded scales; wgrad: masked A
            fields.append(("dec_mbar", MemRange[cutlass.Int64, self.ab_stages]))
        fields += [("ends", MemRange[Int32, self.sched.ends_words()]), ("valid", MemRange[Int32, 4]),
                   ("prob", MemRange[Float32, self.tile_m]), ("scalars", MemRange[Float32, 4]),
                   ("bias", MemRange[Float32, self.tile_n]),
                   ("sA", Align[MemRange[a_dtype, cute.cosize(a_layout)], 1024]),
                   ("sB", Align[MemRange[b_dtype, cute.cosize(b_layout)], 1024])]
        if const_expr(self.d_smem):
            fields.append(("sD", Align[MemRange[self.d_dtype, cute.cosize(d_layout)], 1024]))
        fields += self.epilogue_smem_fields(args)
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": dict(fields)}))

        self.shared_storage = SharedStorage
        self._check_smem(SharedStorage.size_in_bytes())

        if const_expr(self.recipe.compute_amax):
            self.zero_amax_kernel(t["amax"]).launch(grid=[1, 1, 1], block=[1024, 1, 1], stream=stream)
        if const_expr(self.quant_d):
            # SF bytes are written only for computed rows/blocks; XLA outputs are uninitialised (rows outside every
            # group and SF padding must read 0x00)
            self.zero_bytes_kernel(mSfdRow, mSfdCol).launch(grid=[264, 1, 1], block=[256, 1, 1], stream=stream)

        if const_expr(self.problem.staged):   # the converters' ready flags and job counter start at zero
            flags = [t[name] for name in ("staged_a_flags", "staged_b_flags") if t[name] is not None]
            views = [cute.make_tensor(cute.recast_ptr(f.iterator, dtype=cutlass.Uint8),
                                      cute.make_layout(cute.size(f) * 4)) for f in flags]
            self.zero_bytes_kernel(views[0], views[-1]).launch(grid=[132, 1, 1], block=[256, 1, 1], stream=stream)

        if const_expr(self.discrete):
            atoms = (tma_atom_b, tma_atom_sfb)[:self.expert_table.operands]
            self.expert_table.build_table(atoms, experts[:len(atoms)], t["expert_descriptors"]).launch(
                grid=[1, 1, 1], block=[BUILD_THREADS, 1, 1], stream=stream)

        num_clusters = cutlass.min(self.sched.num_tiles(m_rows), Int32(self.max_clusters))
        self.kernel(args).launch(
            grid=[self.cluster_m, self.cluster_n, num_clusters],
            block=[NUM_THREADS, 1, 1],
            cluster=[self.cluster_m, self.cluster_n, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    __call__ = launch

    def col_max_field(self):
        """FP8 D: the per-warp column maxima of each subtile of a step (epilogue_fp8d)."""
        if not self.quant_d:
            return []
        return [("col_max", cute.struct.Align[cute.struct.MemRange[Int32, EPI_N * 8 * self.d_per_step], 16])]

    def _check_smem(self, size: int) -> None:
        """Trace time: refuse a layout that could not launch (the stage count comes from an estimate)."""
        if size > SMEM_CAPACITY:
            raise NotImplementedError(f"shared memory {size} B > {SMEM_CAPACITY} B ({self.ab_stages} A/B stages, "
                                      f"{self.epi_stages} epilogue buffers)")

    @cute.kernel
    def zero_amax_kernel(self, mAmax: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < self.num_groups:
            for j in cutlass.range_constexpr(self.d_per_step):  # dglu: (L, 2)
                mAmax[tidx, j] = Float32(0.0)

    @cute.kernel
    def zero_bytes_kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        """Zero two flat uint8 buffers (sizes multiples of 512), grid-stride 4-byte stores."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        for buf in cutlass.range_constexpr(2):
            mT = mX if buf == 0 else mY
            n_words = cute.size(mT) // 4
            words = cute.make_tensor(cute.recast_ptr(mT.iterator, dtype=Int32), cute.make_layout(n_words))
            i = bidx * 256 + tidx
            while i < n_words:
                words[i] = Int32(0)
                i += nblk * 256

    # ------------------------------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, args: KernelArgs):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (args.tma_atom_a, args.tma_atom_b, args.tma_atom_d, args.tma_atom_c, args.tma_atom_sfa,
                         args.tma_atom_sfb, args.tma_atom_dcol, args.tma_atom_cin):
                if const_expr(atom is not None):  # the problem's TMA descriptors
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # the TMA's arrive-and-expect-tx (and the mainloop's own producer copies: PRODUCER_ARRIVALS)
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mainloop_class.PRODUCER_ARRIVALS)
        # every consumer warp releases each stage to all CTAs that multicast into it (its cluster row + column)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, (self.cluster_m + self.cluster_n - 1) * 8)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=self.mainloop_class.tx_bytes(self.ab_dtype, self.tile_m, self.tile_n),
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        stage_mbar = None
        if const_expr(self.stage_arrivals > 0):
            # the stage workers' per-stage barrier (MXFP8: decoded scales; wgrad: masked A): the consumers wait for
            # it after the TMA's
            stage_mbar = storage.dec_mbar.data_ptr()
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for s in cutlass.range_constexpr(self.ab_stages):
                        cute.arch.mbarrier_init(stage_mbar + s, self.stage_arrivals)
            cute.arch.mbarrier_init_fence()
        epi_mbar = self.init_epilogue_barriers(storage, warp_idx)
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, self.cluster_n), is_relaxed=True)

        sEnds = storage.ends.get_tensor(cute.make_layout(self.sched.ends_words()))
        sValid = storage.valid.get_tensor(cute.make_layout(4))
        # staged: the codes the converters read (the workspaces' extents are padded)
        m_rows, extent = self.rows_and_extent(args.mCodesA if const_expr(self.problem.staged) else args.mA,
                                              args.mAIndex, args.mBIndex)
        sZero = self.init_epilogue_smem(storage, tidx)
        if warp_idx == 0:
            self.sched.load_group_ends(args.mOffsets, extent, sEnds, sValid)
        ml_smem = self.mainloop.smem_tensors(storage, tidx, NUM_THREADS)
        cute.arch.sync_threads()
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, self.cluster_n))

        a_layout, b_layout = args.a_layout, args.b_layout
        cta = CtaSetup(storage, ab_pipeline, stage_mbar, epi_mbar, sZero, sEnds, sValid, m_rows, ml_smem,
                       storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner),
                       storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner))
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.mainloop_class.PRODUCER_REGS)
            if warp_idx == 0:
                self.producer(args, cta)
            for worker in self.mainloop_class.STAGE_WORKERS:
                if warp_idx == worker[0]:
                    self.stage_worker(cta, worker)
            if const_expr(len(self.mainloop_class.CONVERT_WARPS) > 0):
                if warp_idx >= self.mainloop_class.CONVERT_WARPS[0]:   # the warpgroup's last warps
                    self.mainloop.convert(args, cta)
            if const_expr(self.gather_a or self.gather_b):
                for slot, warp in enumerate(self.mainloop_class.GATHER_WARPS, 1):
                    if warp_idx == warp:
                        self.row_gatherer(args, cta, slot)
        else:
            cute.arch.setmaxregister_increase(consumer_regs(self.mainloop_class.PRODUCER_REGS))
            self.consumer(args, cta, tidx - 128, warp_idx)

    def init_epilogue_barriers(self, storage, warp_idx):
        """Op kind: initialise its epilogue's mbarriers (before the cluster's init arrive); returns them."""
        return None

    def init_epilogue_smem(self, storage, tidx):
        """Op kind: shared memory its epilogue needs written before the CTA barrier; returns its view."""
        return None

    # ------------------------------------------------------------------------------------------ roles
    # (the load side -- producer, stage workers, row gatherers -- is loads.OperandLoads)
    @cute.jit
    def consumer(self, args: KernelArgs, cta: CtaSetup, ctid: Int32, warp_idx: Int32):
        """Warpgroups 1-2: wgmma mainloop + fused epilogue for every tile (compute and zero) of this CTA."""
        rank_m, rank_n = self._cluster_coord()
        wg = warp_idx // 4 - 1
        tiled_mma = args.tiled_mma
        thr_mma = tiled_mma.get_slice(wg * 128)
        mma_operands = self.mainloop.consumer_operands(tiled_mma, cta.sA, cta.sB, cta.ml_smem, wg)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        setup = self.epilogue_setup(args, cta, acc, ctid, warp_idx)
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256),
        )
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        hooks = self.epilogue_hooks()

        work = self.sched.work(cta.sValid, cta.m_rows)
        t = work.first
        while t < work.total:
            tile = self.sched.tile(t, work, cta.sEnds, rank_m, rank_n)
            # per-tile epilogue operands, loaded before the mainloop so their latency hides under it
            ctx = self.tile_context(tile, args, setup)
            read_state, release_state = self.mainloop.mma_tile(
                cta.ab_pipeline, read_state, release_state, mma_operands, acc, tile.k_count, cta.stage_mbar, tile
            )
            if const_expr(hasattr(self.mainloop, "tiles_read")):   # (the staged wgrad: its workspaces' readers)
                self.mainloop.tiles_read(args, ctid, tile)
            self.run_epilogue(hooks, setup, ctx, store_pipeline)
            t += work.stride
        store_pipeline.producer_tail()

    @cute.jit
    def epilogue_setup(self, args: KernelArgs, cta: CtaSetup, acc, ctid: Int32, warp_idx: Int32) -> EpilogueSetup:
        """The consumer's epilogue state, built once: smem views, D's partitions (register fragments follow the
        stmatrix source layout of the accumulator), FP8 D's, then the op kind's (`op_epilogue_setup`)."""
        storage = cta.storage
        d_layout = args.d_layout
        sD = None
        if const_expr(self.fp4_d):
            sD = storage.sD.get_tensor(d_layout)        # plain packed tiles (epilogue_fp4d)
        elif const_expr(self.d_smem):
            sD = storage.sD.get_tensor(d_layout.outer, swizzle=d_layout.inner)
        sProb = storage.prob.get_tensor(cute.make_layout(self.tile_m))
        sScalars = storage.scalars.get_tensor(cute.make_layout(4))
        sBias = storage.bias.get_tensor(cute.make_layout(self.tile_n))
        copy_atom_layout = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.Float16)
        tiled_copy_acc = cute.make_tiled_copy_C_atom(copy_atom_layout, args.tiled_mma)
        # FP4 D: the codes are made in the 8-bit fragment layout (kernels/quantize.py), then packed (epilogue_fp4d)
        r2s_d = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.d_frag_dtype, Float32), tiled_copy_acc
        )
        thr_r2s_d = r2s_d.get_slice(ctid)
        tRS_sD = bSG_sD = bSG_gD = None
        if const_expr(self.d_smem and not self.fp4_d):
            tRS_sD = thr_r2s_d.partition_D(sD)
        tRS_rAcc = r2s_d.retile(acc)
        tRS_cD = thr_r2s_d.partition_S(cute.make_identity_tensor(self.epi_tile))  # (row, col) in a subtile
        frag_shape = tRS_cD.shape
        tRS_rD = cute.make_rmem_tensor(frag_shape, self.d_dtype)
        if const_expr(self.d_smem):
            bSG_sD, bSG_gD = cpasync.tma_partition(
                args.tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), cute.zipped_divide(args.mD,
                                                                                                       self.d_tile)
            )
        epi_barrier = pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID, num_threads=256)
        is_store_warp = warp_idx == 4
        fp8 = None
        if const_expr(self.quant_d and not self.fp4_d):
            # D_col store partition (same smem layout as D), the column-maxima table, norm_const
            q8.check_fragment_layout(tRS_cD)
            tRS_rDcol = cute.make_rmem_tensor(frag_shape, self.d_dtype)
            _, bSG_gDcol = cpasync.tma_partition(
                args.tma_atom_dcol, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                cute.zipped_divide(args.mDcol, self.epi_tile)
            )
            sColMax = storage.col_max.get_tensor(cute.make_layout(self.col_max_shape()))
            fp8 = Fp8Setup(args.tma_atom_dcol, bSG_gDcol, args.mDcol, tRS_rDcol, sColMax, args.mSfdRow,
                           args.mSfdCol, args.mNormConst[0], cta.sEnds, cta.m_rows)
        if const_expr(self.fp4_d):
            q8.check_fragment_layout(tRS_cD)
            bSG_sDcol = bSG_gDcol = sColMax = None
            if const_expr(self.quant_d):
                bSG_sDcol, bSG_gDcol = self.fp4_dcol_partition(sD, args.tma_atom_dcol, args.mDcol)
                sColMax = storage.col_max.get_tensor(cute.make_layout(self.col_max_shape()))
            fp8 = Fp8Setup(args.tma_atom_dcol, bSG_gDcol, args.mDcol, None, sColMax, args.mSfdRow, args.mSfdCol,
                           args.mNormConst[0], cta.sEnds, cta.m_rows, bSG_sDcol)
        op = self.op_epilogue_setup(args, cta, tiled_copy_acc, ctid)
        return EpilogueSetup(ctid, acc, tRS_rAcc, tRS_cD, cute.size(frag_shape), r2s_d, tRS_rD, tRS_sD, bSG_sD,
                             bSG_gD, args.tma_atom_d, args.mD, args.mDout, sD, sProb, sBias, sScalars,
                             epi_barrier, is_store_warp, args.mAmax, fp8, op)

    def col_max_shape(self):
        """(column, warp) of the FP8-D column-maxima table (dgrad: per subtile of a step)."""
        return (EPI_N, 8)
