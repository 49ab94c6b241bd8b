"""Where a kernel's warps wait, from ncu's PC sampling per SASS instruction, and what changed between two profiles.

    python -m lab.pc_samples A.csv [B.csv] [--top 12] [--reason long_sb]

A.csv / B.csv: the source page of a report, `ncu -i REP --page source --csv --print-source sass` (the `mxsrc` step of
tools/gpu/run_device.sh writes it as mxsrc_sass.csv next to the report). B is a second kernel to compare A with,
e.g. the same op without one output.

Printed per profile:
- the samples of every stall reason over the whole kernel (with B: A's, B's and the difference);
- the samples by *execution class*: instructions grouped by how often they ran. Instructions that ran equally often
  are usually one loop body of one warp role (e.g. the epilogue runs once per warp and tile, the consumer k-loop once
  per k-tile pair), so the classes split the kernel by role and loop without reading its layout;
- the `--top` instructions by the samples of `--reason` (default: all samples), each with the instructions before
  it: a wait shows as its try-wait and the branch that loops on it.

Counts are samples (a fixed sampling interval over every warp), so a kernel that runs longer has more of them; with
B, compare the classes' shares as well as their counts.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from typing import NamedTuple

ALL = "all"


class Profile(NamedTuple):
    source: list       # SASS text per instruction, in address order
    executed: list     # warp-level executions per instruction
    samples: list      # all samples per instruction
    reasons: list      # Counter per instruction: stall reason -> samples (issued and not issued together)


def load(path: str) -> Profile:
    """The per-instruction rows of a `--page source --csv --print-source sass` export (its first line names the
    kernel, the second is the header)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    names, data = rows[header], rows[header + 1:]
    col = {n: i for i, n in enumerate(names)}
    stall = [(n[len("stall_"):], i) for n, i in col.items() if n.startswith("stall_") and "(Not Issued)" not in n]

    def num(row, i):
        return int(float(row[i] or 0))

    src, ex, smp, rsn = [], [], [], []
    for r in data:
        if len(r) < len(names):
            continue
        src.append(r[col["Source"]].strip())
        ex.append(num(r, col["Instructions Executed"]))
        smp.append(num(r, col["Warp Stall Sampling (All Samples)"]))
        rsn.append(Counter({name: v for name, i in stall if (v := num(r, i))}))
    return Profile(src, ex, smp, rsn)


def reason_totals(p: Profile) -> Counter:
    total = Counter()
    for c in p.reasons:
        total.update(c)
    return total


def execution_classes(p: Profile) -> list:
    """[(executions, instructions, samples, reasons Counter)] of the instructions that ran equally often, the classes
    with the most samples first (instructions that never ran are left out)."""
    groups = {}
    for e, s, r in zip(p.executed, p.samples, p.reasons):
        if e == 0:
            continue
        n, total, reasons = groups.get(e, (0, 0, Counter()))
        groups[e] = (n + 1, total + s, reasons + r)
    return sorted(((e, n, s, r) for e, (n, s, r) in groups.items()), key=lambda g: -g[2])


def top_instructions(p: Profile, reason: str = ALL, count: int = 12) -> list:
    """Indices of the `count` instructions with the most samples of `reason` (ALL: every sample), in address order."""
    key = p.samples if reason == ALL else [c[reason] for c in p.reasons]
    best = sorted(range(len(key)), key=lambda i: -key[i])[:count]
    return sorted(i for i in best if key[i] > 0)


def _reasons_line(c: Counter, k: int = 5) -> str:
    return ", ".join(f"{name} {v}" for name, v in c.most_common(k))


def report(a: Profile, b: Profile = None, reason: str = ALL, top: int = 12, context: int = 3) -> str:
    out = []
    ta = reason_totals(a)
    if b is None:
        out.append(f"samples {sum(a.samples)}: {_reasons_line(ta, 12)}")
    else:
        tb = reason_totals(b)
        out.append(f"samples A {sum(a.samples)}, B {sum(b.samples)}; by reason (A, B, A - B):")
        for name in sorted(set(ta) | set(tb), key=lambda n: -(ta[n] - tb[n])):
            out.append(f"  {name:18s} {ta[name]:8d} {tb[name]:8d} {ta[name] - tb[name]:+8d}")
    for label, p in (("A", a), ("B", b)):
        if p is None:
            continue
        total = max(1, sum(p.samples))
        out.append(f"{label}: execution classes (executions: instructions, samples, share, top reasons)")
        for e, n, s, r in execution_classes(p)[:top]:
            out.append(f"  {e:10d}: {n:5d} instr {s:7d} {100 * s / total:5.1f}%  {_reasons_line(r, 4)}")
    out.append(f"A: top instructions by {reason} samples (with the {context} before each)")
    for i in top_instructions(a, reason, top):
        for j in range(max(0, i - context), i):
            out.append(f"          {j:6d}  {a.source[j][:90]}")
        n = a.samples[i] if reason == ALL else a.reasons[i][reason]
        out.append(f"  {n:6d}  {i:6d}  {a.source[i][:90]}  (executed {a.executed[i]})")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b", nargs="?")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--reason", default=ALL, help="a stall reason without its stall_ prefix, e.g. long_sb")
    args = ap.parse_args(argv)
    print(report(load(args.a), load(args.b) if args.b else None, args.reason, args.top))


if __name__ == "__main__":
    main()
