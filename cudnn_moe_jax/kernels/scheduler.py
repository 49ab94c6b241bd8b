"""Persistent tile scheduler over `padded_offsets` (device side, CuTe DSL).

One compiled module serves every routing draw: group sizes are read on device, never baked into the kernel.

Work space. Rows of A are cut into *M blocks* of `block_m = tile_m * cluster_m` rows (128 or 256). The sanitized
group ends (NOTES.md "Device offsets") are multiples of 256, so every M block lies inside exactly one group, or
entirely past `valid_m = end_{L-1}`. With `n_tiles = ceil(N / tile_n)` the linear work index `t` runs over
`(m / block_m) * n_tiles` cluster tiles (`n_tiles` counts cluster tiles along N: `cluster_n` CTA tiles each):

* `t <  valid_m / block_m * n_tiles`: a *compute* tile, decoded with a grouped swizzle (`group_m` M blocks at a
  time, M fastest inside a swizzle group) so that concurrently running clusters share A rows and B columns in L2;
* `t >= ...`: a *zero* tile: rows `>= valid_m`; the epilogue writes zeros there (XLA outputs are uninitialised)
  and the producer issues no loads. Empty experts own no M block, so they are skipped for free.

Cluster `c` of `C` handles `t = c, c + C, c + 2C, ...` (static persistent schedule; all CTAs of a cluster walk
the same sequence, which TMA multicast of B needs). Each warp role runs its own copy of the schedule; nothing
about it is communicated through shared memory except the sanitized group ends.

Group lookup. Warp 0 turns `padded_offsets` into the sanitized ends once per CTA, into shared memory:
`s_g = clip(offsets[g], 0, m) & ~255`, `end_g = max_{j<=g} s_j` (a chunked warp scan), plus `valid_m = end_{L-1}`.
The group of an M block starting at row `r` is `#{g : end_g <= r}` (ends are non-decreasing), found by a
branch-free binary search over the ends (`ceil(log2(L+1))` shared-memory reads per tile).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

# FIX_PAD_SIZE of cuDNN: group boundaries are multiples of 256 rows (the one copy of the constant is in _problem)
from cudnn_moe_jax._problem import GROUP_ALIGN as OFFSET_ALIGN


class GroupedTileScheduler:
    """Static description + device functions of the grouped persistent schedule.

    tile_m, tile_n: CTA tile; cluster_m: CTAs per cluster along M (1 or 2); num_groups: L (static);
    group_m: M blocks per swizzle group.
    """

    def __init__(self, tile_m: int, tile_n: int, cluster_m: int, num_groups: int, group_m: int = 8):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.cluster_m = cluster_m
        self.block_m = tile_m * cluster_m
        if OFFSET_ALIGN % self.block_m != 0:
            raise ValueError(f"block_m={self.block_m} must divide {OFFSET_ALIGN}")
        self.num_groups = num_groups
        self.group_m = group_m
        self.align = OFFSET_ALIGN
        # ends are scanned by one warp: each lane owns a contiguous chunk of ceil(L/32) groups
        self.chunk = (num_groups + 31) // 32
        self.search_steps = [1 << s for s in reversed(range(max(1, math.ceil(math.log2(num_groups + 1)))))]

    # ---------------------------------------------------------------------------------------- setup
    @cute.jit
    def load_group_ends(self, mOffsets: cute.Tensor, m_rows: Int32, sEnds: cute.Tensor, sValid: cute.Tensor):
        """Warp-collective (call from one full warp). sEnds: (L,) Int32 smem; sValid: (1,) Int32 smem. Ends are
        rounded down to `self.align` (256 rows; 1 for the token offsets of a K-grouped weight gradient)."""
        lane = cute.arch.lane_idx()
        L = self.num_groups
        run = Int32(0)
        for i in cutlass.range_constexpr(self.chunk):
            j = lane * self.chunk + i
            if j < L:
                v = mOffsets[j]
                v = cutlass.max(cutlass.min(v, m_rows), Int32(0))
                if const_expr(self.align > 1):
                    v = v & Int32(~(self.align - 1))
                run = cutlass.max(run, v)
                sEnds[j] = run
        # inclusive max-scan of the per-lane chunk maxima
        incl = run
        for d in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(incl, offset=1 << d)
            if lane >= (1 << d):
                incl = cutlass.max(incl, other)
        excl = cute.arch.shuffle_sync_up(incl, offset=1)
        if lane == 0:
            excl = Int32(0)
        for i in cutlass.range_constexpr(self.chunk):
            j = lane * self.chunk + i
            if j < L:
                sEnds[j] = cutlass.max(sEnds[j], excl)
        total = cute.arch.shuffle_sync(incl, offset=31)
        if lane == 0:
            sValid[0] = total

    # ---------------------------------------------------------------------------------------- queries
    def num_n_tiles(self, n: int) -> int:
        return (n + self.tile_n - 1) // self.tile_n

    @cute.jit
    def group_of_row(self, row: Int32, sEnds: cute.Tensor) -> Int32:
        """#{g : end_g <= row}: the group owning `row` (L when row >= valid_m)."""
        L = self.num_groups
        g = Int32(0)
        for step in cutlass.range_constexpr(len(self.search_steps)):
            s = self.search_steps[step]
            probe = cutlass.min(g + (s - 1), Int32(L - 1))
            if g + s <= L:
                if sEnds[probe] <= row:
                    g = g + s
        return g

    @cute.jit
    def decode(self, t: Int32, valid_blocks: Int32, n_tiles: Int32):
        """Linear cluster-tile index -> (m_block, n_tile, is_compute)."""
        num_compute = valid_blocks * n_tiles
        m_block = Int32(0)
        n_tile = Int32(0)
        is_compute = t < num_compute
        if is_compute:
            tiles_per_group = self.group_m * n_tiles
            sgroup = t // tiles_per_group
            first = sgroup * self.group_m
            rows_in_group = cutlass.min(valid_blocks - first, Int32(self.group_m))
            local = t - sgroup * tiles_per_group
            m_block = first + local % rows_in_group
            n_tile = local // rows_in_group
        else:
            z = t - num_compute
            m_block = valid_blocks + z // n_tiles
            n_tile = z % n_tiles
        return m_block, n_tile, is_compute


class KGroupedTileScheduler(GroupedTileScheduler):
    """The weight-gradient schedule: output tiles (expert e, M block, N block) of W (L, m_w, n_w), every expert's
    tiles in turn (M fastest: consecutive clusters share B columns in L2); the reduction runs over the expert's
    token range [end_{e-1}, end_e) of the sanitized token ends (`load_group_ends(..., align=1)`, m_rows = T). An
    expert without tokens still owns its tiles: they store zeros."""

    def __init__(self, tile_m: int, tile_n: int, cluster_m: int, num_groups: int, m_blocks: int):
        super().__init__(tile_m, tile_n, cluster_m, num_groups)
        self.m_blocks = m_blocks
        self.align = 1

    @cute.jit
    def decode_kgrouped(self, t: Int32, n_blocks: Int32):
        """Linear cluster-tile index -> (expert, m_block, n_block)."""
        per_expert = self.m_blocks * n_blocks
        e = t // per_expert
        local = t - e * per_expert
        return e, local % self.m_blocks, local // self.m_blocks

    @cute.jit
    def token_tiles(self, e: Int32, sEnds: cute.Tensor, tile_k: cutlass.Constexpr):
        """Expert e's k-tiles: (first token of k-tile 0 = its first token rounded down to tile_k, k-tile count,
        tokens to drop at the head of k-tile 0, tokens to keep in the last k-tile). TMA boxes then start on
        tile_k boundaries; the masker zeroes the other experts' tokens at both ends."""
        start = Int32(0)
        if e > 0:
            start = sEnds[e - 1]
        end = sEnds[e]
        k0 = start - start % tile_k
        k_count = Int32(0)
        if end > start:
            k_count = (end - k0 + tile_k - 1) // tile_k
        return k0, k_count, start - k0, end - (k0 + (k_count - 1) * tile_k)
