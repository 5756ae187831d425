"""The compiled program is what runs: `meshplan run` compiles once, before any worker starts,
and every rank loads that program; `meshplan run DIR` runs a `meshplan compile -o DIR` folder.

Through the real command line and torchrun, a compile folder trains exactly like its plan
(the same losses, step by step), and at any other shape its splits divide like the plan
compiled for that shape (the plans' runs, and the folder's at other shapes, are `meshplan
run` minus torchrun: tests/runs.py). A folder that
does not fit the run (a sequence the plan cannot cut, another model) and a plan that does
not fit the model are one error from the launcher, exit 2, before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runs import meshplan_command, meshplan_run

from meshplan.main import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples" / "llama_tp.plan"
LLAMA = "meshplan.examples.models.llama:build"
SHAPE = ("--batch", "2", "--seq", "32")


def losses(run: Path) -> list[float]:
    lines = (run / "metrics" / "rank0.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compiled") / "build"
    assert main(["compile", str(PLAN), "--model", LLAMA, *SHAPE, "-o", str(out)]) == 0  # in this process
    return out


def test_a_compile_folder_trains_like_its_plan(compiled: Path, tmp_path: Path, capfd, monkeypatch) -> None:
    meshplan_run(str(PLAN), *SHAPE, "--steps", "4", "--out", str(tmp_path / "plan"))  # without torchrun
    assert (tmp_path / "plan" / "program.pt").is_file()  # what the workers ran, kept with the run
    # the folder knows its model and shapes: none of them is given again; through torchrun
    monkeypatch.setenv("NO_COLOR", "1")
    from_folder = meshplan_command(
        capfd, "run", str(compiled), "--steps", "4", "--out", str(tmp_path / "folder")
    )
    assert from_folder.returncode == 0, from_folder.stderr
    assert losses(tmp_path / "folder") == losses(tmp_path / "plan")
    assert len(losses(tmp_path / "plan")) == 4


def test_a_compile_folder_runs_other_shapes_like_a_plan_compiled_for_them(
    compiled: Path, tmp_path: Path
) -> None:
    """Captured with symbolic batch and sequence length, the folder compiled at (2, 32) trains
    (3, 16) micro-batches exactly as the plan compiled for (3, 16) does."""
    other = ("--batch", "3", "--seq", "16")
    from_plan = meshplan_run(str(PLAN), *other, "--steps", "3", "--out", str(tmp_path / "plan"))[0]
    from_folder = meshplan_run(str(compiled), *other, "--steps", "3", "--out", str(tmp_path / "folder"))[0]
    assert [r["loss"] for r in from_folder] == [r["loss"] for r in from_plan]
    assert len(from_folder) == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--seq", "33"],
            "cannot run --batch 2 --seq 33: --seq 33 does not divide by 2: "
            "`layers.*.{input,post_attention}_layernorm: sequence over tp` cuts each sequence into 2 "
            "shards over `tp`",
        ),
        (["--seq", "130"], "--seq 130 is longer than"),
        (["--model", str(ROOT / "examples" / "models" / "gpt.py:build")], "compiled for another model"),
    ],
)
def test_a_folder_that_does_not_fit_the_run_is_refused_before_launch(
    compiled: Path, tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["run", str(compiled), "--steps", "1", "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and "torch.distributed" not in err
    assert not list((tmp_path / "run").glob("metrics/*.jsonl"))  # no worker wrote a step


def test_a_plan_that_does_not_fit_the_model_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    plan = tmp_path / "typo.plan"
    plan.write_text(PLAN.read_text().replace("o_proj:", "out_proj:"))
    assert main(["run", str(plan), *SHAPE, "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "typo.plan:" in err and "matches no module" in err
    assert err.count("matches no module") == 1  # once, from the launcher, not once per rank
    assert "torch.distributed" not in err
    assert not list((tmp_path / "run").glob("metrics/*.jsonl"))  # no worker wrote a step
