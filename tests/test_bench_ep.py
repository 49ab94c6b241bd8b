"""benchmarks/bench_ep.py, the weak-scaling benchmark of nn.moe_layer_ep, on 2 virtual CPU devices (host-timed,
tiny sizes): its rows, the derived numbers in its json and table; and that its kernel bundle built for 1 device
serves 2 (the 2-device step lowered for CUDA asks for exactly the 1-device step's kernel modules).

Both run in subprocesses: the CPU device count has to be fixed before jax is imported."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--experts-per-device", "2", "--rows-per-expert", "128", "--hidden", "64", "--intermediate", "64"]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    return env


@pytest.mark.slow  # ~30 s on 2 shared cores: five programs compiled on the CPU reference
def test_bench_ep_rows_on_two_virtual_devices(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_ep", "--devices", "1,2", *TINY, "--reps", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=_env(), text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_ep.json").read_text())
    rows = result["rows"]
    assert [(r["layer"], r["devices"]) for r in rows] == [("moe_layer_ep", 1), ("moe_layer", 1), ("moe_layer_ep", 2)]
    # no torch here: host wall time, and the header says so
    assert not result["cupti"] and "HOST" in result["timing"] and "CUPTI unavailable" in result["timing"]
    assert all(r["timing"] == "host" and r["gpus_in_span"] is None for r in rows)
    # same per-device load on every row: 2 experts x 128 rows / top-2 = 128 tokens per device
    assert result["tokens_per_device"] == 128 and all(r["tokens_per_device"] == 128 for r in rows)
    assert result["flops_per_row"] == 3 * (2 * 64 * 128 + 2 * 64 * 64)
    ep1, one, ep2 = rows
    assert ep1["assignments"] == 256 and one["assignments"] == 256 and ep2["assignments"] == 512
    # capacity 1.25: one device keeps all T*k (the no-drop cap); two devices ceil(1.25 * 128 * 2 / 2) per pair
    assert ep1["capacity"] == 256 and ep1["dropped"] == 0 and ep2["capacity"] == 160 and ep2["received_rows"] == 320
    for r in rows:
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0, r
        assert r["rows_per_gpu"] == (r["assignments"] - r["dropped"]) / r["devices"], r
        assert r["tflops_per_gpu"] == pytest.approx(result["flops_per_row"] * r["rows_per_gpu"] / r["step_ms"] / 1e9)
        assert r["fallbacks"] == []  # the CPU has no kernels to miss: the reference is the backend, not a fallback
    for r in (ep1, ep2):
        assert 0 < r["exchange_ms"] and r["exchange_pct"] == pytest.approx(100 * r["exchange_ms"] / r["step_ms"])
        assert math.isfinite(r["loss"]) and r["loss"] > 0
    assert one["exchange_ms"] is None and one["efficiency"] is None
    assert ep1["efficiency"] == 1.0 and ep2["efficiency"] == pytest.approx(ep1["step_ms"] / ep2["step_ms"])
    assert ep2["efficiency_vs_moe_layer"] == pytest.approx(one["step_ms"] / ep2["step_ms"])
    # the printed table (and its copy beside the json): the host-timing header and one line per row
    table = (tmp_path / "bench_ep.md").read_text()
    assert table.strip() in proc.stdout and table.startswith("JAX timed on the HOST")
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[:2] for line in lines[1:]] == [["| 1", "moe_layer_ep"], ["| 1", "moe_layer"],
                                                             ["| 2", "moe_layer_ep"]]
    assert lines[0].startswith("| devices | layer | step ms | exchange ms")


# Lowers the benchmark's EP step (1 and 2 devices) and moe_layer step (1 device) for CUDA with the module lookup
# replaced by a recorder: the (op, fingerprint, avals key) of every module asked for, no compiling.
_RECORD = """
import json, sys, warnings
from cudnn_moe_jax import _modules, _runtime
from benchmarks import bench_ep
asked = []
def record(spec):
    asked.append((spec.name, spec.fingerprint, spec.avals_key))
    raise _runtime.KernelUnavailable("recorded, not compiled")
_modules.get_module = record   # the lowering looks modules up through _modules
out = {}
argv = sys.argv[1:]
for name, items in (("d1", bench_ep.bundle_items(1, argv)), ("d2", bench_ep.two_device_items(argv))):
    for i, item in enumerate(items):
        asked.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # each recorded call falls back to the reference, with a warning
            item()
        out[f"{name}/{i}"] = sorted(set(asked))
print(json.dumps(out))
"""


def test_two_device_step_needs_only_the_one_device_modules():
    """At a small shape with the default's structure (2 local experts, swiglu, bf16; H = I = 256, kernel-covered):
    the default shape was checked the same way, and with `python -m tools.gpu.check_bundle`, by hand (~1 min)."""
    small = ["--experts-per-device", "2", "--rows-per-expert", "256", "--hidden", "256", "--intermediate", "256"]
    proc = subprocess.run([sys.executable, "-c", _RECORD, *small], cwd=ROOT, env=_env(), text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert set(got) == {"d1/0", "d1/1", "d2/0"}              # EP step d=1, moe_layer step, EP step d=2
    names = sorted(name for name, _, _ in got["d1/0"])
    assert names == sorted(["grouped_gemm/glu", "grouped_gemm/quant", "grouped_gemm/quant", "grouped_gemm/dglu",
                            "grouped_gemm/wgrad", "grouped_gemm/wgrad"])   # the six GEMMs of the MLP step
    assert got["d2/0"] == got["d1/0"]   # the two-device EP step: the one-device EP step's modules
    # the moe_layer row reads dY (and at this size x) through the routing's row map: the same six GEMMs, gathered
    assert sorted(name for name, _, _ in got["d1/1"]) == names and got["d1/1"] != got["d1/0"]
