"""Persistent tile scheduler over a grouped GEMM (device side, CuTe DSL), one class for both groupings.

One compiled module serves every routing draw: group sizes are read on device, never baked into the kernel.

Groupings (`M_GROUPED`, `K_GROUPED`):

* M-grouped (forward, dgrad): `acc[r, :] = A[r, :] @ B[g(r)]^T`, groups are row ranges of A and of the output.
  The sanitized group ends are multiples of `m_aligned` (256 by default). The linear work index `t` runs over
  *M blocks* of `cluster_m` CTA tiles (`block_m = tile_m * cluster_m` rows) times `n_blocks`:
  - `t <  valid_blocks * n_blocks`: a *compute* tile, decoded with a grouped swizzle (`group_m` M blocks at a
    time, M fastest inside a swizzle group) so that concurrently running clusters share A rows and B columns in L2;
  - `t >= ...`: a *zero* tile: rows `>= valid_m = end_{L-1}`; the epilogue writes zeros there (XLA outputs are
    uninitialised) and the producer issues no loads.
  Row blocks (`m_aligned % block_m == 0`, the default): every M block of `block_m` rows lies inside one group, or
  entirely past `valid_m`; the group of a tile is a lookup of its first row in the ends (`group_of_row`).
  Tile lists (`by_tiles`, any other m_aligned): each group's rows are cut into CTA tiles from its first row,
  `ceil(|g| / tile_m)` of them, the last one clipped at the group end (`Tile.rows` < tile_m: the epilogue stores
  those rows only and folds only them into its reductions); the groups' tiles in order form one list (the tile
  ends `tile_end_g = sum_{j <= g} ceil(|j| / tile_m)` in shared memory), and M block b holds tiles
  cluster_m * b + rank_m. The tiles of one block may belong to two groups: then B is not multicast
  (`Tile.mcast_b` False, each CTA loads its own B tile whole); a block past the list's end is a *masked* tile
  (rows 0: it runs the block partner's loads and stores nothing). Zero tiles start at valid_m. Empty groups own
  no tile, a 1-row group one.
* K-grouped (wgrad): `W[e] = A[:, T_e] @ B[:, T_e]^T`, groups are token (K) ranges. Output tiles (expert e,
  M block, N block) of W (L, m_w, n_w), every expert's tiles in turn (M fastest: consecutive clusters share B
  columns in L2); the reduction runs over the expert's tokens `[end_{e-1}, end_e)`, in k-tiles from its first
  token rounded down to `tile_k` (`k_start`; the mainloop masks the neighbours' tokens at both ends, `k_head` /
  `k_keep`). An expert without tokens still owns its tiles: they store zeros. Padded tokens (`padded_tokens`,
  the staged wgrad: its operands are converted into a workspace where each expert's tokens start on a `tile_k`
  boundary and its last k-tile is zero-filled): expert e's k-tiles start at `tile_k * tile_end_{e-1}` with
  `tile_end_g = sum_{j <= g} ceil(|j| / tile_k)` (the tile-list scan over k-tiles), nothing to mask.

Cluster `c` of `C` handles `t = c, c + C, c + 2C, ...` (static persistent schedule; all CTAs of a cluster walk the
same sequence, which TMA multicast needs). Each warp role runs its own copy of the schedule; nothing about it is
communicated through shared memory except the sanitized group ends.

Group ends. Warp 0 turns the offsets into the sanitized ends once per CTA, into shared memory:
`s_g = clip(offsets[g], 0, extent)` (M-grouped: `& ~(m_aligned - 1)`), `end_g = max_{j<=g} s_j` (a chunked warp
scan), plus `valid = end_{L-1}`; tile lists also the tile ends (a chunked warp sum scan) and their total. The group
of an M block starting at row `r` is `#{g : end_g <= r}` (ends are non-decreasing), found by a branch-free binary
search over the ends (`ceil(log2(L+1))` shared-memory reads); that of list tile i likewise in the tile ends.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from cudnn_moe_jax.limits import GROUP_ALIGN

M_GROUPED = "m"  # groups are row ranges of A and the output (forward, dgrad)
K_GROUPED = "k"  # groups are token ranges of the reduction (wgrad)


class Tile(NamedTuple):
    """One tile of the schedule as a CTA sees it."""

    m_tile: Any       # CTA tile row of A (M-grouped: and of the output); tile lists: the tile's index in the list
    n_tile: Any       # CTA tile column
    group: Any        # the tile's group (expert)
    out_m_tile: Any   # CTA tile row of the output (K-grouped: W[e]'s rows start at e * m_w)
    is_compute: Any   # False: a zero tile (no loads, zeros stored)
    k_count: Any      # k-tiles of the reduction
    k_start: Any = None  # K-grouped: first token of k-tile 0 (the expert's first token rounded down to tile_k)
    k_head: Any = None   # K-grouped: tokens to drop at the head of k-tile 0
    k_keep: Any = None   # K-grouped: tokens to keep in the last k-tile
    row0: Any = None     # tile lists: the tile's first row (of A and the output)
    rows: Any = None     # tile lists: its rows to store, 0..tile_m (a group's last tile: to the group end)
    mcast_b: Any = None  # tile lists: both tiles of the cluster block read B[group] (else each loads its own)


class Work(NamedTuple):
    """The tiles of this CTA's cluster: t = first, first + stride, ... < total."""

    first: Any
    stride: Any
    total: Any
    valid_blocks: Any = None  # M-grouped: M blocks of compute tiles
    k_tiles: Any = None       # M-grouped: k-tiles of a compute tile
    list_tiles: Any = None    # tile lists: tiles in the list
    valid_m: Any = None       # tile lists: end_{L-1}
    m_rows: Any = None        # tile lists: A's rows


class GroupedTileScheduler:
    """Static description + device functions of the persistent schedule of one grouping.

    tile_m, tile_n: CTA tile; cluster_m, cluster_n: CTAs per cluster along M / N; num_groups: L (static);
    n_blocks: cluster tiles along N; tile_k: K of one k-tile. M-grouped: k_tiles (the static K's k-tiles), group_m
    (M blocks per swizzle group), m_aligned (the ends' alignment: row blocks when block_m divides it, else tile
    lists). K-grouped: m_blocks (cluster tiles along W's m_w), tokens_per_unit (tokens per element of A's storage
    along T: packed FP4 holds two a byte, so A (m_w, T / 2) bytes spans T tokens).
    """

    def __init__(self, grouping: str, tile_m: int, tile_n: int, cluster_m: int, cluster_n: int, num_groups: int,
                 n_blocks: int, tile_k: int, *, k_tiles: int = None, group_m: int = 8, m_blocks: int = None,
                 m_aligned: int = GROUP_ALIGN, tokens_per_unit: int = 1, padded_tokens: bool = False):
        if grouping not in (M_GROUPED, K_GROUPED):
            raise ValueError(f"grouping must be {M_GROUPED!r} or {K_GROUPED!r}")
        self.grouping = grouping
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.cluster_m, self.cluster_n = cluster_m, cluster_n
        self.block_m = tile_m * cluster_m
        self.num_groups = num_groups
        self.n_blocks = n_blocks
        self.by_tiles = False   # tile lists (M-grouped ends not on block_m multiples)
        self.clipped = False    # a tile may end inside its group's last tile_m rows (ends not on tile_m multiples)
        if grouping == M_GROUPED:
            if m_aligned & (m_aligned - 1):
                raise ValueError(f"m_aligned={m_aligned} must be a power of two")
            self.align = m_aligned
            self.by_tiles = m_aligned % self.block_m != 0
            self.clipped = m_aligned % tile_m != 0
            self.k_tiles, self.group_m = k_tiles, group_m
        else:
            self.align = 1  # token ends: any alignment
            self.m_blocks = m_blocks
        self.padded_tokens = padded_tokens   # K-grouped: the k-tile ends of padded token ranges after the ends
        self.tokens_per_unit = tokens_per_unit
        # ends are scanned by one warp: each lane owns a contiguous chunk of ceil(L/32) groups
        self.chunk = (num_groups + 31) // 32

    # ---------------------------------------------------------------------------------------- host
    def num_tiles(self, m_rows):
        """Cluster tiles of the whole schedule (the persistent grid is at most this many clusters); tile lists: a
        bound (at most cdiv(valid_m, tile_m) + L - 1 list tiles, cdiv(m - valid_m, tile_m) zero tiles, each rounded
        up to whole blocks)."""
        if self.grouping == K_GROUPED:
            return self.num_groups * self.m_blocks * self.n_blocks
        if self.by_tiles:
            return ((m_rows + self.tile_m - 1) // self.tile_m + self.num_groups) // self.cluster_m * self.n_blocks \
                + 2 * self.n_blocks
        return (m_rows // self.block_m) * self.n_blocks

    def ends_words(self) -> int:
        """Int32 words of the group ends in shared memory: the ends (tile lists: then the tile ends)."""
        return self.num_groups * (2 if self.by_tiles or self.padded_tokens else 1)

    def group_extent(self, mA: cute.Tensor):
        """The extent the offsets index: A's rows (M-grouped) or its tokens (K-grouped: A is (m_w, T), packed FP4
        (m_w, T / 2) bytes: the token count is its columns times `tokens_per_unit`)."""
        if self.grouping == K_GROUPED:
            return mA.shape[1] * self.tokens_per_unit if self.tokens_per_unit != 1 else mA.shape[1]
        return mA.shape[0]

    # ---------------------------------------------------------------------------------------- setup
    @cute.jit
    def load_group_ends(self, mOffsets: cute.Tensor, extent: Int32, sEnds: cute.Tensor, sValid: cute.Tensor):
        """Warp-collective (call from one full warp). sEnds: (ends_words(),) Int32 smem; sValid: (2,) Int32 smem.
        Ends are clipped to `extent` and rounded down to `self.align`; tile lists: sEnds[L + g] = tile_end_g and
        sValid[1] = the list's tiles (padded tokens: k-tiles)."""
        lane = cute.arch.lane_idx()
        L = self.num_groups
        run = Int32(0)
        for i in cutlass.range_constexpr(self.chunk):
            j = lane * self.chunk + i
            if j < L:
                v = mOffsets[j]
                v = cutlass.max(cutlass.min(v, extent), Int32(0))
                if const_expr(self.align > 1):
                    v = v & Int32(~(self.align - 1))
                run = cutlass.max(run, v)
                sEnds[j] = run
        # max-scan of the per-lane chunk maxima
        excl, total = self._warp_scan(run, lane, add=False)
        for i in cutlass.range_constexpr(self.chunk):
            j = lane * self.chunk + i
            if j < L:
                sEnds[j] = cutlass.max(sEnds[j], excl)
        if lane == 0:
            sValid[0] = total
        if const_expr(self.by_tiles or self.padded_tokens):
            self._load_tile_ends(sEnds, sValid, lane, excl)

    @cute.jit
    def _load_tile_ends(self, sEnds: cute.Tensor, sValid: cute.Tensor, lane: Int32, prev_end: Int32):
        """tile_end_g = sum_{j <= g} ceil((end_j - end_{j-1}) / tile) into sEnds[L + g], tile = tile_m (tile_k for
        padded tokens) (a chunked warp sum scan; each lane reads only the ends it wrote, `prev_end` being the end
        before its chunk); the total to sValid[1]."""
        L = self.num_groups
        tile = self.tile_k if const_expr(self.padded_tokens) else self.tile_m
        run = Int32(0)
        end_before = prev_end
        for i in cutlass.range_constexpr(self.chunk):
            j = lane * self.chunk + i
            if j < L:
                e = sEnds[j]
                run = run + (e - end_before + (tile - 1)) // tile
                end_before = e
                sEnds[L + j] = run
        excl, total = self._warp_scan(run, lane, add=True)
        for i in cutlass.range_constexpr(self.chunk):
            j = lane * self.chunk + i
            if j < L:
                sEnds[L + j] = sEnds[L + j] + excl
        if lane == 0:
            sValid[1] = total

    @cute.jit
    def _warp_scan(self, value: Int32, lane: Int32, add: cutlass.Constexpr):
        """(exclusive scan (lane 0: 0), total) over the warp's lanes of one value each; max, or sum with `add`."""
        incl = value
        for d in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(incl, offset=1 << d)
            if lane >= (1 << d):
                if const_expr(add):
                    incl = incl + other
                else:
                    incl = cutlass.max(incl, other)
        excl = cute.arch.shuffle_sync_up(incl, offset=1)
        if lane == 0:
            excl = Int32(0)
        return excl, cute.arch.shuffle_sync(incl, offset=31)

    # ---------------------------------------------------------------------------------------- queries
    @cute.jit
    def work(self, sValid: cute.Tensor, m_rows: Int32, k_tiles=None) -> Work:
        """The tiles of this CTA's cluster. k_tiles (M-grouped): the k-tiles of a compute tile, if not the static
        K's (the producer counts them from A's TMA partition)."""
        _, _, cluster_id = cute.arch.block_idx()
        _, _, num_clusters = cute.arch.grid_dim()
        if const_expr(self.grouping == K_GROUPED):
            return Work(cluster_id, num_clusters, Int32(self.num_tiles(None)))
        if const_expr(k_tiles is None):
            k_tiles = Int32(self.k_tiles)
        if const_expr(self.by_tiles):
            cm = self.cluster_m
            list_tiles, valid_m = sValid[1], sValid[0]
            valid_blocks = (list_tiles + (cm - 1)) // cm
            zero_blocks = ((m_rows - valid_m + (self.tile_m - 1)) // self.tile_m + (cm - 1)) // cm
            return Work(cluster_id, num_clusters, (valid_blocks + zero_blocks) * self.n_blocks, valid_blocks,
                        k_tiles, list_tiles, valid_m, m_rows)
        return Work(cluster_id, num_clusters, self.num_tiles(m_rows), sValid[0] // self.block_m, k_tiles)

    @cute.jit
    def tile(self, t: Int32, work: Work, sEnds: cute.Tensor, rank_m: Int32, rank_n: Int32) -> Tile:
        """Linear cluster-tile index t -> this CTA's tile (rank_m, rank_n: its place in the cluster)."""
        if const_expr(self.grouping == K_GROUPED):
            return self._k_grouped_tile(t, sEnds, rank_m, rank_n)
        if const_expr(self.by_tiles):
            return self._listed_tile(t, work, sEnds, rank_m, rank_n)
        return self._m_grouped_tile(t, work.valid_blocks, work.k_tiles, sEnds, rank_m, rank_n)

    @cute.jit
    def _m_grouped_tile(self, t: Int32, valid_blocks: Int32, k_tiles, sEnds: cute.Tensor, rank_m: Int32,
                        rank_n: Int32):
        m_block, n_block, is_compute = self.decode(t, valid_blocks, Int32(self.n_blocks))
        g = cutlass.min(self.group_of_row(m_block * self.block_m, sEnds), Int32(self.num_groups - 1))
        m_tile = m_block * self.cluster_m + rank_m
        n_tile = n_block * self.cluster_n + rank_n
        k_count = Int32(0)
        if is_compute:
            k_count = k_tiles
        return Tile(m_tile, n_tile, g, m_tile, is_compute, k_count)

    @cute.jit
    def _listed_tile(self, t: Int32, work: Work, sEnds: cute.Tensor, rank_m: Int32, rank_n: Int32):
        """Tile lists: M block b holds list tiles cluster_m * b + rank; a zero block the tile_m-row tiles from
        valid_m on (rows past m clipped)."""
        L, cm, tile_m = self.num_groups, self.cluster_m, self.tile_m
        m_block, n_block, is_compute = self.decode(t, work.valid_blocks, Int32(self.n_blocks))
        n_tile = n_block * self.cluster_n + rank_n
        first = m_block * cm
        i = first + rank_m
        # a tile past the list's end (a masked tile) reads the block's first tile's rows and stores none
        masked = i >= work.list_tiles
        i_read = i
        if masked:
            i_read = first
        g, row0, rows = self.list_tile(i_read, sEnds)
        if masked:
            rows = Int32(0)
        mcast_b = True
        if const_expr(cm > 1):   # the block's two tiles in one group: B multicast (cluster_m is 1 or 2)
            g_first, _, _ = self.list_tile(first, sEnds)
            g_second, _, _ = self.list_tile(cutlass.min(first + 1, work.list_tiles - 1), sEnds)
            mcast_b = g_first == g_second
        k_count = Int32(0)
        m_tile = i
        if is_compute:
            k_count = work.k_tiles
        else:   # zero tile z: rows valid_m + tile_m * z .. (past m: clipped; wholly past m: rows 0 at valid_m)
            z = (m_block - work.valid_blocks) * cm + rank_m
            row0 = work.valid_m + z * tile_m
            rows = cutlass.max(cutlass.min(work.m_rows - row0, Int32(tile_m)), Int32(0))
            if rows == 0:
                row0 = work.valid_m
            g = Int32(L - 1)
            m_tile = row0 // tile_m
        return Tile(m_tile, n_tile, g, m_tile, is_compute, k_count, row0=row0, rows=rows, mcast_b=mcast_b)

    @cute.jit
    def list_tile(self, i: Int32, sEnds: cute.Tensor):
        """List tile i (< the list's tiles) -> (group, first row, rows to store)."""
        L, tile_m = self.num_groups, self.tile_m
        sTileEnds = cute.make_tensor(sEnds.iterator + L, cute.make_layout(L))
        g = cutlass.min(self.group_of_row(i, sTileEnds), Int32(L - 1))
        start = Int32(0)
        tile_start = Int32(0)
        if g > 0:
            start = sEnds[g - 1]
            tile_start = sTileEnds[g - 1]
        row0 = start + (i - tile_start) * tile_m
        return g, row0, cutlass.min(sEnds[g] - row0, Int32(tile_m))

    @cute.jit
    def _k_grouped_tile(self, t: Int32, sEnds: cute.Tensor, rank_m: Int32, rank_n: Int32):
        e, m_block, n_block = self.decode_kgrouped(t, Int32(self.n_blocks))
        k_start, k_count, k_head, k_keep = self.token_tiles(e, sEnds)
        m_tile = m_block * self.cluster_m + rank_m
        n_tile = n_block * self.cluster_n + rank_n
        out_m_tile = e * (self.m_blocks * self.cluster_m) + m_tile
        return Tile(m_tile, n_tile, e, out_m_tile, True, k_count, k_start, k_head, k_keep)

    @cute.jit
    def group_of_row(self, row: Int32, sEnds: cute.Tensor) -> Int32:
        """#{g : end_g <= row}: the group owning `row` (L when row >= valid_m); over the tile ends, the group of a
        list tile."""
        return count_ends_at_most(sEnds, row, self.num_groups)

    @cute.jit
    def decode(self, t: Int32, valid_blocks: Int32, n_tiles: Int32):
        """M-grouped: linear cluster-tile index -> (m_block, n_block, is_compute)."""
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

    @cute.jit
    def decode_kgrouped(self, t: Int32, n_blocks: Int32):
        """K-grouped: linear cluster-tile index -> (expert, m_block, n_block)."""
        per_expert = self.m_blocks * n_blocks
        e = t // per_expert
        local = t - e * per_expert
        return e, local % self.m_blocks, local // self.m_blocks

    @cute.jit
    def token_tiles(self, e: Int32, sEnds: cute.Tensor):
        """Expert e's k-tiles: (first token of k-tile 0 = its first token rounded down to tile_k, k-tile count,
        tokens to drop at the head of k-tile 0, tokens to keep in the last k-tile). TMA boxes then start on
        tile_k boundaries; the masker zeroes the other experts' tokens at both ends. Padded tokens: the expert's
        k-tiles in the padded ranges (class docstring), nothing at the head."""
        tile_k = self.tile_k
        start = Int32(0)
        if e > 0:
            start = sEnds[e - 1]
        end = sEnds[e]
        if const_expr(self.padded_tokens):
            first = Int32(0)
            if e > 0:
                first = sEnds[self.num_groups + e - 1]
            k_count = sEnds[self.num_groups + e] - first
            return first * tile_k, k_count, Int32(0), end - start - (k_count - 1) * tile_k
        k0 = start - start % tile_k
        k_count = Int32(0)
        if end > start:
            k_count = (end - k0 + tile_k - 1) // tile_k
        return k0, k_count, start - k0, end - (k0 + (k_count - 1) * tile_k)


@cute.jit
def count_ends_at_most(ends: cute.Tensor, value: Int32, num_groups: cutlass.Constexpr) -> Int32:
    """#{g < num_groups : ends[g] <= value} of non-decreasing ends: a branch-free binary search
    (ceil(log2(num_groups + 1)) shared-memory reads)."""
    steps = [1 << s for s in reversed(range(max(1, math.ceil(math.log2(num_groups + 1)))))]
    g = Int32(0)
    for step in cutlass.range_constexpr(len(steps)):
        s = steps[step]
        probe = cutlass.min(g + (s - 1), Int32(num_groups - 1))
        if g + s <= num_groups:
            if ends[probe] <= value:
                g = g + s
    return g

