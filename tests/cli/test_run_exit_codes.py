"""The launcher's exit code from torchrun's outcome: torchrun exits 1 whatever failed, and
`meshplan run` turns that into 3 for a rank lost or stuck, 1 only for a worker's meshplan bug.
A stand-in process plays torchrun: it prints the failure report torchrun prints and exits 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshplan.launcher import _run_torchrun

STUCK = "rank 0 waited 5 s in all_reduce over dp (bucket 1 of 1, 858.4 KB, step 4); rank 1 did not join it (stuck or dead)"


def torchrun_report(rank: int, exitcode: int) -> str:
    """What torchrun prints when a worker fails: its log line, then the root cause."""
    return (
        "E1122 03:54:31.754000 4560 /venv/torch/distributed/elastic/multiprocessing/api.py:882] "
        f"failed (exitcode: {exitcode}) local_rank: {rank} (pid: 9028)\n"
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-22_05:39:56\n"
        f"  host      : localhost\n  rank      : {rank} (local_rank: {rank})\n"
        f"  exitcode  : {exitcode} (pid: 9028)\n"
    )


def launcher_exit(tmp_path: Path, stderr: str) -> int:
    fake = [sys.executable, "-c", f"import sys; sys.stderr.write({stderr!r}); sys.exit(1)"]
    return _run_torchrun(fake, {}, tmp_path)


@pytest.mark.parametrize(
    ("stderr", "code", "summary"),
    [
        (torchrun_report(1, 137), 3, "rank 1 failed first (exit code 137: killed)"),
        (torchrun_report(1, -9), 3, "rank 1 failed first (killed by signal 9)"),
        (f"meshplan: error: {STUCK}\n" + torchrun_report(0, 3), 3, STUCK),
        (
            torchrun_report(0, 1),
            1,
            "rank 0 failed first (exit code 1)",
        ),  # the worker said "a bug in meshplan"
    ],
    ids=["killed", "signal", "stuck", "worker_bug"],
)
def test_a_lost_or_stuck_rank_exits_3_and_only_a_workers_bug_exits_1(
    tmp_path: Path, capsys, stderr: str, code: int, summary: str
) -> None:
    assert launcher_exit(tmp_path, stderr) == code
    err = capsys.readouterr().err
    assert f"meshplan: error: {summary}; torchrun stopped the other ranks" in err


def test_a_workers_user_error_exits_2_with_its_message(tmp_path: Path, capsys) -> None:
    (tmp_path / "rank1.txt").write_text("meshplan: error: the message\n")
    assert launcher_exit(tmp_path, torchrun_report(1, 2)) == 2
    assert capsys.readouterr().err == "meshplan: error: the message\n"


def test_a_reader_that_leaves_ends_the_command_quietly() -> None:
    """`meshplan estimate --json | head`: the closed pipe is the reader's choice, not a bug in
    meshplan: no "internal error", SIGPIPE's status (128 + 13), as the shell's own tools."""
    import subprocess

    code = (
        "import sys\n"
        "from meshplan.errors import guarded\n"
        "def command():\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "sys.exit(guarded(command))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 141
    assert done.stderr == ""
