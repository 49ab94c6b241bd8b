"""Epilogue device functions, composed per problem (one recipe object per compiled variant).

Semantics (docs/ops.md, docs/activations.md, docs/ops.md#amax; fp32 math on the fp32 accumulator, RNE output conversion):

=========  ===================================  ==========================================================
op         C (pre-activation, stored if c)      D
=========  ===================================  ==========================================================
quant      (none)                               prob*alpha*acc;  with bias: alpha*acc + prob*bias
srelu      alpha*acc (+ bias)                   prob * relu(C)^2;  tanh_clamp_scale s: prob*(s*tanh(relu(C)/s))^2
glu        alpha*acc (+ bias), interleaved      prob * glu_alpha * act(gate, up); gate = even 32-col block of C,
                                                up = the following odd block; swiglu: up*gate*sigmoid(gate);
                                                geglu: (u'+1)*g'*sigmoid(1.702 g'), g' = min(gate, 7),
                                                u' = clamp(up, -7, 7); glu_limit L replaces both clamps by +-L
=========  ===================================  ==========================================================

amax (per group, docs/ops.md#amax): max |D| in fp32 before conversion, merged as a max over the *bit patterns* of |D|
(non-negative floats order like their bits, and a NaN (0x7fc00000 after abs) beats +inf, so NaN wins as the
spec asks). The kernel reduces per thread -> per warp, then one `atomicMax` per warp and tile; the result does
not depend on the order of the atomics (max is exact), so it is deterministic.

sigmoid uses ex2.approx + rcp.approx (relative error ~1e-7, far below bf16/fp16 rounding); tanh (sReLU clamp,
argument >= 0) is a degree-15 odd Taylor polynomial below 0.55 and 1 - 2/(e^2x + 1) above (relative error
< 3e-7 everywhere; tanh.approx.f32 would be ~5e-4, and libdevice's tanh spills next to a 128-register accumulator).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cudnn_moe_jax import activations

LOG2_E = 1.4426950408889634
GEGLU_SCALE = 1.702
GEGLU_DEFAULT_LIMIT = 7.0


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


class EpilogueRecipe:
    """Static recipe of one problem's epilogue + the scalar device functions it composes.

    The kernel calls `c_value` / `d_value` / `d_glu` per accumulator element (unrolled); everything that is not
    used by this problem is never traced.
    """

    def __init__(self, problem):
        epi = problem.epilogue
        self.op = problem.op
        self.act = None if epi.act is None else activations.get(epi.act, "act").name  # unknown: ValueError
        self.is_glu = problem.op == "glu"
        self.has_bias = epi.has_bias
        self.has_prob = epi.has_prob
        self.has_c = epi.c_dtype is not None and problem.op != "quant"
        self.compute_amax = epi.compute_amax
        self.glu_limit = epi.glu_limit
        self.glu_alpha = epi.glu_alpha
        self.tanh_clamp_scale = epi.tanh_clamp_scale

    # C (pre-activation) ------------------------------------------------------------------------
    @cute.jit
    def c_value(self, acc: Float32, alpha: Float32, bias: Float32) -> Float32:
        c = alpha * acc
        if const_expr(self.has_bias):
            c = c + bias
        return c

    # D for quant / srelu ----------------------------------------------------------------------
    @cute.jit
    def d_value(self, acc: Float32, c: Float32, alpha: Float32, prob: Float32, bias: Float32) -> Float32:
        d = Float32(0.0)
        if const_expr(self.op == "quant"):
            if const_expr(self.has_bias):
                d = alpha * acc + prob * bias
            else:
                d = prob * (alpha * acc)
        else:  # srelu: c already holds alpha*acc (+bias)
            r = relu(c)
            if const_expr(self.tanh_clamp_scale is not None):
                s = Float32(self.tanh_clamp_scale)
                r = s * tanh_nonneg(r * Float32(1.0 / self.tanh_clamp_scale))
            d = prob * (r * r)
        return d

    # D for GLU ------------------------------------------------------------------------------
    @cute.jit
    def d_glu(self, gate: Float32, up: Float32, prob: Float32) -> Float32:
        d = Float32(0.0)
        if const_expr(self.act == "swiglu"):
            if const_expr(self.glu_limit is not None):
                lim = Float32(self.glu_limit)
                gate = cute.arch.fmax(cute.arch.fmin(gate, lim), -lim)
                up = cute.arch.fmax(cute.arch.fmin(up, lim), -lim)
            d = up * (gate * sigmoid(gate))
        elif const_expr(self.act == "geglu"):
            if const_expr(self.glu_limit is not None):
                lim = Float32(self.glu_limit)
                gate = cute.arch.fmax(cute.arch.fmin(gate, lim), -lim)
                up = cute.arch.fmax(cute.arch.fmin(up, lim), -lim)
            else:
                lim = Float32(GEGLU_DEFAULT_LIMIT)
                gate = cute.arch.fmin(gate, lim)
                up = cute.arch.fmax(cute.arch.fmin(up, lim), -lim)
            d = (up + Float32(1.0)) * (gate * sigmoid(gate * Float32(GEGLU_SCALE)))
        if const_expr(self.glu_alpha is not None):
            d = d * Float32(self.glu_alpha)
        return prob * d


@cute.jit
def abs_bits(x: Float32) -> Int32:
    """Bit pattern of |x| as Int32: monotone in |x| for non-NaN, NaN above +inf."""
    return x.bitcast(Int32) & Int32(0x7FFFFFFF)


@cute.jit
def warp_max_i32(v: Int32) -> Int32:
    for i in cutlass.range_constexpr(5):
        v = cutlass.max(v, cute.arch.shuffle_sync_bfly(v, offset=1 << (4 - i)))
    return v


class DgradRecipe:
    """Static recipe of a backward epilogue (dglu: dswiglu / dgeglu, dsrelu): the derivative of the forward
    activation evaluated on the saved pre-activation x = beta * C, exactly as the reference's `_glu` / `_srelu`
    (clamped inputs pass no gradient; the tanh-clamped sReLU uses 1 - t^2 = 4e / (1 + e)^2, e = exp(-2u))."""

    def __init__(self, problem):
        epi = problem.epilogue
        self.op = problem.op
        self.is_glu = problem.op == "dglu"
        self.act = activations.get(epi.act, "act").name                  # dswiglu -> swiglu
        self.has_prob = epi.has_prob
        self.has_bias = False                                              # backward ops take no bias input
        self.has_c = False                                                 # C is an input here, not an output
        self.has_dbias = epi.dbias_dtype is not None
        self.compute_amax = epi.compute_amax
        self.glu_limit = epi.glu_limit
        self.glu_alpha = epi.glu_alpha
        self.tanh_clamp_scale = epi.tanh_clamp_scale

    @cute.jit
    def dsrelu(self, x: Float32):
        """(relu(x)^2 or its tanh-clamped form, d/dx of it)."""
        r = relu(x)
        value = r * r
        dvalue = Float32(2.0) * r
        if const_expr(self.tanh_clamp_scale is not None):
            s = Float32(self.tanh_clamp_scale)
            u = r * Float32(1.0 / self.tanh_clamp_scale)
            st = s * cute.arch.fmin(tanh_nonneg(u), Float32(1.0))
            value = st * st
            e = cute.math.exp2(u * Float32(-2.0 * LOG2_E), fastmath=True)
            one_e = Float32(1.0) + e
            dvalue = Float32(2.0) * st * (Float32(4.0) * e * cute.arch.rcp_approx(one_e * one_e))
            dvalue = Float32(cutlass.select_(x > Float32(0.0), dvalue, Float32(0.0)))
        return value, dvalue

    @cute.jit
    def _clamp(self, x: Float32, lo, hi):
        """(clamped x, 1.0 where the gradient passes (inclusive bounds) else 0.0); None = unbounded."""
        y = x
        ok = Float32(1.0)
        if const_expr(lo is not None):
            ok = Float32(cutlass.select_(x >= Float32(lo), ok, Float32(0.0)))
            y = cute.arch.fmax(y, Float32(lo))
        if const_expr(hi is not None):
            ok = Float32(cutlass.select_(x <= Float32(hi), ok, Float32(0.0)))
            y = cute.arch.fmin(y, Float32(hi))
        return y, ok

    @cute.jit
    def dglu(self, gate: Float32, up: Float32):
        """(act(gate, up), d act / d gate, d act / d up)."""
        glo = ghi = ulo = uhi = None
        if const_expr(self.glu_limit is not None):
            glo, ghi, ulo, uhi = -self.glu_limit, self.glu_limit, -self.glu_limit, self.glu_limit
        elif const_expr(self.act == "geglu"):
            ghi, ulo, uhi = GEGLU_DEFAULT_LIMIT, -GEGLU_DEFAULT_LIMIT, GEGLU_DEFAULT_LIMIT
        g, g_ok = self._clamp(gate, glo, ghi)
        u, u_ok = self._clamp(up, ulo, uhi)
        k = 1.0
        lin = u
        sig = Float32(0.0)
        if const_expr(self.act == "geglu"):
            k = GEGLU_SCALE
            lin = u + Float32(1.0)
            sig = sigmoid(g * Float32(GEGLU_SCALE))
        else:
            sig = sigmoid(g)
        gact = g * sig
        value = lin * gact
        d_gate = g_ok * (lin * sig * (Float32(1.0) + Float32(k) * g * (Float32(1.0) - sig)))
        d_up = u_ok * gact
        return value, d_gate, d_up
