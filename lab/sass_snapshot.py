"""Write (or compare) the normalized SASS of every compile case: the byte-identity check of a restructuring.

    python -m lab.sass_snapshot --out DIR                # one DIR/<case>.sass per case + DIR/index.json
    python -m lab.sass_snapshot --out DIR2 --compare DIR # and list the cases whose SASS differs from DIR's
    python -m lab.sass_snapshot --out DIR --only dswiglu # a subset (substring of the case names)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from . import compile_cases, sass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--compare", type=Path, help="a previous --out folder")
    ap.add_argument("--only", default="", help="substring of the case names to keep")
    args = ap.parse_args(argv)
    sass.cutlass_sm90()
    args.out.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, problem in compile_cases.all_cases().items():
        if args.only not in name:
            continue
        t0 = time.time()
        text = sass.normalized(sass.sass_of(sass.compile_module(problem)))
        (args.out / f"{name}.sass").write_text(text)
        index[name] = hashlib.sha256(text.encode()).hexdigest()
        print(f"{name:40s} {index[name][:12]} {time.time() - t0:5.1f}s", flush=True)
    (args.out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    if args.compare is None:
        return 0
    old = json.loads((args.compare / "index.json").read_text())
    differ = [n for n in index if old.get(n) != index[n]]
    missing = [n for n in old if n not in index and args.only in n]
    print(f"{len(index) - len(differ)} identical, {len(differ)} differ: {differ}; not compiled now: {missing}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
