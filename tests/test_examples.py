"""The README's flows run as written: examples/moe_layer.py on the CPU reference, with batched (B, S, H) tokens and
W1 / b1 converted from a checkpoint's [gate; up] halves."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import jax
import pytest

from cudnn_moe_jax import nn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe_layer.py"


def _example():
    spec = importlib.util.spec_from_file_location("moe_layer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moe_layer_example_batched_with_checkpoint_gate_up_halves(capsys):
    example = _example()
    small = ["--batch", "2", "--tokens", "64", "--experts", "4", "--hidden", "64", "--intermediate", "64", "--bias"]
    argv = small + ["--gate-up-halves", "--steps", "0"]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "x (2, 64, 64) bfloat16 -> y (2, 64, 64) bfloat16" in out and "grad w1" in out
    # the interleave the example applies is undone exactly on the way back
    params = example.init_params(jax.random.PRNGKey(0), example.parse_args(argv))
    halves = example.init_params(jax.random.PRNGKey(0), example.parse_args(small))
    assert (nn.deinterleave_glu_weights(params["w1"]) == halves["w1"]).all()
    assert (nn.deinterleave_glu_weights(params["b1"]) == halves["b1"]).all()


# ---------------------------------------------------------------------------------------------------------------
# The training examples (Flax NNX, Equinox) and the block-scaled example, with tiny options

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY_LM = ["--steps", "25", "--batch", "8", "--seq-len", "16", "--layers", "1", "--d-model", "32", "--heads", "2",
           "--experts", "2", "--intermediate", "32", "--lr", "1e-2", "--log-every", "5"]


def _load(name, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))        # as `python examples/<name>.py` has it: siblings import
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)   # dataclasses (eqx.Module) look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["train_lm_flax", "train_lm_equinox", "block_scaled"])
def test_examples_have_help(name, monkeypatch, capsys):
    with pytest.raises(SystemExit) as info:
        _load(name, monkeypatch).main(["--help"])
    assert info.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name, plot", [("train_lm_flax", True), ("train_lm_equinox", False)])
def test_lm_training_examples_learn(name, plot, monkeypatch, capsys, tmp_path):
    png = tmp_path / "loss.png"
    assert _load(name, monkeypatch).main(TINY_LM + ["--plot", str(png) if plot else ""]) == 0
    out = capsys.readouterr().out
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([\d.]+)$", out, re.M)]
    first, last, floor = map(float, re.search(r"^loss ([\d.]+) -> ([\d.]+) .*floor ([\d.]+)$", out, re.M).groups())
    assert len(losses) == 6 and losses[0] == first                     # steps 0, 5, ..., 20 and the last one
    assert first > math.log(64) - 1 and last < first - 1.0 and floor < last, out    # log(vocab) falls toward the floor
    if not plot:
        assert "plotted" not in out and not png.exists()
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"loss curve plotted to {png}" in out


def test_block_scaled_example_reads_fp8_and_fp4_outputs_back_within_the_format_bounds(monkeypatch, capsys):
    argv = ["--rows", "512", "--experts", "2", "--hidden", "64", "--intermediate", "128"]
    assert _load("block_scaled", monkeypatch).main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(": ok)") == 3 and "all errors within the formats' bounds" in out, out
    assert "D float8_e4m3fn (512, 128)" in out and "D uint8 (512, 64) (packed), sfd float8_e4m3fn" in out


def test_too_many_devices_says_how_to_get_cpu_devices(monkeypatch):
    """examples/moe_expert_parallel.py --devices N and benchmarks/bench_ep.py --devices 1,N on a machine with fewer
    devices: the error says so and, on a CPU machine, names XLA_FLAGS=--xla_force_host_platform_device_count=N."""
    from benchmarks import bench_ep

    n = jax.device_count() + 1
    hint = f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
    with pytest.raises(SystemExit) as info:
        _load("moe_expert_parallel", monkeypatch).main(["--devices", str(n)])
    assert f"{n} devices asked for, {n - 1} visible" in str(info.value.code)
    assert (hint in str(info.value.code)) == (jax.default_backend() == "cpu")
    with pytest.raises(SystemExit) as info:
        bench_ep.main(["--devices", f"1,{n}"])
    assert f"--devices 1,{n}: {n} devices asked for" in str(info.value.code)
    assert (hint in str(info.value.code)) == (jax.default_backend() == "cpu")


def test_readme_quick_start_is_the_cpu_install_and_names_a_quick_test_set():
    """The first two commands: install (CPU-only) + the main job, then exactly the test command CI runs; the quick
    subset and the GPU extra are named in the prose."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("## The ops")]
    commands = re.search(r"```bash\n(.*?)```", quick_start, re.S).group(1).splitlines()
    assert commands[0].startswith('pip install -e ".[test]" && python examples/moe_layer.py')
    test_command = commands[1].split("#")[0].strip()
    assert test_command == "python -m pytest -q tests"
    assert test_command in (root / ".ci" / "run").read_text()
    assert '".[cuda,test]"' in quick_start and re.search(r"~\d+-\d+ min on 2 cores", quick_start)
    prose = " ".join(quick_start.split())
    quick = re.search(r"quick check[^`]*`(python -m pytest[^`]*)`", prose).group(1)
    files = re.findall(r"tests/\S+\.py", quick)
    assert files and all((root / f).is_file() for f in files)
