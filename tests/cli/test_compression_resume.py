"""`compress`'s error feedback is part of a checkpoint: a run stopped after a save and resumed
continues the uninterrupted run bit for bit, under plain data parallelism (bf16) and ZeRO-2
(PowerSGD, its warm-up crossed before the save), and ZeRO-2 beside sequence-parallel norms
(the per-axes engines, each set's feedback saved and restored). On another layout (another bucket size) the
feedback cannot be placed: it starts from zero, and the resume says so."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from gloo_pool import shared_processes, spawn
from plans import data_parallel, llama_rules, llama_sequence, plan
from runs import meshplan_run

PLANS = {
    "bf16": "mesh dp=2\n\ndata_parallel over dp {\n    compress = bf16\n}\n",
    "powersgd-zero2": (
        "mesh dp=2\n\ndata_parallel over dp {\n    zero = 2\n    compress = powersgd(rank=2, warmup=1)\n}\n"
    ),
    # the per-axes engines: the norms' state over dp x tp, the rest over dp, each with its feedback
    "powersgd-zero2-sp": plan(
        llama_rules(vocab=False) + llama_sequence(),
        mesh="dp=2, tp=2",
        extra=data_parallel(zero=2, compress="powersgd(rank=2, warmup=1)"),
    ),
}


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


def _losses(records: list[list[dict]]) -> list[list[float]]:
    return [[r["loss"] for r in rank] for rank in records]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_a_resumed_run_continues_the_uninterrupted_one_bit_for_bit(tmp_path: Path, name: str) -> None:
    plan = tmp_path / f"{name}.plan"
    plan.write_text(PLANS[name])
    whole = tmp_path / "whole"
    flags = ["--steps", "6", "--save-every", "3", "--seq", "32"]
    uninterrupted = meshplan_run(str(plan), *flags, "--out", str(whole))
    # the same run, stopped right after its step-3 save
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step00000006")
    shutil.rmtree(resumed / "metrics")
    records = meshplan_run(str(plan), *flags, "--out", str(resumed), "--resume")
    assert [rank[0]["step"] for rank in records] == [4] * len(uninterrupted)
    assert _losses(records) == [losses[3:] for losses in _losses(uninterrupted)]


def _load(rank: int, world_size: int, folder: str, bucket_bytes: int) -> tuple[tuple[str, ...], bool]:
    """Load the bf16 run's checkpoint into a DataParallel of `bucket_bytes` buckets: the notes,
    and whether the residuals came back (the same values as saved)."""
    import torch.distributed as dist

    from meshplan.examples.models.llama import build
    from meshplan.runtime import checkpoint
    from meshplan.runtime.compression import Compression
    from meshplan.runtime.data_parallel import DataParallel
    from meshplan.runtime.train import TrainConfig

    model = build()
    sync = DataParallel(model, dist.group.WORLD, bucket_bytes=bucket_bytes, compression=Compression("bf16"))
    sync.optimizer(TrainConfig())
    restored = checkpoint.load(Path(folder), sync)
    residuals = sync.own_local()
    return restored.notes, bool(residuals) and all(torch.count_nonzero(t) > 0 for t in residuals.values())


@pytest.mark.slow
def test_another_layout_starts_the_feedback_from_zero_and_says_so(tmp_path: Path) -> None:
    plan = tmp_path / "bf16.plan"
    plan.write_text(PLANS["bf16"].replace("compress = bf16", "bucket = 4MB\n    compress = bf16"))
    meshplan_run(
        str(plan), "--steps", "2", "--save-every", "2", "--seq", "32", "--out", str(tmp_path / "run")
    )
    folder = str(tmp_path / "run" / "checkpoints" / "step00000002")
    same = spawn(_load, 2, (folder, 4 * 2**20))
    assert all(notes == () and back for notes, back in same)
    other = spawn(_load, 2, (folder, 2**14))  # many small buckets: none fits the saved one
    assert all(not back and "starts from zero" in notes[0] for notes, back in other)
