"""The commands of the documents `tests/test_docs.py` does not run itself (`RUN_HERE`), run as
it runs them: a module of their own, so that `--dist loadfile` gives them the other worker."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_docs import DOCUMENTS, ROOT, run_document, run_here


@pytest.mark.slow
@pytest.mark.parametrize(
    "document", [d for d in DOCUMENTS if not run_here(d)], ids=lambda d: str(d.relative_to(ROOT))
)
def test_every_command_shown_runs(document: Path, tmp_path: Path, monkeypatch, capfd) -> None:
    run_document(document, tmp_path, monkeypatch, capfd)
