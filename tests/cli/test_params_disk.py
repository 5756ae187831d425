"""`offload = params:disk` through the command: `check`, `explain`, `estimate`, `verify`, and
`meshplan run` (minus torchrun: tests/runs.py) under ZeRO-3 with the parameter shards in files.

Each run is compared with plain ZeRO-3 and with the shards in host memory (`offload = params`)
on the same data and seed: the losses and gradient norms of every step and the exported
weights must be equal to the bit (the same arithmetic; only where the shards wait differs).
A run stopped after its step-2 checkpoint and resumed, under params:disk and under a plan
without offload, must continue as the uninterrupted run did.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gloo_pool import shared_processes
from runs import meshplan_run

from meshplan.dsl import load_plan
from meshplan.main import main
from meshplan.verify import render, verify

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LLAMA = f"{ROOT}/examples/models/llama.py:build"
MODEL = """
from meshplan.examples.models.llama import build as _build


def build():
    return _build(num_hidden_layers=3)
"""
STEPS = 4
FLAGS = ("--steps", str(STEPS), "--batch", "4", "--seq", "32", "--warmup", "2", "--grad-clip", "0.5")
OFFLOADS = {
    "zero3": "",
    "params": "params",
    "params-disk": "params:disk",
    "both-disk": "optimizer:disk, params:disk",
}


def plan_text(offload: str) -> str:
    line = f"    offload = {offload}\n" if offload else ""
    return f"mesh dp=2\n\ndata_parallel over dp {{\n    zero = 3\n    bucket = 16KB\n{line}}}\n"


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("params_disk")
    (tmp / "model.py").write_text(MODEL)
    for name, offload in OFFLOADS.items():
        (tmp / f"{name}.plan").write_text(plan_text(offload))
    return tmp


def _run(folder: Path, plan: str, out: str, *extra: str) -> list[list[dict]]:
    return meshplan_run(
        str(folder / f"{plan}.plan"), "--model", f"{folder / 'model.py'}:build", *FLAGS, "--out",
        str(folder / out), *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(folder: Path) -> dict[str, list[list[dict]]]:
    """name -> per rank, the metrics records of each step; each run exports its weights to
    folder/NAME.safetensors and checkpoints every 2 steps."""
    out = {}
    for name in OFFLOADS:
        out[name] = _run(
            folder, name, name, "--save-every", "2", "--export", str(folder / f"{name}.safetensors")
        )
    # stopped after its step-2 checkpoint, resumed: under params:disk, and without offload
    for name, plan, source in (
        ("both-disk-resumed", "both-disk", "both-disk"),
        ("params-disk-resumed-plain", "zero3", "params-disk"),
    ):
        shutil.copytree(folder / source, folder / name)
        shutil.rmtree(folder / name / "checkpoints" / f"step{STEPS:08d}")
        shutil.rmtree(folder / name / "metrics")
        shutil.rmtree(folder / name / "offload", ignore_errors=True)
        out[name] = _run(folder, plan, name, "--resume")
    return out


def _series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


@pytest.mark.parametrize("name", ["params", "params-disk", "both-disk"])
def test_runs_are_bit_identical_to_plain_zero3(runs, folder: Path, name: str) -> None:
    for records, plain in zip(runs[name], runs["zero3"], strict=True):
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        for key in ("loss", "grad_norm"):
            assert _series(records, key) == _series(plain, key)
    # the final weights, as `--export` gathers them unit by unit
    assert (folder / f"{name}.safetensors").read_bytes() == (folder / "zero3.safetensors").read_bytes()


def test_the_shards_are_in_files_between_steps(runs, folder: Path) -> None:
    in_memory = runs["params"][0][-1]["zero_memory"]["params"]
    for name in ("params-disk", "both-disk"):
        assert runs[name][0][-1]["zero_memory"]["params"] < in_memory / 2  # the gathered root unit only
        files = sorted((folder / name / "offload" / "rank0").glob("params*.bin"))
        assert len(files) >= 4  # a unit a layer, and the root's
    assert sorted((folder / "both-disk" / "offload" / "rank1").glob("flat*.bin"))  # the optimizer's too


@pytest.mark.parametrize("name", ["both-disk-resumed", "params-disk-resumed-plain"])
def test_resumed_runs_continue_as_the_uninterrupted_one(runs, name: str) -> None:
    uninterrupted = runs[name.removesuffix("-resumed").removesuffix("-resumed-plain")]
    for resumed, whole in zip(runs[name], uninterrupted, strict=True):
        assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
        assert _series(resumed, "loss") == _series(whole[2:], "loss")
        assert _series(resumed, "grad_norm") == _series(whole[2:], "grad_norm")


def test_the_plan_is_accepted_with_zero3_only(folder: Path, capsys) -> None:
    plan = load_plan(folder / "both-disk.plan", world_size=2)
    assert plan.data_parallel is not None
    assert plan.data_parallel.params_on_disk and plan.data_parallel.optimizer_on_disk
    assert main(["check", str(folder / "params-disk.plan")]) == 0
    bad = folder / "zero2.plan"
    bad.write_text(plan_text("params:disk").replace("zero = 3", "zero = 2"))
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "zero2.plan:6:15: error: offloading parameters to disk needs `zero = 3`" in err


def test_explain_and_estimate_put_the_shards_on_disk(folder: Path, capsys) -> None:
    model = f"{folder / 'model.py'}:build"
    capsys.readouterr()
    assert main(["explain", str(folder / "both-disk.plan"), "--model", model]) == 0
    said = capsys.readouterr().out
    assert "offload = params:disk: each rank's parameter shards live in files" in said
    assert "the step writes each back with its flat's state" in said
    (folder / "state-disk.plan").write_text(plan_text("optimizer:disk, params"))
    by_plan = {}
    for name in [*OFFLOADS, "state-disk"]:
        argv = ["estimate", str(folder / f"{name}.plan"), "--model", model, "--batch", "2", "--seq", "16"]
        assert main([*argv, "--json"]) == 0
        by_plan[name] = json.loads(capsys.readouterr().out)["ranks"][0]
    params, on_disk = by_plan["params"], by_plan["params-disk"]
    assert params["disk"] == 0 and params["host"] > 0
    shards = params["host"]  # fp32 on a CPU: the shards are the optimizer's masters, on the host
    # the optimizer's state in memory: the step reads every shard back, so the host's peak is the same
    assert on_disk["disk"] == shards and on_disk["host"] == shards
    # with the optimizer's state in files, the shards join it there; the host holds two units' of them
    state, both = by_plan["state-disk"], by_plan["both-disk"]
    assert both["disk"] == state["disk"] + shards
    assert 0 < both["host"] - (state["host"] - shards) < shards


def test_verify_passes(folder: Path) -> None:
    report = verify(str(folder / "both-disk.plan"), LLAMA, steps=2)
    assert report.ok, render(report)
