"""Shared by the runtime tests (tests/test_runtime.py, test_module_cache.py, test_wgrad_lowering.py) and their
subprocesses (`import runtime_helpers as t`, `aot build --variants runtime_helpers:tiny_variants`): a tiny CuTe DSL
kernel (elementwise f32 add) behind its own primitive, the real kernel's smallest quant problem, fake modules for the
cache, the custom calls of a lowering (and the lowering tests' one-kernel assertion), and a child Python with the
checkout and tests/ on its path (optionally with cutlass blocked: the GPU machine's situation).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

from cudnn_moe_jax import _runtime

REPO = Path(__file__).resolve().parent.parent
try:
    HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None
except ImportError:  # blocked (the no-compiler subprocess below)
    HAVE_CUTLASS = False
needs_cutlass = pytest.mark.skipif(not HAVE_CUTLASS, reason="needs the CuTe DSL compiler (nvidia-cutlass-dsl)")
TINY_SHAPES = ((64, 128), (3, 1000))


# ------------------------------------------------------------------------------------------------ the tiny kernel

def _tiny_launcher():
    global cute  # CuTe DSL re-parses the kernels' source and resolves names in module globals, not closures
    import cutlass.cute as cute

    @cute.kernel
    def add_kernel(gA: cute.Tensor, gB: cute.Tensor, gC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bdim, _, _ = cute.arch.block_dim()
        i = bidx * bdim + tidx
        m, n = gA.shape
        if i < m * n:
            gC[i // n, i % n] = gA[i // n, i % n] + gB[i // n, i % n]

    @cute.jit
    def add(stream, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        m, n = a.shape
        add_kernel(a, b, c).launch(grid=((m * n + 255) // 256, 1, 1), block=(256, 1, 1), stream=stream)

    return add


def tiny_spec(shape) -> _runtime.KernelSpec:
    aval = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
    fp = _runtime.fingerprint("test/tiny_add", inspect.getsource(_tiny_launcher), _runtime.DEFAULT_ARCH,
                              _runtime.cutlass_dsl_version(), [aval, aval], [aval])
    return _runtime.KernelSpec("test/tiny_add", fp, (aval, aval), (aval,), lambda: (_tiny_launcher(), {}))


def tiny_variants():
    return [tiny_spec(s) for s in TINY_SHAPES]


def small_quant_problem():
    """The real kernel's smallest default problem: bf16 quant (m 2048, N 512, K 256, L 4) with amax."""
    pkg = _runtime.kernels_package()
    p = pkg.variants.problems()[0]
    assert p.op == "quant" and p.ab_dtype == "bfloat16" and p.epilogue.compute_amax
    return p, pkg.variants.input_avals(p)


def small_quant_variants():
    p, ins = small_quant_problem()
    return [(p, None, ins)]


def small_quant(a, b, offsets, alpha, prob):
    import cudnn_moe_jax as cmj
    return cmj.grouped_gemm_quant(a_tensor=a, b_tensor=b, padded_offsets=offsets, alpha_tensor=alpha,
                                  prob_tensor=prob, compute_amax=True)


tiny_add_p = Primitive("cudnn_moe_test_tiny_add")
tiny_add_p.def_abstract_eval(lambda a, b: a)
tiny_add_p.def_impl(lambda a, b: jax.jit(tiny_add_p.bind)(a, b))
mlir.register_lowering(tiny_add_p, mlir.lower_fun(lambda a, b: a + b, multiple_results=False))
mlir.register_lowering(tiny_add_p, mlir.lower_fun(  # the same shape of rule as the real primitive's
    lambda a, b: _runtime.call_spec(tiny_spec(a.shape), [a, b], [a])[0], multiple_results=False), platform="cuda")


def tiny_program(a, b):
    return tiny_add_p.bind(a, b) * 2.0 + 1.0


def assert_lowers_to_one_kernel(fn, x) -> None:
    """jax.jit(fn)(x) lowered for CUDA is one kernel custom call, with no fallback to the reference (its
    RuntimeWarning an error)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert len(custom_calls(text)) == 1, "expected one kernel custom call"


def custom_calls(text: str) -> list[dict]:
    """Each CuTe DSL stablehlo.custom_call's target, attributes (verbatim text) and types; operand names left out.
    (Others, e.g. jax.export's shape assertions, are left out.)"""
    found = re.findall(r"stablehlo\.custom_call @(CuteDSLRT\w+)\([^)]*\) \{(.*)\} : (.*)$", text, re.M)
    string = lambda name, a: re.search(name + r' = "((?:[^"\\]|\\.)*)"', a).group(1)  # noqa: E731
    return [{"target": t, "attributes": a, "types": ty, "key": string("key", a), "module": string("module", a)}
            for t, a, ty in found]


_BLOCK_CUTLASS = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cutlass", "cuda"):
            raise ModuleNotFoundError(f"{name} is blocked in this test")
sys.meta_path.insert(0, _Block())
"""


def _python(code: str, env: dict, cwd=REPO) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), **env}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


AVAL = jax.ShapeDtypeStruct((8, 8), jnp.float32)


def fake_module(payload: bytes) -> _runtime.KernelModule:
    return _runtime.KernelModule(payload, hashlib.sha256(payload).digest(), _runtime.FFI_TARGET, ((1, 0),), ((1, 0),))


def fake_spec(name="test/cached") -> _runtime.KernelSpec:
    return _runtime.KernelSpec(name, _runtime.fingerprint(name, "fake"), (AVAL,), (AVAL,),
                               lambda: pytest.fail("build() is not reached: compile_module is faked"))
