"""The one primitive behind every op: abstract eval from the problem, lowering per platform.

`grouped_gemm_p` takes the op's canonical arrays (flat, in the order given by `input_names`) and the static
`GroupedGemmProblem`; it returns the present outputs in cuDNN key order. Both orders come from the operand table
(`cudnn_moe_jax.operands`): `bind` orders the inputs by it and every lowering checks `input_names` against it by
name (the kernels take their operands by position). Lowering:
  cuda  -> the CuTe DSL kernel when one covers the problem (cudnn_moe_jax._lowering), else the reference (XLA on
           the GPU) with a one-time warning naming the reason; a block-scaled call with many rows per expert
           (`_dequant_first.dequantize_first`, no explicit Config) -> XLA's exact dequantization to bf16, then the
           bf16 problem's lowering (cudnn_moe_jax._dequant_first);
  other -> the pure-jnp reference (cudnn_moe_jax.reference) through `mlir.lower_fun`.
There is deliberately no JVP/transpose/batching rule: gradients come from the explicit backward ops.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import operands
from ._problem import GroupedGemmProblem

log = logging.getLogger("cudnn_moe_jax")

grouped_gemm_p = Primitive("cudnn_moe_grouped_gemm")
grouped_gemm_p.multiple_results = True


def _present_specs(problem):
    return [(k, v) for k, v in operands.output_specs(problem).items() if v is not None]


def bind(problem: GroupedGemmProblem, inputs: dict, config=None) -> dict:
    """Bind the primitive; `inputs` maps canonical input names to arrays (None entries are dropped), in any order:
    they are bound in the operand table's order, and must be exactly the problem's present inputs.

    Discrete weights arrive as a tuple under "b" (and "sfb") and are flattened to "b:0", "b:1", ...
    Returns a dict with every output key of the op (absent outputs None).
    """
    named = {}
    for name, value in inputs.items():
        if isinstance(value, (tuple, list)):
            named.update((f"{name}:{i}", v) for i, v in enumerate(value))
        elif value is not None:
            named[name] = value
    names = operands.input_names(problem)
    if set(named) != set(names):
        raise ValueError(f"{problem.op}: inputs {sorted(named)} are not this problem's operands {sorted(names)} "
                         "(cudnn_moe_jax/operands.py: their presence rules)")
    results = grouped_gemm_p.bind(*[named[n] for n in names], problem=problem, input_names=names, config=config)
    out = dict.fromkeys(operands.output_keys(problem.op))
    for (key, _), value in zip(_present_specs(problem), results):
        out[key] = value
    return out


def _abstract_eval(*avals, problem, input_names, config):
    del avals, input_names, config
    return [jax.core.ShapedArray(shape, jnp.dtype(dtype)) for _, (shape, dtype) in _present_specs(problem)]


def _regroup(input_names, arrays) -> dict:
    """Inverse of the flattening in `bind`: {"a": x, "b": (b0, b1, ...), ...}."""
    named = {}
    for name, value in zip(input_names, arrays):
        if ":" in name:
            base, _ = name.split(":")
            named.setdefault(base, []).append(value)
        else:
            named[name] = value
    return {k: tuple(v) if isinstance(v, list) else v for k, v in named.items()}


def reference_outputs(problem, input_names, *arrays):
    """Run the problem on the pure-jnp reference; returns the present outputs in key order."""
    from . import _reference_adapter

    result = _reference_adapter.run(problem, _regroup(input_names, arrays))
    outs = []
    for key, (shape, dtype) in _present_specs(problem):
        value = result[key]
        if value is None:
            raise AssertionError(f"reference did not produce {key} for {problem}")
        value = jnp.asarray(value)
        if value.dtype != jnp.dtype(dtype):
            # SF outputs travel as uint8 bit patterns; everything else must already have the declared dtype.
            value = jax.lax.bitcast_convert_type(value, jnp.dtype(dtype)) if value.dtype.itemsize == 1 else value
        outs.append(jnp.reshape(value, shape))
    return outs


@functools.lru_cache(maxsize=256)
def _jitted(problem, input_names, config, kernels_enabled):
    # One jitted callable per static signature (and kernel switch, read at lowering time): a fresh
    # jax.jit(partial) per call would retrace and recompile every eager call (~0.5 s each on CPU, not ~1 ms).
    del kernels_enabled
    return jax.jit(functools.partial(grouped_gemm_p.bind, problem=problem, input_names=input_names, config=config))


def _impl(*arrays, problem, input_names, config):
    return _jitted(problem, input_names, config, _kernels_enabled)(*arrays)


def _reference_lowering(ctx, *args, problem, input_names, config):
    del config
    operands.check_input_names(problem, input_names)
    return mlir.lower_fun(functools.partial(reference_outputs, problem, input_names),
                          multiple_results=True)(ctx, *args)


_warned = set()


def _warn_once(problem, reason):
    key = (problem.op, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"cudnn_moe_jax: no GPU kernel for this {problem.op} problem ({reason}); running the "
                      "reference implementation through XLA instead.", RuntimeWarning, stacklevel=2)


_kernels_enabled = os.environ.get("CUDNN_MOE_JAX_KERNELS", "1") != "0"


def set_kernels_enabled(enabled: bool) -> None:
    """Lower to the GPU kernels (default) or always to the reference (also: env CUDNN_MOE_JAX_KERNELS=0).
    Takes effect for functions traced/lowered afterwards (a jitted function already compiled keeps its choice)."""
    global _kernels_enabled
    _kernels_enabled = bool(enabled)


def _reference_on_gpu(ctx, *args, problem, input_names, config):
    """The reference on CUDA: the same math with its GEMMs on the tensor cores (16-bit operands, fp32 sums)."""
    from . import reference

    with reference.tensor_core_operands():
        return _reference_lowering(ctx, *args, problem=problem, input_names=input_names, config=config)


def bind_dequantized(problem: GroupedGemmProblem, inputs: dict, config=None) -> dict:
    """`bind` of `problem`'s 16-bit problem on its exactly dequantized operands (cudnn_moe_jax._dequant_first): the
    same outputs (the 16-bit call lowers to the 16-bit kernel, or falls back like any call). Not for an fp16 A
    beside weights fp16 does not hold exactly (`formats.exact_in_float16`)."""
    from . import _dequant_first

    if not operands.has_exact_half(problem):
        raise NotImplementedError(f"an fp16 A beside {problem.ab_dtype} weights with {problem.sf_dtype} scales has "
                                  "no dequantize-first route (fp16 does not hold the weights exactly)")
    return bind(_dequant_first.half_problem(problem), _dequant_first.dequantized_inputs(problem, inputs), config)


def _dequantized_outputs_with(config, problem, input_names, *arrays):
    result = bind_dequantized(problem, _regroup(input_names, arrays), config)
    return [result[key] for key, _ in _present_specs(problem)]


def _dequantizes_first(problem, config) -> bool:
    """No explicit kernel config and the measured rule says so (`_dequant_first.dequantize_first`)."""
    from . import _dequant_first

    # an explicit Config names the kernel (and so its mainloop); cuDNN's tile hints (a tuple) do not
    return (config is None or isinstance(config, tuple)) and _dequant_first.dequantize_first(problem)


def _cuda_lowering(ctx, *args, problem, input_names, config):
    operands.check_input_names(problem, input_names)  # a wrong binding is an error, not a reason to fall back
    if not _kernels_enabled:
        return _reference_on_gpu(ctx, *args, problem=problem, input_names=input_names, config=config)
    if _dequantizes_first(problem, config):  # cuDNN's tile hints (a tuple) pass on to the bf16 kernel
        from . import _dequant_first

        staged = _dequant_first.staged_problem(problem)
        if staged is None:
            run = functools.partial(_dequantized_outputs_with, config, problem, input_names)
            return mlir.lower_fun(run, multiple_results=True)(ctx, *args)
        problem = staged   # the same bf16 values, converted inside the kernel beside the GEMM
    reason = None
    try:
        from . import _lowering

        lowering = _lowering.kernel_lowering(problem, input_names, config, ctx.avals_in, ctx.avals_out)
    except Exception as exc:  # noqa: BLE001 - any failure to find/compile a kernel falls back, loudly once
        lowering, reason = None, f"{type(exc).__name__}: {exc}"
    if lowering is None:
        _warn_once(problem, reason or "not covered by a kernel yet")
        return _reference_on_gpu(ctx, *args, problem=problem, input_names=input_names, config=config)
    return lowering(ctx, *args)


def _no_autodiff(*args, **params):
    raise TypeError(
        "cudnn_moe_jax ops have no automatic derivative: use the explicit fused backward ops "
        "(grouped_gemm_dglu / grouped_gemm_dswiglu, grouped_gemm_dsrelu, grouped_gemm_quant as dgrad, "
        "grouped_gemm_wgrad) or cudnn_moe_jax.nn.moe_mlp, whose custom_vjp wires them.")


def _no_vmap(*args, **params):
    raise TypeError(
        "cudnn_moe_jax ops do not support jax.vmap: experts are already the batch dimension (stack them in B and "
        "padded_offsets), and the backward is explicit (grouped_gemm_dglu / grouped_gemm_dsrelu / "
        "grouped_gemm_wgrad).")


grouped_gemm_p.def_impl(_impl)
grouped_gemm_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(grouped_gemm_p, _reference_lowering)
mlir.register_lowering(grouped_gemm_p, _cuda_lowering, platform="cuda")
ad.primitive_jvps[grouped_gemm_p] = _no_autodiff
ad.primitive_transposes[grouped_gemm_p] = _no_autodiff
batching.primitive_batchers[grouped_gemm_p] = _no_vmap
