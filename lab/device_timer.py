"""Device time of a jitted JAX program, from the CUPTI kernel timeline (read through torch.profiler).

Host wall time around `jax.block_until_ready(program(...))` charges the program's host-side dispatch and
completion to the kernels: on the H200 that is ~1-2 ms per 20-call program outside the kernel timeline
(RESULTS.md run 8: fc1 1247 us/call on the device, 1349 us/call host-timed). CUPTI records every kernel of the
process, JAX's included, with GPU timestamps, so (end of the last device event - start of the first) over one
profiled program execution is the device time of that program: profiler start/stop, dispatch and the host's
wait are outside it, and the ~1 us gaps between the program's kernels are inside it (they are part of running
the program back to back). torch is only the CUPTI front end here; lab/trace_launch_gaps.py reads the
same trace the same way. Without torch or CUPTI, `cupti_timer()` says why and callers time on the host.

A program over several GPUs of one process (a jitted shard_map): CUPTI stamps every device's events on one
clock (CUPTI's timestamps are process-wide, not per device), so the same span is first start on any GPU to last
end on any GPU, i.e. the mesh's wall time on the device side, launch skew between the GPUs included;
`Timing.devices` says how many GPUs had events in it.

The pure helpers (`span_us`, `device_intervals`, `device_count`, `primary`) take plain values or duck-typed events, so they are
testable without torch or a GPU (tests/test_bench_timer.py).
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Iterable, NamedTuple, Optional, Sequence


class Timing(NamedTuple):
    """One timed execution, per call (seconds). None where that clock was not read."""

    device: Optional[float]  # device clock: CUPTI span (JAX) or CUDA events (torch)
    host: Optional[float]  # host wall clock, dispatch to block_until_ready (JAX only)
    events: Optional[int] = None  # device events in the CUPTI span (None: no CUPTI)
    devices: Optional[int] = None  # distinct GPUs with events in the span (a multi-GPU program must show all)


# Kineto reports CUDA synchronization records (opt-in `enable_cuda_sync_events`) with the CUDA device type,
# but their timestamps are the host's wait, not device work: never let one stretch the span.
SYNC_EVENT_NAMES = frozenset({"Event Sync", "Stream Sync", "Context Sync", "Stream Wait Event", "Unknown Sync"})


def span_us(intervals: Iterable[tuple[float, float]]) -> Optional[float]:
    """Last end - first start over (start, end) pairs (us); None for no pair (CUPTI saw nothing, which
    must not read as zero time). The pairs may overlap (concurrent streams) and come in any order."""
    pairs = list(intervals)
    if not pairs:
        return None
    bad = [(s, e) for s, e in pairs if e < s]
    if bad:
        raise ValueError(f"device events ending before they start: {bad[:3]}")
    return max(e for _, e in pairs) - min(s for s, _ in pairs)


def device_intervals(events: Iterable, cuda_type) -> list[tuple[float, float]]:
    """(start, end) in us of every device event (kernels, memsets, memcpys: all device work of the
    program) among torch.profiler FunctionEvents; `cuda_type` is torch.autograd.DeviceType.CUDA."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.device_type == cuda_type and e.name not in SYNC_EVENT_NAMES]


def device_count(events: Iterable, cuda_type) -> int:
    """Distinct device indices among the device events (as `device_intervals` selects them): a span over a
    multi-GPU program is only that program's time if every GPU of its mesh shows up here."""
    return len({getattr(e, "device_index", None) for e in events
                if e.device_type == cuda_type and e.name not in SYNC_EVENT_NAMES})


def primary(samples: Sequence[Timing]) -> tuple[str, list[float]]:
    """(method, per-round seconds) to report for one implementation's rounds: the device clock when every
    round has it ("cupti" for JAX, "cuda_events" for torch), else the host clock for all rounds ("host":
    one round without kernels in its trace would otherwise mix host and device times in one median)."""
    if all(s.device is not None for s in samples):
        return ("cupti" if all(s.host is not None for s in samples) else "cuda_events"), [s.device for s in samples]
    if any(s.host is None for s in samples):
        raise ValueError("a round has neither a device nor a host time")
    return "host", [s.host for s in samples]


def host_time(run: Callable[[], object], calls: int) -> Timing:
    """Host wall time of `run` (which must block until the device is done), per call."""
    t0 = time.perf_counter()
    run()
    return Timing(None, (time.perf_counter() - t0) / calls)


class CuptiTimer:
    """Times one program execution per `time()` call, each in its own profiler session: a session holds
    only that execution's device events, so no boundary between programs has to be guessed."""

    def __init__(self):
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        supported = getattr(torch.profiler, "supported_activities", lambda: {ProfilerActivity.CUDA})()
        if ProfilerActivity.CUDA not in supported:
            raise RuntimeError("this torch.profiler has no CUDA (CUPTI) activity")
        # One session per program by design; the warning about events cleared between cycles is expected.
        warnings.filterwarnings("ignore", message=".*[Pp]rofiler clears events.*")
        self._profile = profile
        # CPU as well, as in trace_launch_gaps.py (the combination run 8 validated); no torch op runs, so it
        # records only the CUDA API calls, on the host side, outside the device span.
        self._activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        self._cuda = DeviceType.CUDA

    def time(self, run: Callable[[], object], calls: int) -> Timing:
        """Device span (CUPTI) and host wall time of `run` (which must block until the device is done),
        per call. The host time is read inside the session, so it excludes the profiler's start and stop
        but includes CUPTI's small per-launch cost on the host; the device span excludes both."""
        with self._profile(activities=self._activities) as prof:
            t0 = time.perf_counter()
            run()
            host = time.perf_counter() - t0
        events = prof.events()
        ivs = device_intervals(events, self._cuda)
        span = span_us(ivs)
        return Timing(None if span is None else span * 1e-6 / calls, host / calls, len(ivs),
                      device_count(events, self._cuda))


def cupti_timer() -> tuple[Optional[CuptiTimer], str]:
    """(timer, "") or (None, why not): torch missing, no CUDA device for torch, or no CUPTI in its profiler."""
    try:
        return CuptiTimer(), ""
    except Exception as e:  # noqa: BLE001 -- any failure here only means: time on the host
        return None, f"{type(e).__name__}: {e}"


def config_main(run: Callable, doc: str, default_configs: str, argv=None) -> None:
    """The command line of the lab's microbenchmarks over benchmark configs: `--configs a,b,...`, then
    run(name, timer) per config with a CUPTI timer (exits without one)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=default_configs)
    args = ap.parse_args(argv)
    timer, why = cupti_timer()
    if timer is None:
        raise SystemExit(f"no CUPTI timer: {why}")
    for name in args.configs.split(","):
        run(name, timer)
