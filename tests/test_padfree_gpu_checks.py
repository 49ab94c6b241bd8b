"""CPU self-test of the padding-free GPU suite's checks (tests/gpu/padfree_checks.py, the cases lab/padfree_cases.py):
on the reference backend the cases pass them (the op against the float64 oracle, every element, rows outside every
group zero), and an op run with the wrong group alignment fails them -- so a kernel that wrote a neighbouring
expert's rows would too."""

from __future__ import annotations

import pytest

import padfree_checks as checks  # noqa: E402  (tests/conftest.py puts tests/gpu/ on sys.path)
from lab import padfree_cases as cases


@pytest.mark.parametrize("index", [0, 13, 23, 26, 36])
def test_cases_pass_on_the_reference(index):
    item = cases.ITEMS[index]
    assert not checks.run_case(item), item


def test_checks_catch_rows_of_the_wrong_group(monkeypatch):
    """The op groups the rows with m_aligned=8 (ends 32, 32, 32, 296, 552, 1000 instead of 37, 38, 38, 300, ...),
    the oracle with 1: the rows between are another expert's, and the checks must say so."""
    item = next(i for i in cases.ITEMS if i[0][0] == "dswiglu_dbias_amax" and i[1] == "straddle")
    original = cases.call

    def misaligned(item, x):
        return original((item[0], "unsanitized"), x)   # the same ops with m_aligned=8

    monkeypatch.setattr(cases, "call", misaligned)
    errs = checks.run_case(item)
    assert any("out of bounds" in e for e in errs), errs
