"""docs/nn.md: its ```python blocks run in order in one namespace (their asserts are the documented facts)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "nn.md"


def test_docs_nn_snippets_run():
    pytest.importorskip("flax")
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 9, "docs/nn.md lost its examples"
    namespace: dict = {}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/nn.md block {i}", "exec"), namespace)
        except Exception as err:  # noqa: BLE001 -- name the block that failed
            raise AssertionError(f"docs/nn.md python block {i} failed:\n{block}") from err
