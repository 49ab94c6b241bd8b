"""The per-tile epilogue driver of the sm90 grouped GEMM and the reductions its hooks share.

`run_epilogue` owns the step loop and the store sequence of one tile; the forward (forward.py) and the backward
(dgrad.py) epilogues are two sets of `EpilogueHooks` it calls. Per tile:

  state = begin(setup, ctx)                    per-tile set-up (smem staging, thread coordinates, reductions' zeros)
  for each 32-column step (unrolled):
      frags = visit(step, state)               the step's output register fragments (dgrad: waits for its C first)
      store warp: store_pipeline.producer_acquire()     (the TMA store `epi_stages` steps back read the buffer)
      epi_barrier
      refill(step, state)                      extra TMA inputs: reload the buffer every thread has now read
      for each output block j of the step:     (dglu: gate and up; otherwise one)
          finish(step, j, state, frags)        work that needs the other warps' smem data (FP8 column quantization)
          writes(step, buf, j, state, frags)   (register->smem copy, fragment, smem buffer) of each output subtile
      fence_proxy; epi_barrier
      store warp: stores(step, buf, state)     each subtile (a `gemm.Store`) by TMA; commit
      (a clipped tile: every thread stores its rows by plain 16-byte stores instead, `store_rows`)
      after_store(step, state)                 (dgrad: the dbias column partials)
  end(state)                                   per-tile reductions to global (amax atomics, dprob partials)

`writes` and `stores` are generators: each entry's views (and the global tile's coordinate arithmetic) are built
when the driver asks for it, right before its copy, so the emitted operations come in the order of the former
hand-written loops (kept because the acceptance test of this structure is byte-identical SASS).

`setup` is the consumer's `gemm.EpilogueSetup` (built once per kernel), `ctx` the tile's `gemm.TileContext`. A mixin
of the kernel classes' shared body (`gemm.GroupedGemmSm90Base`), traced inside the consumer warpgroups' tile loop.

Clipped tiles (m_aligned < tile_m, `scheduler.Tile.rows`): a group's last tile ends at the group end, inside its
128 rows, and the TMA store of its box would overwrite the next group's rows. Such a tile (and the last zero tile
past m) stores its staged subtiles with plain stores, each thread a 16-byte piece of a row, predicated on the row
(`store_rows`); every other tile keeps the TMA store. Chosen over per-group tensor maps rewritten on the device
(a 128-byte descriptor write, a proxy fence and a descriptor fetch each time a CTA changes group, for every output;
complex to get right) because the plain stores cost only where they are needed: at most one tile per group and N
tile. Cost estimate: a 128 x 32 bf16 subtile is 512 16-byte pieces, 2 per thread (LDS.128 + STG.128), ~60 cycles
of issue per step against a step's ~500; coalesced (a quad of lanes writes one row's 64 bytes). On the fine-grained
layers (~2k rows per expert, 16 tiles per group) that is ~1/17 of the tiles, so < 1% of the GEMM.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from .. import quantize as q8
from ..dequant import st_global_v4
from ..epilogue import abs_bits, warp_max_i32
from .epilogue_fp8d import EPI_N


EPI_THREADS = 256    # the two consumer warpgroups


def no_hook(*_args) -> None:
    """A hook with nothing to do for this epilogue."""


class EpilogueHooks(NamedTuple):
    """One epilogue as the driver sees it (signatures in the module docstring)."""

    begin: Callable[..., Any]
    visit: Callable[..., Any]
    writes: Callable[..., Any]
    stores: Callable[..., Any]
    end: Callable[..., Any]
    blocks: int = 1  # output blocks per step, each gets finish + writes
    refill: Callable[..., Any] = no_hook
    finish: Callable[..., Any] = no_hook
    after_store: Callable[..., Any] = no_hook


class EpilogueDriver:
    # The L2 cache policy of the outputs' TMA stores (a 64-bit createpolicy word), or None: the default (evict-normal)
    OUTPUT_L2_POLICY = None

    @cute.jit
    def run_epilogue(self, hooks, setup, ctx, store_pipeline):
        """One tile's epilogue: `hooks.begin(setup, ctx)`, then per step the visit and the store sequence, then the
        end.

        Two named barriers per step (measured: one barrier with the store warp draining the previous store first
        was 8-13% slower)."""
        epi_barrier, is_store_warp = setup.epi_barrier, setup.is_store_warp
        state = hooks.begin(setup, ctx)
        for step in cutlass.range_constexpr(self.epi_steps):
            frags = hooks.visit(step, state)
            # ---- registers -> smem, once the TMA store `epi_stages` steps back has read this buffer
            buf = step % self.epi_stages
            if is_store_warp:
                store_pipeline.producer_acquire()
            epi_barrier.arrive_and_wait()
            hooks.refill(step, state)
            for j in cutlass.range_constexpr(hooks.blocks):
                hooks.finish(step, j, state, frags)
                for r2s, frag, dst in hooks.writes(step, buf, j, state, frags):
                    cute.copy(r2s, frag, dst)
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            # ---- smem -> global (TMA clips columns past N). The generator is made outside the dynamic `if`: a
            # method called on an object inside one carries that object through it (the DSL treats it as
            # written). It emits nothing until iterated, so its operations land inside the store warp's branch;
            # the loop's names are new ones for the same reason (a name written inside is carried if live before)
            stores = hooks.stores(step, buf, state)
            if const_expr(not self.sched.by_tiles):
                if is_store_warp:
                    for out in stores:
                        self.tma_store(out, ctx)
                    store_pipeline.producer_commit()
            else:   # tile lists: TMA for whole tiles; a clipped one by rows, a masked one (rows 0) not at all
                whole = ctx.rows == self.tile_m
                clipped = hooks.stores(step, buf, state)
                if is_store_warp:
                    if whole:
                        for out in stores:
                            self.tma_store(out, ctx)
                    store_pipeline.producer_commit()
                if const_expr(self.sched.clipped):
                    if not whole:
                        for out_rows in clipped:
                            self.store_rows(out_rows, ctx, setup.ctid)
            hooks.after_store(step, state)
        hooks.end(state)

    def owns_rows(self, ctx):
        """Whether the tile's reductions (amax) and scale-factor bytes count: a compute tile, with tile lists not a
        masked one (rows 0: it computed its block partner's rows with prob 1)."""
        if not self.sched.by_tiles:
            return ctx.is_compute
        return ctx.is_compute & (ctx.rows > 0)

    @cute.jit
    def tma_store(self, out, ctx):
        """The TMA store of output subtile `out`'s staged buffer (with OUTPUT_L2_POLICY where set)."""
        if const_expr(self.OUTPUT_L2_POLICY is None):
            cute.copy(out.tma_atom, out.bSG_s[(None, out.buf)], self.store_tile(out, ctx))
        else:
            cute.copy(out.tma_atom, out.bSG_s[(None, out.buf)], self.store_tile(out, ctx),
                      cache_policy=Int64(self.OUTPUT_L2_POLICY))

    @cute.jit
    def store_tile(self, out, ctx):
        """The global TMA tile of output subtile `out` (a `gemm.Store`): by M tile index, or (tile lists) from
        the tile's first row."""
        if const_expr(out.transposed):   # never with tile lists (config.supports)
            return out.bSG_g[(None, (out.col, ctx.m_tile))]
        if const_expr(not self.sched.by_tiles):
            return out.bSG_g[(None, (ctx.m_tile, out.col))]
        return self.tile_at_row(out.tma_atom, out.smem, out.mX, ctx.row0, out.col)

    @cute.jit
    def tile_at_row(self, tma_atom, smem, mX, row0, col):
        """The TMA tile (tile_m rows from row0, 32-column block col) of the TMA view mX, staged through `smem`
        (tile lists: a tile starts at its group's first row; TMA boxes may start at any row)."""
        _, bSG_g = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                         cute.zipped_divide(cute.domain_offset((row0, 0), mX), self.epi_tile))
        return bSG_g[(None, (0, col))]

    @cute.jit
    def store_rows(self, out, ctx, ctid):
        """All epilogue threads, after the step's second barrier: rows [row0, row0 + rows) of output subtile `out`
        from its staging buffer to memory, a 16-byte piece of a row per thread and pass (LDS.128 + STG.128);
        pieces past the output's width are dropped (widths are multiples of 16 bytes). The buffer is next written
        after a later step's first barrier, which every thread reaches after these reads."""
        dtype = out.out.element_type
        vec = 128 // dtype.width              # elements per 16 bytes
        per_row = EPI_N // vec                # threads per subtile row
        width = out.out.shape[1]
        col0 = out.col * EPI_N
        piece = ctid % per_row
        sX = out.smem[(None, None, out.buf)]
        base = out.out.iterator.toint() + (Int64(ctx.row0) * width + col0 + piece * vec) * (dtype.width // 8)
        for p in cutlass.range_constexpr(self.tile_m * per_row // EPI_THREADS):
            r = p * (EPI_THREADS // per_row) + ctid // per_row
            if (r < ctx.rows) & (col0 + piece * vec < width):
                dst = cute.make_tensor(
                    cute.make_ptr(dtype, base + Int64(r) * width * (dtype.width // 8), cute.AddressSpace.gmem,
                                  assumed_align=16), cute.make_layout((1, vec)))
                cute.autovec_copy(cute.local_tile(sX, (1, vec), (r, piece)), dst)


# ---------------------------------------------------------------------------------------------- reductions
# amax per group: max |x| over the output, reduced per thread -> per warp -> one atomicMax per warp and tile on the
# bit patterns (non-negative floats order like their bits; exact, so independent of the atomics' order).

@cute.jit
def fold_amax(bits: Int32, v: Float32) -> Int32:
    """The thread's amax bits with value v folded in."""
    return cutlass.max(bits, abs_bits(v))


@cute.jit
def row_kept(v: Float32, row, rows) -> Float32:
    """v, or 0 for a row past the tile's `rows` (a clipped tile's rows of the next group: kept out of amax, dbias)."""
    out = Float32(0.0)
    if row < rows:
        out = v
    return out


@cute.jit
def merge_amax(bits: Int32, mAmax: cute.Tensor, g, is_compute, lane=None, j: cutlass.Constexpr = None,
               per_group: cutlass.Constexpr = 1):
    """End of tile: the warp's maximum -> atomicMax on amax slot g (j given: slot g * per_group + j). Zero tiles
    merge nothing. lane None: read the lane index here (the forward; the backward passes its derived lane)."""
    bits = warp_max_i32(bits)
    if is_compute:
        _lane0_atomic_max(bits, mAmax, g, lane, j, per_group)


@cute.jit
def _lane0_atomic_max(bits, mAmax, g, lane, j: cutlass.Constexpr, per_group: cutlass.Constexpr):
    if const_expr(lane is None):
        lane = cute.arch.lane_idx()
    if lane == 0:
        if const_expr(j is None):
            cute.arch.atomic_max(cute.recast_ptr(mAmax.iterator + g, dtype=Int32), bits)
        else:
            cute.arch.atomic_max(cute.recast_ptr(mAmax.iterator + g * per_group + j, dtype=Int32), bits)


# dprob: per-thread sums over the tile's columns of the thread's two rows (fragment index i is on row
# q8.row_of(i)), then a fixed-order quad sum at the end of the tile.

def fold_row_sum(row_sum: list, i: int, v) -> None:
    """row_sum[row of fragment index i] += v (trace time: one fp32 add)."""
    row_sum[q8.row_of(i)] = row_sum[q8.row_of(i)] + v


@cute.jit
def store_row_partials(row_sum: list, is_compute, lane, r0, mParts, m_tile, n_tile, tile_m: cutlass.Constexpr,
                       row0=None, rows=None):
    """The thread's two row sums -> quad sums (lanes 4q..4q+3 hold one row's columns; fixed shuffle order) ->
    mParts[n_tile, row] by the quad's first lane (rows r0, r0 + 8 of tile m_tile; tile lists: of the tile from
    row0, only its `rows` rows); zero tiles store 0."""
    for h in cutlass.range_constexpr(2):
        s = row_sum[h]
        if not is_compute:
            s = Float32(0.0)
        s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
        s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
        if const_expr(row0 is None):
            if lane % 4 == 0:
                mParts[n_tile, m_tile * tile_m + r0 + 8 * h] = s
        else:
            if (lane % 4 == 0) & (r0 + 8 * h < rows):
                mParts[n_tile, row0 + r0 + 8 * h] = s


# ---------------------------------------------------------------------------------------------- register stores
# A 16-bit output stored by its threads from registers in whole 32-byte sectors (4-byte pair stores write half
# sectors: a bf16 W so stored ran 2.2-2.6x slower, RESULTS run 176).

def adjacent_pairs(coords, what: str) -> list:
    """Trace time: the (row, column)s of one lane's subtile values (`coords`: its partition of the identity tensor),
    checked to come in pairs of adjacent columns of one row (values 2j, 2j + 1, as the wgmma accumulator layout
    holds them: loaded or stored as one); else NotImplementedError naming `what`."""
    at = [(int(coords[i][0]), int(coords[i][1])) for i in range(cute.size(coords.shape))]
    if any(at[i + 1] != (at[i][0], at[i][1] + 1) for i in range(0, len(at), 2)):
        raise NotImplementedError(f"{what}: values 2j, 2j + 1 are not adjacent columns of one row")
    return at


def row_pairs(r2s_d, epi_tile, what: str) -> list:
    """Trace time: per row of a thread's subtile values, the flat indices of its 4 pairs (values i, i + 1: adjacent
    columns, `adjacent_pairs`) ordered by column, checked from the static coordinates of lanes 0-3 (every quad
    alike): columns 2q + 8k (k = 0..3) of lane q. Else NotImplementedError naming `what`."""
    rows = None
    for lane in range(4):
        at = adjacent_pairs(r2s_d.get_slice(lane).partition_S(cute.make_identity_tensor(epi_tile)), what)
        by_row = {}
        for i in range(0, len(at), 2):
            by_row.setdefault(at[i][0], []).append(i)
        pairs = [sorted(ix, key=lambda i: at[i][1]) for _, ix in sorted(by_row.items())]
        if any([at[i][1] for i in ix] != [2 * lane + 8 * k for k in range(4)] for ix in pairs):
            raise NotImplementedError(f"{what}: a row's value pairs are not at columns 2q + 8k")
        if rows is not None and pairs != rows:
            raise NotImplementedError(f"{what}: the lanes of a quad differ in fragment layout")
        rows = pairs
    return rows


@cute.jit
def store_row_chunk(addr: Int64, words: list, q: Int32, store):
    """Lane q of a quad holds one row's 16-bit pairs at columns 2q + 8k (`words[k]`, k = 0..3); a 4 x 4 word
    transpose inside the quad (two butterfly rounds, each swapping the words whose index bit differs from the
    lane's) leaves it the row's columns 8q .. 8q + 7, stored at `addr` (that chunk's address) by one 16-byte store
    where `store`."""
    a = list(words)
    for bit in cutlass.range_constexpr(2):
        mine = (q & (1 << bit)) != 0
        lo = [k for k in range(4) if not k & (1 << bit)]     # word indices with the bit clear / set
        hi = [k + (1 << bit) for k in lo]
        # send the words whose bit differs from the lane's; receive the partner's into them
        got = [cute.arch.shuffle_sync_bfly(Int32(cutlass.select_(mine, a[lo[s]], a[hi[s]])), offset=1 << bit)
               for s in range(2)]
        for s in cutlass.range_constexpr(2):
            a[lo[s]] = Int32(cutlass.select_(mine, got[s], a[lo[s]]))
            a[hi[s]] = Int32(cutlass.select_(mine, a[hi[s]], got[s]))
    if store:
        st_global_v4(addr, a)
