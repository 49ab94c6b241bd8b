"""Device group offsets (docs/offsets.md): the sanitizer every backend applies and the row -> group map.

`padded_offsets` are device data, so they cannot be checked under jit; every backend reads the *sanitized* ends
instead, which is the identity for valid offsets and keeps any value in bounds. The reference computes with these
helpers and the lowering reduces the kernels' per-tile partial sums with them (kernels/sm90/operands.py), so both
sides share one definition. Pure jnp, jit-able.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .limits import GROUP_ALIGN


def sanitize_offsets(padded_offsets, m: int, align: int = GROUP_ALIGN):
    """(L,) int32 group ends: clip to [0, m], round down to a multiple of `align`, running max (docs/offsets.md)."""
    ends = jnp.clip(jnp.asarray(padded_offsets).astype(jnp.int32), 0, m)
    if align > 1:
        ends = (ends // align) * align
    return jax.lax.cummax(ends, axis=0)


def sanitize_token_offsets(offsets, total_tokens: int):
    """wgrad token ends: running_max(clip(offsets, 0, T)), no alignment (docs/offsets.md#wgrad-token-offsets)."""
    return sanitize_offsets(offsets, total_tokens, align=1)


def group_starts(ends):
    return jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])


def search_sorted(sorted_values, queries, side: str = "left"):
    """`jnp.searchsorted` as int32, without a device loop. Its default method is a while loop, which XLA:GPU runs
    with a host round trip per iteration: in the routed layer's step the ~15 iterations left the GPU idle ~0.5 ms
    (benchmarks/RESULTS.md, run 65). The unrolled binary search is log2(n) gathers that XLA fuses."""
    return jnp.searchsorted(sorted_values, queries, side=side, method="scan_unrolled").astype(jnp.int32)


def row_groups(ends, m: int):
    """(m,) int32 group id of each row, `min{g : end_g > row}`; L for rows outside every group."""
    return search_sorted(ends, jnp.arange(m, dtype=ends.dtype), side="right")
