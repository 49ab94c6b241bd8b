"""GPU: the public ops end to end (primitive -> runtime -> bundled kernel module -> FFI custom call) against the
same ops lowered to the reference on the same GPU, and the main job on the GPU.

The cases are lab/public_ops_cases.py's. Needs a Hopper GPU and a bundle holding their modules
(tools/gpu/build_bundle.sh); skipped otherwise.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import cudnn_moe_jax as cmj  # noqa: E402
from cudnn_moe_jax import formats  # noqa: E402
from lab import harness  # noqa: E402
from lab import public_ops_cases as cases  # noqa: E402

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


harness.skip_without_gpu_or_bundle("lab.public_ops_cases")


def _run(op, options, x, kernels: bool):
    cmj.set_kernels_enabled(kernels)
    try:
        fn = jax.jit(functools.partial(cases.call, op, options))  # a fresh jit: lowered with this setting
        with harness.kernels_only():   # a fallback to the reference would warn: an error here
            return jax.block_until_ready(fn(x))
    finally:
        cmj.set_kernels_enabled(True)


def _as_f32(x):
    return np.asarray(x.astype(np.float32) if x.dtype != np.float32 else x)


def _compared(result, key):
    """(values, relative tolerance) of one output: FP8 D / D_col dequantized with their SFD (the two sides may round
    a value, or a block scale at a power-of-two boundary, one FP8 step apart); other FP8 codes as values."""
    x = result[key]
    ulp = {"float8_e4m3fn": 2 ** -3, "float8_e5m2": 2 ** -2}.get(str(x.dtype), 2 ** -7)
    if key in ("d_tensor", "d_col_tensor") and result.get("sfd_row_tensor") is not None:
        m, n = x.shape
        if key == "d_tensor":
            sf = formats.unpack_sf(result["sfd_row_tensor"], m, n // 32)[0]                  # (m, n / 32)
            scale = np.repeat(_as_f32(formats.e8m0_decode(sf)), 32, axis=1)
        else:
            sf = formats.unpack_sf(result["sfd_col_tensor"], n, m // 32)[0]                  # (n, m / 32)
            scale = np.repeat(_as_f32(formats.e8m0_decode(sf)), 32, axis=1).T
        return _as_f32(x) * scale, ulp
    return _as_f32(x), ulp


@pytest.mark.parametrize("name, op, options", cases.CASES, ids=[c[0] for c in cases.CASES])
def test_public_op_kernel_matches_reference_on_gpu(name, op, options):
    x = cases.inputs()
    got = _run(op, options, x, kernels=True)
    want = _run(op, options, x, kernels=False)
    valid = cases.OFFSETS[-1]
    for key, g in got.items():
        if g is None:
            assert want[key] is None
            continue
        assert g.shape == want[key].shape and g.dtype == want[key].dtype, key
        if key.startswith("sfd_"):
            # e8m0 block scales: equal, except a block whose amax the two summation orders round across a power of two
            gs, ws = (np.asarray(formats.as_u8(v)).astype(np.int32) for v in (g, want[key]))
            assert np.max(np.abs(gs - ws)) <= 1 and np.mean(gs != ws) < 1e-3, f"{name}:{key}"
            continue
        (gv, rtol), (wv, _) = _compared(got, key), _compared(want, key)
        assert np.all(np.isfinite(gv)), key
        scale = max(float(np.max(np.abs(wv))), 1e-6)
        # one rounding of an fp32 value on each side (one output step apart at most); summation orders differ
        np.testing.assert_allclose(gv, wv, rtol=rtol, atol=scale * 2 ** -9, err_msg=f"{name}:{key}")
        if key in ("c_tensor", "d_tensor", "d_col_tensor"):
            assert not np.any(_as_f32(g)[valid:]), f"{name}:{key} rows past valid_m must be zero"


def test_main_job_runs_on_gpu():
    # This pytest process already holds most of the GPU memory (XLA preallocates): the child allocates on demand.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    proc = subprocess.run([sys.executable, "-m", "examples.moe_layer"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    assert "backend=gpu" in proc.stdout and "loss" in proc.stdout
