"""`meshplan run`: the launcher's torchrun command, its one-line errors, and a real end-to-end run
(the command's `main` in this process, torchrun and its workers in theirs: tests/runs.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from runs import meshplan_command, meshplan_run

from meshplan.faults import Fault, injected_fault
from meshplan.launcher import torchrun_command
from meshplan.main import main
from meshplan.options import RunOptions, parse
from meshplan.outcome import first_failure

ROOT = Path(__file__).resolve().parents[2]
TINY_DP = str(ROOT / "examples" / "tiny_dp.plan")


def test_the_launcher_runs_real_torchrun_with_the_mesh_world_size() -> None:
    options = parse([TINY_DP, "--steps", "7", "--save-every", "3", "--resume", "--max-restarts", "1"])
    cmd = torchrun_command(options, world_size=2)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd and "--max-restarts=1" in cmd
    worker = cmd[cmd.index("meshplan.run") + 1 :]
    assert worker == options.worker_argv()
    assert worker[0] == TINY_DP and "--resume" in worker
    assert worker[worker.index("--steps") + 1] == "7"
    assert not any("restarts" in a or "nnodes" in a for a in worker)  # torchrun's flags stay with torchrun


def test_multi_node_flags_pass_through() -> None:
    options = parse([TINY_DP, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29500"])
    cmd = torchrun_command(options, world_size=2)
    assert "--nproc-per-node=1" in cmd and "--nnodes=2" in cmd and "--node-rank=1" in cmd
    assert "--rdzv-endpoint=head:29500" in cmd and "--standalone" not in cmd


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([str(ROOT / "examples" / "gpt_zero3.plan")], "pass --nproc-per-node"),
        ([TINY_DP, "--data", "no/such/file.txt"], "does not exist"),
    ],
)
def test_user_mistakes_are_one_line_errors(argv: list[str], message: str, capsys) -> None:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_meshplan_run_trains_the_tiny_llama_through_torchrun(tmp_path: Path, capfd, monkeypatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    board = tmp_path / "tensorboard"
    done = meshplan_command(
        capfd, "run", TINY_DP, "--steps", "30", "--out", str(tmp_path), "--log-every", "10",
        "--tensorboard", str(board),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step    30/30" in done.stdout and "summary" in done.stdout
    scalars = tensorboard_scalars(board)
    for rank in (0, 1):
        records = [
            json.loads(line) for line in (tmp_path / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        ]
        # TensorBoard shows what the JSONL holds: rank 0's curves, every rank's memory
        if rank == 0:
            assert scalars[".", "train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in records]
        assert scalars[f"rank{rank}", "memory/peak"] == [(r["step"], r["peak_memory"]) for r in records]
        assert [r["step"] for r in records] == list(range(1, 31))
        assert set(records[0]) >= {
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "peak_memory",
            "mfu",
            "skipped_steps",
        }
        first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
        assert first > 5.0 and last < first - 1.0, (first, last)


def tensorboard_scalars(folder: Path) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(run, tag) -> [(step, value)] of every scalar TensorBoard reads in `folder`; the plan and
    ledger texts checked on the way."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    runs = EventMultiplexer().AddRunsFromDirectory(str(folder))
    runs.Reload()
    texts = runs.Runs()["."]["tensors"]
    assert {"plan/text_summary", "ledger/text_summary"} <= set(texts)
    plan = runs.Tensors(".", "plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "mesh dp=2" in plan
    return {
        (run, tag): [(e.step, e.value) for e in runs.Scalars(run, tag)]
        for run, tags in runs.Runs().items()
        for tag in tags["scalars"]
    }


def test_tensorboard_without_its_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` raises ImportError
    assert main(["run", TINY_DP, "--out", str(tmp_path), "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan: error: --tensorboard needs the `tensorboard` package (hint: pip install")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "tb").exists()


def test_injected_faults_kill_or_hang_one_rank_on_the_first_attempt_only(monkeypatch) -> None:
    monkeypatch.setenv("MESHPLAN_FAULT", "rank=1,step=3,hang")
    assert injected_fault(1) == Fault(step=3, hang=True) and injected_fault(0) is None
    monkeypatch.setenv("MESHPLAN_FAULT", "rank=1,step=3")
    assert injected_fault(1) == Fault(step=3, hang=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert injected_fault(1) is None


def torchrun_report(rank: int, exitcode: int) -> str:
    """The end of torchrun's failure report, as it prints it."""
    return (
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-22_05:39:56\n"
        f"  host      : localhost\n  rank      : {rank} (local_rank: {rank})\n"
        f"  exitcode  : {exitcode} (pid: 9028)\n"
    )


STUCK = "rank 0 waited 5 s in all_reduce over dp (bucket 1 of 1, 858.4 KB, step 4); rank 1 did not join it (stuck or dead)"


def test_the_summary_is_the_report_of_the_rank_that_gave_up_first_on_a_collective() -> None:
    worker = f"meshplan: error: {STUCK}\n  hint: continue with --resume from the last checkpoint in runs/x\n"
    assert first_failure(worker + torchrun_report(0, 3)) == STUCK
    # a rank that died is named by its exit code, whatever its peers said
    assert first_failure(worker + torchrun_report(1, 137)) == "rank 1 failed first (exit code 137: killed)"
    assert first_failure(torchrun_report(0, 3)) == "rank 0 failed first (a collective failed)"
    # torchrun saw the peer's failure first, but rank 1 was killed: it is the cause
    both = torchrun_report(1, 137).replace(
        "Root Cause (first observed failure)", "Failures"
    ) + torchrun_report(0, 3)
    assert first_failure(worker + both) == "rank 1 failed first (exit code 137: killed)"
    # a stuck rank that torchrun stopped (SIGTERM) is not the cause: the report that names it is
    stopped = torchrun_report(1, -15).replace("Root Cause (first observed failure)", "Failures")
    assert first_failure(worker + stopped + torchrun_report(0, 3)) == STUCK


def test_a_mistake_found_inside_the_workers_is_one_error_without_torchruns_report(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    # the command's main() in this process: the launcher passes torchrun's stderr on through
    # sys.stderr, so whatever reaches the user is captured here
    monkeypatch.delenv("MESHPLAN_DEBUG", raising=False)
    status = main(
        ["run", TINY_DP, "--model", "no_such_model.py:build", "--steps", "1", "--out", str(tmp_path)]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "model file 'no_such_model.py' does not exist" in err
    assert "Traceback" not in err and "ChildFailedError" not in err


def a_finished_run(folder: Path) -> Path:
    """A run folder as a run leaves it: one complete checkpoint, metrics."""
    (folder / "checkpoints" / "step00000010").mkdir(parents=True)
    (folder / "checkpoints" / "step00000010" / ".metadata").write_bytes(b"dcp")
    (folder / "metrics").mkdir()
    (folder / "metrics" / "rank0.jsonl").write_text('{"step": 10}\n')
    return folder


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "already holds a run (1 checkpoint) (hint: continue it with --resume, pick another --out"),
        (["--resume", "--overwrite"], "--resume continues the run in --out and --overwrite replaces it"),
    ],
)
def test_a_second_run_into_a_run_folder_is_refused_and_loses_nothing(
    tmp_path, capsys, extra, message
) -> None:
    folder = a_finished_run(tmp_path / "run")
    assert main(["run", TINY_DP, "--out", str(folder), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert (folder / "checkpoints" / "step00000010" / ".metadata").read_bytes() == b"dcp"
    assert (folder / "metrics" / "rank0.jsonl").read_text() == '{"step": 10}\n'


def test_resume_with_nothing_to_resume_is_said(tmp_path, capsys) -> None:
    folder = tmp_path / "run"
    (folder / "metrics").mkdir(parents=True)
    (folder / "metrics" / "rank0.jsonl").write_text("{}\n")
    assert main(["run", TINY_DP, "--out", str(folder), "--resume"]) == 2
    assert f"--resume: no complete checkpoint in {folder}" in capsys.readouterr().err
    assert main(["run", TINY_DP, "--out", str(tmp_path / "never"), "--resume"]) == 2
    assert "--resume: no run folder" in capsys.readouterr().err


def test_overwrite_replaces_only_what_a_run_leaves(tmp_path) -> None:
    from meshplan.launcher import _check_run_folder

    folder = a_finished_run(tmp_path / "run")
    (folder / "notes.txt").write_text("mine")
    _check_run_folder(RunOptions(TINY_DP, out=str(folder), overwrite=True))
    assert not (folder / "checkpoints").exists() and not (folder / "metrics").exists()
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "case", ["out_is_a_file", "export_exists", "export_unwritable", "export_is_a_folder"]
)
def test_paths_that_cannot_work_are_found_before_training(tmp_path, capsys, case) -> None:
    a_file = tmp_path / "model.pt"
    a_file.write_bytes(b"weights")
    argv, message = {
        "out_is_a_file": (["--out", str(a_file)], "is a file, not a folder"),
        "export_exists": (["--export", str(a_file)], "exists (hint: name another file, or pass --overwrite"),
        "export_unwritable": (["--export", str(a_file / "model.pt")], "cannot write"),
        "export_is_a_folder": (["--export", str(tmp_path)], "is a folder that is not empty"),
    }[case]
    out = [] if case == "out_is_a_file" else ["--out", str(tmp_path / "run")]
    assert main(["run", TINY_DP, *out, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert a_file.read_bytes() == b"weights"


def test_a_damaged_checkpoint_stops_the_resume_with_one_line(tmp_path: Path, capfd) -> None:
    argv = [TINY_DP, "--out", str(tmp_path), "--batch", "2", "--seq", "16"]
    meshplan_run(*argv, "--steps", "2", "--save-every", "1")  # the run that saved it (no torchrun)
    shard = tmp_path / "checkpoints" / "step00000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-200:-136] = bytes(64)
    shard.write_bytes(bytes(data))
    done = meshplan_command(capfd, "run", *argv, "--steps", "3", "--resume")  # rank 0 finds it
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"meshplan: error: checkpoint {tmp_path}/checkpoints/step00000002 is damaged: __1_0.distcp does "
        f"not match the checksum written with it (hint: move step00000002 out of {tmp_path}/checkpoints "
        "to resume from step00000001)"
    )


def test_a_mesh_too_large_to_launch_is_refused_before_any_process(tmp_path, capsys) -> None:
    plan = tmp_path / "typo.plan"
    plan.write_text("mesh dp=100000\n\ndata_parallel over dp {}\n")
    assert main(["run", str(plan), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "the mesh needs 100,000 processes, 100,000 on this node" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("spec", ["rank=1", "rank=x,step=3", "rank=1,step=3,stuck", "garbage"])
def test_a_malformed_fault_hook_is_one_error_before_launch(tmp_path, capsys, monkeypatch, spec) -> None:
    monkeypatch.setenv("MESHPLAN_FAULT", spec)
    assert main(["run", TINY_DP, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"MESHPLAN_FAULT={spec!r} is not `rank=R,step=S`" in err and len(err.splitlines()) == 1
