"""`meshplan run` without torchrun, for the tests that compare training runs by their metrics.

`meshplan run PLAN ...` is two halves: the launcher checks the plan, the model, the data and
the run folder and compiles the program once (`launcher.prepare`), then torchrun starts a
worker per rank that joins the process group and trains (`run.train_rank`). Here the
launcher's half runs in the test process and each rank's half on the session's kept gloo
processes (`gloo_pool`), so a run costs neither torchrun nor a fresh Python importing torch
per rank: both halves are the command's own code, only the process start-up is shared.

    records = meshplan_run(str(plan), "--steps", "4", "--out", str(tmp_path / "run"))[0]

torchrun itself (restarts, signals, exit codes, errors from the workers) is tested through
the real command in tests/cli/test_run.py, test_run_user_errors.py and test_restart.py:
`meshplan_command` runs it as the console script does (its `main`) in the test process, so the
launcher's imports and compile are the test process's own; torchrun and its workers are real
processes. A test of the launcher process itself (a signal sent to it) starts `meshplan`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gloo_pool
import pytest

from meshplan.launcher import prepare
from meshplan.main import main
from meshplan.options import parse, run_dir
from meshplan.run import train_rank


def meshplan_run(*argv: str) -> list[list[dict]]:
    """Train as `meshplan run *argv` does; each rank's metrics records, by rank."""
    options, world_size = prepare(parse(list(argv)))  # with the program and vocabulary for the workers
    steps = gloo_pool.spawn(_worker, world_size, (options.worker_argv(),))
    assert all(done >= options.steps for done in steps), steps  # the command would exit 2
    return metrics(run_dir(options))


def _worker(rank: int, world_size: int, argv: list[str]) -> int:
    """A torchrun worker's part: the arguments the launcher hands it, parsed as it parses them."""
    return train_rank(parse(argv), rank, world_size, show_progress=False).steps_done


def metrics(folder: Path) -> list[list[dict]]:
    """Each rank's records (one per step) from a run folder, by rank."""
    files = sorted((folder / "metrics").glob("rank*.jsonl"), key=lambda f: int(f.stem.removeprefix("rank")))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def meshplan_command(capfd: pytest.CaptureFixture[str], *argv: str) -> SimpleNamespace:
    """`meshplan *argv` as its console script runs it (`sys.exit(main())`), in this process: the
    exit status, and what reached stdout and stderr, the workers' output included (captured at
    the file descriptors torchrun's processes inherit)."""
    capfd.readouterr()  # what came before is not the command's
    status = main(list(argv))
    out, err = capfd.readouterr()
    return SimpleNamespace(returncode=status, stdout=out, stderr=err)


def verified_rank(rank: int, world_size: int, job):
    """`meshplan verify`'s own rank (its worker, `verify._rank`), and the session it opened:
    for a test's worker to read what the rank's engines did after training.

        def worker(facts, rank, world_size, job):
            result, session = verified_rank(rank, world_size, job)
            ...  # session.dp, session.program
            return result
    """
    import meshplan.session
    from meshplan.verify import _rank

    opened = []
    open_session = meshplan.session.open_session

    def recording(*args, **kwargs):
        opened.append(open_session(*args, **kwargs))
        return opened[-1]

    meshplan.session.open_session = recording  # `_rank` imports it when it is called
    try:
        result = _rank(rank, world_size, job)
    finally:
        meshplan.session.open_session = open_session  # the process runs the next plan's rank too
    return result, opened[0]
