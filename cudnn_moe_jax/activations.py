"""The expert activations: one table, and every layer dispatches through it.

A GLU activation (`glu`) reads gate/up pairs of 32-column blocks and gives one output per pair (ops glu / dglu);
srelu one column per output (ops srelu / dsrelu). The backward act_func is the name with a "d" in front.

Each entry carries its functions, in the form each layer needs:
  * `reference`: jnp, fp32 (below): the value, and with `grad=True` the value and its derivatives;
  * the kernels' CuTe DSL functions over fp32 values: `kernels/activations.py` defines one per act_func name (the
    forward value `swiglu`, the backward value-and-derivatives `dswiglu`); the kernels look them up by the entry's
    `name` / `derivative`, so importing this table never imports cutlass;
  * the float64 test oracle keeps its own functions, keyed by the same names (tests/np_ops.py `NP_ACTIVATIONS`).
Options are static keyword arguments of the ops and fields of `_problem.Epilogue`; an entry says which it takes,
their defaults and which one scales the output (outside the function: `output_scale`). A name outside the table is
a ValueError everywhere. The math and the derivatives at the clamp bounds: docs/activations.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable, Optional

import jax
import jax.numpy as jnp

GLU_BLOCK = 32          # GLU pairing (docs/activations.md#glu-layout): even 32-column blocks gate, odd blocks up
GEGLU_SCALE = 1.702     # cuDNN's GeGLU: g * sigmoid(1.702 g), the sigmoid approximation of GELU
GEGLU_LIMIT = 7.0       # cuDNN's GeGLU default clamps: gate <= 7, up in [-7, 7]


@dataclasses.dataclass(frozen=True)
class Option:
    default: Optional[float]     # used where the option is None; None: off
    meaning: str
    scales_output: bool = False  # D = value * option (and dprob, dC with it), applied outside the function


@dataclasses.dataclass(frozen=True, eq=False)
class Activation:
    name: str                 # the forward act_func
    glu: bool                 # gate/up pairs of 32-column blocks in, one output per pair
    derivative: str           # the backward act_func
    forward_op: str           # the problem op of the fused FC1 forward
    backward_op: str          # the problem op of the fused FC2 dgrad + derivative
    reference: Callable       # jnp: f(gate, up | x, **constants, grad=False) -> value | (value, derivatives...)
    options: Mapping          # option name -> Option: the keyword options it takes

    def output_width(self, n: int) -> int:
        """Columns of the activation output from n pre-activation columns (GLU: one per gate/up pair)."""
        return n // 2 if self.glu else n

    def input_width(self, n_out: int) -> int:
        """Pre-activation columns of n_out outputs (the width of C and of the backward's dC)."""
        return n_out * 2 if self.glu else n_out

    @property
    def column_multiple(self) -> int:
        """The pre-activation width must be a multiple of this (GLU: whole gate/up block pairs)."""
        return 2 * GLU_BLOCK if self.glu else 1

    def constants(self, options) -> dict:
        """{option: value} of the options the functions read (all but the output scale), defaults filled in.
        `options`: a mapping or an object with the options as attributes (an Epilogue)."""
        return {name: _option_value(options, name, opt) for name, opt in self.options.items()
                if not opt.scales_output}

    def output_scale(self, options) -> Optional[float]:
        """The factor on D outside the function (swiglu / geglu: glu_alpha), None for none."""
        scales = [_option_value(options, name, opt) for name, opt in self.options.items() if opt.scales_output]
        return scales[0] if scales else None


def _option_value(options, name: str, opt: Option):
    value = options.get(name) if isinstance(options, Mapping) else getattr(options, name, None)
    return opt.default if value is None else value


# ---------------------------------------------------------------------------------------------------------------
# jnp functions (the reference; fp32)


def _clamp(x, lo, hi):
    """Clamped value and the pass-through mask (inclusive bounds: the gradient flows at the bound); None =
    unbounded."""
    y, ok = x, jnp.ones(x.shape, bool)
    if lo is not None:
        ok = ok & (x >= lo)
        y = jnp.maximum(y, lo)
    if hi is not None:
        ok = ok & (x <= hi)
        y = jnp.minimum(y, hi)
    return y, ok


def _sigmoid_glu(gate, up, *, k: float, offset: Optional[float], bounds, grad: bool):
    """(u' + offset) * g' * sigmoid(k g') with g', u' clamped to bounds = (gate_lo, gate_hi, up_lo, up_hi);
    grad: also d/d gate and d/d up, zero where the input lies outside its bounds."""
    glo, ghi, ulo, uhi = bounds
    g, g_ok = _clamp(gate, glo, ghi)
    u, u_ok = _clamp(up, ulo, uhi)
    sig = jax.nn.sigmoid(g if k == 1.0 else k * g)
    lin = u if offset is None else u + offset
    gact = g * sig
    value = lin * gact
    if not grad:
        return value
    d_gate = jnp.where(g_ok, lin * sig * (1.0 + k * g * (1.0 - sig)), 0.0)
    d_up = jnp.where(u_ok, gact, 0.0)
    return value, d_gate, d_up


def _both_sides(limit):
    return (None,) * 4 if limit is None else (-limit, limit, -limit, limit)


def swiglu(gate, up, *, glu_limit=None, grad: bool = False):
    """u' g' sigmoid(g'); glu_limit L clamps gate and up to [-L, L]."""
    return _sigmoid_glu(gate, up, k=1.0, offset=None, bounds=_both_sides(glu_limit), grad=grad)


def geglu(gate, up, *, glu_limit=None, grad: bool = False):
    """cuDNN's GeGLU: (u' + 1) g' sigmoid(1.702 g'), g' = min(gate, 7), u' = clip(up, -7, 7); glu_limit L
    replaces both clamps by [-L, L]."""
    bounds = _both_sides(glu_limit) if glu_limit is not None else (None, GEGLU_LIMIT, -GEGLU_LIMIT, GEGLU_LIMIT)
    return _sigmoid_glu(gate, up, k=GEGLU_SCALE, offset=1.0, bounds=bounds, grad=grad)


def gpt_oss_swiglu(gate, up, *, glu_alpha, glu_limit, grad: bool = False):
    """GPT-OSS: (u' + 1) g' sigmoid(alpha g'), g' = min(gate, limit) (from above only), u' = clip(up, -limit,
    limit)."""
    return _sigmoid_glu(gate, up, k=glu_alpha, offset=1.0, bounds=(None, glu_limit, -glu_limit, glu_limit),
                        grad=grad)


def srelu(x, *, tanh_clamp_scale=None, grad: bool = False):
    """relu(x)^2, or (s * min(tanh(relu(x)/s), 1))^2 with s = tanh_clamp_scale; grad: also d/dx."""
    pos = x > 0
    r = jnp.where(pos, x, 0.0)
    if tanh_clamp_scale is None:
        value = r * r
        return (value, 2.0 * r) if grad else value
    s = float(tanh_clamp_scale)
    u = r / s
    t = jnp.minimum(jnp.tanh(u), 1.0)
    st = s * t
    value = st * st
    if not grad:
        return value
    # 1 - t^2 = sech^2(u) = 4e / (1 + e)^2 with e = exp(-2u): no cancellation as t -> 1 (fp32 1 - t*t is 0 there).
    e = jnp.exp(-2.0 * u)
    return value, jnp.where(pos, 2.0 * st * (4.0 * e / ((1.0 + e) * (1.0 + e))), 0.0)


# ---------------------------------------------------------------------------------------------------------------
# the table

_GLU_LIMIT = Option(None, "clamp gate and up to [-L, L] (positive)")
_GLU_ALPHA_SCALE = Option(None, "D = glu_alpha * prob * act (finite)", scales_output=True)

TABLE = {a.name: a for a in (
    Activation("swiglu", True, "dswiglu", "glu", "dglu", swiglu,
               {"glu_limit": _GLU_LIMIT, "glu_alpha": _GLU_ALPHA_SCALE}),
    Activation("geglu", True, "dgeglu", "glu", "dglu", geglu,
               {"glu_limit": Option(None, "clamp gate and up to [-L, L]; off: cuDNN's gate <= 7, up in [-7, 7]"),
                "glu_alpha": _GLU_ALPHA_SCALE}),
    Activation("gpt_oss_swiglu", True, "dgpt_oss_swiglu", "glu", "dglu", gpt_oss_swiglu,
               {"glu_alpha": Option(1.702, "alpha of sigmoid(alpha * gate)"),
                "glu_limit": Option(7.0, "gate clamped from above to L, up to [-L, L]")}),
    Activation("srelu", False, "dsrelu", "srelu", "dsrelu", srelu,
               {"tanh_clamp_scale": Option(None, "s * tanh(relu(x) / s) before squaring (positive)")}),
)}
BY_DERIVATIVE = {a.derivative: a for a in TABLE.values()}
GLU_NAMES = tuple(a.name for a in TABLE.values() if a.glu)
GLU_DERIVATIVES = tuple(a.derivative for a in TABLE.values() if a.glu)


def get(name, arg: str = "act_func") -> Activation:
    """The activation of a forward or a backward name ("swiglu" or "dswiglu"); ValueError naming `arg` else."""
    found = TABLE.get(name) or BY_DERIVATIVE.get(name)
    if found is None:
        raise ValueError(f"{arg}={name!r} is not an activation: expected one of {tuple(TABLE)} (forward) or "
                         f"{tuple(BY_DERIVATIVE)} (backward)")
    return found
