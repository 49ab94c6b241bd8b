"""The K-grouped schedule of the sm90 kernel: per-expert weight gradients W[e] = A[:, T_e] @ B[:, T_e]^T.

Output tiles (expert e, M block, N block) of W (L, m_w, n_w), stored through the forward `quant` epilogue (D = acc,
no prob, alpha 1) into W seen as (L * m_w, n_w); A (m_w, T) and B (n_w, T) are read K-major (tokens contiguous)
from expert e's first token rounded down to a k-tile (any alignment of the offsets): the producer offsets both
TMA coordinate tensors by it, and the mainloop's stage worker (mainloop.KGroupedWgmmaMainloop) zeroes the
neighbouring experts' tokens in the first and last k-tiles. Token ends are sanitized like
the reference's (running max of clip(offsets, 0, T)); an expert with no token runs no k-tile and stores zeros.

A mixin of `GroupedGemmSm90` (kernels/sm90/gemm.py): the consumer's tile loop reads `sched.decode_kgrouped` /
`sched.token_tiles` for wgrad problems; everything else (pipeline, mainloop, epilogue) is the kernel's own.
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

class KGroupedSchedule:
    @cute.jit
    def _kgrouped_work(self):
        """(first tile, stride, total tiles) of this CTA's cluster: every expert's tiles."""
        _, _, cluster_id = cute.arch.block_idx()
        _, _, num_clusters = cute.arch.grid_dim()
        return cluster_id, num_clusters, Int32(self.num_groups * self.sched.m_blocks * self.n_blocks)

    @cute.jit
    def kgrouped_producer(self, ab_pipeline, tma_atom_a, mA, tma_atom_b, mB, sA, sB, sEnds):
        """Warp 0: for every tile, the TMA loads of its expert's token range (A multicast along the cluster's N,
        B along M, as the forward producer)."""
        rank_m, rank_n = self._cluster_coord()
        a_mcast_mask, b_mcast_mask = self._mcast_masks(rank_m, rank_n)
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        t, stride, total = self._kgrouped_work()
        while t < total:
            e, m_block, n_block = self.sched.decode_kgrouped(t, Int32(self.n_blocks))
            start, k_count, _, _ = self.sched.token_tiles(e, sEnds, self.tile_k)
            m_tile = m_block * self.cluster_m + rank_m
            n_tile = n_block * self.cluster_n + rank_n
            # k-tile k of this tile = tokens start + 64 k ..: start is the expert's first token rounded down to 64
            gA = cute.local_tile(cute.domain_offset((0, start), mA), (self.tile_m, self.tile_k), (None, None))
            gB = cute.local_tile(cute.domain_offset((0, start), mB), (self.tile_n, self.tile_k), (None, None))
            tAsA, tAgA = cpasync.tma_partition(
                tma_atom_a, rank_n, cute.make_layout(self.cluster_n), cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2))
            tBsB, tBgB = cpasync.tma_partition(
                tma_atom_b, rank_m, cute.make_layout(self.cluster_m), cute.group_modes(sB, 0, 2),
                cute.group_modes(gB, 0, 2))
            prod_state = self.mainloop.load_tile(
                ab_pipeline, prod_state, tma_atom_a, tAgA[(None, m_tile, None)], tAsA,
                tma_atom_b, tBgB[(None, n_tile, None)], tBsB, a_mcast_mask, b_mcast_mask, k_count,
            )
            t += stride
        ab_pipeline.producer_tail(prod_state)
