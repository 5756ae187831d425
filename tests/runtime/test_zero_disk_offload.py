"""ZeRO with the optimizer state offloaded to disk (`runtime/disk_offload.py`) on 2 gloo ranks:
bit-identical to the same run offloaded to the CPU, at ZeRO-1 and ZeRO-3; its checkpoints resume
with CPU offload and the reverse; a write that fails mid-run is one error naming the file.

Every case runs in one spawn (`results`): process start-up dominates.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from gloo_pool import spawn
from reference import zero_steps

from meshplan.examples.models.llama import build
from meshplan.runtime.disk_offload import DiskState, OffloadError
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import Zero, ZeroOptions, shard_for_zero

WORLD = 2
MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
SETTINGS = TrainConfig(lr=1e-2, weight_decay=0.1)
SEQ = 16


def _engine(model: torch.nn.Module, stage: int, disk: Path | None) -> Zero:
    options = ZeroOptions(stage=stage, bucket_bytes=4096, offload_optimizer=True, offload_dir=disk)
    return shard_for_zero(model, torch.distributed.group.WORLD, options).optimizer(SETTINGS)


def _steps(zero: Zero, model: torch.nn.Module, seeds: range) -> list[float]:
    return zero_steps(zero, model, seeds, world=WORLD, seq=SEQ)


def _params(zero: Zero, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with zero.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def worker(rank: int, world: int, tmp: str) -> dict:
    from meshplan.runtime import checkpoint

    out: dict = {}
    for stage in (1, 3):
        root = Path(tmp) / f"zero{stage}"
        runs = {}
        for kind in ("cpu", "disk"):
            model = build(**MODEL)
            zero = _engine(model, stage, root / "offload" if kind == "disk" else None)
            losses = _steps(zero, model, range(2))
            saved = checkpoint.save(root / kind, 2, zero)
            losses += _steps(zero, model, range(2, 4))
            runs[kind] = (losses, _params(zero, model), zero, saved)
        (cpu_losses, cpu_params, _, cpu_saved), (disk_losses, disk_params, disk, disk_saved) = (
            runs["cpu"],
            runs["disk"],
        )
        resumed = {}
        for name, saved, into in (("disk->cpu", disk_saved, None), ("cpu->disk", cpu_saved, root / "again")):
            fresh = build(seed=1, **MODEL)  # other weights: the checkpoint must replace them all
            engine = _engine(fresh, stage, into)
            checkpoint.load(saved, engine)
            if into is not None:  # read into memory, then written back to the files at once
                out[f"zero{stage} held after resume"] = engine.memory()["optimizer"]
            resumed[name] = _steps(engine, fresh, range(2, 4)) == cpu_losses[2:] and _same(
                _params(engine, fresh), cpu_params
            )
        out[f"zero{stage}"] = {
            "losses": disk_losses == cpu_losses,
            "params": _same(disk_params, cpu_params),
            "resumed": resumed,
            "peak_resident": disk.optim.disk.peak_resident if disk.optim.disk else None,
            "flats": len(disk.flats),
            "held_between_steps": disk.memory()["optimizer"],
            "files": sorted(p.name for p in (root / "offload" / f"rank{rank}").iterdir()),
        }
    # a write that fails mid-run: the step fails with one error naming the file
    model = build(**MODEL)
    zero = _engine(model, 1, Path(tmp) / "full")
    state = zero.optim.disk
    assert state is not None

    def no_space(i: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    state._write_now = no_space  # type: ignore[method-assign]
    try:
        _steps(zero, model, range(1))
        out["failed"] = ""
    except OffloadError as e:
        out["failed"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(worker, WORLD, (str(tmp_path_factory.mktemp("disk")),))


@pytest.mark.parametrize("stage", [1, 3])
def test_bit_identical_to_cpu_offload(results: list[dict], stage: int) -> None:
    for by_rank in results:
        case = by_rank[f"zero{stage}"]
        assert case["losses"] and case["params"]


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoints_resume_across_cpu_and_disk_offload(results: list[dict], stage: int) -> None:
    for by_rank in results:
        assert by_rank[f"zero{stage}"]["resumed"] == {"disk->cpu": True, "cpu->disk": True}


@pytest.mark.parametrize("stage", [1, 3])
def test_state_on_disk_between_steps(results: list[dict], stage: int) -> None:
    for by_rank in results:
        case = by_rank[f"zero{stage}"]
        assert case["flats"] > 3  # so that the bound below says something
        assert case["peak_resident"] <= 3
        assert case["held_between_steps"] <= 4 * case["flats"]  # AdamW's step counts only
        assert by_rank[f"zero{stage} held after resume"] <= 4 * case["flats"]
        assert case["files"] == [f"flat{i:04d}.bin" for i in range(case["flats"])]


def test_a_failed_write_names_the_file(results: list[dict]) -> None:
    for rank, by_rank in enumerate(results):
        assert f"full/rank{rank}/flat0000.bin failed mid-run: No space left on device" in by_rank["failed"]


def test_round_trip_and_unwritable_folder(tmp_path: Path) -> None:
    tensors = [[torch.arange(5.0) + i, torch.full((5,), float(i))] for i in range(4)]
    expected = [[t.clone() for t in ts] for ts in tensors]
    state = DiskState(tmp_path / "state", tensors)
    assert all(t.numel() == 0 for ts in tensors for t in ts)
    for i in state.walk():
        assert all(torch.equal(t, e) for t, e in zip(tensors[i], expected[i], strict=True))
        tensors[i][0].add_(1)
    state.fetch_all()
    assert all(torch.equal(tensors[i][0], expected[i][0] + 1) for i in range(4))
    (tmp_path / "file").write_text("")
    with pytest.raises(OffloadError, match=r"cannot create the optimizer's offload files in .*file/x"):
        DiskState(tmp_path / "file" / "x", tensors)


def _anonymous_bytes() -> int:
    """This process's resident anonymous memory (not file pages, which the kernel may drop)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_a_checkpoint_maps_the_files_instead_of_reading_the_state_into_memory(tmp_path: Path) -> None:
    """`map_all` (what a checkpoint's `own_elements` calls): the state readable and writable in
    place, as file pages; the process's anonymous memory does not grow by the state's 96 MiB, and
    what is written through the mapping is in the file for the next walk."""
    n = 2**22  # 16 MiB a tensor, 3 a flat, 2 flats
    tensors = [[torch.full((n,), float(i)), torch.zeros(n), torch.ones(n)] for i in range(2)]
    state = DiskState(tmp_path / "state", tensors)
    before = _anonymous_bytes()
    state.map_all()
    assert [float(ts[0][-1]) for ts in tensors] == [0.0, 1.0]  # every page read
    assert all(
        float(t.sum()) == n * (1 if j == 2 else i if j == 0 else 0)
        for i, ts in enumerate(tensors)
        for j, t in enumerate(ts)
    )
    grown = _anonymous_bytes() - before
    assert grown < 8 * 2**20, f"anonymous memory grew by {grown / 2**20:.1f} MiB for 96 MiB of state"
    tensors[1][1].fill_(7.0)  # a resume loads into the mapping
    for i in state.walk():
        assert float(tensors[i][1][0]) == (7.0 if i == 1 else 0.0)
    assert all(t.numel() == 0 for ts in tensors for t in ts)  # unmapped, on disk
