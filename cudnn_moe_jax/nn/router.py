"""The MoE router: logits, scores, expert selection and gate weights, configured by one frozen `RouterConfig`.

For tokens x (T, H), router weight W (H, L) and an optional router bias b (L,):

    logits = x W  (+ b when bias="logits": a router Linear's bias, GPT-OSS)
    scores = softmax(logits) over the L experts, or sigmoid(logits)                       (score)
    key    = scores, or logits when topk_first                                            (what top-k ranks)
             (+ b when bias="selection": DeepSeek-V3's balancing bias, used for choosing only)
    key    = key outside the topk_groups best of n_groups expert groups set to -inf         (group-limited top-k;
             a group's value: the sum of its 2 largest keys, DeepSeek-V3, or its largest, DeepSeek-V2)
    experts = top_k(key)  (T, k) int32, in decreasing key order
    weights = scores[experts], or score(logits[experts]) over the k when topk_first (Mixtral: softmax of the k
              largest logits; GPT-OSS the same with the bias in the logits)
    weights = weights / sum(weights)   when normalize (norm_topk_prob)
    weights = weights * scaling        (routed_scaling_factor)

The default (`RouterConfig()`) is a softmax router with renormalized top-2 weights. With softmax, top-k after the
score plus renormalization equals top-k of the logits followed by a softmax over the k (Mixtral): the same math,
different rounding. Gradients reach W (and a "logits" bias) through the weights; the selection is a discrete
choice and passes none (a "selection" bias gets a zero gradient: update it with `nn.balancing_bias_update`).

The router GEMM runs on operands in the layer's compute dtype (bf16 / fp16: x as it is, W cast) with fp32
accumulation and an fp32 result, and so do its two backward GEMMs (`matmul_f32_acc`): no float32 copy of x.
`RouterConfig(dtype=jnp.float32)` runs it on float32 operands instead (pass `precision="highest"` as well to keep
XLA from using TF32 or bf16 passes on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

SCORES = ("softmax", "sigmoid")
BIAS_MODES = ("selection", "logits")
GROUP_SCORES = ("top2_sum", "max")
_PRECISIONS = ("default", "high", "highest")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How the router picks experts and weighs them (module doc for the equations). Frozen and hashable: a static
    argument of jitted functions and a static field of the Flax / Equinox modules.

    top_k: experts per token. score: "softmax" | "sigmoid". topk_first: take the top-k of the logits, then the
    score of the k (Mixtral, GPT-OSS), instead of the top-k of the scores. normalize: divide the k weights by their
    sum (HF `norm_topk_prob`). scaling: multiply the weights (DeepSeek `routed_scaling_factor`). bias: None, or how
    the `router_bias` (L,) argument is used: "selection" (added to the ranking key only) or "logits" (added to the
    logits). n_groups / topk_groups / group_score: group-limited top-k (experts in n_groups equal consecutive
    groups; only the topk_groups best groups are eligible). dtype: operand dtype of the router GEMM (None: the
    layer's compute dtype). precision: the GEMM's `jax.lax.Precision` name ("default", "high", "highest") or None.
    """

    top_k: int = 2
    score: str = "softmax"
    topk_first: bool = False
    normalize: bool = True
    scaling: float = 1.0
    bias: Optional[str] = None
    n_groups: int = 1
    topk_groups: Optional[int] = None
    group_score: str = "top2_sum"
    dtype: Optional[str] = None
    precision: Optional[str] = None

    def __post_init__(self):
        if not (_is_int(self.top_k) and self.top_k >= 1):
            raise ValueError(f"RouterConfig: top_k={self.top_k!r} must be an int >= 1")
        for name, allowed in (("score", SCORES), ("group_score", GROUP_SCORES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"RouterConfig: {name}={getattr(self, name)!r} must be one of {allowed}")
        if self.bias is not None and self.bias not in BIAS_MODES:
            raise ValueError(f"RouterConfig: bias={self.bias!r} must be None or one of {BIAS_MODES}")
        for name in ("topk_first", "normalize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RouterConfig: {name}={getattr(self, name)!r} must be a bool")
        if not (isinstance(self.scaling, numbers.Real) and not isinstance(self.scaling, bool)
                and math.isfinite(self.scaling) and self.scaling > 0):
            raise ValueError(f"RouterConfig: scaling={self.scaling!r} must be a finite number > 0")
        object.__setattr__(self, "scaling", float(self.scaling))
        if not (_is_int(self.n_groups) and self.n_groups >= 1):
            raise ValueError(f"RouterConfig: n_groups={self.n_groups!r} must be an int >= 1")
        groups = self.n_groups if self.topk_groups is None else self.topk_groups
        if not (_is_int(groups) and 1 <= groups <= self.n_groups):
            raise ValueError(f"RouterConfig: topk_groups={self.topk_groups!r} must be an int in [1, n_groups="
                             f"{self.n_groups}] (or None: every group)")
        object.__setattr__(self, "topk_groups", int(groups))
        if self.dtype is not None:
            name = jnp.dtype(self.dtype).name
            if name not in ("bfloat16", "float16", "float32"):
                raise ValueError(f"RouterConfig: dtype={self.dtype!r} must be bfloat16, float16, float32 or None")
            object.__setattr__(self, "dtype", name)
        if self.precision is not None:
            name = str(getattr(self.precision, "name", self.precision)).lower()
            if name not in _PRECISIONS:
                raise ValueError(f"RouterConfig: precision={self.precision!r} must be None or one of {_PRECISIONS}")
            object.__setattr__(self, "precision", name)

    def check(self, num_experts: int, bias_given: bool) -> None:
        """The rules that need the expert count L and whether a `router_bias` array was passed."""
        if self.top_k > num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, L={num_experts}]")
        if num_experts % self.n_groups:
            raise ValueError(f"RouterConfig: n_groups={self.n_groups} must divide the number of experts "
                             f"L={num_experts}")
        per_group = num_experts // self.n_groups
        if self.n_groups > 1 and self.group_score == "top2_sum" and per_group < 2:
            raise ValueError(f"RouterConfig: group_score='top2_sum' needs >= 2 experts per group, got "
                             f"L/n_groups={per_group}")
        if self.top_k > self.topk_groups * per_group:
            raise ValueError(f"RouterConfig: top_k={self.top_k} exceeds the experts of the topk_groups="
                             f"{self.topk_groups} eligible groups ({self.topk_groups * per_group})")
        if bias_given != (self.bias is not None):
            raise ValueError("router_bias is given but RouterConfig.bias is None (say 'selection' or 'logits')"
                             if bias_given else
                             f"RouterConfig.bias={self.bias!r} needs the router_bias (L,) argument")


def resolve_config(router_config: Optional[RouterConfig], top_k: Optional[int]) -> RouterConfig:
    """The layers' `router_config` / `top_k` arguments -> one RouterConfig (`top_k=k` is short for
    `router_config=RouterConfig(top_k=k)`)."""
    if router_config is None:
        return RouterConfig() if top_k is None else RouterConfig(top_k=top_k)
    if not isinstance(router_config, RouterConfig):
        raise TypeError(f"router_config must be a cudnn_moe_jax.nn.RouterConfig, got {type(router_config).__name__}")
    if top_k is not None and top_k != router_config.top_k:
        raise ValueError(f"top_k={top_k} disagrees with router_config.top_k={router_config.top_k}: give it once, "
                         f"in the RouterConfig")
    return router_config


class Gating(NamedTuple):
    """The router's decision for T tokens (L experts, k choices). logits / scores are None for a precomputed
    gating (`gating=(experts, weights)`)."""

    experts: jax.Array                   # (T, k) int32 chosen experts, in decreasing ranking order
    weights: jax.Array                   # (T, k) float32 gate weights
    logits: Optional[jax.Array] = None   # (T, L) float32 router logits (a "logits" bias included)
    scores: Optional[jax.Array] = None   # (T, L) float32 softmax / sigmoid of the logits over all L experts


# ------------------------------------------------------------------------------------------------ router GEMM

def _precision(name):
    return None if name is None else jax.lax.Precision[name.upper()]


def _dot(a, b, dtype, precision, contract):
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (contract, ((), ())),
                               precision=_precision(precision), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul_f32_acc(a, b, dtype: str, precision: Optional[str] = None):
    """a (M, K) @ b (K, N) -> (M, N) float32, both operands cast to `dtype`, fp32 accumulation.

    The gradients are GEMMs on `dtype` operands too (the fp32 cotangent rounded to `dtype`), accumulated in fp32 and
    returned in each operand's own dtype: a float32 master weight gets a float32 gradient (JAX's own rule would
    round it to `dtype` first), and a bf16 `a` is never copied to float32."""
    return _dot(a, b, dtype, precision, ((1,), (0,)))


def _matmul_fwd(a, b, dtype, precision):
    return _dot(a, b, dtype, precision, ((1,), (0,))), (a, b)


def _matmul_bwd(dtype, precision, residuals, g):
    a, b = residuals
    da = _dot(g, b, dtype, precision, ((1,), (1,)))          # (M, N) x (K, N)^T
    db = _dot(a, g, dtype, precision, ((0,), (0,)))          # (M, K)^T x (M, N)
    return da.astype(a.dtype), db.astype(b.dtype)


matmul_f32_acc.defvjp(_matmul_fwd, _matmul_bwd)


# ------------------------------------------------------------------------------------------------ selection

def _score(logits, kind: str):
    return jax.nn.softmax(logits, axis=-1) if kind == "softmax" else jax.nn.sigmoid(logits)


def _limit_groups(key, config: RouterConfig):
    """key (T, L) with the experts outside each token's topk_groups best groups set to -inf."""
    tokens, num_experts = key.shape
    grouped = key.reshape(tokens, config.n_groups, num_experts // config.n_groups)
    if config.group_score == "top2_sum":
        group_value = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    else:
        group_value = jnp.max(grouped, axis=-1)
    _, best = jax.lax.top_k(group_value, config.topk_groups)
    eligible = jnp.any(best[:, :, None] == jnp.arange(config.n_groups)[None, None, :], axis=1)
    return jnp.where(eligible[:, :, None], grouped, -jnp.inf).reshape(tokens, num_experts)


# From this many tokens on the top-k of the router key is k row reductions (`top_k_indices`), below it
# `jax.lax.top_k`, which XLA:GPU runs as a sort of each row: on the H200 (RESULTS run 68) 5.4 vs 9.8 us at 8192 x 8
# (k 2), 7.5 vs 14.6 at 4096 x 64 (k 4), 69 vs 123 at 32768 x 128 (k 8), but 10.7 vs 6.3 at 512 x 128 (k 8).
TOP_K_REDUCTIONS_FROM = 4096


def top_k_indices(key, k: int):
    """`jax.lax.top_k(key, k)[1]` for a float key (..., L): the k largest entries of the last axis in IEEE total
    order (-NaN < -inf < -0 < +0 < inf < NaN), the lower index first on ties -- by k variadic row reductions over
    (taken, total-order key, index), each a fused XLA reduction, instead of a sort."""
    bits = jax.lax.bitcast_convert_type(key.astype(jnp.float32), jnp.int32)
    ordered = bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))        # the float total order as int32 order
    idx = jax.lax.broadcasted_iota(jnp.int32, key.shape, key.ndim - 1)

    def pick(a, b):
        (ta, va, ia), (tb, vb, ib) = a, b
        a_wins = (ta < tb) | ((ta == tb) & ((va > vb) | ((va == vb) & (ia < ib))))
        return tuple(jnp.where(a_wins, x, y) for x, y in ((ta, tb), (va, vb), (ia, ib)))

    init = (jnp.int32(1), jnp.int32(-2 ** 31), jnp.int32(2 ** 31 - 1))   # loses to every entry
    taken = jnp.zeros(key.shape, jnp.int32)
    out = []
    for _ in range(k):
        best = jax.lax.reduce((taken, ordered, idx), init, pick, (key.ndim - 1,))[2]
        out.append(best)
        taken = jnp.where(idx == best[..., None], 1, taken)
    return jnp.stack(out, axis=-1)


def _top_k(key, k: int):
    if key.shape[0] >= TOP_K_REDUCTIONS_FROM:
        return top_k_indices(key, k)
    return jax.lax.top_k(key, k)[1]


def gate(logits, config: RouterConfig, router_bias=None) -> Gating:
    """Experts and gate weights from float32 router logits (T, L) (a "logits" bias already added) by `config`;
    `router_bias` (L,) is the "selection" bias or None."""
    scores = _score(logits, config.score)
    key = logits if config.topk_first else scores
    if config.bias == "selection":
        key = key + router_bias.astype(jnp.float32)
    key = jax.lax.stop_gradient(key)
    if config.topk_groups < config.n_groups:
        key = _limit_groups(key, config)
    experts = _top_k(key, config.top_k)
    if config.topk_first:
        weights = _score(jnp.take_along_axis(logits, experts, axis=-1), config.score)
    else:
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if config.scaling != 1.0:
        weights = weights * config.scaling
    return Gating(experts.astype(jnp.int32), weights, logits, scores)


def apply_router(x, router_weight, config: RouterConfig, router_bias=None, compute_dtype=None) -> Gating:
    """The whole router on tokens x (T, H) with router_weight (H, L): the GEMM (operands in `config.dtype`, else
    `compute_dtype`, else x's dtype; fp32 accumulation), the "logits" bias, then `gate`."""
    dtype = config.dtype or jnp.dtype(compute_dtype or x.dtype).name
    logits = matmul_f32_acc(x, router_weight, dtype, config.precision)
    if config.bias == "logits":
        logits = logits + router_bias.astype(jnp.float32)
    return gate(logits, config, router_bias)


def top_k_gating(logits: jax.Array, top_k: int, normalize: bool = True):
    """Softmax router on given logits (T, L): (expert index (T, k) int32, gate weight (T, k) float32);
    `gate(logits, RouterConfig(top_k=top_k, normalize=normalize))` without the rest."""
    gating = gate(logits.astype(jnp.float32), RouterConfig(top_k=top_k, normalize=normalize))
    return gating.experts, gating.weights


def check_router_args(router_weight, router_bias, gating, config: RouterConfig, hidden: int, num_experts: int):
    """Shapes of the router arguments against H (from x) and L (from w1); `gating` = precomputed (experts, weights)
    or None."""
    if gating is not None:
        if router_weight is not None or router_bias is not None:
            raise ValueError("gating=(experts, weights) replaces the router: pass router_weight=None and no "
                             "router_bias")
        if not (isinstance(gating, (tuple, list)) and len(gating) == 2):
            raise TypeError("gating must be a pair (experts (..., k) int, weights (..., k) float)")
        experts, weights = gating
        if experts.shape != weights.shape or experts.ndim < 1 or not 1 <= experts.shape[-1] <= num_experts:
            raise ValueError(f"gating: experts {tuple(experts.shape)} and weights {tuple(weights.shape)} must both "
                             f"be (..., k) with the tokens' leading shape and 1 <= k <= L={num_experts}")
        if not jnp.issubdtype(experts.dtype, jnp.integer):
            raise TypeError(f"gating: experts must be integer expert ids, got {experts.dtype}")
        return
    if router_weight is None:
        raise ValueError("router_weight is None: pass the router (H, L) or gating=(experts, weights)")
    if tuple(router_weight.shape) != (hidden, num_experts):
        raise ValueError(f"router_weight must have shape (H, L) = ({hidden}, {num_experts}) (H from x, L from w1); "
                         f"got {tuple(router_weight.shape)}")
    config.check(num_experts, router_bias is not None)
    if router_bias is not None and tuple(router_bias.shape) != (num_experts,):
        raise ValueError(f"router_bias must have shape (L,) = ({num_experts},); got {tuple(router_bias.shape)}")
