"""The weight-gradient kernel class of the sm90 grouped GEMM: per-expert W[e] = A[:, T_e] @ B[:, T_e]^T.

The forward class with the K-grouped schedule (`kernels.scheduler.K_GROUPED`) and the token-masking mainloop
(`mainloop.KGroupedWgmmaMainloop`; block-scaled A / B: `mainloop_dequant_wgrad`, exact bf16 conversion on chip with
the scales read from the per-expert segments): output tiles (expert e, M block, N block) of W (L, m_w, n_w), stored
through the forward `quant` epilogue (D = alpha * acc, no prob) into W seen as (L * m_w, n_w). A (m_w, T) and
B (n_w, T) are read from expert e's first token rounded down to a k-tile (any alignment of the offsets): the
producer offsets both TMA coordinate tensors by it per tile, and the mainloop zeroes the neighbouring experts'
tokens in the first and last k-tiles. Token ends are sanitized like the reference's (running max of clip(offsets, 0, T));
an expert with no token runs no k-tile and stores zeros. Global scales: alpha = gsa[e] * gsb[e] (the two vectors
ride in the launcher's alpha / beta slots). accumulate_on_output: the W input is aliased to the output and the
epilogue adds the old W (forward.py `_load_old_w`).
"""

from __future__ import annotations

import dataclasses

import cutlass.cute as cute
from cutlass import Float32, const_expr

from cudnn_moe_jax._problem import Epilogue
from cudnn_moe_jax.limits import values_per_byte

from ..scheduler import K_GROUPED, GroupedTileScheduler
from .forward import GroupedGemmSm90Forward
from . import mainloop_dequant_wgrad
from .mainloop import KGroupedWgmmaMainloop


class GroupedGemmSm90Wgrad(GroupedGemmSm90Forward):
    """`W[e] = alpha_e * A[:, T_e] @ B[:, T_e]^T (+ the old W[e])` for every expert e."""

    def init_epilogue(self, problem):
        self.accumulate = problem.accumulate
        self.scaled = problem.has_global_scales
        return super().init_epilogue(dataclasses.replace(
            problem, op="quant", epilogue=Epilogue(has_prob=False, d_dtype=problem.wgrad_dtype)))

    def mainloop_class_for(self, problem):
        """bf16 / fp16: the token-masking bf16 mainloop; block-scaled: the K-grouped dequantizing mainloop."""
        if problem.block_scaled:
            return mainloop_dequant_wgrad.mainloop_class(problem, self.config)
        return KGroupedWgmmaMainloop

    def make_scheduler(self, problem):
        """K-grouped; the token count T is dynamic: the kernel reads it from A's shape (load_group_ends; packed FP4
        A is (m_w, T / 2) bytes: two tokens a column)."""
        return GroupedTileScheduler(K_GROUPED, self.tile_m, self.tile_n, self.cluster_m, self.cluster_n,
                                    self.num_groups, self.n_blocks, self.tile_k,
                                    m_blocks=problem.m // (self.tile_m * self.cluster_m),
                                    tokens_per_unit=values_per_byte(problem.ab_dtype))

    def output_operands(self, t):
        """W (L, m_w, n_w) as (L * m_w, n_w): expert e's rows start at e * m_w; the global scales in the alpha /
        beta slots; with accumulation the buffer W is written to holds the old W (input_output_aliases)."""
        d = cute.make_tensor(t["wgrad"].iterator, cute.make_layout((self.num_groups * self.problem.m, self.n),
                                                                  stride=(self.n, 1)))
        return d, t["global_scale_a"], t["global_scale_b"], t["wgrad"] if self.accumulate else None

    @cute.jit
    def tile_alpha(self, g, args):
        alpha = Float32(1.0)
        if const_expr(self.scaled):
            alpha = args.mAlpha[g] * args.mBeta[g]  # gsa[e] * gsb[e], rounded once as the reference's (1 * gsa) * gsb
        return alpha

    def ab_partitions(self, args, cta, rank_m, rank_n):
        """Nothing made once: each tile's K range starts at its expert's first token (`tile_ab`)."""
        return None

    def ab_k_tiles(self, ab):
        return None

    @cute.jit
    def tile_ab(self, ab, tile, args, cta, rank_m, rank_n):
        """(tAgA, tAsA, tBgB, tBsB) of one tile: k-tile k = tokens tile.k_start + tile_k * k (k_start: the expert's
        first token rounded down to tile_k); packed FP4 operands hold two tokens a byte (TMA box: tile_k / 2)."""
        (_, a_box), (_, b_box) = self.mainloop.tma_operands()
        k0 = tile.k_start
        if const_expr(a_box != self.tile_k):
            k0 = tile.k_start // (self.tile_k // a_box)
        gA = cute.local_tile(cute.domain_offset((0, k0), args.mA), (self.tile_m, a_box), (None, None))
        gB = cute.local_tile(cute.domain_offset((0, k0), args.mB), (self.tile_n, b_box), (None, None))
        tAsA, tAgA, tBsB, tBgB = self.tma_partitions(args, gA, gB, cta, rank_m, rank_n)
        return tAgA[(None, tile.m_tile, None)], tAsA, tBgB[(None, tile.n_tile, None)], tBsB
