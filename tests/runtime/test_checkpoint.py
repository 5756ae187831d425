"""Checkpoints: atomic publication, and resume that continues bit-identically on CPU."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import spawn

from meshplan.examples import CORPUS
from meshplan.examples.models.llama import build
from meshplan.runtime import checkpoint
from meshplan.runtime.axes import Axes
from meshplan.runtime.data import TextBatches, read_bytes
from meshplan.runtime.data_parallel import DataParallel
from meshplan.runtime.grad_sync import Local
from meshplan.runtime.train import TrainConfig, train


def tiny(hidden_size: int = 32) -> tuple[torch.nn.Module, Local, torch.optim.Optimizer]:
    """A model on one process, its engine (what a checkpoint saves from) and the engine's AdamW."""
    model = build(num_hidden_layers=1, hidden_size=hidden_size, intermediate_size=64)
    sync = Local(model)
    return model, sync, sync.optimizer(TrainConfig(lr=1e-2))


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(ids, ids).backward()
    optimizer.step()
    optimizer.zero_grad()


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_crash_between_write_and_rename_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    model, sync, optimizer = tiny()
    one_step(model, optimizer, 0)
    checkpoint.save(tmp_path, 1, sync)
    at_step_1 = state(model)
    one_step(model, optimizer, 1)
    # the job dies after every rank wrote step 2 but before rank 0 renamed it
    tmp = checkpoint.write_temporary(tmp_path, 2, sync)
    assert tmp.name.startswith(checkpoint.TMP_PREFIX) and (tmp / ".metadata").exists()

    assert checkpoint.latest(tmp_path) == tmp_path / "step00000001"
    fresh, fresh_sync, fresh_opt = tiny()
    restored = checkpoint.load(checkpoint.latest(tmp_path), fresh_sync)
    assert restored.step == 1
    assert all(torch.equal(fresh_param, at_step_1[n]) for n, fresh_param in state(fresh).items())
    assert fresh_opt.state_dict()["state"][0]["step"] == 1

    # the next save of that step replaces the leftover and publishes normally
    checkpoint.save(tmp_path, 2, sync)
    assert checkpoint.latest(tmp_path) == tmp_path / "step00000002"
    assert not tmp.exists()


def test_old_checkpoints_are_pruned(tmp_path: Path) -> None:
    _, sync, _ = tiny()
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, sync, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000002", "step00000003"]


def test_latest_ignores_unfinished_folders(tmp_path: Path) -> None:
    (tmp_path / "step00000009").mkdir()  # no .metadata: not a complete checkpoint
    (tmp_path / ".tmp-step00000010").mkdir()
    assert checkpoint.latest(tmp_path) is None
    assert checkpoint.latest(tmp_path / "missing") is None


# ---------------------------------------------------------------------------- resume, 2 ranks

STEPS = 6


class Crash(RuntimeError):
    pass


def resume_worker(rank: int, world_size: int, tmp: str) -> dict[str, list[float]]:
    tokens = read_bytes(CORPUS)

    def run(run_dir: str, *, save_every: int = 0, resume: bool = False, crash_at: int | None = None):
        model = build(num_hidden_layers=1)
        dp = DataParallel(model, dist.group.WORLD, bucket_bytes=100_000)
        source = TextBatches(tokens, batch=2, seq=32, seed=7, dp_rank=rank, dp_size=2, accumulation=2)

        def batches(step: int, micro: int):
            if step == crash_at:
                raise Crash(f"killed at step {step}")
            return source(step, micro)

        cfg = TrainConfig(
            steps=STEPS, warmup_steps=2, accumulation=2, seed=7, run_dir=Path(tmp) / run_dir,
            save_every=save_every, resume=resume,
        )  # fmt: skip
        summary = train(
            model,
            lambda x, y: dp(x, y),
            batches,
            cfg,
            axes=Axes(groups={"dp": dist.group.WORLD}, data=("dp",)),
            sync=dp,
        )
        return summary.losses, [p.detach().numpy().copy() for p in model.parameters()]

    straight, straight_params = run("straight")
    with contextlib.suppress(Crash):
        run("interrupted", save_every=3, crash_at=4)
    resumed, resumed_params = run("interrupted", save_every=3, resume=True)
    same = all((a == b).all() for a, b in zip(straight_params, resumed_params, strict=True))
    return {"straight": straight, "resumed": resumed, "same_params": same}


@pytest.mark.slow
def test_resume_continues_bit_identically(tmp_path: Path) -> None:
    results = spawn(resume_worker, 2, (str(tmp_path),))
    for r in results:
        assert len(r["resumed"]) == STEPS - 3  # from the checkpoint of step 3, not the crash at 4
        assert r["resumed"] == r["straight"][3:]  # exact float equality
        assert r["same_params"]
    metrics = (tmp_path / "interrupted" / "metrics" / "rank0.jsonl").read_text().splitlines()
    assert len(metrics) == 4 + 3  # steps 1-4 before the crash, 4-6 after the resume


def saved_twice(tmp_path: Path) -> Path:
    model, sync, optimizer = tiny()
    for step in (1, 2):
        one_step(model, optimizer, step)
        checkpoint.save(tmp_path, step, sync)
    return tmp_path / "step00000002"


def shard_of(folder: Path) -> Path:
    return next(folder.glob("*.distcp"))


def test_a_checkpoint_records_a_checksum_of_every_file(tmp_path: Path) -> None:
    folder = saved_twice(tmp_path)
    sums = json.loads((folder / checkpoint.CHECKSUMS).read_text())
    assert set(sums) == {p.name for p in folder.iterdir()} - {checkpoint.CHECKSUMS}
    assert sums[".metadata"]["bytes"] == (folder / ".metadata").stat().st_size


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("zeroed", r"is damaged: __0_0\.distcp does not match the checksum written with it"),
        ("truncated", r"is damaged: __0_0\.distcp has 100 bytes, \d+ were written"),
        ("missing", r"is incomplete: __0_0\.distcp is missing"),
    ],
)
def test_a_damaged_checkpoint_is_one_error_naming_the_file(tmp_path: Path, damage: str, message: str) -> None:
    """64 zeroed bytes in a shard once loaded silently and training diverged."""
    folder = saved_twice(tmp_path)
    shard = shard_of(folder)
    data = bytearray(shard.read_bytes())
    if damage == "zeroed":
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
        shard.write_bytes(bytes(data))
    elif damage == "truncated":
        shard.write_bytes(bytes(data[:100]))
    else:
        shard.unlink()
    _, fresh_sync, _ = tiny()
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.load(folder, fresh_sync)


def test_a_checkpoint_of_another_model_names_what_does_not_fit(tmp_path: Path) -> None:
    folder = saved_twice(tmp_path)
    _, other, _ = tiny(hidden_size=16)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"does not fit this run: `\S+` was saved as \["
    ) as info:
        checkpoint.load(folder, other)
    assert "Traceback" not in str(info.value)
