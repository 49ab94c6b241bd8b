"""The kernel lab: what tests, tools and benchmarks share, and the kernel experiments.

  harness          GPU-suite helpers: skip rules, the fallback guard, the NaN-poisoned allocator, routing
                   patterns, the tolerance check, the compute-sanitizer marker
  *_cases          the GPU suites' case tables and the bundle items that record their kernel modules
                   (forward_cases: kernel-level (problem, config) cases through the primitive; dgrad / wgrad /
                   public_ops / blockscaled / discrete / fp4_out / padfree / nn_grads: the public ops and nn)
  sass             also `check_sass`, the compile tests' SASS check
  bench_kernels    the benchmark's other schedules (`benchmarks.bench_grouped_gemm --lab`, ncu)
  device_timer     device time of a jitted program from the CUPTI timeline (benchmarks, tests)
  sass, compile_cases, sass_snapshot   SASS of compiled modules; the byte-identity check of a restructuring
  profile_one, probe_launch_overhead, trace_launch_gaps   single-kernel runs for ncu and launch-gap probes

Not part of the installed product: `cudnn_moe_jax` never imports it. Scripts run from the checkout's root
(`python -m lab.<module>`); the tests import it through tests/conftest.py, which puts the root on sys.path.
"""
