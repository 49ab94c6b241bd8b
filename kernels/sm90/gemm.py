"""The sm90 grouped-GEMM kernel class: one persistent, warp-specialized kernel for every forward fusion.

Roles (384 threads, one CTA per SM, clusters of `cluster_m` x `cluster_n` CTAs; grid (cm, cn, clusters)):
  warpgroup 0, warp 0   `producer`: TMA loads of A (128 x 64) and B[g] (tile_n x 64, multicast to the cluster)
                        into an `ab_stages`-deep mbarrier pipeline;
  warpgroups 1-2        `consumer`: wgmma over the tile (each warpgroup 64 rows x tile_n), then `epilogue`:
                        fused math per 32-column subtile -> swizzled smem -> TMA store (the first consumer warp
                        issues the stores; `epi_stages` buffers keep stores in flight under the next subtile).
The schedule (which tile, which expert) is `kernels.scheduler.GroupedTileScheduler`, run independently by every
role. Rows past `valid_m` are written as zeros by the epilogue ("zero tiles"): XLA outputs are uninitialised.
amax, when requested, is zeroed by a one-block kernel launched just before the GEMM in the same call, then merged
with per-warp `atomicMax` on the bit patterns of |D| (exact, so deterministic).

Launcher argument order (what `cutlass.jax.cutlass_call` passes: the stream first, then inputs, then outputs):
  stream, a (m, K), b (L, N, K), padded_offsets (L,) i32, alpha (L,) f32, [prob (m,) f32], [bias (L, N)],
  [c (m, N)], d (m, N_out), [amax (L, 1) f32]
(bracketed tensors present iff the problem has them). `m` is dynamic: one module serves every m % 256 == 0.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.utils import LayoutEnum

from ..epilogue import EpilogueRecipe, abs_bits, warp_max_i32
from ..scheduler import GroupedTileScheduler
from .config import SMEM_CAPACITY, Config, default_config, supports
from .mainloop import TILE_K, WgmmaMainloop, ab_stage_bytes, make_ab_smem_layouts, make_tiled_mma

_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
}

DEBUG_LAYOUTS = False
EPI_N = 32  # epilogue subtile width = one GLU block
EPI_BARRIER_ID = 1
NUM_THREADS = 384
PRODUCER_REGS = 40
CONSUMER_REGS = 232


class GroupedGemmSm90:
    """`acc[r, :] = A[r, :] @ B[g(r)]^T` for the rows of every group, with the problem's epilogue fused."""

    def __init__(self, problem, config: Optional[Config] = None):
        reason = supports(problem)
        if reason is not None:
            raise NotImplementedError(reason)
        self.problem = problem
        self.config = config if config is not None else default_config(problem)
        cfg, epi = self.config, problem.epilogue
        self.recipe = EpilogueRecipe(problem)

        self.ab_dtype = _DTYPES[problem.ab_dtype]
        self.d_dtype = _DTYPES[epi.d_dtype]
        self.c_dtype = _DTYPES[epi.c_dtype] if self.recipe.has_c else None
        self.bias_dtype = _DTYPES[epi.bias_dtype] if epi.has_bias else None
        self.tile_m, self.tile_n, self.cluster_m, self.cluster_n = cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n
        self.cluster_size = self.cluster_m * self.cluster_n
        self.n, self.k, self.num_groups = problem.n, problem.k, problem.num_groups
        self.n_tiles = -(-problem.n // self.tile_n)
        self.n_blocks = -(-self.n_tiles // self.cluster_n)  # cluster tiles along N
        self.is_glu = self.recipe.is_glu
        # epilogue steps per tile: one D subtile each (GLU: from a gate/up pair of C subtiles)
        self.c_per_step = 2 if self.is_glu else 1
        self.epi_steps = self.tile_n // EPI_N // self.c_per_step
        self.epi_tile = (self.tile_m, EPI_N)
        self.sched = GroupedTileScheduler(self.tile_m, self.tile_n, self.cluster_m, self.num_groups, cfg.group_m)
        self.max_clusters = cfg.num_sms // self.cluster_size
        self.epi_stages, self.ab_stages = self._choose_stages(cfg)
        self.mainloop = WgmmaMainloop(self.ab_dtype, self.tile_m, self.tile_n, self.ab_stages)

    def _smem_fit(self, epi_stages: int) -> int:
        """A/B stages that fit next to `epi_stages` epilogue buffers (exact layout of SharedStorage)."""
        header = 16 * 8 + 4 * self.num_groups + 32 + 4 * (self.tile_m + self.tile_n)  # mbarriers (<= 8 stages) ..
        header = -(-header // 1024) * 1024  # sA/sB/sC/sD are 1024-aligned, each a multiple of 1 KiB
        epi = self.tile_m * EPI_N * epi_stages * (
            self.d_dtype.width // 8 + (self.c_per_step * self.c_dtype.width // 8 if self.c_dtype else 0))
        return (SMEM_CAPACITY - header - epi) // ab_stage_bytes(self.ab_dtype, self.tile_m, self.tile_n)

    def _choose_stages(self, cfg: Config):
        candidates = [cfg.epi_stages] if cfg.epi_stages is not None else [2]
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

    # ------------------------------------------------------------------------------------------ host
    @property
    def cache_key(self):
        return ("GroupedGemmSm90", self.problem, self.config)

    @property
    def cutlass_call_kwargs(self) -> dict:
        """TensorSpecs for `cutlass.jax.cutlass_call(self.launch, **kwargs)` (present tensors, launcher order)."""
        from .jax_bridge import tensor_specs

        ins, outs = tensor_specs(self.problem)
        return {"input_spec": tuple(ins), "output_spec": tuple(outs)}

    def _unpack(self, tensors):
        it = iter([x for x in tensors if x is not None])  # absent tensors may arrive as None
        named = {"a": next(it), "b": next(it), "offsets": next(it), "alpha": next(it)}
        named["prob"] = next(it) if self.recipe.has_prob else None
        named["bias"] = next(it) if self.recipe.has_bias else None
        named["c"] = next(it) if self.recipe.has_c else None
        named["d"] = next(it)
        named["amax"] = next(it) if self.recipe.compute_amax else None
        rest = list(it)
        if rest:
            raise ValueError(f"{len(rest)} unexpected tensors")
        return named

    @cute.jit
    def launch(self, stream: cuda.CUstream, *tensors):
        t = self._unpack(tensors)
        a, b, d = t["a"], t["b"], t["d"]
        m_rows = a.shape[0]

        tiled_mma = make_tiled_mma(self.ab_dtype, self.tile_n)
        a_layout, b_layout = make_ab_smem_layouts(self.ab_dtype, self.tile_m, self.tile_n, self.ab_stages)
        a_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_n > 1 else cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            a_op, a, cute.slice_(a_layout, (None, None, 0)), (self.tile_m, TILE_K), num_multicast=self.cluster_n
        )
        b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster_m > 1 else cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            b_op, b, cute.slice_(b_layout, (None, None, 0)), (self.tile_n, TILE_K), num_multicast=self.cluster_m
        )
        d_layout = sm90_utils.make_smem_layout_epi(self.d_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.epi_stages)
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), d, cute.slice_(d_layout, (None, None, 0)), self.epi_tile
        )
        c_layout = None
        tma_atom_c = None
        tma_c = None
        if const_expr(self.recipe.has_c):
            c_layout = sm90_utils.make_smem_layout_epi(
                self.c_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.epi_stages * self.c_per_step
            )
            tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), t["c"], cute.slice_(c_layout, (None, None, 0)), self.epi_tile
            )

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            ends: cute.struct.MemRange[Int32, self.num_groups]
            valid: cute.struct.MemRange[Int32, 4]
            prob: cute.struct.MemRange[Float32, self.tile_m]
            scalars: cute.struct.MemRange[Float32, 4]
            bias: cute.struct.MemRange[Float32, self.tile_n]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(d_layout)], 1024]
            if const_expr(self.recipe.has_c):
                sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(c_layout)], 1024]

        self.shared_storage = SharedStorage

        if const_expr(self.recipe.compute_amax):
            self.zero_amax_kernel(t["amax"]).launch(grid=[1, 1, 1], block=[1024, 1, 1], stream=stream)

        total = (m_rows // self.sched.block_m) * self.n_blocks
        num_clusters = cutlass.min(total, Int32(self.max_clusters))
        self.kernel(
            tiled_mma,
            tma_atom_a, tma_a, tma_atom_b, tma_b,
            tma_atom_c, tma_c, tma_atom_d, tma_d,
            t["offsets"], t["alpha"], t["prob"], t["bias"], t["amax"],
            a_layout, b_layout, c_layout, d_layout,
        ).launch(
            grid=[self.cluster_m, self.cluster_n, num_clusters],
            block=[NUM_THREADS, 1, 1],
            cluster=[self.cluster_m, self.cluster_n, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    __call__ = launch

    @cute.kernel
    def zero_amax_kernel(self, mAmax: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < self.num_groups:
            mAmax[tidx, 0] = Float32(0.0)

    # ------------------------------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom, mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom, mB: cute.Tensor,
        tma_atom_c, mC, tma_atom_d: cute.CopyAtom, mD: cute.Tensor,
        mOffsets: cute.Tensor, mAlpha: cute.Tensor, mProb, mBias, mAmax,
        a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout, c_layout, d_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            cpasync.prefetch_descriptor(tma_atom_d)
            if const_expr(self.recipe.has_c):
                cpasync.prefetch_descriptor(tma_atom_c)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # every consumer warp releases each stage to all CTAs that multicast into it (its cluster row + column)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, (self.cluster_m + self.cluster_n - 1) * 8)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=ab_stage_bytes(self.ab_dtype, self.tile_m, self.tile_n),
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, self.cluster_n), is_relaxed=True)

        sEnds = storage.ends.get_tensor(cute.make_layout(self.num_groups))
        sValid = storage.valid.get_tensor(cute.make_layout(4))
        m_rows = mA.shape[0]
        if warp_idx == 0:
            self.sched.load_group_ends(mOffsets, m_rows, sEnds, sValid)
        cute.arch.sync_threads()
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, self.cluster_n))

        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.producer(ab_pipeline, tma_atom_a, mA, tma_atom_b, mB, sA, sB, sEnds, sValid, m_rows)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            sD = storage.sD.get_tensor(d_layout.outer, swizzle=d_layout.inner)
            sC = None
            if const_expr(self.recipe.has_c):
                sC = storage.sC.get_tensor(c_layout.outer, swizzle=c_layout.inner)
            sProb = storage.prob.get_tensor(cute.make_layout(self.tile_m))
            sScalars = storage.scalars.get_tensor(cute.make_layout(4))
            sBias = storage.bias.get_tensor(cute.make_layout(self.tile_n))
            self.consumer(
                ab_pipeline, tiled_mma, sA, sB, sC, sD, sProb, sBias, sScalars, sEnds, sValid, m_rows,
                tma_atom_c, mC, tma_atom_d, mD, mAlpha, mProb, mBias, mAmax, tidx - 128, warp_idx,
            )

    # ------------------------------------------------------------------------------------------ roles
    @cute.jit
    def _cluster_work(self, sValid: cute.Tensor, m_rows: Int32):
        """(first tile, stride, total tiles, valid M blocks) of this CTA's cluster."""
        _, _, cluster_id = cute.arch.block_idx()
        _, _, num_clusters = cute.arch.grid_dim()
        total = (m_rows // self.sched.block_m) * self.n_blocks
        valid_blocks = sValid[0] // self.sched.block_m
        return cluster_id, num_clusters, total, valid_blocks

    @cute.jit
    def _cluster_coord(self):
        """(rank_m, rank_n) of this CTA in its cluster (cluster dims (cm, cn, 1): rank = x + cm * y)."""
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return rank % self.cluster_m, rank // self.cluster_m

    @cute.jit
    def producer(self, ab_pipeline, tma_atom_a, mA, tma_atom_b, mB, sA, sB, sEnds, sValid, m_rows):
        """Warp 0: TMA loads for every compute tile of this CTA (A multicast along the cluster's N, B along M)."""
        rank_m, rank_n = self._cluster_coord()
        # (bM, bK, RestM, RestK) / (bN, bK, RestN, RestK, L)
        gA = cute.local_tile(mA, (self.tile_m, TILE_K), (None, None))
        gB = cute.local_tile(mB, (self.tile_n, TILE_K), (None, None, None))
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, rank_n, cute.make_layout(self.cluster_n), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, rank_m, cute.make_layout(self.cluster_m), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        cta_layout = cute.make_layout((self.cluster_m, self.cluster_n, 1))
        a_mcast_mask = 0
        if const_expr(self.cluster_n > 1):
            a_mcast_mask = cute.make_layout_image_mask(cta_layout, (rank_m, rank_n, 0), mode=1)
        b_mcast_mask = 0
        if const_expr(self.cluster_m > 1):
            b_mcast_mask = cute.make_layout_image_mask(cta_layout, (rank_m, rank_n, 0), mode=0)
        k_tiles = cute.size(gA, mode=[3])
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)

        t, stride, total, valid_blocks = self._cluster_work(sValid, m_rows)
        while t < total:
            m_block, n_block, is_compute = self.sched.decode(t, valid_blocks, Int32(self.n_blocks))
            g = cutlass.min(self.sched.group_of_row(m_block * self.sched.block_m, sEnds), Int32(self.num_groups - 1))
            k_count = Int32(0)
            if is_compute:
                k_count = k_tiles
            m_tile = m_block * self.cluster_m + rank_m
            n_tile = n_block * self.cluster_n + rank_n
            prod_state = self.mainloop.load_tile(
                ab_pipeline, prod_state,
                tma_atom_a, tAgA[(None, m_tile, None)], tAsA,
                tma_atom_b, tBgB[(None, n_tile, None, g)], tBsB,
                a_mcast_mask, b_mcast_mask, k_count,
            )
            t += stride
        ab_pipeline.producer_tail(prod_state)

    @cute.jit
    def consumer(
        self, ab_pipeline, tiled_mma, sA, sB, sC, sD, sProb, sBias, sScalars, sEnds, sValid, m_rows,
        tma_atom_c, mC, tma_atom_d, mD, mAlpha, mProb, mBias, mAmax, ctid: Int32, warp_idx: Int32,
    ):
        """Warpgroups 1-2: wgmma mainloop + fused epilogue for every tile (compute and zero) of this CTA."""
        rank_m, rank_n = self._cluster_coord()
        wg = warp_idx // 4 - 1
        thr_mma = tiled_mma.get_slice(wg * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)

        # epilogue partitions: register fragments follow the stmatrix source layout of the accumulator
        copy_atom_layout = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.Float16)
        tiled_copy_acc = cute.make_tiled_copy_C_atom(copy_atom_layout, tiled_mma)
        r2s_d = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.d_dtype, Float32), tiled_copy_acc
        )
        thr_r2s_d = r2s_d.get_slice(ctid)
        tRS_sD = thr_r2s_d.partition_D(sD)
        tRS_rAcc = r2s_d.retile(acc)
        tRS_cD = thr_r2s_d.partition_S(cute.make_identity_tensor(self.epi_tile))  # (row, col) in a subtile
        frag_shape = tRS_cD.shape
        frag_size = cute.size(frag_shape)
        tRS_rD = cute.make_rmem_tensor(frag_shape, self.d_dtype)
        gD = cute.zipped_divide(mD, self.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(
            tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD
        )
        r2s_c = None
        tRS_sC = None
        tRS_rC0 = None
        tRS_rC1 = None
        bSG_sC = None
        bSG_gC = None
        if const_expr(self.recipe.has_c):
            r2s_c = cute.make_tiled_copy_S(
                sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.c_dtype, Float32), tiled_copy_acc
            )
            thr_r2s_c = r2s_c.get_slice(ctid)
            tRS_sC = thr_r2s_c.partition_D(sC)
            # same TV layout as D's copy, so flat index i is the same (row, col) in both fragments; only the
            # split into atom/rest modes differs between stmatrix (16-bit) and plain stores (32-bit)
            c_frag_shape = thr_r2s_c.partition_S(cute.make_identity_tensor(self.epi_tile)).shape
            tRS_rC0 = cute.make_rmem_tensor(c_frag_shape, self.c_dtype)
            tRS_rC1 = cute.make_rmem_tensor(c_frag_shape, self.c_dtype)
            if const_expr(DEBUG_LAYOUTS):
                print("D coords", tRS_cD.layout, "C coords", thr_r2s_c.partition_S(cute.make_identity_tensor(self.epi_tile)).layout)
            gC = cute.zipped_divide(mC, self.epi_tile)
            bSG_sC, bSG_gC = cpasync.tma_partition(
                tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC
            )

        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256),
        )
        epi_barrier = pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID, num_threads=256)
        is_store_warp = warp_idx == 4
        k_tiles = (self.k + TILE_K - 1) // TILE_K
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)

        t, stride, total, valid_blocks = self._cluster_work(sValid, m_rows)
        while t < total:
            m_block, n_block, is_compute = self.sched.decode(t, valid_blocks, Int32(self.n_blocks))
            g = cutlass.min(self.sched.group_of_row(m_block * self.sched.block_m, sEnds), Int32(self.num_groups - 1))
            m_tile = m_block * self.cluster_m + rank_m
            n_tile = n_block * self.cluster_n + rank_n
            k_count = Int32(0)
            if is_compute:
                k_count = Int32(k_tiles)
            # per-tile epilogue operands, loaded before the mainloop so their latency hides under it
            alpha = mAlpha[g]
            prob_v = Float32(1.0)
            if const_expr(self.recipe.has_prob):
                if ctid < self.tile_m:
                    prob_v = mProb[m_tile * self.tile_m + ctid]
            bias_v = Float32(0.0)
            if const_expr(self.recipe.has_bias):
                col = n_tile * self.tile_n + ctid
                if ctid < self.tile_n and col < self.n:
                    bias_v = mBias[g, col].to(Float32)

            read_state, release_state = self.mainloop.mma_tile(
                ab_pipeline, read_state, release_state, tiled_mma, acc, tCrA, tCrB, k_count
            )
            self.epilogue(
                acc, tRS_rAcc, tRS_cD, frag_size, alpha, prob_v, bias_v, sProb, sBias, sScalars, is_compute, ctid,
                r2s_d, tRS_rD, tRS_sD, bSG_sD, bSG_gD, tma_atom_d,
                r2s_c, tRS_rC0, tRS_rC1, tRS_sC, bSG_sC, bSG_gC, tma_atom_c,
                store_pipeline, epi_barrier, is_store_warp, m_tile, n_tile, g, mAmax,
            )
            t += stride
        store_pipeline.producer_tail()

    @cute.jit
    def epilogue(
        self, acc, tRS_rAcc, tRS_cD, frag_size: cutlass.Constexpr, alpha, prob_v, bias_v, sProb, sBias, sScalars,
        is_compute, ctid,
        r2s_d, tRS_rD, tRS_sD, bSG_sD, bSG_gD, tma_atom_d,
        r2s_c, tRS_rC0, tRS_rC1, tRS_sC, bSG_sC, bSG_gC, tma_atom_c,
        store_pipeline, epi_barrier, is_store_warp, m_tile, n_tile, g, mAmax,
    ):
        """Fused epilogue of one tile: per step, one D subtile (and its one or two C subtiles)."""
        recipe = self.recipe
        # stage per-row prob and per-column bias in smem (previous tile's readers passed its last barrier)
        if const_expr(recipe.has_prob):
            if ctid < self.tile_m:
                sProb[ctid] = prob_v
        if ctid == 0:
            sScalars[0] = alpha
        if const_expr(recipe.has_bias):
            if ctid < self.tile_n:
                sBias[ctid] = bias_v
        epi_barrier.arrive_and_wait()

        amax_bits = Int32(0)
        rVal = cute.make_rmem_tensor(tRS_cD.shape, Float32)
        for step in cutlass.range_constexpr(self.epi_steps):
            s0 = step * self.c_per_step
            alpha_s = alpha
            if const_expr(self.config.epi_pin):
                # re-read from smem: the step's math then depends on a load issued after the last barrier, so
                # ptxas cannot hoist every step's math above the barriers (less register pressure, less overlap)
                alpha_s = sScalars[0]
            # ---- math (fp32), one element at a time
            for i in cutlass.range_constexpr(frag_size):
                col = tRS_cD[i][1]
                prob = Float32(1.0)
                if const_expr(recipe.has_prob):
                    prob = sProb[tRS_cD[i][0]]
                if const_expr(self.is_glu):
                    bias_g = Float32(0.0)
                    bias_u = Float32(0.0)
                    if const_expr(recipe.has_bias):
                        bias_g = sBias[s0 * EPI_N + col]
                        bias_u = sBias[(s0 + 1) * EPI_N + col]
                    cg = recipe.c_value(tRS_rAcc[s0 * frag_size + i], alpha_s, bias_g)
                    cu = recipe.c_value(tRS_rAcc[(s0 + 1) * frag_size + i], alpha_s, bias_u)
                    if const_expr(recipe.has_c):
                        tRS_rC0[i] = cg.to(self.c_dtype)
                        tRS_rC1[i] = cu.to(self.c_dtype)
                    rVal[i] = recipe.d_glu(cg, cu, prob)
                else:
                    bias = Float32(0.0)
                    if const_expr(recipe.has_bias):
                        bias = sBias[s0 * EPI_N + col]
                    acc_i = tRS_rAcc[s0 * frag_size + i]
                    c = recipe.c_value(acc_i, alpha_s, bias)
                    if const_expr(recipe.has_c):
                        tRS_rC0[i] = c.to(self.c_dtype)
                    rVal[i] = recipe.d_value(acc_i, c, alpha_s, prob, bias)
                if const_expr(recipe.compute_amax):
                    amax_bits = cutlass.max(amax_bits, abs_bits(rVal[i]))
            tRS_rD.store(rVal.load().to(self.d_dtype))
            if not is_compute:  # rows past valid_m: zeros
                tRS_rD.fill(0.0)
                if const_expr(recipe.has_c):
                    tRS_rC0.fill(0.0)
                    tRS_rC1.fill(0.0)
            # ---- registers -> smem, once the TMA store `epi_stages` steps back has read this buffer. (Measured:
            # one barrier per step with the store warp draining the previous store first was 8-13% slower.)
            buf = step % self.epi_stages
            if is_store_warp:
                store_pipeline.producer_acquire()
            epi_barrier.arrive_and_wait()
            cute.copy(r2s_d, tRS_rD, tRS_sD[(None, None, None, buf)])
            if const_expr(recipe.has_c):
                cute.copy(r2s_c, tRS_rC0, tRS_sC[(None, None, None, buf * self.c_per_step)])
                if const_expr(self.is_glu):
                    cute.copy(r2s_c, tRS_rC1, tRS_sC[(None, None, None, buf * self.c_per_step + 1)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            # ---- smem -> global (TMA clips columns past N)
            if is_store_warp:
                subtiles_per_tile = self.tile_n // EPI_N
                cute.copy(
                    tma_atom_d,
                    bSG_sD[(None, buf)],
                    bSG_gD[(None, (m_tile, n_tile * (subtiles_per_tile // self.c_per_step) + step))],
                )
                if const_expr(recipe.has_c):
                    for j in cutlass.range_constexpr(self.c_per_step):
                        cute.copy(
                            tma_atom_c,
                            bSG_sC[(None, buf * self.c_per_step + j)],
                            bSG_gC[(None, (m_tile, n_tile * subtiles_per_tile + s0 + j))],
                        )
                store_pipeline.producer_commit()

        if const_expr(recipe.compute_amax):
            amax_bits = warp_max_i32(amax_bits)
            if is_compute:
                if cute.arch.lane_idx() == 0:
                    ptr = cute.recast_ptr(mAmax.iterator + g, dtype=Int32)
                    cute.arch.atomic_max(ptr, amax_bits)
