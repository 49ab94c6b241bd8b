"""Validation and canonicalisation shared by the public ops (docs/ops.md, docs/formats.md#block-scaled-inputs).

Every static rule is checked here, once, before anything is bound or lowered; errors name the argument and the
rule. What leaves this module is canonical: A `(m, K)`, B `(L, N, K)`, SF as uint8 physical 6-D arrays, prob
`(m,)` f32, alpha `(L,)` f32, dtype names as strings.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..formats import dtype_name  # noqa: F401 (re-exported: the one dtype normaliser of the ops and of formats)
from ..formats import sf_physical_shape
from ..limits import (FLOAT_OUT_DTYPES, FP4, FP8_DTYPES, GROUP_ALIGN, HALF_DTYPES, M_ALIGNED_CHOICES, MAX_GROUPS,
                      SF_DTYPES, SF_GROUP_ALIGN, k_align, values_per_byte)


def check_choice(value, allowed, arg: str, why: str = ""):
    if value not in allowed:
        raise ValueError(f"{arg}={value!r} is not supported: allowed {tuple(allowed)}{'; ' + why if why else ''}")


def array(x, arg: str):
    if x is None:
        raise TypeError(f"{arg} is required")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    return x


def squeeze_unit(x, ndim: int, arg: str, shape_hint: str):
    """Accept cuDNN's trailing unit modes, e.g. A `(m, K, 1)` -> `(m, K)`."""
    while x.ndim > ndim and x.shape[-1] == 1:
        x = jnp.reshape(x, x.shape[:-1])
    if x.ndim != ndim:
        raise ValueError(f"{arg} must have shape {shape_hint}, got {tuple(x.shape)}")
    return x


def operand_dtype(x, arg: str) -> str:
    """Storage dtype of an A/B operand; uint8 means packed FP4 (two values a byte, low nibble first)."""
    name = x.dtype.name
    if name == "uint8":
        return FP4
    if name == FP4:
        raise TypeError(f"{arg}: pass FP4 data packed two values per byte as uint8 (low nibble = even element), "
                        "e.g. cudnn_moe_jax.formats.pack_fp4(codes)")
    if name not in HALF_DTYPES + FP8_DTYPES:
        raise TypeError(f"{arg}: dtype {name} is not supported; use bfloat16, float16, float8_e4m3fn, "
                        "float8_e5m2 or uint8 (packed FP4): cast with x.astype(jnp.bfloat16), or quantize with "
                        "cudnn_moe_jax.formats.to_block_scaled(x, 'mxfp8')")
    return name


def logical_k(x, ab_dtype: str) -> int:
    return x.shape[-1] * values_per_byte(ab_dtype)


def check_k_alignment(k: int, ab_dtype: str, arg: str):
    # The contiguous extent of A and B must be a multiple of 16 bytes (TMA), docs/ops.md#errors.
    need = k_align(ab_dtype)
    if k % need:
        raise ValueError(f"{arg}: K={k} must be a multiple of {need} for {ab_dtype} (16-byte rows)")


def check_m(m: int, m_aligned: int, arg: str = "a_tensor"):
    if m <= 0 or m % m_aligned:
        raise ValueError(f"{arg}: rows m={m} must be a positive multiple of {m_aligned} (m_aligned: expert groups "
                         f"are padded to {m_aligned} rows): cudnn_moe_jax.nn.route + nn.permute build that layout "
                         "(nn.permuted_rows(T, top_k, L, m_aligned) rows), or pad with jnp.pad")


def pop_m_aligned(static_kwargs: dict) -> int:
    """Pop cuDNN's `m_aligned` (the group-end alignment, default 256) from the static keywords
    (docs/offsets.md#group-alignment)."""
    value = static_kwargs.pop("m_aligned", None)
    if value is None:
        return GROUP_ALIGN
    if isinstance(value, bool) or not isinstance(value, int) or value not in M_ALIGNED_CHOICES:
        raise ValueError(f"m_aligned must be one of {M_ALIGNED_CHOICES} (group ends are multiples of it; 256 is "
                         f"cuDNN's), got {value!r}")
    return value


def check_sf_alignment(m_aligned: int, what: str):
    """Scale factors along M come in 128-row atoms and 32-row column blocks: a call that has them (block-scaled A,
    FP8 / FP4 outputs) keeps group ends on multiples of 128 (docs/offsets.md#group-alignment)."""
    if m_aligned % SF_GROUP_ALIGN:
        raise ValueError(f"m_aligned={m_aligned}: {what} needs m_aligned to be a multiple of {SF_GROUP_ALIGN} "
                         f"(scale factors along M come in {SF_GROUP_ALIGN}-row atoms and 32-row column blocks, "
                         "which must not span two expert groups)")


def int_vector(x, length: int, arg: str):
    x = array(x, arg)
    x = jnp.reshape(x, (-1,)) if x.ndim > 1 and math.prod(x.shape) == x.shape[0] else x
    if x.ndim != 1 or x.shape[0] != length:
        raise ValueError(f"{arg} must have shape ({length},), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{arg} must be an integer array (int32), got {x.dtype}: cast with .astype(jnp.int32)")
    return x.astype(jnp.int32)


def concrete_value(x) -> Optional[np.ndarray]:
    """x as numpy when its value is known now (an eager call, or a constant), None when it is traced (jit, grad,
    export): only then can the host look at device data such as the group offsets."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def offsets_vector(x, length: int, limit: int, arg: str, align: int, rule: str):
    """int_vector for group ends, plus the rules when the values are concrete: every end in [0, limit], a multiple
    of `align`, non-decreasing. Traced ends cannot be checked: every backend sanitizes them (README, NOTES.md
    "Device offsets"), which is the identity for valid ends."""
    out = int_vector(x, length, arg)
    values = concrete_value(x)
    if values is None:
        return out
    values = values.reshape(-1).astype(np.int64)
    running = np.maximum.accumulate(values)
    bad = (values < 0) | (values > limit) | (values % align != 0) | (values < np.concatenate([[0], running[:-1]]))
    if bad.any():
        i = int(np.argmax(bad))
        v = int(values[i])
        if not 0 <= v <= limit:
            reason = f"outside [0, {limit}]"
        elif v % align:
            reason = f"not a multiple of {align}"
        else:
            j = int(np.argmax(values[:i]))
            reason = f"smaller than {arg}[{j}]={int(values[j])} (ends must be non-decreasing)"
        raise ValueError(f"{arg}[{i}]={v} is {reason}: {arg} holds {rule}")
    return out


def float_vector(x, length: int, arg: str, default: Optional[float] = None):
    """`(length,)` float32 (also accepts `(length, 1, 1)`); None -> `default` filled, or None if no default."""
    if x is None:
        return None if default is None else jnp.full((length,), default, jnp.float32)
    x = array(x, arg)
    if math.prod(x.shape) != length or (x.ndim and x.shape[0] != length):
        raise ValueError(f"{arg} must have shape ({length},) (or ({length}, 1, 1)), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{arg} must be float32 (or bfloat16), got {x.dtype}")
    return jnp.reshape(x, (length,)).astype(jnp.float32)


def scalar_f32(x, arg: str):
    x = array(x, arg)
    if math.prod(x.shape) != 1:
        raise ValueError(f"{arg} must hold one value (shape (1,)), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{arg} must be float32, got {x.dtype}")
    return jnp.reshape(x, (1,)).astype(jnp.float32)


# How to build each kind of scale-factor buffer (the hint of a wrong one).
SF_HINT_TILED = ("quantize the {what} with cudnn_moe_jax.formats.to_block_scaled({x}, format), or "
                 "pack logical {logical} scales with cudnn_moe_jax.formats.pack_sf")
SF_HINT_SEGMENTS = ("this op takes per-expert segment scales: pack the logical (rows, cdiv(T, sf_vec_size)) scales "
                    "with cudnn_moe_jax.formats.pack_sf_segments(s, offsets_tensor, sf_vec_size)")


def _is_layout(x, shape: tuple) -> bool:
    """Whether buffer x is the physical array of `shape` or its flat bytes."""
    return math.prod(x.shape) == math.prod(shape) and (x.ndim <= 1 or tuple(x.shape) == tuple(shape))


def sf_bytes(x, expected_shape: tuple, arg: str, hint: str, other_vec: Optional[tuple] = None):
    """A scale-factor buffer -> uint8 with `expected_shape` (accepts the physical array or its flat bytes); `hint`
    says which call builds the right buffer. `other_vec` = (sf_vec_size, shape): the operand's layout at the other
    vec size FP4 allows, named in the error when the buffer has it (scales quantized for the other vec)."""
    x = array(x, arg)
    name = x.dtype.name
    if name not in SF_DTYPES + ("uint8",):
        raise TypeError(f"{arg}: dtype {name} is not a scale-factor dtype (float8_e8m0fnu, float8_e4m3fn or "
                        "uint8 bit patterns)")
    if not _is_layout(x, expected_shape):
        if other_vec is not None and _is_layout(x, other_vec[1]):
            hint = (f"its shape is that of sf_vec_size={other_vec[0]} scales: pass sf_vec_size={other_vec[0]} if "
                    f"they were quantized so, else quantize with formats.to_block_scaled(x, 'nvfp4' | 'mxfp4')")
        raise ValueError(f"{arg}: expected the packed MMA-tiled buffer of shape {tuple(expected_shape)} (or its "
                         f"{math.prod(expected_shape)} flat bytes), got shape {tuple(x.shape)}; {hint}")
    if name != "uint8":
        x = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return jnp.reshape(x, expected_shape)


def sf_dtype_of(named) -> Optional[str]:
    """The one SF dtype of `named` [(buffer, arg)]. uint8 buffers hold e8m0 bit patterns (docs/formats.md): e4m3
    scales must arrive typed as float8_e4m3fn, so they can never be misread as exponents."""
    names = set()
    for t, arg in named:
        name = array(t, arg).dtype.name
        if name not in SF_DTYPES + ("uint8",):
            raise TypeError(f"{arg}: dtype {name} is not a scale-factor dtype (float8_e8m0fnu, float8_e4m3fn or "
                            "uint8 e8m0 bit patterns)")
        names.add("float8_e8m0fnu" if name == "uint8" else name)
    if len(names) > 1:
        raise TypeError(f"{', '.join(arg for _, arg in named)} must share one scale-factor dtype, got "
                        f"{sorted(names)}")
    return names.pop() if names else None


def resolve_block_format(ab_dtype: str, sfa, sfb, sf_vec_size, sfb_arg: str = "sfb_tensor",
                         weight_only: bool = False):
    """Checks which data dtype goes with which SF dtype and vec size (docs/formats.md#block-scaled-inputs);
    returns (sf_dtype, vec) or (None, None).

    `sfb` is one buffer, or (discrete weights, `sfb_arg="sfb_tensors"`) a sequence of per-expert buffers.
    `weight_only`: A is bf16 / fp16 and B block-scaled (`ab_dtype` is B's), so only B has scale factors.
    """
    sfbs = list(sfb) if sfb_arg == "sfb_tensors" and sfb is not None else None
    if ab_dtype in HALF_DTYPES:
        for t, arg in ((sfa, "sfa_tensor"), (sfb, sfb_arg)):
            if t is not None:
                raise TypeError(f"{arg} must be None for {ab_dtype} inputs (they carry no scale factors)")
        if sf_vec_size is not None:
            raise ValueError(f"sf_vec_size={sf_vec_size!r} only applies to block-scaled inputs, not {ab_dtype}")
        return None, None
    if (sfa is None and not weight_only) or sfb is None:
        raise TypeError(f"sfa_tensor and {sfb_arg} are required for block-scaled {ab_dtype} inputs: quantize "
                        "operands with cudnn_moe_jax.formats.to_block_scaled(x, format) (format 'mxfp8', 'nvfp4', "
                        "...), which returns (codes, scales)")
    named = ([] if weight_only else [(sfa, "sfa_tensor")]) + (
        [(t, f"{sfb_arg}[{i}]") for i, t in enumerate(sfbs)] if sfbs is not None else [(sfb, sfb_arg)])
    # uint8 bit patterns carry no dtype: e8m0.
    sf_dtype = sf_dtype_of(named) or "float8_e8m0fnu"
    if ab_dtype in FP8_DTYPES:
        vec = 32 if sf_vec_size is None else sf_vec_size
        if vec != 32 or sf_dtype != "float8_e8m0fnu":
            raise ValueError(f"sf_vec_size/sf dtype: {ab_dtype} inputs are MXFP8 (float8_e8m0fnu scales, "
                             f"sf_vec_size=32); got sf_vec_size={vec}, {sf_dtype}")
    else:
        if sf_vec_size is None:
            if sf_dtype != "float8_e4m3fn":
                raise ValueError("sf_vec_size is required for FP4 inputs with e8m0 scales (16 = NVFP4-e8m0, "
                                 "32 = MXFP4)")
            sf_vec_size = 16
        check_choice(sf_vec_size, (16, 32), "sf_vec_size")
        vec = sf_vec_size
        if sf_dtype == "float8_e4m3fn" and vec != 16:
            raise ValueError("sf_vec_size: float8_e4m3fn scale factors require sf_vec_size=16 (NVFP4)")
    return sf_dtype, vec


def out_dtype(dtype, arg: str, allowed, fp4_reason: str = "") -> str:
    """The canonical name of an output dtype argument, one of `allowed`; an FP4 one where `allowed` has none is a
    NotImplementedError saying why (`fp4_reason`)."""
    name = dtype_name(dtype, arg)
    if name == FP4 and FP4 not in allowed:
        raise NotImplementedError(f"{arg}=float4_e2m1fn: {fp4_reason or 'no FP4 output here'}")
    check_choice(name, allowed, arg)
    return name


def operand_majors(static_kwargs: dict, a_major_allowed: bool = False) -> dict:
    """Pop cuDNN's `b_major` ('k' | 'n') and, where the op takes it, `a_major` ('k' | 'm') from the static
    keywords: {"a_major": ..., "b_major": ...} for the problem (docs/ops.md#operand-majors)."""
    out = {"a_major": "k", "b_major": "k"}
    for arg, allowed in (("a_major", ("k", "m")), ("b_major", ("k", "n"))):
        if arg not in static_kwargs or (arg == "a_major" and not a_major_allowed):
            continue
        value = static_kwargs.pop(arg)
        if value not in allowed:
            raise ValueError(f"{arg} must be one of {allowed} (the contiguous dimension of the operand), got "
                             f"{value!r}")
        out[arg] = value
    return out


def check_static_kwargs(acc_dtype=None, cd_major=None, vector_f32=None, stream=None, mma_tiler_mn=None,
                        cluster_shape_mn=None, **unknown):
    """cuDNN wrapper keywords we accept for drop-in compatibility; anything but the supported value is an error
    (`m_aligned` is popped before, by `pop_m_aligned`)."""
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)} (this op does not take them)")
    if acc_dtype is not None and dtype_name(acc_dtype, "acc_dtype") != "float32":
        raise ValueError("acc_dtype: only float32 accumulation is supported")
    if cd_major is not None and cd_major != "n":
        raise ValueError("cd_major: outputs are row-major (cd_major='n') in JAX")
    if vector_f32:
        raise ValueError("vector_f32=True is not supported")
    if stream is not None:
        raise ValueError("stream: XLA owns streams in JAX; do not pass one")
    config = None
    for value, arg in ((mma_tiler_mn, "mma_tiler_mn"), (cluster_shape_mn, "cluster_shape_mn")):
        if value is not None and (not isinstance(value, (tuple, list)) or len(value) != 2
                                  or not all(isinstance(v, int) and v > 0 for v in value)):
            raise ValueError(f"{arg} must be a pair of positive ints, got {value!r}")
    if mma_tiler_mn is not None or cluster_shape_mn is not None:
        config = (tuple(mma_tiler_mn) if mma_tiler_mn else None,
                  tuple(cluster_shape_mn) if cluster_shape_mn else None)
    return config


def _static_float(value, arg: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{arg} must be a Python number (a static option), got {value!r}") from exc


def positive_float(value, arg: str) -> Optional[float]:
    if value is None:
        return None
    value = _static_float(value, arg)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{arg} must be a positive finite number, got {value}")
    return value


def finite_float(value, arg: str) -> Optional[float]:
    if value is None:
        return None
    value = _static_float(value, arg)
    if not math.isfinite(value):
        raise ValueError(f"{arg} must be finite, got {value}")
    return value



def _weight_layout_hint(b_shape: tuple, a_k: int) -> str:
    """What to do with a weight whose K axis is not last: the layouts cuDNN ((N, K, L)) and torch ((L, K, N),
    per expert (K, N)) store, and the transpose that gives this library's (L, N, K) / (N, K)."""
    if len(b_shape) == 3 and b_shape[1] == a_k:
        return (f"; weights are (L, N, K) here (expert-major, K contiguous), and {tuple(b_shape)} has K in the "
                "middle: cuDNN's (N, K, L) layout converts with jnp.transpose(b, (2, 0, 1)); torch's (L, K, N) with "
                "jnp.swapaxes(b, 1, 2) (bf16/fp16: add b_major='n' and the kernel reads the original buffer, no copy)")
    if len(b_shape) == 2 and b_shape[0] == a_k:
        return (f"; each expert's weight is (N, K) here, and {tuple(b_shape)} looks like (K, N): pass its "
                "transpose (w.T; bf16/fp16: add b_major='n' and the kernel reads the original buffer, no copy)")
    return "; weights are (L, N, K) here (expert-major, K contiguous), per expert (N, K)"


def gather_index(index, rows: int, arg: str = "a_index", tensor: str = "a_tensor", what: str = "row"):
    """`index` (m,) int32, the `tensor` row (wgrad: token) each GEMM row (token) reads (outside [0, rows): zeros);
    its shape and dtype checked, its values never (any int32 is meaningful)."""
    x = array(index, arg)
    if x.dtype != jnp.int32:
        raise TypeError(f"{arg} must be int32 (the {tensor} {what} of each GEMM {what}), got {x.dtype}: cast with "
                        ".astype(jnp.int32)")
    if x.ndim != 1:
        raise ValueError(f"{arg} must have shape ({'T' if what == 'token' else 'm'},) (one {tensor} {what} per "
                         f"GEMM {what}), got {tuple(x.shape)}")
    if rows < 1:
        raise ValueError(f"{tensor}: with {arg} it must have at least one {what} (an index outside them reads "
                         "zeros)")
    return x


def gemm_operands(a_tensor, b_tensor, b_tensors, sfa_tensor, sfb_tensor, sfb_tensors, padded_offsets,
                  sf_vec_size, m_aligned: int = GROUP_ALIGN, b_arg="b_tensor", a_index=None):
    """Validate and canonicalise the grouped-GEMM operands shared by every forward and dgrad op.

    `a_index` (m,) int32 (the M-grouped ops but the Hadamard one): GEMM row r reads row a_index[r] of A (T, K).
    Returns (inputs dict, dims dict) with dims = m, n, k, num_groups, ab_dtype, a_dtype (a bf16 / fp16 A with
    block-scaled B, else None), sf_dtype, vec, discrete, m_aligned, a_rows (T of a gathered A, else None).
    """
    a = squeeze_unit(array(a_tensor, "a_tensor"), 2, "a_tensor", "(m, K) (or (m, K, 1))")
    ab_dtype = operand_dtype(a, "a_tensor")
    m, k = a.shape[0], logical_k(a, ab_dtype)
    a_rows = None
    if a_index is not None:
        a_index = gather_index(a_index, m)
        a_rows, m = m, a_index.shape[0]
    check_m(m, m_aligned, "a_tensor" if a_index is None else "a_index")
    discrete = b_tensors is not None
    if discrete == (b_tensor is not None):
        raise ValueError(f"pass exactly one of {b_arg} (dense (L, N, K)) and b_tensors (list of per-expert "
                         "(N, K) arrays)")
    if discrete:
        experts = [squeeze_unit(array(b, "b_tensors[i]"), 2, f"b_tensors[{i}]", "(N, K)")
                   for i, b in enumerate(b_tensors)]
        if not experts:
            raise ValueError("b_tensors must hold at least one expert")
        shapes = {tuple(b.shape) for b in experts}
        dtypes = {b.dtype.name for b in experts}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(f"b_tensors: all experts must share shape and dtype, got {shapes} {dtypes}")
        b_shape, num_groups = experts[0].shape, len(experts)
        b = tuple(experts)
        n = b_shape[0]
        b_dtype = operand_dtype(experts[0], "b_tensors")
        b_k = logical_k(experts[0], b_dtype)
        if sfb_tensor is not None:
            raise ValueError("with b_tensors pass the per-expert scales as sfb_tensors, not sfb_tensor")
    else:
        b = array(b_tensor, b_arg)
        if b.ndim != 3:
            raise ValueError(f"{b_arg} must have shape (L, N, K) (expert-major, K contiguous), got "
                             f"{tuple(b.shape)}; per-expert (N, K) weights go in b_tensors=[...] (or jnp.stack "
                             "them)")
        b_dtype = operand_dtype(b, b_arg)
        b_shape = b.shape
        num_groups, n, b_k = b.shape[0], b.shape[1], logical_k(b, b_dtype)
        if sfb_tensors is not None:
            raise ValueError("sfb_tensors goes with b_tensors; with a dense b_tensor pass sfb_tensor")
    # the kernels gather 16-bit rows: block-scaled A would need its scale factors gathered too
    if a_index is not None and not (ab_dtype in HALF_DTYPES and b_dtype in HALF_DTYPES and sfa_tensor is None):
        raise ValueError(f"a_index (gathered A rows) needs a plain 16-bit A: a bf16 / fp16 a_tensor and weights, not "
                         f"block-scaled (no sfa_tensor, no FP8 / FP4 weights); got a_tensor {ab_dtype}, {b_arg} "
                         f"{b_dtype}{' and an sfa_tensor' if sfa_tensor is not None else ''}")
    a_dtype = None
    if b_dtype != ab_dtype:
        if not (ab_dtype in HALF_DTYPES and b_dtype not in HALF_DTYPES and sfa_tensor is None):
            raise TypeError(f"a_tensor ({ab_dtype}) and {b_arg} ({b_dtype}) must have the same dtype (or a bf16 / "
                            "fp16 a_tensor with block-scaled weights and sfa_tensor=None: weight-only "
                            "quantization): cast one with .astype(...)")
        a_dtype, ab_dtype = ab_dtype, b_dtype   # weight-only: the block format is B's
    if b_k != k:
        raise ValueError(f"{b_arg}: K={b_k} does not match a_tensor's K={k}"
                         f"{_weight_layout_hint(b_shape, a.shape[-1])}")
    check_k_alignment(k, ab_dtype, "a_tensor")
    if not 1 <= num_groups <= MAX_GROUPS:
        raise ValueError(f"{b_arg}: number of experts L={num_groups} must be in [1, {MAX_GROUPS}]")
    if n <= 0 or n % 8:
        raise ValueError(f"{b_arg}: N={n} must be a positive multiple of 8")
    offsets = offsets_vector(padded_offsets, num_groups, m, "padded_offsets", m_aligned,
                             f"the cumulative end row of each expert group: non-decreasing multiples of m_aligned="
                             f"{m_aligned} in [0, m={m}] (cudnn_moe_jax.nn.route builds them from expert choices)")

    if discrete and sfb_tensors is not None and len(sfb_tensors) != num_groups:
        raise ValueError(f"sfb_tensors must hold one buffer per expert ({num_groups}), got {len(sfb_tensors)}")
    sf_dtype, vec = resolve_block_format(ab_dtype, sfa_tensor, sfb_tensors if discrete else sfb_tensor,
                                         sf_vec_size, "sfb_tensors" if discrete else "sfb_tensor",
                                         weight_only=a_dtype is not None)
    sfa = sfb = None
    if sf_dtype is not None:
        if a_dtype is None:   # A's scale factors (weight-only calls have B's only)
            check_sf_alignment(m_aligned, f"block-scaled {ab_dtype} A (sfa_tensor)")
        # FP4 scales quantized for the other vec size have another layout, except where K cannot tell them apart
        # (K <= 64: one atom of 4 k-blocks either way); that is why e8m0 FP4 calls must state sf_vec_size.
        other = {16: 32, 32: 16}[vec] if ab_dtype == FP4 else None

        def other_layout(rows, num_groups=1):
            return None if other is None else (other, sf_physical_shape(rows, k, other, num_groups))

        if a_dtype is None:   # weight-only: A has no scale factors
            sfa = sf_bytes(sfa_tensor, sf_physical_shape(m, k, vec), "sfa_tensor",
                           SF_HINT_TILED.format(what="(m, K) activations", x="a",
                                                logical="(m, cdiv(K, sf_vec_size))"), other_layout(m))
        if discrete:
            hint = SF_HINT_TILED.format(what="(N, K) weight of each expert", x="b_tensors[i]",
                                        logical="(N, cdiv(K, sf_vec_size))")
            sfb = tuple(sf_bytes(s, sf_physical_shape(n, k, vec), f"sfb_tensors[{i}]", hint, other_layout(n))
                        for i, s in enumerate(sfb_tensors))
        else:
            sfb = sf_bytes(sfb_tensor, sf_physical_shape(n, k, vec, num_groups), "sfb_tensor",
                           SF_HINT_TILED.format(what="(L, N, K) weights", x="b",
                                                logical="(L, N, cdiv(K, sf_vec_size))"),
                           other_layout(n, num_groups))
    inputs = {"a": a, "b": b, "sfa": sfa, "sfb": sfb, "padded_offsets": offsets, "a_index": a_index}
    dims = dict(m=m, n=n, k=k, num_groups=num_groups, ab_dtype=ab_dtype, a_dtype=a_dtype, sf_dtype=sf_dtype,
                vec=vec, discrete=discrete, m_aligned=m_aligned, b_arg="b_tensors" if discrete else b_arg,
                a_rows=a_rows)
    return inputs, dims


def bias_array(bias_tensor, num_groups: int, n: int, arg: str = "bias_tensor"):
    """Per-expert bias `(L, N)` (cuDNN's `(N, L)` view of the same memory is not expressible in JAX)."""
    if bias_tensor is None:
        return None, None
    bias = squeeze_unit(array(bias_tensor, arg), 2, arg, f"({num_groups}, {n})")
    if tuple(bias.shape) != (num_groups, n):
        raise ValueError(f"{arg} must have shape (L, N) = ({num_groups}, {n}), got {tuple(bias.shape)}")
    name = bias.dtype.name
    check_choice(name, FLOAT_OUT_DTYPES, f"{arg} dtype")
    return bias, name
