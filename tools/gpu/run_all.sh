#!/usr/bin/env bash
# One device call that runs every GPU check of the repo, each step under its own `timeout -s KILL`, logs in $OUT,
# a compact summary on stdout. Needs, carried into the repo root (all git-ignored):
#   .bundle   tools/gpu/build_bundle.sh (every module the steps lower; checked with compiling disabled)
#   .runtime  python tools/fetch_runtime.py (libcute_dsl_runtime.so.xz)
#   .peers    tokamax + deps for the step benchmark (optional; without it the benchmark reports tokamax unavailable)
# Use:  OUT=... bash tools/gpu/run_all.sh [tests blockscaled discrete fp4out padfree kernels sanitize ep bench
#   bench_layer bench_ep]   (default: all, in this order; `kgpu` is the old name of `kernels`). Every script runs
# from the checkout's root (PYTHONPATH=$PWD: the checkout's cudnn_moe_jax, lab, benchmarks). Each step fits one
# 10-minute device call.
# Expected (H200, warm caches not assumed): tests ~4 min, blockscaled ~5 min, discrete ~4 min, fp4out ~6 min,
# padfree ~2 min, kernels ~3 min, sanitize ~3 min, ep ~1 min, bench ~5 min, bench_layer ~5 min, bench_ep ~2 min
# (estimates: the bundle-based kernels / padfree steps have not yet run on a GPU).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_all_out}; mkdir -p "$OUT"
if compgen -G ".peers/wheels/*.whl" > /dev/null; then   # tokamax for the benchmark's peer row (no registry here)
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers_site .peers/wheels/*.whl > "$OUT/peers.log" 2>&1
  export PYTHONPATH=/tmp/peers_site:$PWD/.peers/stub:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
steps=${*:-tests blockscaled discrete fp4out padfree kernels sanitize ep bench bench_layer bench_ep}
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
[ -f .bundle/manifest.json ] && echo "bundle: $(grep -c '"file"' .bundle/manifest.json) module(s)" || echo "NO .bundle"
[ -d .runtime ] || echo "NO .runtime (python tools/fetch_runtime.py)"

summary() {  # $1 log: pytest counts and the FAILED lines
  grep -E "^(FAILED|ERROR) " "$1" | cut -c1-300 | head -30
  grep -E "[0-9]+ (passed|failed|skipped|error)" "$1" | tail -1
}

sanitizer_summary() {  # $1 log of compute-sanitizer around pytest: the tool's summary, failures, pytest counts
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAILED|[0-9]+ (passed|failed|deselected)|Error" "$1" | cut -c1-300 | tail -8
}

for s in $steps; do
  case $s in
    tests)  # dgrad, wgrad (bf16 and block-scaled), public ops + main job, nn grads: modules from .bundle, no fallback
            # allowed
      timeout -s KILL ${TESTS_TIMEOUT:-420} python3 -m pytest tests/gpu/test_dgrad_gpu.py tests/gpu/test_wgrad_gpu.py \
        tests/gpu/test_public_ops_gpu.py tests/gpu/test_nn_grads_gpu.py -q -rf -p no:cacheprovider --tb=short \
        > "$OUT/tests.log" 2>&1
      echo "== tests rc=$?"; summary "$OUT/tests.log" ;;
    blockscaled)  # block-scaled inputs (NVFP4 / MXFP4 / MXFP8) on the dequantizing kernel: every case vs the float64
      # oracle (exact inputs bit-identical), then TFLOP/s by input format beside bf16
      timeout -s KILL ${BS_TIMEOUT:-420} python3 -m pytest tests/gpu/test_blockscaled_gpu.py -q -rf -p no:cacheprovider \
        --tb=line > "$OUT/blockscaled.log" 2>&1
      echo "== blockscaled rc=$?"; summary "$OUT/blockscaled.log"
      timeout -s KILL ${FMT_TIMEOUT:-300} python3 -m benchmarks.bench_grouped_gemm --formats mxfp8,nvfp4,mxfp4,w_nvfp4,w_mxfp8,w16_nvfp4 \
        --out "$OUT/formats" > "$OUT/formats.log" 2>&1
      echo "== formats rc=$?"; grep -E "TFLOP/s|time bf16" "$OUT/formats.log" | cut -c1-200 | tail -40 ;;
    discrete)  # discrete weights (b_tensors): every case vs the float64 oracle and bit-identical to stacked, the
      # --discrete benchmark row (fc1 / small, target <= 1.03x stacked), memcheck + racecheck of the suite's
      # `sanitize` subset (`kernelssm90`: the descriptor-table kernel and the GEMM)
      timeout -s KILL ${DISCRETE_TIMEOUT:-150} python3 -m pytest tests/gpu/test_discrete_gpu.py -q -rf \
        -p no:cacheprovider --tb=line > "$OUT/discrete.log" 2>&1
      echo "== discrete rc=$?"; summary "$OUT/discrete.log"
      timeout -s KILL ${DBENCH_TIMEOUT:-200} python3 -m benchmarks.bench_grouped_gemm --discrete --out "$OUT/discrete" \
        > "$OUT/discrete_bench.log" 2>&1
      echo "== discrete bench rc=$?"; grep -E "TFLOP/s|discrete / stacked" "$OUT/discrete_bench.log" | cut -c1-200 | tail -8
      for tool in memcheck racecheck; do
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s KILL ${DSAN_TIMEOUT:-90} compute-sanitizer --tool $tool \
          --kernel-name kns=kernelssm90 --error-exitcode 9 python3 -m pytest tests/gpu/test_discrete_gpu.py \
          -m sanitize -q -rf -p no:cacheprovider --tb=line > "$OUT/discrete_$tool.log" 2>&1
        echo "== discrete $tool rc=$?"; sanitizer_summary "$OUT/discrete_$tool.log"
      done ;;
    fp4out)  # FP4 outputs: the Hadamard op and MXFP4 D vs the float64 oracle (pm1 / exact inputs bit-identical),
      # memcheck + racecheck of the suite's `sanitize` subset, then the Hadamard op's cost over the plain GLU
      # (fc1 / small)
      timeout -s KILL ${FP4_TIMEOUT:-240} python3 -m pytest tests/gpu/test_fp4_out_gpu.py -q -rf -p no:cacheprovider \
        --tb=line > "$OUT/fp4out.log" 2>&1
      echo "== fp4out rc=$?"; summary "$OUT/fp4out.log"
      for tool in memcheck racecheck; do
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s KILL ${FSAN_TIMEOUT:-100} compute-sanitizer --tool $tool \
          --kernel-name kns=GroupedGemmSm90 --error-exitcode 9 python3 -m pytest tests/gpu/test_fp4_out_gpu.py \
          -m sanitize -q -rf -p no:cacheprovider --tb=line > "$OUT/fp4_$tool.log" 2>&1
        echo "== fp4 $tool rc=$?"; sanitizer_summary "$OUT/fp4_$tool.log"
      done
      timeout -s KILL ${HAD_TIMEOUT:-150} python3 -m benchmarks.bench_grouped_gemm --hadamard nvfp4,bf16 \
        --out "$OUT/hadamard" > "$OUT/hadamard.log" 2>&1
      echo "== hadamard bench rc=$?"; grep -E "time / glu|\|" "$OUT/hadamard.log" | cut -c1-250 | tail -14 ;;
    padfree)  # padding-free expert groups (m_aligned < 256): every M-grouped op and wgrad vs the float64 oracle
      timeout -s KILL ${PADFREE_TIMEOUT:-240} python3 -m pytest tests/gpu/test_padfree_gpu.py -q -rf \
        -p no:cacheprovider --tb=line > "$OUT/padfree.log" 2>&1
      echo "== padfree rc=$?"; summary "$OUT/padfree.log"
      # gathered operands (a_index / b_index): every M-grouped op and wgrad, bit-identical to the op on the
      # gathered rows and vs the float64 oracle
      timeout -s KILL ${GATHER_TIMEOUT:-240} python3 -m pytest tests/gpu/test_gather_gpu.py -q -rf \
        -p no:cacheprovider --tb=line > "$OUT/gather.log" 2>&1
      echo "== gather rc=$?"; summary "$OUT/gather.log" ;;
    kernels|kgpu)  # the kernel-level suites: every forward case (lab/forward_cases.py) through the primitive
      timeout -s KILL ${KERNELS_TIMEOUT:-300} python3 -m pytest tests/gpu/test_grouped_gemm_gpu.py \
        tests/gpu/test_mxfp8_gpu.py -q -rf -p no:cacheprovider --tb=line > "$OUT/kernels.log" 2>&1
      echo "== kernels rc=$?"; summary "$OUT/kernels.log" ;;
    sanitize)  # the backward and padding-free suites' `sanitize` subset under memcheck and racecheck (exit 9: a
               # sanitizer error; 1: a failed test)
      for tool in memcheck racecheck; do
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s KILL ${SAN_TIMEOUT:-240} compute-sanitizer --tool $tool \
          --kernel-name kns=GroupedGemmSm90 --error-exitcode 9 python3 -m pytest tests/gpu/test_dgrad_gpu.py \
          tests/gpu/test_wgrad_gpu.py tests/gpu/test_padfree_gpu.py tests/gpu/test_gather_gpu.py -m sanitize -q -rf \
          -p no:cacheprovider \
          --tb=line > "$OUT/sanitize_$tool.log" 2>&1
        echo "== $tool rc=$?"; sanitizer_summary "$OUT/sanitize_$tool.log"
      done ;;
    ep)  # the expert-parallel example on this one GPU (the run its bundle_items record); a fallback fails the step
      timeout -s KILL ${EP_TIMEOUT:-180} python3 examples/moe_expert_parallel.py --devices 1 > "$OUT/ep.log" 2>&1
      rc=$?; grep -q "no GPU kernel" "$OUT/ep.log" && rc="$rc FALLBACK to the reference"
      echo "== ep rc=$rc"; grep -E "^backend|^loss|^timing|no GPU kernel|Error" "$OUT/ep.log" | cut -c1-300 | tail -6 ;;
    bench)
      timeout -s KILL ${STEP_TIMEOUT:-360} python3 -m benchmarks.bench_moe_step --breakdown --out "$OUT" > "$OUT/step.log" 2>&1
      echo "== bench_moe_step rc=$?"; grep -vE "^\s*$" "$OUT/step.log" | grep -vE "Warning|Autotuning" | cut -c1-250 | tail -30
      timeout -s KILL ${OPS_TIMEOUT:-240} python3 -m benchmarks.bench_moe_ops --shape fc > "$OUT/ops.log" 2>&1
      echo "== bench_moe_ops rc=$?"; grep -vE "^\s*$" "$OUT/ops.log" | grep -vE "Warning" | cut -c1-250 | tail -18 ;;
    bench_layer)  # the routed layer's step: padding-free vs 256-padded vs ragged_dot / tokamax / torch, memory
      timeout -s KILL ${LAYER_TIMEOUT:-480} python3 -m benchmarks.bench_moe_layer --out "$OUT/layer" \
        > "$OUT/layer.log" 2>&1
      rc=$?; grep -q "no GPU kernel" "$OUT/layer.log" && rc="$rc FALLBACK to the reference"
      echo "== bench_moe_layer rc=$rc"; grep -vE "^\s*$" "$OUT/layer.log" | grep -vE "Warning" | cut -c1-250 | tail -24 ;;
    bench_ep)  # EP weak scaling, device-timed: 1 GPU, and 1 vs 2 where two are visible (NCCL env left as set)
      ngpu=$(python3 -c "import jax; print(jax.device_count())" 2>/dev/null | tail -1); ngpu=${ngpu:-1}
      devs=1; [ "$ngpu" -ge 2 ] && devs=1,2
      timeout -s KILL ${EP_BENCH_TIMEOUT:-300} python3 -m benchmarks.bench_ep --devices $devs --out "$OUT" \
        > "$OUT/bench_ep.log" 2>&1
      rc=$?; grep -q "no GPU kernel" "$OUT/bench_ep.log" && rc="$rc FALLBACK to the reference"
      echo "== bench_ep --devices $devs rc=$rc"; grep -E "^(backend|JAX timed|\|)|^WARNING|no GPU kernel|Error" \
        "$OUT/bench_ep.log" | cut -c1-300 | tail -12 ;;
    *) echo "unknown step $s (tests blockscaled discrete fp4out padfree kernels sanitize ep bench bench_layer bench_ep)" ;;
  esac
done
