"""The CuTe DSL runtime glue, one import for its users (aot, tools, tests). No `import cutlass` at import.

By role:
  `_ffi`       libcute_dsl_runtime.so found and registered as XLA FFI targets; `KernelModule` and its custom call
  `_modules`   fingerprints; memory -> bundles -> on-disk module cache (`_module_cache`) -> compile; bundles
  `_compile`   CuTe DSL compilation through cutlass.jax's own steps
  `_lowering`  the grouped GEMM's CUDA lowering: problem -> KernelSpec -> module -> custom call
Each keeps its own state: to replace a function or a cache in a test, patch the module that defines it (this one
only re-exports).
"""

from __future__ import annotations

from ._compile import (  # noqa: F401
    CUTLASS_DSL_VERSION, DEFAULT_ARCH, KernelUnavailable, compile_module, compile_unavailable_reason,
    cutlass_dsl_version, import_cutlass,
)
from ._ffi import (  # noqa: F401
    FFI_TARGET, FFI_TARGET_NO_CUDA_GRAPH, FFI_TYPE, LIB_NAME, KernelModule, export_disabled_checks,
    find_runtime_library, register_runtime, runtime_library_path,
)
from ._lowering import (  # noqa: F401
    canonical_problem, grouped_gemm_avals, grouped_gemm_fingerprint, grouped_gemm_spec, kernel_lowering,
    kernels_package, launch_avals, resolve_config, symbolic_a_rows, symbolic_m, symbolic_t,
)
from ._modules import (  # noqa: F401
    BUNDLE_FORMAT, MANIFEST, KernelSpec, bundle_dirs, call_spec, fingerprint, get_module, has_module,
    kernels_source_digest, read_manifest, recording, write_bundle,
)
from ._module_cache import cache_dir, module_cache_dir  # noqa: F401
