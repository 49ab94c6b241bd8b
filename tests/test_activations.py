"""The activation table (cudnn_moe_jax/activations.py): every entry has its functions in every layer (jnp reference,
float64 oracle, device code), every oracle refuses a name it does not know, option defaults and output scales, and
the derivatives at the clamp bounds (docs/activations.md: a value exactly at a bound passes the gradient, one step
beyond passes none) -- the reference against the oracle on exactly representable inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from cudnn_moe_jax import activations
from cudnn_moe_jax.reference import glu_split
from lab.sass import require_compiler

import nn_grads_checks
import np_ops as O


def test_every_entry_is_in_the_oracle_and_the_names_pair():
    assert sorted(O.NP_ACTIVATIONS) == sorted(activations.TABLE)
    for name, entry in activations.TABLE.items():
        assert entry.derivative == "d" + name and activations.get(entry.derivative) is entry
        assert callable(entry.reference)
        assert all(isinstance(opt, activations.Option) for opt in entry.options.values())


def test_every_entry_has_device_functions():
    require_compiler()   # cutlass imported for sm_90a (CUTE_DSL_ARCH is read once, at its first import), or skip
    from cudnn_moe_jax.kernels import activations as device

    for entry in activations.TABLE.values():
        fwd, bwd = device.functions(entry)
        assert callable(fwd) and callable(bwd)


@pytest.mark.parametrize("oracle", [
    lambda: O.np_glu("gelu"),
    lambda: O.grouped_gemm_dglu(*([None] * 9), ab_dtype="bfloat16", d_dtype="bfloat16", act_func="dgelu"),
    lambda: O.np_glu_value(jnp.ones((2, 32)), jnp.ones((2, 32)), "relu", {}, xp=jnp),  # test_reference's autodiff
    lambda: nn_grads_checks._act("gelu", jnp.ones((2, 64))),
], ids=["np_ops", "np_ops_dglu", "np_ops_jnp", "nn_grads_checks"])
def test_oracles_raise_on_an_unknown_name(oracle):
    with pytest.raises(ValueError, match="knows no GLU activation"):
        oracle()


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="act_func='gelu' is not an activation"):
        activations.get("gelu")


def test_option_defaults_and_output_scale():
    gpt = activations.TABLE["gpt_oss_swiglu"]
    assert gpt.constants({}) == {"glu_alpha": 1.702, "glu_limit": 7.0}
    assert gpt.constants(dict(glu_alpha=1.0, glu_limit=3.0)) == {"glu_alpha": 1.0, "glu_limit": 3.0}
    assert gpt.output_scale(dict(glu_alpha=1.0)) is None                  # alpha is the sigmoid's, not a scale
    swi = activations.TABLE["swiglu"]
    assert swi.constants(dict(glu_alpha=2.0)) == {"glu_limit": None} and swi.output_scale(dict(glu_alpha=2.0)) == 2.0
    assert activations.TABLE["srelu"].constants({}) == {"tanh_clamp_scale": None}


def _f32_steps(v):
    """v and its float32 neighbours."""
    v = np.float32(v)
    return [np.nextafter(v, np.float32(-np.inf)), v, np.nextafter(v, np.float32(np.inf))]


@pytest.mark.parametrize("act, options", [
    ("gpt_oss_swiglu", {}), ("gpt_oss_swiglu", dict(glu_limit=2.5, glu_alpha=1.1)), ("geglu", {}),
    ("geglu", dict(glu_limit=2.5)), ("swiglu", dict(glu_limit=2.5))])
def test_glu_derivatives_at_the_clamp_bounds(act, options):
    entry = activations.TABLE[act]
    lim = options.get("glu_limit", 7.0)
    edges = [x for v in (lim, -lim) for x in _f32_steps(v)]
    rng = np.random.default_rng(0)
    # every (gate, up) pair of edge values and random values around them
    values = np.array(edges + list(rng.uniform(-1.5 * lim, 1.5 * lim, 10)), np.float32)
    gate, up = (g.ravel() for g in np.meshgrid(values, values))
    value, d_gate, d_up = (np.asarray(t, np.float64) for t in entry.reference(
        jnp.asarray(gate), jnp.asarray(up), **entry.constants(options), grad=True))
    g64, u64 = gate.astype(np.float64), up.astype(np.float64)
    want_dg, want_du = O.np_glu_derivatives(g64, u64, act, options)
    want_v = O.np_glu_value(g64, u64, act, options)
    # the pass-through masks agree exactly (no tolerance at a bound), the values to fp32 rounding
    assert np.array_equal(d_gate == 0, want_dg == 0) and np.array_equal(d_up == 0, want_du == 0)
    for got, want in ((value, want_v), (d_gate, want_dg), (d_up, want_du)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    # the documented rule, spelled out: at gate == limit and |up| == limit the gradient flows, one step beyond not
    above_lim, below_lim = _f32_steps(lim)[2], _f32_steps(-lim)[0]
    gate = jnp.asarray([lim, above_lim, -lim, below_lim, 1.0, 1.0, 1.0, 1.0], jnp.float32)
    up = jnp.asarray([0.5, 0.5, 0.5, 0.5, lim, -lim, above_lim, below_lim], jnp.float32)
    _, d_gate, d_up = (np.asarray(t) for t in entry.reference(gate, up, **entry.constants(options), grad=True))
    assert d_gate[0] != 0 and d_gate[1] == 0 and d_gate[2] != 0
    assert d_up[4] != 0 and d_up[5] != 0 and d_up[6] == 0 and d_up[7] == 0
    one_sided = act == "gpt_oss_swiglu" or (act == "geglu" and "glu_limit" not in options)
    assert (d_gate[3] != 0) == one_sided      # the gate's lower clamp: none for GPT-OSS and cuDNN's GeGLU default


def test_gpt_oss_swiglu_is_the_published_formula():
    """out = (up + 1) * g * sigmoid(alpha * g), g = min(gate, limit), up = clip(up, -limit, limit), written out
    here (GPT-OSS's reference), on the interleaved layout of the reference op."""
    rng = np.random.default_rng(1)
    c = rng.uniform(-10, 10, (8, 128)).astype(np.float32)
    gate, up = (np.asarray(t, np.float64) for t in glu_split(jnp.asarray(c)))
    g = np.minimum(gate, 7.0)
    want = (np.clip(up, -7.0, 7.0) + 1.0) * g / (1.0 + np.exp(-1.702 * g))
    got = activations.TABLE["gpt_oss_swiglu"].reference(*glu_split(jnp.asarray(c)), glu_alpha=1.702, glu_limit=7.0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-6, atol=1e-6)
