#!/usr/bin/env bash
# CPU machine (nvidia-cutlass-dsl installed): the one bundle tools/gpu/run_all.sh needs, then a check that every
# item finds its module with compiling disabled (as on the GPU machine), then the kgpu artifacts.
#   bash tools/gpu/build_bundle.sh [OUT_DIR=.bundle]        (SKIP_ARTIFACTS=1: no .out/kgpu)
# Then: python tools/fetch_runtime.py (.runtime) and, for the benchmark's tokamax row, the peers' wheels in .peers;
# carry .bundle .runtime .peers .out/kgpu and run `bash tools/gpu/run_all.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a
out=${1:-.bundle}
sets="tests.gpu.wgrad_cases:bundle_items tests.gpu.dgrad_cases:bundle_items tests.gpu.public_ops_cases:bundle_items
  tests.gpu.blockscaled_cases:bundle_items tests.gpu.discrete_cases:bundle_items tests.gpu.fp4_out_cases:bundle_items
  tests.gpu.nn_grads_cases:bundle_items tests.gpu.padfree_cases:bundle_items tools.gpu.sanitize_backward:bundle_items
  examples.moe_expert_parallel:bundle_items benchmarks.bench_moe_step:bundle_items benchmarks.bench_moe_ops:bundle_items
  benchmarks.bench_moe_layer:bundle_items
  benchmarks.bench_cases:bundle_items
  benchmarks.bench_ep:bundle_items"
python -m cudnn_moe_jax.aot build --arch sm_90a --out "$out" --variants $sets
python tools/gpu/check_bundle.py "$out" $sets
[ -n "${SKIP_ARTIFACTS:-}" ] || python tools/gpu/build_artifacts.py
