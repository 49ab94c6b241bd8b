"""lab.pc_samples on a small export in ncu's source-page CSV shape: the reason totals, the execution classes, the
top instructions and the comparison of two profiles."""

from __future__ import annotations

import csv

from lab import pc_samples

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_selected", "stall_long_sb (Not Issued)"]


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "kernel_x"])
        w.writerow(HEADER)
        for i, (src, ex, long_sb, selected) in enumerate(rows):
            w.writerow([hex(0x100 + 16 * i), f"  {src}", long_sb + selected, long_sb, ex, long_sb, selected, 99])
    return str(path)


ROWS_A = [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8], R2", 64, 0, 1), ("@!P0 BRA 0x120", 64, 40, 2),
          ("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24", 64, 0, 5), ("FADD R3, R4, R5", 8, 3, 6),
          ("STG.E.64 desc[UR20][R2.64], R4", 8, 7, 1), ("EXIT", 0, 0, 0)]


def test_totals_classes_and_top_instructions(tmp_path):
    p = pc_samples.load(_write(tmp_path / "a.csv", ROWS_A))
    assert p.executed == [64, 64, 64, 8, 8, 0]
    assert p.samples == [1, 42, 5, 9, 8, 0]
    assert pc_samples.reason_totals(p) == {"long_sb": 50, "selected": 15}   # "(Not Issued)" columns not added in
    classes = pc_samples.execution_classes(p)
    assert [(e, n, s) for e, n, s, _ in classes] == [(64, 3, 48), (8, 2, 17)]   # never-run instructions left out
    assert classes[0][3] == {"long_sb": 40, "selected": 8}
    assert pc_samples.top_instructions(p, count=2) == [1, 3]
    assert pc_samples.top_instructions(p, "long_sb", count=2) == [1, 4]


def test_report_compares_two_profiles(tmp_path):
    a = pc_samples.load(_write(tmp_path / "a.csv", ROWS_A))
    b = pc_samples.load(_write(tmp_path / "b.csv", [(s, e, ls // 2, sel) for s, e, ls, sel in ROWS_A]))
    text = pc_samples.report(a, b, top=2)
    assert "samples A 65, B 39" in text   # B: long_sb halved, rounded down per instruction (20 + 1 + 3)
    assert "long_sb                  50       24      +26" in text
    assert "TRYWAIT" in text.split("top instructions")[1]   # the wait's try-wait is shown before its branch
