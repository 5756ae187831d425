"""`meshplan compile -o PATH` where PATH cannot be written: one located error and exit 2, found
before torch is imported and the model compiled (never exit 1 or a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TP = str(ROOT / "examples" / "llama_tp.plan")
LLAMA = str(ROOT / "examples" / "models" / "llama.py") + ":build"


def meshplan(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1")
    env.pop("MESHPLAN_DEBUG", None)
    return subprocess.run(["meshplan", *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def compile_to(tmp_path: Path, out: str) -> subprocess.CompletedProcess:
    return meshplan("compile", LLAMA_TP, "--model", LLAMA, "-o", out, cwd=tmp_path)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("afile", "-o afile: afile is a file, not a folder (hint: pass -o a folder you can write to)"),
        ("afile/sub", "-o afile/sub: afile is a file, so it cannot hold the folder afile/sub"),
    ],
)
def test_compile_into_a_path_that_cannot_be_a_folder_is_refused_before_compiling(
    tmp_path: Path, out: str, message: str
) -> None:
    (tmp_path / "afile").write_text("mine")
    done = compile_to(tmp_path, out)
    assert done.returncode == 2 and f"meshplan: error: {message}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "bug in meshplan" not in done.stderr
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_compile_into_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        done = compile_to(tmp_path, "locked/build")
    finally:
        locked.chmod(0o755)
    assert done.returncode == 2, done.stderr
    assert "meshplan: error: -o locked/build: cannot create files there (Permission denied)" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc takes no new files, even from root")
def test_compile_where_nothing_can_be_created_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    done = compile_to(tmp_path, "/proc/meshplan-build")
    assert done.returncode == 2, done.stderr
    assert "meshplan: error: -o /proc/meshplan-build: cannot create files there (" in done.stderr
    assert "Traceback" not in done.stderr and "bug in meshplan" not in done.stderr
    # a compile that fails after the probe leaves no folder the probe made
    done = meshplan(
        "compile", str(tmp_path / "missing.plan"), "--model", LLAMA, "-o", "new/build", cwd=tmp_path
    )
    assert done.returncode == 2 and not (tmp_path / "new").exists(), done.stderr
