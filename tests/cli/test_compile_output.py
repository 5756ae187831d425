"""`meshplan compile -o PATH` where PATH cannot be written: one located error and exit 2, found
before torch is imported and the model compiled (never exit 1 or a traceback).

The command's `main` runs in this process, in the test's folder: the refusals are its own."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshplan.main import main

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TP = str(ROOT / "examples" / "llama_tp.plan")
LLAMA = str(ROOT / "examples" / "models" / "llama.py") + ":build"


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("MESHPLAN_DEBUG", raising=False)


@pytest.fixture
def meshplan(capsys: pytest.CaptureFixture[str]):
    """`meshplan *argv` (its `main`): the exit status and what it printed."""

    def run(*argv: str) -> SimpleNamespace:
        status = main(list(argv))
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=status, stdout=out, stderr=err)

    return run


@pytest.fixture
def compile_to(meshplan):
    return lambda out: meshplan("compile", LLAMA_TP, "--model", LLAMA, "-o", out)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("afile", "-o afile: afile is a file, not a folder (hint: pass -o a folder you can write to)"),
        ("afile/sub", "-o afile/sub: afile is a file, so it cannot hold the folder afile/sub"),
    ],
)
def test_compile_into_a_path_that_cannot_be_a_folder_is_refused_before_compiling(
    tmp_path: Path, compile_to, out: str, message: str
) -> None:
    (tmp_path / "afile").write_text("mine")
    done = compile_to(out)
    assert done.returncode == 2 and f"meshplan: error: {message}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "bug in meshplan" not in done.stderr
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_compile_into_a_read_only_folder_is_refused(tmp_path: Path, compile_to) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        done = compile_to("locked/build")
    finally:
        locked.chmod(0o755)
    assert done.returncode == 2, done.stderr
    assert "meshplan: error: -o locked/build: cannot create files there (Permission denied)" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc takes no new files, even from root")
def test_compile_where_nothing_can_be_created_is_refused_and_leaves_nothing(
    tmp_path: Path, meshplan, compile_to
) -> None:
    done = compile_to("/proc/meshplan-build")
    assert done.returncode == 2, done.stderr
    assert "meshplan: error: -o /proc/meshplan-build: cannot create files there (" in done.stderr
    assert "Traceback" not in done.stderr and "bug in meshplan" not in done.stderr
    # a compile that fails after the probe leaves no folder the probe made
    done = meshplan("compile", str(tmp_path / "missing.plan"), "--model", LLAMA, "-o", "new/build")
    assert done.returncode == 2 and not (tmp_path / "new").exists(), done.stderr
