"""Discrete per-expert weights (cuDNN's `b_ptrs` / `sfb_ptrs`; `b_tensors=[...]` in JAX) for the M-grouped kernels.

Each expert's B (N, K) -- and, block-scaled, its SFB -- is its own XLA buffer, one launcher operand each. The kernel
reads expert e's through its own TMA descriptor, taken from a device table that the custom call builds before the
GEMM, from the operands themselves (no host sync, no copy into a stacked array):

  launcher   one TMA atom per weight operand from expert 0's buffer, exactly as the stacked layout's (B seen as
             (N, K, 1)): the template. Every expert shares its shape, strides and box.
  build      a one-CTA kernel launched first on the same stream (`build_table`): thread 0 stores the experts' base
             addresses (kernel parameters) into the table; then each thread copies the template of an (operand,
             expert) pair into its 128-byte slot and replaces its global address (`tensormap.replace`), and fences
             the writes for the tensormap proxy (`fence.proxy.tensormap::generic.release.gpu`).
  GEMM       the producer, per tile, acquires the tile's expert's descriptors
             (`fence.proxy.tensormap::generic.acquire.gpu`), prefetches them (`prefetch.tensormap`, so the fetch
             overlaps its wait for a free stage) and issues the tile's B / SFB loads through them (`tma_desc_ptr`) at
             the stacked layout's coordinates with the expert index 0. Multicast is unchanged: a 256-row cluster
             block never straddles two experts, so both CTAs of a cluster use the same descriptor.

The table lives in the launch-only workspace `expert_descriptors` (operands.WORKSPACES): the descriptors (128 bytes,
operand-major: slot d * L + e; XLA buffers are 256-byte aligned, cutlass_call's assumption too), then the experts'
base addresses (8 bytes each, same order).

Cost: one extra launch of a 1-CTA kernel (L or 2L descriptors, ~one 128-byte copy + one replace each, plus L or
2L parameter-to-table stores by one thread) serialized before the GEMM on the stream; per tile one acquire fence
and one prefetch per descriptor in the producer warp (the loads then go through a descriptor in global memory
instead of the kernel parameter: the TMA unit caches it; the acquire compiles to `UTMACCTL.IV`, an invalidation of
that cache entry, the prefetch to `UTMACCTL.PF`). The mainloop, consumers and epilogue are the stacked kernel's
code (the same HGMMA count: tests/test_discrete_weights.py). The build kernel takes 8 bytes of parameters per
expert and operand (L = 1024 block-scaled: 16 KiB of the 32 KiB parameter limit; compiled, not run).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode

from cudnn_moe_jax.operands import TMA_DESCRIPTOR_BYTES

BUILD_THREADS = 256
STATIC_CHUNK = 64
TEMPLATE_BYTES = 64   # what `cpasync.copy_tensormap` copies of a kernel-parameter descriptor
_TENSORMAPS = TensorMapManager(TensorMapUpdateMode.GMEM, TMA_DESCRIPTOR_BYTES)


class ExpertDescriptors(NamedTuple):
    """The TMA descriptors of one tile's expert (global-memory tensormap pointers): B's and SFB's (None without
    scale factors). What `load_tile` takes as `descriptors`."""

    b: Any
    sfb: Any


def b_view(b: cute.Tensor) -> cute.Tensor:
    """One expert's B (N, K) as the stacked layout's (N, K, L) with L = 1 (K-major or N-major strides kept)."""
    (n, k), (s_n, s_k) = b.shape, b.stride
    return cute.make_tensor(b.iterator, cute.make_layout((n, k, 1), stride=(s_n, s_k, n * k)))


def templates(t: dict, num_groups: int) -> tuple[dict, tuple]:
    """(t with "b" / "sfb" set to expert 0's buffers in the stacked layout's form (the templates the launcher makes
    its TMA atoms from), ((B of each expert), (SFB of each expert) or None))."""
    experts = (tuple(t[f"b:{e}"] for e in range(num_groups)),
               tuple(t[f"sfb:{e}"] for e in range(num_groups)) if t.get("sfb:0") is not None else None)
    t = dict(t, b=b_view(experts[0][0]), sfb=None if experts[1] is None else experts[1][0])
    return t, experts


class DescriptorTable:
    """The `expert_descriptors` workspace of an L-expert problem with `operands` weight operands (B; SFB)."""

    def __init__(self, num_groups: int, operands: int):
        self.num_groups, self.operands = num_groups, operands

    def slot(self, base, operand: int, e):
        """First byte of (operand, expert e)'s descriptor."""
        return base + (operand * self.num_groups + e) * TMA_DESCRIPTOR_BYTES

    def descriptor(self, base, operand: int, e, space=cute.AddressSpace.gmem):
        """Tensormap pointer of (operand, expert e)'s descriptor (generic: what a TMA copy takes)."""
        return _TENSORMAPS.get_tensormap_ptr(self.slot(base, operand, e), space)

    def addresses(self, base) -> cute.Tensor:
        """The experts' base addresses, Int64 (operands * L,)."""
        n = self.operands * self.num_groups
        return cute.make_tensor(cute.recast_ptr(base + n * TMA_DESCRIPTOR_BYTES, dtype=Int64), cute.make_layout(n))

    @cute.jit
    def acquire(self, workspace: cute.Tensor, e) -> ExpertDescriptors:
        """Expert e's descriptors for this thread's TMA loads: acquired from the generic-proxy writes of the build
        kernel and prefetched. Called by every lane of the producer warp (the issuing lane is elected later)."""
        base = workspace.iterator
        descs = [None, None]
        for d in cutlass.range_constexpr(self.operands):
            descs[d] = self.descriptor(base, d, e, cute.AddressSpace.generic)
            cpasync.fence_tma_desc_acquire(descs[d])
            prefetch_tensormap(descs[d])
        return ExpertDescriptors(descs[0], descs[1])

    @cute.kernel
    def build_table(self, atoms: tuple, experts: tuple, workspace: cute.Tensor):
        """The table: expert e's descriptor of operand d is atom d's with the global address of `experts[d][e]`.
        One CTA of BUILD_THREADS threads, a descriptor per thread (`cpasync.update_tma_descriptor` is not used: it
        rewrites shape and strides too, from one elected lane of the warp)."""
        tidx, _, _ = cute.arch.thread_idx()
        base = workspace.iterator
        addresses = self.addresses(base)
        L = self.num_groups
        if tidx == 0:   # the experts' addresses are kernel parameters: constant indices only (static loops of
            # at most STATIC_CHUNK iterations: the DSL warns about longer ones; the code is the same)
            for d in cutlass.range_constexpr(self.operands):
                for e0 in cutlass.range_constexpr(0, L, STATIC_CHUNK):
                    for e in cutlass.range_constexpr(e0, min(e0 + STATIC_CHUNK, L)):
                        addresses[d * L + e] = experts[d][e].iterator.toint()
        cute.arch.sync_threads()
        for d in cutlass.range_constexpr(self.operands):
            for e in cutlass.range(tidx, L, BUILD_THREADS, unroll=1):
                # the bytes past those `copy_tensormap` copies are zeroed (as Triton's device-built descriptors
                # are), not left as the uninitialised workspace's
                words = cute.make_tensor(cute.recast_ptr(self.slot(base, d, e), dtype=Int64),
                                         cute.make_layout(TMA_DESCRIPTOR_BYTES // 8))
                for i in cutlass.range_constexpr(TEMPLATE_BYTES // 8, TMA_DESCRIPTOR_BYTES // 8):
                    words[i] = Int64(0)
                desc = self.descriptor(base, d, e)
                cpasync.copy_tensormap(atoms[d], desc)
                replace_global_address(desc, addresses[d * L + e])
        cpasync.fence_tma_desc_release()


@cute.jit
def replace_global_address(desc, address: Int64) -> None:
    """`tensormap.replace.tile.global_address` of a descriptor in global memory, by this thread."""
    llvm.inline_asm(None, [desc.toint().ir_value(), Int64(address).ir_value()],
                    "tensormap.replace.tile.global_address.global.b1024.b64 [$0], $1;", "l,l", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def prefetch_tensormap(desc) -> None:
    """`prefetch.tensormap` of a descriptor in global memory (generic address)."""
    llvm.inline_asm(None, [desc.toint().ir_value()], "prefetch.tensormap [$0];", "l", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
