"""Expert weight layouts of the MoE MLP: the GLU gate/up interleave, and the check of x / w1 / w2 / b1 against it.

The fused GLU ops read FC1's output columns in 32-wide blocks, even blocks the gate and odd blocks the up half
(docs/activations.md), so W1 (L, 2I, H) interleaves its gate and up rows in 32-row blocks. Checkpoints usually store
the two halves one after the other ([gate; up], e.g. a fused `gate_up_proj`): convert them once with
`interleave_glu_weights` when loading and back with `deinterleave_glu_weights` when saving.

The layers also take the weights as stored elsewhere and convert them inside the jitted function (a reshape /
transpose that JAX differentiates, so the gradients come back in the layout given): separate gate and up
weights `(w_gate, w_up)` instead of the interleaved W1, and `weight_layout="in_out"`, the (E, in, out) order of
Flax / MaxText kernels (W1 (L, H, 2I), W2 (L, I, H)), instead of the fused ops' (E, out, in) ("out_in", torch's
Linear order). `to_fused_layout` does the conversion.

The checks run before the fused ops, so a wrong shape or dtype is reported with the user's argument names and
layouts (x, w1, w2, b1, router_weight) rather than the ops' internal a_tensor / b_tensor.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import activations
from ..limits import TOKEN_ALIGN

GLU_BLOCK = 32  # columns per gate / up block in the fused GLU ops
MAX_EXPERTS = 1024
_HALF = ("bfloat16", "float16")
COMPUTE_DTYPES = _HALF + ("float32",)
WEIGHT_LAYOUTS = ("out_in", "in_out")


def _glu_axis(w, axis: int, arg: str):
    w = jnp.asarray(w)
    if not -w.ndim <= axis < w.ndim:
        raise ValueError(f"{arg}: axis={axis} is not an axis of shape {tuple(w.shape)}")
    axis %= w.ndim
    if w.shape[axis] % (2 * GLU_BLOCK):
        raise ValueError(f"{arg}: the gate/up axis {axis} must have size 2I with I a multiple of {GLU_BLOCK}, got "
                         f"shape {tuple(w.shape)}")
    return w, axis, w.shape[axis]


def interleave_glu_weights(w_gate_up, axis: int = 1):
    """[gate; up] halves -> the fused ops' 32-block interleave, along `axis`.

    `w_gate_up` holds 2I entries along `axis`, the first I the gate and the last I the up projection: an FC1
    weight (L, 2I, H) (axis 1, the default), its bias (L, 2I) (axis 1), or one expert's (2I, H) (axis 0). The
    result has block 2j = gate rows [32j, 32j + 32) and block 2j + 1 = the up rows of the same range, which is
    what `moe_mlp`, `moe_layer` and `grouped_gemm_glu` expect for W1. Inverse: `deinterleave_glu_weights`.
    """
    w, axis, size = _glu_axis(w_gate_up, axis, "interleave_glu_weights: w_gate_up")
    blocks = jnp.reshape(w, w.shape[:axis] + (2, size // (2 * GLU_BLOCK), GLU_BLOCK) + w.shape[axis + 1:])
    return jnp.reshape(jnp.swapaxes(blocks, axis, axis + 1), w.shape)


def deinterleave_glu_weights(w_interleaved, axis: int = 1):
    """The fused ops' 32-block gate/up interleave -> [gate; up] halves along `axis` (inverse of
    `interleave_glu_weights`, e.g. to save W1 or its gradient in a checkpoint's layout)."""
    w, axis, size = _glu_axis(w_interleaved, axis, "deinterleave_glu_weights: w_interleaved")
    blocks = jnp.reshape(w, w.shape[:axis] + (size // (2 * GLU_BLOCK), 2, GLU_BLOCK) + w.shape[axis + 1:])
    return jnp.reshape(jnp.swapaxes(blocks, axis, axis + 1), w.shape)


def check_expert_mlp(x, w1, w2, b1, act: str, x_arg: str = "x"):
    """Check x (..., H) against W1 (L, 2I or I, H), W2 (L, H, I), b1 (L, 2I or I); returns (L, H, I).

    Errors name the caller's arguments and their expected layouts and say which call fixes them."""
    glu = activations.get(act, "act").glu
    w1_layout = ("(L, 2I, H) with gate/up interleaved in 32-row blocks (convert [gate; up] halves with "
                 "cudnn_moe_jax.nn.interleave_glu_weights)") if glu else "(L, I, H)"
    if x.ndim < 2:
        raise ValueError(f"{x_arg} must have shape (..., H) (tokens x hidden), got {tuple(x.shape)}")
    dtype = x.dtype.name
    if dtype not in COMPUTE_DTYPES:
        raise TypeError(f"{x_arg}: dtype {dtype} is not supported; the fused expert GEMMs take bfloat16 or float16 "
                        f"activations (float32 runs the jnp reference path): cast with {x_arg}.astype(jnp.bfloat16)")
    hidden = x.shape[-1]
    if w1.ndim != 3 or w1.shape[2] != hidden:
        raise ValueError(f"w1 must have shape {w1_layout}, H={hidden} from {x_arg}'s last dimension; got "
                         f"{tuple(w1.shape)}")
    num_experts, fc1_out = w1.shape[:2]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"w1: the number of experts L={num_experts} must be in [1, {MAX_EXPERTS}]")
    if glu and fc1_out % (2 * GLU_BLOCK):
        raise ValueError(f"w1 {tuple(w1.shape)}: 2I={fc1_out} must be a multiple of {2 * GLU_BLOCK} (gate and up "
                         f"in {GLU_BLOCK}-row blocks), i.e. I a multiple of {GLU_BLOCK}")
    inter = fc1_out // 2 if glu else fc1_out
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must have shape (L, H, I) = ({num_experts}, {hidden}, {inter}) (L and I from w1 "
                         f"{tuple(w1.shape)}, H from {x_arg}); got {tuple(w2.shape)}")
    for arg, value in (("hidden size H", hidden), ("intermediate size I", inter)):
        if value % 8:
            raise ValueError(f"{arg}={value} must be a multiple of 8 (16-byte rows of the fused GEMMs)")
    for arg, w in (("w1", w1), ("w2", w2)):
        if w.dtype.name not in COMPUTE_DTYPES or (w.dtype != x.dtype and dtype != "float32"
                                                  and w.dtype.name != "float32"):
            raise TypeError(f"{arg} ({w.dtype.name}) must have {x_arg}'s dtype ({dtype}) or be float32 (master "
                            f"weights, cast to {dtype} inside): cast with {arg}.astype({x_arg}.dtype)")
    if b1 is not None:
        if tuple(b1.shape) != (num_experts, fc1_out):
            raise ValueError(f"b1 must have shape (L, {'2I' if glu else 'I'}) = ({num_experts}, {fc1_out})"
                             f"{' in the same interleave as w1' if glu else ''}; got {tuple(b1.shape)}")
        if b1.dtype.name not in _HALF + ("float32",):
            raise TypeError(f"b1: dtype {b1.dtype.name} is not supported (bfloat16, float16 or float32)")
    return num_experts, hidden, inter


def check_permuted(x_perm, prob, padded_offsets, num_experts: int, m_aligned: int):
    """The routing arguments of moe_mlp: x_perm (m, H) with m a multiple of m_aligned and of 8 (the wgrad ops read
    the rows as tokens), prob (m,), padded_offsets (L,)."""
    unit = max(m_aligned, TOKEN_ALIGN)
    if x_perm.ndim != 2 or x_perm.shape[0] % unit:
        raise ValueError(f"x_perm must have shape (m, H) with m a multiple of {unit} (permuted rows, every expert "
                         f"group padded to a multiple of m_aligned={m_aligned}, m of {TOKEN_ALIGN}: nn.route + "
                         f"nn.permute, nn.permuted_rows); got {tuple(x_perm.shape)}")
    m = x_perm.shape[0]
    if tuple(prob.shape) != (m,):
        raise ValueError(f"prob must have shape (m,) = ({m},) (one gate weight per permuted row); got "
                         f"{tuple(prob.shape)}")
    if tuple(padded_offsets.shape) != (num_experts,):
        raise ValueError(f"padded_offsets must have shape (L,) = ({num_experts},) (one group end per expert of "
                         f"w1); got {tuple(padded_offsets.shape)}")


def _glu_pair(pair, axis: int, arg: str):
    """(gate, up) halves of equal shape -> the 32-block interleave along `axis`."""
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise TypeError(f"{arg}: separate gate / up weights are a pair (gate, up), got {type(pair).__name__} of "
                        f"length {len(pair)}")
    gate, up = (jnp.asarray(p) for p in pair)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{arg}: the gate {tuple(gate.shape)} {gate.dtype.name} and up {tuple(up.shape)} "
                         f"{up.dtype.name} halves must have the same shape and dtype")
    if not -gate.ndim <= axis < gate.ndim or gate.shape[axis] % GLU_BLOCK:
        raise ValueError(f"{arg}: gate / up of shape {tuple(gate.shape)} must have I, a multiple of {GLU_BLOCK}, "
                         f"along axis {axis}")
    return interleave_glu_weights(jnp.concatenate([gate, up], axis=axis), axis=axis)


def to_fused_layout(w1, w2, b1=None, weight_layout: str = "out_in", act: str = "swiglu", prefix: str = ""):
    """(w1, w2, b1) as given -> the fused ops' (W1 (L, 2I or I, H), W2 (L, H, I), b1 (L, 2I or I)).

    w1: an array in `weight_layout` (GLU: gate/up interleaved in 32-blocks), or a pair (w_gate, w_up) of (L, I, H)
    ("out_in") / (L, H, I) ("in_out") halves; w2: (L, H, I) / (L, I, H); b1: (L, 2I or I) interleaved, a pair
    (b_gate, b_up) of (L, I), or None. Plain jnp (reshape, concatenate, transpose): under jit it is part of the
    step, and JAX's gradient of it returns the weight gradients in the layout given. `prefix` names the
    arguments in errors (the shared expert's "shared.")."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={weight_layout!r} must be one of {WEIGHT_LAYOUTS}: 'out_in' = (E, out, in) "
                         f"(W1 (L, 2I, H), W2 (L, H, I)), 'in_out' = (E, in, out) (W1 (L, H, 2I), W2 (L, I, H))")
    glu = activations.get(act, "act").glu
    in_out = weight_layout == "in_out"
    for arg, value in ((f"{prefix}w1", w1), (f"{prefix}b1", b1)):
        if isinstance(value, (tuple, list)) and not glu:
            raise ValueError(f"{arg}: separate gate / up weights apply to GLU activations, not act={act!r}")
    if isinstance(w1, (tuple, list)):
        w1 = _glu_pair(w1, -1 if in_out else 1, f"{prefix}w1")
    if isinstance(b1, (tuple, list)):
        b1 = _glu_pair(b1, -1, f"{prefix}b1")
    if in_out:
        for arg, w in ((f"{prefix}w1", w1), (f"{prefix}w2", w2)):
            if jnp.ndim(w) != 3:
                raise ValueError(f"{arg} must be (L, in, out) for weight_layout='in_out', got shape "
                                 f"{tuple(jnp.shape(w))}")
        w1, w2 = jnp.swapaxes(w1, 1, 2), jnp.swapaxes(w2, 1, 2)
    return w1, w2, b1
