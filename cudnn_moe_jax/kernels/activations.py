"""Device functions of the activation table (cudnn_moe_jax/activations.py): CuTe DSL, fp32 values in and out.

One function per act_func name, with the entry's constants (its options, defaults filled in) as keywords:
  forward   `swiglu(gate, up, glu_limit)` -> act          `srelu(x, tanh_clamp_scale)` -> act
  backward  `dswiglu(gate, up, glu_limit)` -> (act, d act / d gate, d act / d up)
            `dsrelu(x, tanh_clamp_scale)` -> (act, d act / dx)
The epilogue recipes (kernels/epilogue.py) look them up with `functions(activation)`. They compute what the
reference's jnp functions compute (docs/activations.md), with approximate exp / reciprocal:

sigmoid uses ex2.approx + rcp.approx (relative error ~1e-7, far below bf16/fp16 rounding); tanh (sReLU clamp,
argument >= 0) is a degree-15 odd Taylor polynomial below 0.55 and 1 - 2/(e^2x + 1) above (relative error
< 3e-7 everywhere; tanh.approx.f32 would be ~5e-4, and libdevice's tanh spills next to a 128-register accumulator).
Clamped inputs pass no gradient; a value exactly at a bound passes it (inclusive bounds, as the reference).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from cudnn_moe_jax.activations import GEGLU_LIMIT, GEGLU_SCALE

LOG2_E = 1.4426950408889634


def functions(activation):
    """(forward value function, backward value-and-derivatives function) of a table entry."""
    found = globals().get(activation.name), globals().get(activation.derivative)
    if None in found:
        raise NotImplementedError(f"activation {activation.name!r} has no device functions in kernels/activations.py")
    return found


@cute.jit
def sigmoid(x: Float32) -> Float32:
    return cute.arch.rcp_approx(Float32(1.0) + cute.math.exp2(x * Float32(-LOG2_E), fastmath=True))


# odd Taylor coefficients of tanh through x^15 (alternating series: error < 5e-8 relative for x <= 0.55)
_TANH_TAYLOR = (1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835, -1382.0 / 155925, 21844.0 / 6081075,
                -929569.0 / 638512875)
TANH_SPLIT = 0.55


@cute.jit
def tanh_nonneg(x: Float32) -> Float32:
    """tanh(x) for x >= 0 (or +inf), few registers, relative error < 3e-7."""
    x2 = x * x
    p = Float32(_TANH_TAYLOR[-1])
    for i in cutlass.range_constexpr(len(_TANH_TAYLOR) - 1):
        p = p * x2 + Float32(_TANH_TAYLOR[-2 - i])
    small = p * x
    e = cute.math.exp2(x * Float32(2.0 * LOG2_E), fastmath=True)
    large = Float32(1.0) - Float32(2.0) * cute.arch.rcp_approx(e + Float32(1.0))
    return Float32(cutlass.select_(x < Float32(TANH_SPLIT), small, large))


@cute.jit
def relu(x: Float32) -> Float32:
    # fmax is NaN-quiet: relu(NaN) = 0, as the spec's where(x > 0, x, 0)
    return cute.arch.fmax(x, Float32(0.0))


# ---------------------------------------------------------------------------------------------------------------
# sigmoid GLUs: act(g, u) = lin(u') * g' * sigmoid(k g'), lin(u') = u' or u' + 1, g' and u' clamped to
# bounds = (gate_lo, gate_hi, up_lo, up_hi) (None: unbounded)


def _both_sides(limit):
    return (None,) * 4 if limit is None else (-limit, limit, -limit, limit)


# The clamps propagate NaN (min.NaN / max.NaN), as the reference's jnp.minimum / jnp.maximum: the plain PTX min /
# max return the other operand, so a NaN gate or up became the bound and D finite where the reference has NaN.


@cute.jit
def _clamped(x: Float32, lo, hi) -> Float32:
    if const_expr(hi is not None):
        x = cute.arch.fmin(x, Float32(hi), nan=True)
    if const_expr(lo is not None):
        x = cute.arch.fmax(x, Float32(lo), nan=True)
    return x


@cute.jit
def _clamp_pass(x: Float32, lo, hi):
    """(clamped x, 1.0 where the gradient passes (inclusive bounds) else 0.0; a NaN x: NaN, 0.0)."""
    y = x
    ok = Float32(1.0)
    if const_expr(lo is not None):
        ok = Float32(cutlass.select_(x >= Float32(lo), ok, Float32(0.0)))
        y = cute.arch.fmax(y, Float32(lo), nan=True)
    if const_expr(hi is not None):
        ok = Float32(cutlass.select_(x <= Float32(hi), ok, Float32(0.0)))
        y = cute.arch.fmin(y, Float32(hi), nan=True)
    return y, ok


@cute.jit
def _passed(ok: Float32, d: Float32) -> Float32:
    """d where the gradient passes, else 0 -- selected, as the reference's jnp.where (0 * NaN would be NaN)."""
    return Float32(cutlass.select_(ok != Float32(0.0), d, Float32(0.0)))


@cute.jit
def _sigmoid_of(g: Float32, k) -> Float32:
    s = Float32(0.0)
    if const_expr(k == 1.0):
        s = sigmoid(g)
    else:
        s = sigmoid(g * Float32(k))
    return s


@cute.jit
def _sigmoid_glu(gate: Float32, up: Float32, k, plus_one, bounds) -> Float32:
    glo, ghi, ulo, uhi = bounds
    g = _clamped(gate, glo, ghi)
    u = _clamped(up, ulo, uhi)
    lin = u
    if const_expr(plus_one):
        lin = u + Float32(1.0)
    return lin * (g * _sigmoid_of(g, k))


@cute.jit
def _sigmoid_glu_grad(gate: Float32, up: Float32, k, plus_one, bounds):
    """(act, d act / d gate = lin * s * (1 + k g' (1 - s)), d act / d up = g' s); s = sigmoid(k g')."""
    glo, ghi, ulo, uhi = bounds
    g, g_ok = _clamp_pass(gate, glo, ghi)
    u, u_ok = _clamp_pass(up, ulo, uhi)
    lin = u
    if const_expr(plus_one):
        lin = u + Float32(1.0)
    sig = _sigmoid_of(g, k)
    gact = g * sig
    value = lin * gact
    d_gate = _passed(g_ok, lin * sig * (Float32(1.0) + Float32(k) * g * (Float32(1.0) - sig)))
    d_up = _passed(u_ok, gact)
    return value, d_gate, d_up


def _geglu_bounds(glu_limit):
    return _both_sides(glu_limit) if glu_limit is not None else (None, GEGLU_LIMIT, -GEGLU_LIMIT, GEGLU_LIMIT)


def _gpt_oss_bounds(glu_limit):
    return (None, glu_limit, -glu_limit, glu_limit)


@cute.jit
def swiglu(gate: Float32, up: Float32, glu_limit=None) -> Float32:
    return _sigmoid_glu(gate, up, 1.0, False, _both_sides(glu_limit))


@cute.jit
def dswiglu(gate: Float32, up: Float32, glu_limit=None):
    return _sigmoid_glu_grad(gate, up, 1.0, False, _both_sides(glu_limit))


@cute.jit
def geglu(gate: Float32, up: Float32, glu_limit=None) -> Float32:
    return _sigmoid_glu(gate, up, GEGLU_SCALE, True, _geglu_bounds(glu_limit))


@cute.jit
def dgeglu(gate: Float32, up: Float32, glu_limit=None):
    return _sigmoid_glu_grad(gate, up, GEGLU_SCALE, True, _geglu_bounds(glu_limit))


@cute.jit
def gpt_oss_swiglu(gate: Float32, up: Float32, glu_alpha, glu_limit) -> Float32:
    return _sigmoid_glu(gate, up, glu_alpha, True, _gpt_oss_bounds(glu_limit))


@cute.jit
def dgpt_oss_swiglu(gate: Float32, up: Float32, glu_alpha, glu_limit):
    return _sigmoid_glu_grad(gate, up, glu_alpha, True, _gpt_oss_bounds(glu_limit))


# ---------------------------------------------------------------------------------------------------------------
# squared ReLU


@cute.jit
def srelu(x: Float32, tanh_clamp_scale=None) -> Float32:
    r = relu(x)
    if const_expr(tanh_clamp_scale is not None):
        s = Float32(tanh_clamp_scale)
        r = s * tanh_nonneg(r * Float32(1.0 / tanh_clamp_scale))
    return r * r


@cute.jit
def dsrelu(x: Float32, tanh_clamp_scale=None):
    """(relu(x)^2 or its tanh-clamped form, d/dx of it); the clamped form's 1 - t^2 = 4e / (1 + e)^2,
    e = exp(-2u) (no cancellation as t -> 1)."""
    r = relu(x)
    value = r * r
    dvalue = Float32(2.0) * r
    if const_expr(tanh_clamp_scale is not None):
        s = Float32(tanh_clamp_scale)
        u = r * Float32(1.0 / tanh_clamp_scale)
        st = s * cute.arch.fmin(tanh_nonneg(u), Float32(1.0))
        value = st * st
        e = cute.math.exp2(u * Float32(-2.0 * LOG2_E), fastmath=True)
        one_e = Float32(1.0) + e
        dvalue = Float32(2.0) * st * (Float32(4.0) * e * cute.arch.rcp_approx(one_e * one_e))
        dvalue = Float32(cutlass.select_(x > Float32(0.0), dvalue, Float32(0.0)))
    return value, dvalue
