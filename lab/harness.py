"""Shared pieces of the GPU suites (tests/gpu), the lab's GPU tools and benchmarks.

Kernels reach the GPU machine (no CuTe DSL compiler) in one way: a kernel bundle built on a CPU machine from the
`bundle_items` the suites and benchmarks declare (tools/gpu/build_bundle.sh), carried as `.bundle`; the calls go
through the public ops or the primitive, which find their modules there.

Here: whether a GPU suite can run (`skip_without_gpu_or_bundle`), a guard that makes a fallback to the reference an
error (`kernels_only`), the route a block-scaled call takes (`block_scaled_route`, `on_route`), a lab schedule
(`schedule_override`, `under_schedule`, `config_change`) and the layer step under several (`layer_step_ab`), the
NaN-poisoned allocator, the routing patterns the suites run and the tolerance check of a device result against the
float64 oracle (tests/np_ops.py: np_forward_oracle, np_sanitized_ends, np_group_of_rows), and the `sanitize` marker
of the compute-sanitizer subset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import numpy as np

from cudnn_moe_jax.limits import GROUP_ALIGN

# ------------------------------------------------------------------------------------------- GPU, bundle, fallback


def gpu_available() -> bool:
    try:
        import jax

        return bool(jax.devices("gpu"))
    except Exception:  # noqa: BLE001
        return False


def skip_without_gpu_or_bundle(cases_module: str) -> None:
    """Module-level skip of a GPU suite: no GPU, or no kernel bundle (every case would fall back)."""
    import pytest

    from cudnn_moe_jax import _runtime

    if not gpu_available():
        pytest.skip("no GPU", allow_module_level=True)
    if not any(d.is_dir() for d in _runtime.bundle_dirs()):
        pytest.skip(f"no kernel bundle: build one with `bash tools/gpu/build_bundle.sh` (its modules: "
                    f"{cases_module}:bundle_items) and carry `.bundle` to the GPU machine -- without it every case "
                    "would fall back to the reference", allow_module_level=True)


@contextlib.contextmanager
def kernels_only():
    """Inside: a fallback to the reference (a RuntimeWarning at lowering) raises instead of running XLA -- every
    time: the ops warn once per problem and reason, so the record of earlier warnings is cleared on entry (else a
    second test of a problem whose module is missing would run the reference silently and pass)."""
    from cudnn_moe_jax import _primitive

    _primitive._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


BLOCK_SCALED_ROUTES = ("on-chip", "xla-dequant")


@contextlib.contextmanager
def block_scaled_route(name: str):
    """Every block-scaled call traced and lowered inside takes route `name` (BLOCK_SCALED_ROUTES: the dequantizing
    kernel, or XLA's exact conversion then the bf16 kernel; or "staged": converted once inside the bf16 kernel,
    mainloop_staged, wherever it implements the problem (also below the library's size rule), else XLA's) whatever
    `cudnn_moe_jax._dequant_first` would pick for its shape: a GPU suite pins the kernel it tests, the lab times the
    routes (an fp16 A always stays on chip: no exact 16-bit pair)."""
    from cudnn_moe_jax import _dequant_first

    rule, staged = _dequant_first.dequantize_first, _dequant_first.staged_problem
    _dequant_first.dequantize_first = lambda p: name != "on-chip" and p.block_scaled and p.a_dtype != "float16"
    if name == "xla-dequant":
        _dequant_first.staged_problem = lambda p: None
    if name == "staged":
        _dequant_first.staged_problem = lambda p: staged(p, by_size=False)
    try:
        yield
    finally:
        _dequant_first.dequantize_first, _dequant_first.staged_problem = rule, staged


def on_route(route: str, item):
    """An `aot build` item lowered under `block_scaled_route(route)`. Each route needs items of its own (a jitted
    function lowers once: a second route through it would reuse the first's lowering)."""
    def lower():
        with block_scaled_route(route):
            return item()
    return lower


def config_change(applies, **fields):
    """A schedule change for `schedule_override`: the problems where `applies(problem)` run the library's config with
    `fields` replaced."""
    return lambda problem, config: dataclasses.replace(config, **fields) if applies(problem) else None


@contextlib.contextmanager
def schedule_override(change):
    """Every lowering inside runs `change(problem, config)` (a None result, or change None: the config unchanged) as
    its kernel schedule instead of the library's `default_config`: a lab schedule through the public ops. The config
    is in each module's fingerprint, so a bundle built under an override serves the runs under the same override."""
    if change is None:
        yield
        return
    from cudnn_moe_jax.kernels import sm90
    from cudnn_moe_jax.kernels.sm90 import config as sm90_config

    library = sm90_config.default_config

    def default_config(problem):
        config = library(problem)
        return change(problem, config) or config

    sm90_config.default_config = sm90.default_config = default_config
    try:
        yield
    finally:
        sm90_config.default_config = sm90.default_config = library


def under_schedule(change, item):
    """An `aot build` item lowered under `schedule_override(change)`."""
    def lower():
        with schedule_override(change):
            return item()
    return lower


def layer_step_ab(configs, schedules: dict) -> None:
    """bench_moe_layer's own step (`nn.moe_layer`) on `configs` under each of `schedules` (label -> a change for
    `schedule_override`, the first the baseline), alternated bench_moe_layer.REPS times in one process (each
    schedule lowers its own step: JAX caches a lowering per function); median device time per schedule."""
    import statistics

    from benchmarks import bench_moe_layer as bml
    from lab import device_timer

    timer, why = device_timer.cupti_timer()
    if timer is None:
        raise SystemExit(f"no CUPTI timer: {why}")
    base = next(iter(schedules))
    for name in configs:
        t, h, i, e, k = bml.CONFIGS[name]
        avals = bml._avals(name)
        runners = {}
        for label, change in schedules.items():
            with schedule_override(change):
                runners[label], fallbacks = bml._jax_runner(bml.ours_step(k), avals, timer, device_timer)
            if fallbacks:
                raise SystemExit(f"{name} {label}: reference fallback: {fallbacks}")
        samples = {label: [] for label in runners}
        for _ in range(bml.REPS):
            for label, once in runners.items():
                samples[label].append(once())
        ms = {label: statistics.median(device_timer.primary(v)[1]) * 1e3 for label, v in samples.items()}
        for label in runners:
            print(f"{name:5s} {label:12s} {ms[label]:9.3f} ms {bml.useful_flops(t, h, i, k) / ms[label] / 1e9:7.1f} "
                  f"useful TFLOP/s, speed vs {base}: {ms[base] / ms[label]:.3f}", flush=True)


def poison_allocator(nbytes: int = 256 << 20) -> None:
    """Hand XLA's allocator a NaN-filled block: outputs a kernel forgets to write then read NaN, not zeros."""
    import jax.numpy as jnp

    x = jnp.full((nbytes // 4,), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


def run_twice(fn, *args):
    """(first, second) result of two calls of `fn` (jitted by the caller), the allocator poisoned with NaN before
    each and a fallback to the reference an error: the caller compares both with the oracle and with each other."""
    import jax

    with kernels_only():
        poison_allocator()
        first = jax.block_until_ready(fn(*args))
        poison_allocator()
        second = jax.block_until_ready(fn(*args))
    return first, second


def repeat_differences(first: dict, second: dict) -> list:
    """["<key>: two calls differ"] for each output of `run_twice`'s two results whose bytes differ (None: absent)."""
    import numpy as np

    return [f"{key}: two calls differ" for key, g in first.items() if g is not None
            and not np.array_equal(np.asarray(g).view(np.uint8), np.asarray(second[key]).view(np.uint8))]


def sanitize_params(params, sanitize) -> list:
    """pytest params from (id, values) pairs; those whose id is in `sanitize` carry the `sanitize` mark: the small
    subset run under compute-sanitizer (`pytest -m sanitize`, tools/gpu/run_all.sh)."""
    import pytest

    return [pytest.param(*values, id=name, marks=[pytest.mark.sanitize] if name in sanitize else [])
            for name, values in params]


# ------------------------------------------------------------------------------------------- routing patterns


PATTERNS = {
    # name -> function(m, L) -> offsets (int list)
    "uniform": lambda m, L: [(g + 1) * (m // L) // GROUP_ALIGN * GROUP_ALIGN for g in range(L - 1)] + [m],
    "empty_experts": lambda m, L: [0] + [m // 2 // GROUP_ALIGN * GROUP_ALIGN] * (L - 2) + [m],
    "one_expert": lambda m, L: [0] * (L - 1) + [m],
    "first_only": lambda m, L: [m] * L,
    "skewed": lambda m, L: list(np.cumsum(_skew_sizes(m, L))),
    "m_gt_valid": lambda m, L: [(g + 1) * (m // 2 // L) // GROUP_ALIGN * GROUP_ALIGN for g in range(L)],
    "unsanitized": lambda m, L: ([300, 100, 10 * m, m - 200] + [m] * L)[:L],
}


def offsets_for(pattern: str, m: int, L: int) -> list:
    """The pattern's offsets, cut or padded (with m) to exactly L entries."""
    return [int(x) for x in (list(PATTERNS[pattern](m, L)) + [m] * L)[:L]]


def _skew_sizes(m: int, L: int):
    blocks = m // GROUP_ALIGN
    w = np.array([2.0 ** -g for g in range(L)])
    sizes = np.floor(w / w.sum() * blocks).astype(int)
    sizes[0] += blocks - sizes.sum()
    return (sizes * GROUP_ALIGN).tolist()


# ------------------------------------------------------------------------------------------- tolerance


RTOL = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 3e-5}
ULP = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 2 ** -24}   # half an output step, relative
SUBNORMAL_STEP = {"bfloat16": 2.0 ** -133, "float16": 2.0 ** -24, "float32": 2.0 ** -149}


def compare(name: str, got, ref, dtype: str, valid_rows=None) -> list:
    """Problems found comparing `got` (device result) with the float64 `ref` (list of strings, empty = ok)."""
    errs = []
    got = np.asarray(got).astype(np.float64)
    if got.shape != ref.shape:
        return [f"{name}: shape {got.shape} != {ref.shape}"]
    if not np.isfinite(got).all():
        errs.append(f"{name}: {int((~np.isfinite(got)).sum())} non-finite values")
    if valid_rows is not None and (~valid_rows).any():
        outside = got[~valid_rows]
        if np.any(outside != 0):
            errs.append(f"{name}: {int((outside != 0).sum())} nonzero values in rows outside every group")
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    tol = 1e-5 * scale + RTOL[dtype] * np.abs(ref)
    bad = np.abs(got - ref) > tol
    if bad.any():
        idx = np.argwhere(bad)[:3].tolist()
        errs.append(f"{name}: {int(bad.sum())}/{bad.size} elements out of tolerance, e.g. at {idx}: got "
                    f"{[got[tuple(i)] for i in idx]} ref {[ref[tuple(i)] for i in idx]}")
    return errs
