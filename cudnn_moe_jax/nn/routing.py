"""Token routing for the MoE layer: the permutation of (token, choice) pairs into contiguous expert groups and
back (the router that chooses them is `nn.router`).

The groups are 64-row aligned by default (`M_ALIGNED = 64`): expert e's r assignments take r rows rounded up to a
multiple of 64, so the permuted buffer holds the T*k routed rows plus at most 63 padding rows per expert, and every
gather, residual and expert GEMM scales with the routed rows. 64 is measured (benchmarks/RESULTS.md, run 50): the
whole layer's step is faster than with 256-row groups (cuDNN's layout, the buffer sized for 255 padding rows per
expert) on every benchmark config and much faster than padding-free groups (`m_aligned=1`), whose expert token
ranges start inside the weight-gradient kernel's 64-token k-tiles. The fused ops take any power of two
(`m_aligned`, docs/offsets.md#group-alignment); every function here takes it too.

Everything here is plain jnp (differentiable by JAX): gradients reach the router through `prob`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..limits import TOKEN_ALIGN
from ..offsets import search_sorted

# The group alignment of the layers' permuted rows (measured: the module docstring).
M_ALIGNED = 64


class Routing(NamedTuple):
    """Where each (token, choice) went. Shapes use m = `permuted_rows(T, k, L, m_aligned)` (static under jit)."""

    padded_offsets: jax.Array  # (L,) int32 exclusive group ends, multiples of m_aligned
    row_token: jax.Array       # (m,) int32 source token of each permuted row; T for padding rows
    dest_row: jax.Array        # (T, k) int32 permuted row of each (token, choice)


def permuted_rows(num_tokens: int, top_k: int, num_experts: int, m_aligned: int = M_ALIGNED) -> int:
    """Static row count that holds any routing: the T*k routed rows plus, per expert, the worst-case padding to a
    multiple of m_aligned, rounded up to a multiple of m_aligned and of 8 (the wgrad ops' token count)."""
    unit = max(m_aligned, TOKEN_ALIGN)
    return -(-(num_tokens * top_k + num_experts * (m_aligned - 1)) // unit) * unit


# rank_in_group's one-hot cumsum holds P x G int32; above this many elements (256 MiB) it ranks through a sort.
RANK_BY_COUNTING_MAX = 1 << 26


def rank_in_group(ids: jax.Array, num_groups: int):
    """For ids (P,) in [0, G): (rank (P,) int32 of each entry among the entries of its id, in entry order; counts
    (G,) int32). A cumsum of one-hot rows, no sort: on the H200 6.8 / 7.4 / 21 us at the layer benchmark's 8 / 64 /
    128-expert routings against 62-182 us for the stable argsort, its gather, the per-expert search and the inverse
    scatter (`python -m lab.bench_routing`, benchmarks/RESULTS.md run 68). Its temporary is P x G int32 (128 MiB at
    262144 pairs x 128 experts; the layer step's peak memory did not grow, run 69); past RANK_BY_COUNTING_MAX
    elements the same ranks come from the stable sort."""
    ids = ids.astype(jnp.int32)
    if ids.shape[0] * num_groups > RANK_BY_COUNTING_MAX:
        return rank_by_sort(ids, num_groups)
    one_hot = (ids[:, None] == jnp.arange(num_groups, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    running = jnp.cumsum(one_hot, axis=0)
    rank = jnp.take_along_axis(running, ids[:, None], axis=1)[:, 0] - 1
    return rank, running[-1]


def rank_by_sort(ids: jax.Array, num_groups: int):
    """`rank_in_group` through a stable argsort of the ids, a search per group and the inverse scatter (any size)."""
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    sorted_ids = ids[order]
    first = search_sorted(sorted_ids, jnp.arange(num_groups, dtype=jnp.int32))
    counts = jnp.diff(first, append=jnp.full((1,), ids.shape[0], jnp.int32))
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(ids.shape[0], dtype=jnp.int32) - first[sorted_ids],
                                               unique_indices=True)
    return rank, counts


def route(experts: jax.Array, num_experts: int, m_aligned: int = M_ALIGNED) -> Routing:
    """Assign every (token, choice) a row in the expert-sorted layout, each group padded to a multiple of
    m_aligned, token order kept inside a group (experts: (T, k) ids in [0, L))."""
    num_tokens, top_k = experts.shape
    m = permuted_rows(num_tokens, top_k, num_experts, m_aligned)
    flat_expert = experts.reshape(-1)
    pairs = flat_expert.shape[0]
    rank, counts = rank_in_group(flat_expert, num_experts)
    padded = (counts + m_aligned - 1) // m_aligned * m_aligned
    padded_offsets = jnp.cumsum(padded).astype(jnp.int32)
    dest = (padded_offsets - padded)[flat_expert] + rank
    row_token = jnp.full((m,), num_tokens, jnp.int32).at[dest].set(
        jnp.arange(pairs, dtype=jnp.int32) // top_k, unique_indices=True)
    return Routing(padded_offsets, row_token, dest.reshape(num_tokens, top_k))


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[index] row by row; an index past the last row (the routing's padding marker) gives a zero row."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def sum_rows(y: jax.Array, groups: jax.Array) -> jax.Array:
    """out[t] = sum_j y[groups[t, j]], added in fp32 in choice order and rounded once to y's dtype."""
    picked = take_rows(y, groups).astype(jnp.float32)
    out = picked[:, 0]
    for j in range(1, picked.shape[1]):
        out = out + picked[:, j]
    return out.astype(y.dtype)


# Both directions of the permutation are gathers, so neither the forward nor the backward scatters: the autodiff
# transpose of a row gather is a scatter-add, whose colliding rows (a token's k copies, every padding row) XLA
# resolves with atomics -- slow, and for k > 2 order-dependent. Each map's inverse is known (dest_row <->
# row_token), so the gradient is written as the gather through the inverse map.
@jax.custom_vjp
def gather_rows(x, row_token, dest_row):
    """x[row_token] (zero rows where row_token == len(x)); `dest_row` (len(x), k) lists the rows that copy each x
    row (an index past the output's rows where a copy does not exist), so the gradient is a gather-sum."""
    return take_rows(x, row_token)


def gather_rows_fwd(x, row_token, dest_row):
    return take_rows(x, row_token), dest_row


def gather_rows_bwd(dest_row, g):
    return sum_rows(g, dest_row), None, None   # the routing maps are integer data: no cotangent


gather_rows.defvjp(gather_rows_fwd, gather_rows_bwd)


@jax.custom_vjp
def combine_rows(y_perm, dest_row, row_token):
    """out[t] = sum_j y_perm[dest_row[t, j]] (`sum_rows`); `row_token` (len(y_perm),) is the out row each y_perm
    row feeds (len(out) for none), so the gradient is a gather."""
    return sum_rows(y_perm, dest_row)


def combine_rows_fwd(y_perm, dest_row, row_token):
    return sum_rows(y_perm, dest_row), row_token


def combine_rows_bwd(row_token, g):
    return take_rows(g, row_token), None, None   # padding rows (row_token == T) get zeros


combine_rows.defvjp(combine_rows_fwd, combine_rows_bwd)


def permuted_prob(weights: jax.Array, routing: Routing) -> jax.Array:
    """Gate weights (T, k) -> per permuted row prob (m,) f32; padding rows 0."""
    m = routing.row_token.shape[0]
    return jnp.zeros((m,), jnp.float32).at[routing.dest_row.reshape(-1)].set(weights.reshape(-1))


def permute(x: jax.Array, weights: jax.Array, routing: Routing):
    """Tokens (T, H) and gate weights (T, k) -> permuted rows (m, H) and per-row prob (m,); padding rows are 0."""
    return gather_rows(x, routing.row_token, routing.dest_row), permuted_prob(weights, routing)


def unpermute(y_perm: jax.Array, routing: Routing, num_tokens: int) -> jax.Array:
    """Permuted rows (m, H) -> tokens (T, H): each token's k expert outputs added in fp32 (choice order), rounded
    once to y_perm's dtype."""
    if routing.dest_row.shape[0] != num_tokens:
        raise ValueError(f"unpermute: the routing has {routing.dest_row.shape[0]} tokens, num_tokens={num_tokens}")
    return combine_rows(y_perm, routing.dest_row, routing.row_token)
