"""Prepare the runtime smoke test for a GPU machine that has no CuTe DSL compiler.

    python tools/runtime_smoke.py prepare [DIR]      # here, with nvidia-cutlass-dsl: default DIR = .out/rt

writes DIR/bundle (`python -m cudnn_moe_jax.aot build` of tests/runtime_helpers.py's tiny kernel and of the real
kernel's small quant problem) and DIR/tiny.jax_export (a jax.export of the tiny program for platform cuda, made by
this machine's jax), then prints the command to run on the GPU machine (which also needs `.runtime/`, see
tools/fetch_runtime.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def prepare(out: Path) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "CUDNN_MOE_JAX_BUNDLE": str(out / "bundle")}
    build = [sys.executable, "-m", "cudnn_moe_jax.aot", "build", "--arch", "sm_90a", "--out", str(out / "bundle"),
             "--variants", "runtime_helpers:tiny_variants", "runtime_helpers:small_quant_variants"]
    export = ("import jax, jax.numpy as jnp, runtime_helpers as t; from cudnn_moe_jax import _runtime; "
              "a = jax.ShapeDtypeStruct((64, 128), jnp.float32); "
              "e = jax.export.export(jax.jit(t.tiny_program), platforms=['cuda'], "
              "disabled_checks=_runtime.export_disabled_checks())(a, a); "
              f"open({str(out / 'tiny.jax_export')!r}, 'wb').write(e.serialize()); "
              "print('exported with jax', jax.__version__)")
    for cmd in (build, [sys.executable, "-c", export], [sys.executable, "-m", "cudnn_moe_jax.aot", "list",
                                                         str(out / "bundle")]):
        if subprocess.run(cmd, cwd=REPO, env=env).returncode:
            return 1
    rel = out.resolve().relative_to(REPO) if out.resolve().is_relative_to(REPO) else out
    print(f"\nGPU machine (carry .runtime and {rel}):\n  PYTHONPATH=$PWD:$PWD/tests "
          f"CUDNN_MOE_JAX_BUNDLE=$PWD/{rel}/bundle CUDNN_MOE_JAX_TEST_EXPORT=$PWD/{rel}/tiny.jax_export "
          "python3 -m pytest -q -s -rA tests/test_runtime.py")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "prepare":
        sys.exit(__doc__)
    sys.exit(prepare(Path(sys.argv[2]) if len(sys.argv) > 2 else REPO / ".out" / "rt"))
