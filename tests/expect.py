"""Checked-in expected outputs: `expect(actual, path)` passes when `actual` is the file's text.

    from expect import expect
    expect(render(graph), HERE / "golden" / "precision.diff")

On a difference the test fails with a unified diff of the file against `actual`; an expected
change is accepted by regenerating the files, then reading what changed in `git diff`:

    MESHPLAN_ACCEPT=1 pytest -n0 tests/compiler/test_pass_golden.py

A missing file fails too: a golden file is written on purpose only, never by a first run.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

ACCEPT = "MESHPLAN_ACCEPT"
DIFF_LINES = 80  # enough to see what changed; the rest is in the file after accepting


def expect(actual: str, path: Path) -> None:
    """Compare `actual` with the text of `path`; with MESHPLAN_ACCEPT=1 write it there instead."""
    if os.environ.get(ACCEPT) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" ")[0] or "..."
    accept = f"{ACCEPT}=1 pytest -n0 '{test}'"
    if not path.exists():
        pytest.fail(f"{path} does not exist; write it with {accept}, then read it", pytrace=False)
    expected = path.read_text()
    if actual == expected:
        return
    diff = list(
        difflib.unified_diff(
            expected.splitlines(), actual.splitlines(), f"{path} (expected)", "actual", lineterm=""
        )
    )
    shown = diff[:DIFF_LINES] or ["(the lines are equal: the ends of lines differ)"]
    if len(diff) > DIFF_LINES:
        shown.append(f"... {len(diff) - DIFF_LINES} more lines of diff")
    pytest.fail(
        f"{path} differs from the output:\n"
        + "\n".join(shown)
        + f"\nif that is intended: {accept}, then read the git diff",
        pytrace=False,
    )
