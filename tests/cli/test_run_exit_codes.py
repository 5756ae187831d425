"""The launcher's exit code from torchrun's outcome: torchrun exits 1 whatever failed, and
`meshplan run` turns that into 3 for a rank lost or stuck, 1 only for a worker's meshplan bug.
A stand-in process plays torchrun: it starts as a worker would (its process id left for the
launcher's watch), prints the failure report torchrun prints and exits 1. Others play a torchrun
that never ends: its rendezvous never completes, or it never reaps its workers."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from meshplan.options import RunOptions
from meshplan.outcome import summarize
from meshplan.torchrun import Watch, supervise

ROOT = Path(__file__).resolve().parents[2]
TINY_DP = str(ROOT / "examples" / "tiny_dp.plan")
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


def fake_torchrun(notes: Path, then: str) -> list[str]:
    """A process that starts as worker 0 does (`announce_worker`'s file), then runs `then`."""
    started = f"import os, sys; open({str(notes / 'worker0.pid')!r}, 'w').write(str(os.getpid()))\n"
    return [sys.executable, "-c", started + then]


def launcher_exit(tmp_path: Path, stderr: str, **watch) -> int:
    notes = tmp_path / "notes"
    notes.mkdir()
    command = fake_torchrun(notes, f"sys.stderr.write({stderr!r}); sys.exit(1)")
    watched = Watch(notes, **({"workers": 1, "join_s": 60, "linger_s": 10} | watch))
    return summarize(supervise(command, {}, watched), RunOptions(TINY_DP, out=str(tmp_path / "run")), notes)


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
    # the last line is the command that continues the run (none saved: the one that starts it again)
    assert err.splitlines()[-1] == (
        f"  hint: {tmp_path}/run has no checkpoint to continue with --resume from (--save-every N "
        f"saves them); start again: meshplan run {TINY_DP} --out {tmp_path}/run --overwrite"
    )


def test_a_workers_user_error_exits_2_with_its_message(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "rank1.txt").write_text("meshplan: error: the message\n")
    command = fake_torchrun(tmp_path / "notes", f"sys.stderr.write({torchrun_report(1, 2)!r}); sys.exit(1)")
    ended = supervise(command, {}, Watch(tmp_path / "notes", workers=1, join_s=60, linger_s=10))
    assert summarize(ended, RunOptions(TINY_DP, out=str(tmp_path / "run")), tmp_path / "notes") == 2
    assert capsys.readouterr().err == "meshplan: error: the message\n"


def test_a_torchrun_that_never_reaps_its_ended_workers_is_ended(tmp_path: Path, capsys) -> None:
    """A node cut off from the rendezvous host: its workers gave up (exit 3, their report said),
    but torchrun's agent blocks on the store it cannot reach. The launcher shows the report as it
    comes, ends torchrun `linger_s` after the last worker, and says so: exit 3, not a hang."""
    notes = tmp_path / "notes"
    notes.mkdir()
    hang = (
        f"sys.stderr.write('meshplan: error: {STUCK}\\n'); sys.stderr.flush()\n"
        f"open({str(notes / 'worker0.exit')!r}, 'w').write('3')\n"
        "import time; time.sleep(600)\n"
    )
    started = time.monotonic()
    watch = Watch(notes, workers=1, join_s=60, linger_s=2, hold_s=0.5)
    ended = supervise(fake_torchrun(notes, hang), {}, watch)
    assert ended.ended_by == "lingered" and time.monotonic() - started < 20
    assert summarize(ended, RunOptions(TINY_DP, out=str(tmp_path / "run")), notes) == 3
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"meshplan: error: {STUCK}"  # shown as it came (`hold_s`), not only at the end
    assert err[-2] == (
        f"meshplan: error: {STUCK}; torchrun did not end once every worker here had (its rendezvous "
        "store unreachable?): meshplan ended it"
    )


def test_a_rendezvous_that_never_completes_ends_in_one_line(tmp_path: Path, capsys) -> None:
    """torchrun waits on a rendezvous past its own timeout (a connection it keeps retrying): the
    launcher ends it `join_s` after it started, and says where it waited and what to check."""
    (tmp_path / "notes").mkdir()
    command = [sys.executable, "-c", "import time; print('W... retrying', flush=True); time.sleep(600)"]
    ended = supervise(command, {}, Watch(tmp_path / "notes", workers=1, join_s=1, linger_s=10))
    assert ended.ended_by == "rendezvous" and not ended.started
    options = RunOptions(TINY_DP, nnodes="2", rdzv_endpoint="head:29500", rdzv_backend="c10d")
    assert summarize(ended, options, tmp_path / "notes") == 3
    err = capsys.readouterr().err
    assert err.startswith(
        "meshplan: error: the rendezvous of 2 nodes at head:29500 (c10d) did not complete after"
    )
    assert "(check: are the other nodes started, with the same --rdzv-endpoint" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


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
