"""Compiling a kernel module with CuTe DSL, through cutlass.jax's own steps (the FunctionSpec `cutlass_call` would
build), so a module compiled here is byte-identical to the one cutlass_call compiles. `cutlass` is imported only
when compiling.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
from typing import Optional

from ._ffi import FFI_TARGET, FFI_TARGET_NO_CUDA_GRAPH, KernelModule, sds

log = logging.getLogger("cudnn_moe_jax.runtime")

CUTLASS_DSL_VERSION = "4.8.1"  # the pin in pyproject's [cuda] extra
DEFAULT_ARCH = "sm_90a"


class KernelUnavailable(RuntimeError):
    """No kernel module can be had for a call; `reason` says why and how to get one."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason



def cutlass_dsl_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return CUTLASS_DSL_VERSION


def compile_unavailable_reason() -> Optional[str]:
    if os.environ.get("CUDNN_MOE_JAX_NO_COMPILE", "") not in ("", "0"):
        return "compiling is disabled by CUDNN_MOE_JAX_NO_COMPILE"
    try:
        if importlib.util.find_spec("cutlass") is None:
            return "the CuTe DSL compiler (nvidia-cutlass-dsl) is not installed"
    except (ImportError, ValueError) as e:
        return f"the CuTe DSL compiler (cutlass) cannot be imported ({e})"
    return None



def import_cutlass(arch: str = DEFAULT_ARCH):
    """`import cutlass` set up to compile for `arch` (CUTE_DSL_ARCH is read once, at the first import)."""
    if "cutlass" not in sys.modules or "CUTE_DSL_ARCH" not in os.environ:
        os.environ["CUTE_DSL_ARCH"] = arch
    import cutlass
    from cutlass.cutlass_dsl.cutlass import CuTeDSL
    if CuTeDSL._get_dsl().envar.arch != arch:
        raise KernelUnavailable(f"cutlass was imported with CUTE_DSL_ARCH={CuTeDSL._get_dsl().envar.arch}; set "
                                f"CUTE_DSL_ARCH={arch} before the first `import cutlass` to compile for {arch}")
    return cutlass


def compile_module(spec) -> KernelModule:
    """Compile with CuTe DSL through cutlass.jax's own steps (the FunctionSpec cutlass_call would build)."""
    import_cutlass(spec.arch)
    import jax
    from cutlass.jax import compile as cc, primitive as cp, types as ct

    if cutlass_dsl_version() != CUTLASS_DSL_VERSION:
        log.warning("nvidia-cutlass-dsl %s installed; pinned: %s", cutlass_dsl_version(), CUTLASS_DSL_VERSION)
    fn, kw = spec.build()
    kw = dict(kw or {})
    input_spec, output_spec = kw.pop("input_spec", None), kw.pop("output_spec", None)
    aliases = cc._normalize_input_output_aliases(kw.pop("input_output_aliases", None))
    target = FFI_TARGET if kw.pop("allow_cuda_graph", True) else FFI_TARGET_NO_CUDA_GRAPH
    options, static = kw.pop("compile_options", None), kw.pop("use_static_tensors", False)
    compile_key = kw.pop("compile_key", None)  # only skips cutlass's IR fingerprinting; the module is the same
    outs, box = tuple(sds(a) for a in spec.out_avals), {}

    def trace(*present):  # traced, because build_function_spec insists on jax.Array inputs
        it = iter(present)
        args = tuple(None if a is None else next(it) for a in spec.in_avals)
        flat, tree = jax.tree.flatten(args)
        ispec = cp._resolve_input_spec_flat(input_spec, args, flat)
        ospec = cp._resolve_spec_flat(output_spec, list(outs))
        cp._validate_specs("Input", flat, ispec)
        cp._validate_specs("Output", list(outs), ospec)
        out_flat, out_tree = jax.tree.flatten(outs)
        fspec = cc.build_function_spec(flat, tree, out_flat, out_tree, ispec, ospec, dict(aliases), options, static, kw)
        res = cc.get_or_compile_kernel(fn, fspec, compile_key=compile_key)
        to_jax = ct.cutlass_to_jax_layout_order
        box["m"] = KernelModule(res.module, res.fingerprint, target,
                                tuple(to_jax(s.layout) for s in fspec.input_spec),
                                tuple(to_jax(s.layout) for s in fspec.output_spec), tuple(fspec.input_output_aliases))

    jax.eval_shape(trace, *[a for a in spec.in_avals if a is not None])
    return box["m"]
