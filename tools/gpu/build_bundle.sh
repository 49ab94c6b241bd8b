#!/usr/bin/env bash
# CPU machine (nvidia-cutlass-dsl installed): the one bundle tools/gpu/run_all.sh needs -- the modules of every
# `bundle_items` the GPU suites, the examples and the benchmarks lower (the kernel-level suites' cases included:
# lab.forward_cases) -- then a check that every item finds its module with compiling disabled (as on the GPU
# machine). Extra variant sets (e.g. the lab's benchmark kernels) go after the folder:
#   bash tools/gpu/build_bundle.sh [OUT_DIR=.bundle [MODULE:ATTR ...]]
#   bash tools/gpu/build_bundle.sh .bundle lab.bench_kernels:bundle_items    # + run_device.sh's bench / ncu kernels
# Then: python tools/fetch_runtime.py (.runtime) and, for the benchmark's tokamax row, the peers' wheels in .peers;
# carry .bundle .runtime .peers and run `bash tools/gpu/run_all.sh`. Kernel sources are in every fingerprint:
# rebuild after any edit under cudnn_moe_jax/kernels/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a
out=${1:-.bundle}
sets="lab.forward_cases:bundle_items lab.wgrad_cases:bundle_items lab.dgrad_cases:bundle_items
  lab.public_ops_cases:bundle_items lab.blockscaled_cases:bundle_items lab.discrete_cases:bundle_items
  lab.fp4_out_cases:bundle_items lab.padfree_cases:bundle_items lab.gather_cases:bundle_items
  lab.nn_grads_cases:bundle_items lab.bench_gather:bundle_items lab.bench_layer_bound:bundle_items
  lab.bench_staged:bundle_items
  examples.moe_expert_parallel:bundle_items benchmarks.bench_moe_step:bundle_items benchmarks.bench_moe_ops:bundle_items
  benchmarks.bench_moe_layer:bundle_items benchmarks.bench_cases:bundle_items benchmarks.bench_ep:bundle_items ${*:2}"
python -m cudnn_moe_jax.aot build --arch sm_90a --out "$out" --variants $sets
python -m tools.gpu.check_bundle "$out" $sets
