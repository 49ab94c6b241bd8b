"""A/B of two checkouts on bench_moe_ops rows (GPU machine): each tree's rows run in a process of their own, the
trees alternated round by round, and the op times (ms) printed side by side -- a kernel candidate in a worktree
against main, each with its own bundle (a kernel edit changes every module's fingerprint).

    python -m lab.ab_trees --base .:.bundle_main --new .tree_cand:.bundle_cand [--new TREE:BUNDLE ...] --shape small \\
        --rounds 2 "wgrad w2 nvfp4" "wgrad w1 nvfp4"
    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_cand --variants lab.ab_trees:staged_rows
        (from each tree's root: the rows the staged operands touch -- block-scaled wgrads on `small`, e128_a128 and
        fc, the fc forward and dglu rows)

A row name picks every bench_moe_ops row that contains it (`--only`); each row is printed once per tree and round.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROW = re.compile(r"^  (\S.*?)\s+([0-9.]+) ms ")
TIMEOUT_S = 120


def staged_rows() -> list:
    """bundle items: the block-scaled wgrad rows on `small` / e128_a128 / fc and the fc block-scaled op rows."""
    import lab.bench_dequant_first  # noqa: F401  (e128_a128)
    from benchmarks import bench_moe_ops

    return ([i for name in bench_moe_ops.BS_WGRAD
             for i in bench_moe_ops.bundle_items(("small", "e128_a128", "fc"), name)]
            + [i for name in bench_moe_ops.BS_OPS for i in bench_moe_ops.bundle_items(("fc",), name)])


def run_rows(tree: str, bundle: str, shape: str, rows: list) -> dict:
    """{row: ms} of `rows` on `shape`, timed by bench_moe_ops in a process rooted at `tree` with `bundle` only."""
    tree = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=tree, CUDNN_MOE_JAX_NO_COMPILE="1",
               CUDNN_MOE_JAX_BUNDLE=os.path.abspath(os.path.join(tree, bundle)) if bundle else "")
    code = ("import sys, lab.bench_dequant_first\nfrom benchmarks import bench_moe_ops as b\n"
            "for row in sys.argv[2:]:\n    b.main(['--shape', sys.argv[1], '--only', row])\n")
    out = subprocess.run([sys.executable, "-c", code, shape, *rows], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S).stdout
    got = {}
    for line in out.splitlines():
        m = ROW.match(line)   # (a row's "/ forward" ratio line has no "ms": no match)
        if m:
            got.setdefault(m.group(1), float(m.group(2)))
    return got


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="TREE[:BUNDLE] (BUNDLE relative to TREE)")
    ap.add_argument("--new", required=True, action="append", help="TREE[:BUNDLE] (repeat for more candidates)")
    ap.add_argument("--shape", default="small")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("rows", nargs="+")
    args = ap.parse_args(argv)
    specs = [("base", args.base)] + [(f"new{i + 1}" if len(args.new) > 1 else "new", spec)
                                     for i, spec in enumerate(args.new)]
    trees = {label: (spec.split(":", 1) + [""])[:2] for label, spec in specs}
    times = {}   # (label, round) -> {row: ms}
    for rnd in range(args.rounds):
        for label, (tree, bundle) in trees.items():
            times[label, rnd] = run_rows(tree, bundle, args.shape, args.rows)
    names = list(dict.fromkeys(n for t in times.values() for n in t))
    news = [label for label in trees if label != "base"]
    print(f"{args.shape}: op ms, rounds 1..{args.rounds} (" + ", ".join(f"{lb} {sp}" for lb, sp in specs) + ")")
    print("| row | " + " | ".join(trees) + " | " + " | ".join(f"{lb} / base" for lb in news) + " |")
    print("|---" * (1 + len(trees) + len(news)) + "|")
    for n in names:
        cols = [" / ".join(f"{times[label, r].get(n, float('nan')):.3f}" for r in range(args.rounds))
                for label in trees]
        best = {label: min(times[label, r].get(n, float("nan")) for r in range(args.rounds)) for label in trees}
        ratios = [f"{best[lb] / best['base']:.3f}" for lb in news]
        print(f"| {n} | " + " | ".join(cols) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
