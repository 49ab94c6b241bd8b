"""The README's flows run as written: examples/moe_layer.py on the CPU reference, with batched (B, S, H) tokens and
W1 / b1 converted from a checkpoint's [gate; up] halves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax

from cudnn_moe_jax import nn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe_layer.py"


def _example():
    spec = importlib.util.spec_from_file_location("moe_layer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moe_layer_example_batched_with_checkpoint_gate_up_halves(capsys):
    example = _example()
    small = ["--batch", "2", "--tokens", "64", "--experts", "4", "--hidden", "64", "--intermediate", "64", "--bias"]
    argv = small + ["--gate-up-halves", "--steps", "0"]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "x (2, 64, 64) bfloat16 -> y (2, 64, 64) bfloat16" in out and "grad w1" in out
    # the interleave the example applies is undone exactly on the way back
    params = example.init_params(jax.random.PRNGKey(0), example.parse_args(argv))
    halves = example.init_params(jax.random.PRNGKey(0), example.parse_args(small))
    assert (nn.deinterleave_glu_weights(params["w1"]) == halves["w1"]).all()
    assert (nn.deinterleave_glu_weights(params["b1"]) == halves["b1"]).all()
