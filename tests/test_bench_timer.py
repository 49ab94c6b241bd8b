"""The benchmark's device timing (lab/device_timer.py) without a GPU or torch: the CUPTI span over fake
profiler events, the choice between device and host time per implementation, and what the rows and the table
footnote of bench_grouped_gemm.py record for each case."""

from __future__ import annotations

import contextlib
import importlib.util
from types import SimpleNamespace

import pytest

from benchmarks import bench_grouped_gemm as bench
from lab import device_timer as dt

CUDA, CPU = "cuda", "cpu"  # stand-ins for torch.autograd.DeviceType members (compared with ==)


def ev(start, end, device=CUDA, name="kernel", index=0):
    """A fake torch.profiler FunctionEvent: only the fields device_intervals and device_count read."""
    return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device, name=name,
                           device_index=index)


def test_span_is_first_start_to_last_end():
    # unordered, overlapping (a second stream), with a gap: the span covers all of it
    assert dt.span_us([(30.0, 40.0), (10.0, 25.0), (12.0, 18.0), (41.0, 100.5)]) == pytest.approx(90.5)
    assert dt.span_us([(5.0, 5.0)]) == 0.0


def test_span_of_nothing_is_not_zero():
    assert dt.span_us([]) is None
    assert dt.span_us(iter(())) is None


def test_span_rejects_reversed_interval():
    with pytest.raises(ValueError):
        dt.span_us([(10.0, 20.0), (30.0, 29.0)])


def test_device_intervals_keep_device_work_only():
    events = [ev(0.0, 500.0, CPU, "cuLaunchKernel"), ev(10.0, 11.0, name="[memset]"), ev(12.0, 200.0),
              ev(5.0, 400.0, name="Stream Sync"), ev(201.0, 390.0)]
    ivs = dt.device_intervals(events, CUDA)
    assert ivs == [(10.0, 11.0), (12.0, 200.0), (201.0, 390.0)]
    assert dt.span_us(ivs) == pytest.approx(380.0)


def test_device_count_sees_every_gpu_of_a_multi_gpu_span():
    # two GPUs' kernels on one clock: one span over both; host records and sync records name no GPU
    events = [ev(0.0, 500.0, CPU, "cuLaunchKernel", index=-1), ev(10.0, 50.0, index=0), ev(12.0, 80.0, index=1),
              ev(5.0, 400.0, name="Stream Sync", index=3)]
    assert dt.device_count(events, CUDA) == 2
    assert dt.span_us(dt.device_intervals(events, CUDA)) == pytest.approx(70.0)
    assert dt.device_count(events[:2], CUDA) == 1 and dt.device_count([], CUDA) == 0


def test_primary_prefers_device_clock():
    jax_rounds = [dt.Timing(1e-3, 1.1e-3, 40), dt.Timing(2e-3, 2.2e-3, 40)]
    assert dt.primary(jax_rounds) == ("cupti", [1e-3, 2e-3])
    torch_rounds = [dt.Timing(3e-3, None), dt.Timing(4e-3, None)]
    assert dt.primary(torch_rounds) == ("cuda_events", [3e-3, 4e-3])


def test_primary_never_mixes_clocks():
    # one round whose trace had no kernel: every round of that implementation falls back to host time
    rounds = [dt.Timing(1e-3, 1.1e-3, 40), dt.Timing(None, 1.3e-3, 0)]
    assert dt.primary(rounds) == ("host", [1.1e-3, 1.3e-3])
    with pytest.raises(ValueError):
        dt.primary([dt.Timing(None, None)])


def test_cupti_timer_time_reads_span_per_call():
    """CuptiTimer.time with the profiler replaced by a fake session (no torch): span / calls, host inside."""
    events = [ev(0.0, 1.0, CPU, "cudaLaunchKernel"), ev(100.0, 101.0), ev(102.0, 2100.0)]
    ran = []

    @contextlib.contextmanager
    def fake_profile(activities):
        ran.append(activities)
        yield SimpleNamespace(events=lambda: events)

    timer = object.__new__(dt.CuptiTimer)
    timer._profile, timer._activities, timer._cuda = fake_profile, ["cpu", "cuda"], CUDA
    t = timer.time(lambda: None, 20)
    assert t.device == pytest.approx(2000.0e-6 / 20) and t.events == 2 and t.host >= 0.0
    assert ran == [["cpu", "cuda"]]
    events[:] = events[:1]  # CUPTI saw no device work: no device time, host time still there
    t = timer.time(lambda: None, 20)
    assert t.device is None and t.events == 0 and t.host is not None


def test_cupti_timer_says_why_not():
    timer, why = dt.cupti_timer()
    assert (timer is None) == bool(why)
    if importlib.util.find_spec("torch") is None:
        assert timer is None and "torch" in why


def test_rows_and_footnote(monkeypatch, capsys):
    monkeypatch.setattr(bench, "REPS", 3)
    dev = iter([1e-3, 2e-3, 3e-3])
    runners = {
        "ours[a]": lambda: dt.Timing(next(dev), 5e-3, 40),
        "ragged_dot+jnp": lambda: dt.Timing(None, 7e-3),  # host-timed
        "torch._grouped_mm": lambda: dt.Timing(4e-3, None),
    }
    row = {"shape": "fc1", "ms": {}, "tflops": {}}
    bench._record(row, bench.time_interleaved(runners, row), 2e12, 24)
    assert row["timing"] == {"ours[a]": "cupti", "ragged_dot+jnp": "host", "torch._grouped_mm": "cuda_events"}
    assert row["ms"]["ours[a]"] == pytest.approx(2.0) and row["host_ms"]["ours[a]"] == pytest.approx(5.0)
    assert row["ms"]["ragged_dot+jnp"] == pytest.approx(7.0) and row["ms"]["torch._grouped_mm"] == pytest.approx(4.0)
    assert "torch._grouped_mm" not in row["host_ms"] and row["device_events"] == {"ours[a]": [40]}
    assert row["samples_ms"]["ours[a]"] == [1.0, 2.0, 3.0] and row["spread_pct"]["ours[a]"] == pytest.approx(100.0)
    assert "host    5.000 ms" in capsys.readouterr().out
    note = bench.timing_note([row])
    assert note.startswith(bench.JAX_ON_DEVICE) and "except ragged_dot+jnp" in note and "CUDA events" in note
    host_row = {"timing": {"ours[a]": "host"}, "cupti_unavailable": "ModuleNotFoundError: No module named 'torch'"}
    assert bench.timing_note([host_row]).startswith("JAX timed on host (wall time of the 20-call program: no CUPTI")
    assert bench.timing_note([{"timing": {"ours[a]": "cupti"}}]) == bench.JAX_ON_DEVICE + "."
