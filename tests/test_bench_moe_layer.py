"""CPU checks of benchmarks/bench_moe_layer.py: its peer layer (ragged_dot with exact groups) has the same routing
semantics as ours -- same loss and gradients on a small config -- so the benchmark compares like with like."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_moe_layer as bench


def test_peer_layer_matches_ours(monkeypatch):
    monkeypatch.setitem(bench.CONFIGS, "tiny", (96, 64, 64, 4, 2))
    avals = bench._avals("tiny")
    x, router, w1, w2, dy = bench._inputs(avals, 0)
    ours_loss, ours_grads = jax.jit(bench.ours_step(2))(x, router, w1, w2, dy)
    peer_loss, peer_grads = jax.jit(bench.plain_step(2, jax.lax.ragged_dot))(x, router, w1, w2, dy)
    np.testing.assert_allclose(float(ours_loss), float(peer_loss), rtol=2e-2)
    for name, a, b in zip(("x", "router", "w1", "w2"), ours_grads, peer_grads):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a)) and np.abs(a).max() > 0, name
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert err < 3e-2, (name, err)   # bf16 rounding of h / y at different points


def test_useful_flops_counts_routed_rows_only():
    t, h, i, e, k = bench.CONFIGS["8e"]
    assert bench.useful_flops(t, h, i, k) == 18.0 * 8192 * 2 * 7168 * 2048


def test_padded_layout_step_matches_padding_free(monkeypatch):
    """`ours_pad256` (cuDNN's 256-padded layout, the same pieces) computes the same layer as `ours` (padding-free):
    the layouts differ in where rows sit, not in the math."""
    monkeypatch.setitem(bench.CONFIGS, "tiny", (96, 64, 64, 4, 2))
    x, router, w1, w2, dy = bench._inputs(bench._avals("tiny"), 1)
    free_loss, free_grads = jax.jit(bench.ours_step(2))(x, router, w1, w2, dy)
    pad_loss, pad_grads = jax.jit(bench.ours_step(2, 256))(x, router, w1, w2, dy)
    np.testing.assert_allclose(float(free_loss), float(pad_loss), rtol=1e-3)
    for name, a, b in zip(("x", "router", "w1", "w2"), free_grads, pad_grads):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), name


def test_routed_floor_counts_routed_rows():
    t, h, i, e, k = bench.CONFIGS["decode"]
    weights = e * 2 * i * h + e * h * i
    assert bench.routed_floor_bytes("decode") == 2 * (2 * (t * h + h * e + weights) + t * h + t * k * (2 * h + 3 * i))
