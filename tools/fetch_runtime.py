"""Copy the CuTe DSL runtime library from the installed wheel into `.runtime/` (xz-compressed).

    python tools/fetch_runtime.py [--out .runtime] [--cuda cu13]

`libcute_dsl_runtime.so` (nvidia-cutlass-dsl-libs-cu13, `nvidia_cutlass_dsl/cu13/lib/`, ~43 MB, libc-only) is all a
GPU machine needs to run prebuilt kernel modules. Compressed it is ~13.5 MB, small enough to carry to a machine that
has no compiler. `cudnn_moe_jax._runtime.register_runtime()` finds `.runtime/libcute_dsl_runtime.so.xz` and unpacks
it once into its cache folder. The library is NVIDIA-licensed: `.runtime/` is git-ignored; never commit it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import lzma
import os
import sys
from pathlib import Path

LIB = "libcute_dsl_runtime.so"
REPO = Path(__file__).resolve().parent.parent


def wheel_library(cuda: str) -> Path:
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None:
        sys.exit("nvidia-cutlass-dsl is not installed: pip install 'nvidia-cutlass-dsl[cu13]==4.8.1'")
    for root in spec.submodule_search_locations or ():
        path = Path(root) / cuda / "lib" / LIB
        if path.is_file():
            return path
    sys.exit(f"{LIB} not found under nvidia_cutlass_dsl/{cuda}/lib (is nvidia-cutlass-dsl-libs-{cuda} installed?)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / ".runtime"), help="destination folder (default: <repo>/.runtime)")
    ap.add_argument("--cuda", default="cu13", choices=("cu13", "cu12"))
    ap.add_argument("--preset", type=int, default=6, help="xz preset (6: 41.6 -> 13.0 MiB in ~35 s on 2 cores)")
    args = ap.parse_args(argv)

    src = wheel_library(args.cuda)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / (LIB + ".xz")
    data = src.read_bytes()
    tmp = dst.with_suffix(".xz.tmp")
    with lzma.open(tmp, "wb", preset=args.preset) as f:
        f.write(data)
    os.replace(tmp, dst)
    print(f"{src} ({len(data) / 2**20:.1f} MiB, sha256 {hashlib.sha256(data).hexdigest()[:16]})")
    print(f"  -> {dst} ({dst.stat().st_size / 2**20:.1f} MiB)")
    if out.resolve() == (REPO / ".runtime").resolve():
        print("  (.runtime/ is git-ignored: the library is NVIDIA-licensed, never commit it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
