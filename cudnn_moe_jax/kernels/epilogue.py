"""Epilogue device functions, composed per problem (one recipe object per compiled variant).

Semantics (docs/ops.md, docs/activations.md, docs/ops.md#amax; fp32 math on the fp32 accumulator, RNE output conversion):

=========  ===================================  ==========================================================
op         C (pre-activation, stored if c)      D
=========  ===================================  ==========================================================
quant      (none)                               prob*alpha*acc;  with bias: alpha*acc + prob*bias
srelu      alpha*acc (+ bias)                   prob * act(C)
glu        alpha*acc (+ bias), interleaved      prob * scale * act(gate, up); gate = even 32-col block of C,
                                                up = the following odd block; scale: the entry's output scale
                                                (glu_alpha of swiglu / geglu), else 1
=========  ===================================  ==========================================================
act is the table entry's device function (kernels/activations.py), with the entry's constants.

amax (per group, docs/ops.md#amax): max |D| in fp32 before conversion, merged as a max over the *bit patterns* of |D|
(non-negative floats order like their bits, and a NaN (0x7fc00000 after abs) beats +inf, so NaN wins as the
spec asks). The kernel reduces per thread -> per warp, then one `atomicMax` per warp and tile; the result does
not depend on the order of the atomics (max is exact), so it is deterministic.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cudnn_moe_jax import activations

from . import activations as device_activations


class EpilogueRecipe:
    """Static recipe of one problem's epilogue + the scalar device functions it composes.

    The kernel calls `c_value` / `d_value` / `d_glu` per accumulator element (unrolled); everything that is not
    used by this problem is never traced.
    """

    def __init__(self, problem):
        epi = problem.epilogue
        self.op = problem.op
        self.is_glu = epi.is_glu                   # glu, or glu_hadamard_quant with a GLU
        self.has_bias = epi.has_bias
        self.has_prob = epi.has_prob
        self.has_c = epi.c_dtype is not None and problem.op != "quant"
        self.compute_amax = epi.compute_amax
        if epi.act is not None:
            act = activations.get(epi.act, "act")                          # unknown: ValueError
            self.act_value, _ = device_activations.functions(act)
            self.constants = act.constants(epi)
            self.output_scale = act.output_scale(epi)

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
        else:  # one-column activation: c already holds alpha*acc (+bias)
            d = prob * self.act_value(c, **self.constants)
        return d

    # D for GLU ------------------------------------------------------------------------------
    @cute.jit
    def d_glu(self, gate: Float32, up: Float32, prob: Float32) -> Float32:
        d = self.act_value(gate, up, **self.constants)
        if const_expr(self.output_scale is not None):
            d = d * Float32(self.output_scale)
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
    """Static recipe of a backward epilogue (dglu, dsrelu): the table entry's derivative device function on the
    saved pre-activation x = beta * C (`dact` for a one-column activation, `dglu` for a GLU), and its output scale
    (applied by the kernel to dD)."""

    def __init__(self, problem):
        epi = problem.epilogue
        self.op = problem.op
        self.is_glu = problem.op == "dglu"
        self.has_prob = epi.has_prob
        self.has_bias = False                                              # backward ops take no bias input
        self.has_c = False                                                 # C is an input here, not an output
        self.has_dbias = epi.dbias_dtype is not None
        self.compute_amax = epi.compute_amax
        act = activations.get(epi.act, "act")                              # dswiglu -> swiglu
        _, self.act_grad = device_activations.functions(act)
        self.constants = act.constants(epi)
        self.output_scale = act.output_scale(epi)

    @cute.jit
    def dact(self, x: Float32):
        """(act(x), d act / dx)."""
        return self.act_grad(x, **self.constants)

    @cute.jit
    def dglu(self, gate: Float32, up: Float32):
        """(act(gate, up), d act / d gate, d act / d up)."""
        return self.act_grad(gate, up, **self.constants)
