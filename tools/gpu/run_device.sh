#!/usr/bin/env bash
# The kernel lab's device call: GPU tests, the benchmark with the lab's other configurations, ncu, the forward
# compute-sanitizer subsets. Writes logs/results to $OUT. Every script runs from the checkout's root.
#   run (carry .runtime .bundle):  bash tools/gpu/run_device.sh [tests|bench|ncu|sanitize ...]
#   (.bundle: `bash tools/gpu/build_bundle.sh .bundle lab.bench_kernels:bundle_items`: the suites' modules plus
#    the lab's benchmark kernels, lab/bench_kernels.py)
#   MXFP8:  bash tools/gpu/run_device.sh mxtests mxbench mxncu mxsrc mxsanitize
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/kgpu_out}; mkdir -p "$OUT"
steps=${*:-tests bench ncu sanitize}
# uuid: whether two runs shared a physical GPU
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
  --format=csv,noheader
[ -n "${SKIP_INFO:-}" ] || python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
skip=
for s in $steps; do
  if [ -n "$skip" ] && [ "$s" != mxsanitize ]; then echo "$s skipped ($skip)"; continue; fi
  case $s in
    tests)
      timeout -s KILL 220 python3 -m pytest tests/gpu -q -rf -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
      echo "tests rc=$?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
      grep -E "^FAILED" "$OUT/gpu_tests.log" | head -30 ;;
    bench)
      timeout -s KILL ${BENCH_TIMEOUT:-240} python3 -m benchmarks.bench_grouped_gemm --lab --out "$OUT/bench" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
      echo "bench rc=$?"; tail -12 "$OUT/bench.log" ;;
    ncu)
      specs=${NCU_SPECS:-"ours:fc1_t256c21:^kernel_cutlass_kernel_ ours:fc2_t256c21:^kernel_cutlass_kernel_ torch:fc2:^(?!prepare)"}
      for spec in $specs; do
        IFS=: read -r k1 k2 k3 <<< "$spec"; set -- "$k1" "$k2" "$k3"
        timeout -s KILL 100 ncu --clock-control none --kernel-name "regex:$3" --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section WarpStateStats \
          python3 -m lab.profile_one $1 $2 > "$OUT/ncu_$1_$2.log" 2>&1
        echo "ncu $1 $2 rc=$?"; grep -E "^  [a-zA-Z_]|Duration|Throughput|SM Frequency|Hit Rate|Grid Size|Cluster Size|Block Limit|Waves" "$OUT/ncu_$1_$2.log" | cut -c1-150 | head -24
      done ;;
    mxtests)  # MXFP8 kernels vs the float64 oracle (one line per test: a killed run still tells)
      timeout -s KILL ${MXTESTS_TIMEOUT:-100} python3 -m pytest tests/gpu/test_mxfp8_gpu.py -v -s -rf --tb=line \
        -p no:cacheprovider > "$OUT/mxfp8_tests.log" 2>&1
      echo "mxtests rc=$?"; grep -cE " PASSED" "$OUT/mxfp8_tests.log"; grep -E "FAILED|worst|passed|failed" \
        "$OUT/mxfp8_tests.log" | cut -c1-400 | tail -25
      # nothing passed (a hang or a crash of every case): the timing steps would only burn device time
      grep -q " PASSED" "$OUT/mxfp8_tests.log" || skip="no MXFP8 test passed" ;;
    mxbench)
      timeout -s KILL ${MXBENCH_TIMEOUT:-240} python3 -m benchmarks.bench_grouped_gemm --mxfp8 --lab --out "$OUT/bench" \
        > "$OUT/mxfp8_bench.log" 2>&1
      echo "mxbench rc=$?"; grep -vE "^\s*$" "$OUT/mxfp8_bench.log" | cut -c1-300 | tail -40 ;;
    mxncu)  # where the time goes: pipe utilisation and warp stalls of an MXFP8 kernel. Own process group, killed
            # whole at the deadline: a killed ncu otherwise leaves its profiled python holding the GPU.
      setsid ncu --clock-control none --kernel-name "regex:^kernel_cutlass_kernel_" --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section MemoryWorkloadAnalysis \
        python3 -m lab.profile_one mx ${MXNCU_TARGET:-fc1_bf16d} > "$OUT/ncu_mx.log" 2>&1 &
      pid=$!; ( sleep ${MXNCU_TIMEOUT:-100}; kill -KILL -$pid 2>/dev/null ) & killer=$!
      wait $pid; echo "mxncu rc=$?"; kill $killer 2>/dev/null
      # ncu needed > 40 s to reach its first replay pass of the fc1 kernel (run 6); give it ~100 s
      grep -E "Duration|Throughput|SM Frequency|Pipe|Stall|Issue|Executed Ipc|Warp Cycles|Eligible|Active" \
        "$OUT/ncu_mx.log" | cut -c1-140 | head -45
      grep -E "Shared|Bank|L1|L2" "$OUT/ncu_mx.log" | cut -c1-140 | head -25 ;;
    mxsrc)  # per-instruction warp stalls (PC sampling) of one kernel: which SASS line the warps wait on
            # (MXNCU_KIND=fmt MXNCU_TARGET=fc1_nvfp4_default: a block-scaled schedule of lab.bench_kernels);
            # read it with `python -m lab.pc_samples $OUT/mxsrc_sass.csv [another profile's csv]`
      setsid ncu --clock-control none --kernel-name "regex:^kernel_cutlass_kernel_" --launch-skip 2 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --import-source no \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -o "$OUT/mxsrc" -f \
        python3 -m lab.profile_one ${MXNCU_KIND:-mx} ${MXNCU_TARGET:-fc1_bf16d} > "$OUT/ncu_mxsrc.log" 2>&1 &
      pid=$!; ( sleep ${MXNCU_TIMEOUT:-100}; kill -KILL -$pid 2>/dev/null ) & killer=$!
      wait $pid; echo "mxsrc rc=$?"; kill $killer 2>/dev/null
      ncu -i "$OUT/mxsrc.ncu-rep" --page raw --csv --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        > "$OUT/mxsrc_stalls.csv" 2>&1
      ncu -i "$OUT/mxsrc.ncu-rep" --page source --csv --print-source sass > "$OUT/mxsrc_sass.csv" 2>&1
      echo "source page rc=$? $(wc -l < "$OUT/mxsrc_sass.csv") lines" ;;
    mxsanitize)  # the MXFP8 suite's `sanitize` subset under memcheck
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s KILL ${MXSAN_TIMEOUT:-80} compute-sanitizer --tool memcheck \
        --kernel-name kns=GroupedGemmSm90 --error-exitcode 9 python3 -m pytest tests/gpu/test_mxfp8_gpu.py \
        -m sanitize -q -rf -p no:cacheprovider --tb=line > "$OUT/mxfp8_memcheck.log" 2>&1
      echo "mxsanitize rc=$?"; grep -E "ERROR SUMMARY|passed|failed|Error|error" "$OUT/mxfp8_memcheck.log" | tail -6 ;;
    sanitize)  # the bf16 / fp16 forward suite's `sanitize` subset under memcheck and racecheck
      export XLA_PYTHON_CLIENT_PREALLOCATE=false
      for tool in memcheck racecheck; do
        timeout -s KILL 120 compute-sanitizer --tool $tool --kernel-name kns=GroupedGemmSm90 --error-exitcode 9 \
          python3 -m pytest tests/gpu/test_grouped_gemm_gpu.py -m sanitize -q -rf -p no:cacheprovider --tb=line \
          > "$OUT/$tool.log" 2>&1
        echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Error|error" "$OUT/$tool.log" | tail -6
      done ;;
  esac
done
