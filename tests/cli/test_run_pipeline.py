"""`meshplan run` of pipeline plans (minus torchrun: tests/runs.py) against the same run on one process.

Under a pipeline, `--batch` is one microbatch and a micro-step runs `microbatches` of them,
so `--batch 2` with 4 microbatches trains on the same data as `--batch 8` on one process:
the losses and gradient norms of every step must agree, and a checkpoint written by the
pipeline must resume on one process as if the run had never stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from plans import data_parallel, llama_rules, llama_sequence, plan
from runs import meshplan_run

pytestmark = pytest.mark.slow

STEPS, SEQ, MICRO = 4, 16, 4
PIPELINE = "\npipeline over pp {{\n    schedule = {schedule}\n{virtual}    microbatches = 4\n}}\n"


def pipeline_plan(
    tmp: Path, name: str, *, schedule: str, mesh: str, rules: str = "", virtual: int = 0, extra: str = ""
) -> Path:
    block = PIPELINE.format(schedule=schedule, virtual=f"    virtual_stages = {virtual}\n" if virtual else "")
    block += extra
    path = tmp / f"{name}.plan"
    path.write_text(plan(rules, mesh=mesh, extra=block) if rules else f"mesh {mesh}\n{block}")
    return path


def run(plan_path: Path, out: Path, *extra: str, batch: int = 2, steps: int = STEPS) -> list[dict]:
    argv = [str(plan_path), "--steps", str(steps), "--seq", str(SEQ), "--batch", str(batch)]
    return meshplan_run(*argv, "--out", str(out), *extra)[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    """The reference: the whole model on one process, 8 sequences per step."""
    tmp = tmp_path_factory.mktemp("one")
    (tmp / "one.plan").write_text("mesh dp=1\n")
    return run(tmp / "one.plan", tmp / "run", batch=2 * MICRO)


@pytest.fixture(scope="module")
def one_process_twice_the_batch(tmp_path_factory) -> list[dict]:
    """The reference for two data-parallel ranks: 16 sequences per step on one process."""
    tmp = tmp_path_factory.mktemp("one16")
    (tmp / "one.plan").write_text("mesh dp=1\n")
    return run(tmp / "one.plan", tmp / "run", batch=2 * 2 * MICRO)


def same_steps(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), g["step"]


@pytest.mark.parametrize(("schedule", "zero"), [("1f1b", 0), ("zero_bubble", 2)])
def test_a_pipeline_with_data_parallel_trains_like_one_process(
    tmp_path: Path, one_process_twice_the_batch: list[dict], schedule: str, zero: int
) -> None:
    """dp=2 x pp=2 on 4 processes, plain data parallel under 1F1B or ZeRO-2 under ZB-H1: each
    stage's gradients are reduced once per step, launched by its last backward (under ZB-H1
    its last weight-gradient action)."""
    block = data_parallel(zero=zero, bucket="64KB")
    path = pipeline_plan(tmp_path, "dppp", schedule=schedule, mesh="dp=2, pp=2", extra=block)
    same_steps(run(path, tmp_path / "run"), one_process_twice_the_batch)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_two_chunk_pipelines_with_tensor_and_sequence_parallel_and_checkpointing(
    tmp_path: Path, one_process: list[dict], schedule: str
) -> None:
    """pp=2 x tp=2 on 4 processes, 4 virtual stages (interleaved, or in a V with the backward
    split), Megatron TP with SP, every second layer recomputed: still the one-process run."""
    rules = llama_rules() + llama_sequence() + "    layers.*: checkpoint every 2\n"
    path = pipeline_plan(tmp_path, "pptp", schedule=schedule, mesh="pp=2, tp=2", rules=rules, virtual=2)
    records = run(path, tmp_path / "run")
    same_steps(records, one_process)
    # the measured bubble: some waiting, never all of it
    assert all(0.0 < r["pipeline_idle"] < 1.0 for r in records), [r["pipeline_idle"] for r in records]


def test_a_pipeline_checkpoint_resumes_on_one_process(tmp_path: Path, one_process: list[dict]) -> None:
    """GPipe on 2 ranks saves at step 2; one process holding every stage goes on from there
    exactly as the uninterrupted run did (the checkpoint does not depend on the layout)."""
    path = pipeline_plan(tmp_path, "gpipe", schedule="gpipe", mesh="pp=2")
    out = tmp_path / "run"
    same_steps(run(path, out, "--save-every", "2", steps=2), one_process[:2])
    (tmp_path / "one.plan").write_text("mesh dp=1\n")
    resumed = run(tmp_path / "one.plan", out, "--resume", batch=2 * MICRO)
    same_steps([r for r in resumed if r["step"] > 2], one_process[2:])


def test_a_pipeline_exports_every_weight(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from meshplan.examples.models.llama import build

    export = tmp_path / "weights.safetensors"
    run(
        pipeline_plan(tmp_path, "pp", schedule="1f1b", mesh="pp=2"),
        tmp_path / "run",
        "--export",
        str(export),
        steps=1,
    )
    weights, want = load_file(export), build().state_dict()
    assert set(weights) == set(want)  # each stage's weights, put together from both ranks
    assert all(weights[name].shape == want[name].shape for name in want)
