"""Check on the CPU machine that a bundle serves variant sets as the GPU machine will use it: every item (the
`aot build` items, e.g. the jitted functions a test or example runs) lowered for CUDA with compiling disabled and
no module cache must find every module in the bundle (a miss would be a reference fallback on the GPU).

    python -m tools.gpu.check_bundle .bundle lab.nn_grads_cases:bundle_items examples.moe_expert_parallel:bundle_items

(from the checkout's root: the variant sets are modules of the checkout, imported as `aot build` imports them).

Exit status 1 if any item misses a module (each miss is printed with the op and fingerprint).
"""

from __future__ import annotations

import os
import sys
import warnings


def main(argv) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    # as on the GPU machine: the bundle only (the repo's .bundle too), nothing compiled, nothing cached
    os.environ.update(CUDNN_MOE_JAX_BUNDLE=os.path.abspath(argv[0]), CUDNN_MOE_JAX_NO_COMPILE="1",
                      CUDNN_MOE_JAX_MODULE_CACHE="off")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from cudnn_moe_jax import _primitive, aot

    bad = 0
    for vs in argv[1:]:
        items = aot.variant_items(vs)
        misses = []
        for item in items:
            _primitive._warned.clear()  # the fallback warning is once per (op, reason): every item must show its own
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                item()
            misses += [str(w.message)[:220] for w in caught if "no GPU kernel" in str(w.message)]
        print(f"{'ok  ' if not misses else 'MISS'} {vs}: {len(items)} item(s), {len(misses)} fallback(s)")
        for m in misses:
            print("     ", m)
        bad += bool(misses)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
