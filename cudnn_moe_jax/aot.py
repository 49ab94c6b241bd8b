"""Build prebuilt kernel-module bundles ahead of time, on any x86-64 machine with the CuTe DSL compiler (no GPU).

    python -m cudnn_moe_jax.aot build --arch sm_90a --out DIR [--variants default | MODULE:ATTR ...]
    python -m cudnn_moe_jax.aot list DIR

Then, on the GPU machine (no compiler needed): `CUDNN_MOE_JAX_BUNDLE=DIR` (or copy DIR to `<package>/_bundle`).

Variant sets: `default` is the sm90 kernel package's `default_variants()` (or `DEFAULT_VARIANTS`); `MODULE:ATTR`
names a list (or a function returning one) importable from sys.path.
Items may be:
  - a `_runtime.KernelSpec` (compiled as is);
  - a callable taking no arguments that lowers something for cuda, e.g. `lambda: jax.jit(op).trace(*avals)
    .lower(lowering_platforms=("cuda",))`: every module the lowering asks for is recorded (the surest way: the
    primitive itself decides operands, names and avals);
  - `(problem, config, inputs)` with `inputs` an ordered dict {input name: aval} exactly as the primitive binds them
    (present inputs only, discrete weights as "b:0", "b:1", ...);
  - `problem` or `(problem, config)`: inputs from the kernel package's `variants.input_avals(problem)`.
A None config means the kernel package's `default_config(problem)`, as at lowering time. A grouped-GEMM module
serves every m (it is compiled and recorded for a symbolic m), so the m of an item does not matter.
Modules come from a bundle folder or the module cache where one holds them (`_runtime.module_cache_dir()`), else
are compiled (and cached); each output line and the summary say which (`--no-cache` compiles everything the bundle
folders do not hold). A build extends an existing bundle; failed variants are reported and make the exit status 1.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
import time
from typing import Any

from cudnn_moe_jax import _runtime


def _specs(item: Any, arch: str) -> list:
    """(spec, module) pairs for one variant item (see the module docstring)."""
    if isinstance(item, _runtime.KernelSpec):
        return [(item, _runtime.get_module(item))]
    if callable(item):
        with _runtime.recording() as got:
            item()
        if not got:
            raise _runtime.KernelUnavailable(f"{item!r} lowered no CuTe DSL kernel")
        return got
    problem, config, inputs = (tuple(item) + (None, None))[:3] if isinstance(item, tuple) else (item, None, None)
    if inputs is None:
        inputs = _runtime.kernels_package().variants.input_avals(problem)
    spec = _runtime.grouped_gemm_spec(problem, config, list(inputs), list(inputs.values()), arch=arch)
    return [(spec, _runtime.get_module(spec))]


def variant_items(name: str) -> list:
    if name == "default":
        mod = _runtime.kernels_package()
        v = getattr(mod, "default_variants", None) or getattr(mod, "DEFAULT_VARIANTS")
        return list(v() if callable(v) else v)
    module, _, attr = name.partition(":")
    v = getattr(importlib.import_module(module), attr or "VARIANTS")
    return list(v() if callable(v) else v)


def lowering_items(cases, inputs, call) -> list:
    """Variant items for `build` from a table of cases: one CUDA lowering of `jax.jit(call)(case, inputs(case))`
    each (the modules it asks for are recorded)."""
    import functools

    import jax

    items = []
    for case in cases:
        fn = jax.jit(functools.partial(call, case))
        x = inputs(case)
        items.append(lambda fn=fn, x=x: fn.trace(x).lower(lowering_platforms=("cuda",)))
    return items


def build(arch: str, out: str, variant_sets: list[str]) -> int:
    os.environ["CUTE_DSL_ARCH"] = arch  # before anything imports cutlass
    done, failed = {}, 0
    for vs in variant_sets:
        try:
            items = variant_items(vs)
        except Exception as e:  # noqa: BLE001 - report, go on with the other sets
            print(f"FAIL variant set {vs!r}: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
            continue
        for item in items:
            t0 = time.perf_counter()
            try:
                pairs = _specs(item, arch)
            except Exception as e:  # noqa: BLE001
                print(f"FAIL {item!r}: {type(e).__name__}: {e}", file=sys.stderr)
                failed += 1
                continue
            for spec, mod in pairs:
                done[spec.fingerprint] = (spec, mod)
                print(f"ok   {spec.fingerprint[:16]}  {spec.name:<28} {len(mod.module):>8} B  "
                      f"{time.perf_counter() - t0:6.2f} s  {mod.origin}", flush=True)
    if done:
        path = _runtime.write_bundle(out, done.values())
        print(f"wrote {len(done)} module(s) to {path.parent} ({failed} failed): {_origins(done.values())}")
    return 1 if failed or not done else 0


def _origins(pairs) -> str:
    """'2 compiled, 3 from the module cache DIR (...)': where the modules of a build came from."""
    counts = collections.Counter(mod.origin for _, mod in pairs)
    text = ", ".join(f"{n} {'compiled' if o == 'compiled' else 'from the ' + o}" for o, n in sorted(counts.items()))
    if any(o.startswith("module cache") for o in counts):
        text += ("; modules in the cache were not recompiled (the cache key covers the kernel sources, config, arch "
                 "and compiler version): --no-cache or CUDNN_MOE_JAX_MODULE_CACHE=off compiles them again")
    return text


def list_bundle(folder: str) -> int:
    man = _runtime.read_manifest(folder)
    print(f"{folder}: bundle format {man['format']}, {len(man['entries'])} module(s)")
    for fp, e in sorted(man["entries"].items(), key=lambda kv: kv[1]["name"]):
        prob = (e.get("meta") or {}).get("problem") or {}
        what = " ".join(f"{k}={prob[k]}" for k in ("op", "m", "n", "k", "num_groups", "ab_dtype") if k in prob)
        print(f"  {fp[:16]}  {e['name']:<28} {e['arch']:<8} {e['size']:>8} B  cutlass-dsl "
              f"{e['cutlass_dsl_version']}  {e['target']}  {what}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cudnn_moe_jax.aot", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile variant sets into a bundle folder")
    b.add_argument("--arch", default=_runtime.DEFAULT_ARCH)
    b.add_argument("--out", required=True)
    b.add_argument("--variants", nargs="+", default=["default"], help="'default' or MODULE:ATTR (several allowed)")
    b.add_argument("--no-cache", action="store_true",
                   help="compile every module instead of taking it from the on-disk module cache")
    ls = sub.add_parser("list", help="print a bundle's manifest")
    ls.add_argument("dir")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        return list_bundle(args.dir)
    if args.no_cache:
        os.environ["CUDNN_MOE_JAX_MODULE_CACHE"] = "off"  # read at every lookup (_module_cache.module_cache_dir)
    return build(args.arch, args.out, args.variants)


if __name__ == "__main__":
    sys.exit(main())
