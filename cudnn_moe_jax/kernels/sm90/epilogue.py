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
      store warp: stores(step, buf, state)     (TMA atom, smem buffer, global tile) of each subtile; commit
      after_store(step, state)                 (dgrad: the dbias column partials)
  end(state)                                   per-tile reductions to global (amax atomics, dprob partials)

`writes` and `stores` are generators: each entry's views (and the global tile's coordinate arithmetic) are built
when the driver asks for it, right before its copy, so the emitted operations come in the order of the former
hand-written loops (kept because the acceptance test of this structure is byte-identical SASS).

`setup` is the consumer's `gemm.EpilogueSetup` (built once per kernel), `ctx` the tile's `gemm.TileContext`. A mixin
of the kernel classes' shared body (`gemm.GroupedGemmSm90Base`), traced inside the consumer warpgroups' tile loop.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .. import quantize as q8
from ..epilogue import abs_bits, warp_max_i32


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
            if is_store_warp:
                for tma_atom, smem_src, gmem_dst in stores:
                    cute.copy(tma_atom, smem_src, gmem_dst)
                store_pipeline.producer_commit()
            hooks.after_store(step, state)
        hooks.end(state)


# ---------------------------------------------------------------------------------------------- reductions
# amax per group: max |x| over the output, reduced per thread -> per warp -> one atomicMax per warp and tile on the
# bit patterns (non-negative floats order like their bits; exact, so independent of the atomics' order).

@cute.jit
def fold_amax(bits: Int32, v: Float32) -> Int32:
    """The thread's amax bits with value v folded in."""
    return cutlass.max(bits, abs_bits(v))


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
def store_row_partials(row_sum: list, is_compute, lane, r0, mParts, m_tile, n_tile, tile_m: cutlass.Constexpr):
    """The thread's two row sums -> quad sums (lanes 4q..4q+3 hold one row's columns; fixed shuffle order) ->
    mParts[n_tile, row] by the quad's first lane (rows r0, r0 + 8 of tile m_tile); zero tiles store 0."""
    for h in cutlass.range_constexpr(2):
        s = row_sum[h]
        if not is_compute:
            s = Float32(0.0)
        s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
        s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
        if lane % 4 == 0:
            mParts[n_tile, m_tile * tile_m + r0 + 8 * h] = s
