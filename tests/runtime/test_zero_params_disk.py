"""ZeRO-3 with the parameter shards on disk (`offload = params:disk`, `disk_offload.ParamFiles`).

The files alone (no process group): shards read back as written, read ahead in the order the
last step needed them, freed after their all-gather, a failed read naming its file. Then the
engine on 2 gloo ranks, every case in one spawn (`results`): bit-identical to the same run
with the shards in memory (`offload = params`) and to plain ZeRO-3, with and without the
optimizer's state on disk; at most about two units' shards in memory during a step and none
between steps; checkpoints resume across params:disk and no offload; an export by unit.
"""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gloo_pool import spawn
from reference import zero_steps

from meshplan.examples.models.llama import build
from meshplan.runtime.disk_offload import OffloadError, ParamFiles, shards_in_memory
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import Zero, ZeroOptions, shard_for_zero

WORLD = 2
LAYERS = 6
MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS}
SETTINGS = TrainConfig(lr=1e-2, weight_decay=0.1)
SEQ = 16

# ---------------------------------------------------------------------- the files alone


def _fake(n: int, size: int = 6) -> tuple[list[SimpleNamespace], list[SimpleNamespace], list[torch.Tensor]]:
    """`n` flats of one parameter shard each, a unit each (refetched but the last, as the root)."""
    flats = [SimpleNamespace(shard=torch.arange(float(size)) + 10 * i, files=None) for i in range(n)]
    units = [SimpleNamespace(flats=[f], refetch=i < n - 1) for i, f in enumerate(flats)]
    return flats, units, [f.shard.clone() for f in flats]


def _resident(flats: list[SimpleNamespace]) -> list[int]:
    return [i for i, f in enumerate(flats) if f.shard.numel() > 0]


def test_shards_are_read_for_their_gather_and_freed_after(tmp_path: Path) -> None:
    flats, units, want = _fake(4)
    masters = [torch.empty(0) for _ in flats]  # copies: no shard is its master
    files = ParamFiles(tmp_path / "rank0", units, flats, masters)  # type: ignore[arg-type]
    assert _resident(flats) == [] and all(f.files is files for f in flats)
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == [f"params{i:04d}.bin" for i in range(4)]
    files.need(flats[2])  # type: ignore[arg-type]
    assert torch.equal(flats[2].shard, want[2])
    files.gathered(flats[2])  # type: ignore[arg-type]
    assert 2 not in _resident(flats)
    with shards_in_memory(files, step=True):  # the step walks them (the optimizer's state not on disk)
        for i in files.walk():
            assert set(_resident(flats)) <= {i - 1, i, i + 1}  # i - 1 being written, i + 1 read
            flats[i].shard.add_(1)
    assert _resident(flats) == []
    with shards_in_memory(files):
        assert all(torch.equal(f.shard, w + 1) for f, w in zip(flats, want, strict=True))
    assert _resident(flats) == []


def test_reads_follow_the_last_steps_order_one_unit_ahead(tmp_path: Path) -> None:
    flats, units, want = _fake(5)
    files = ParamFiles(tmp_path, units, flats, [torch.empty(0) for _ in flats])  # type: ignore[arg-type]
    # a step: forward 0..4, backward 3..0 (the last unit is kept from forward)
    order = [0, 1, 2, 3, 4, 3, 2, 1, 0]
    most = 0
    for step in range(2):
        for i in order:
            files.need(flats[i])  # type: ignore[arg-type]
            assert torch.equal(flats[i].shard, want[i])
            most = max(most, len(_resident(flats)))
            files.gathered(flats[i])  # type: ignore[arg-type]
        with files.stepping():
            pass
        if step == 1:  # the order learned: at most this flat and the next, being read (whose
            # storage exists only once the I/O thread starts the read: 1 or 2 by timing)
            assert 1 <= files.gathers_peak <= 2
    assert most <= 2
    files.need(flats[0])  # type: ignore[arg-type]
    files.drain()  # the read ahead done
    assert _resident(flats) == [0, 1]  # 1 was read with it
    files.need(flats[3])  # type: ignore[arg-type]  # not what followed: it finds its place
    files.drain()
    assert _resident(flats) == [0, 3, 4]  # 0 is still being gathered, 4 followed 3; 1 was freed


def test_errors_name_the_folder_or_the_file(tmp_path: Path) -> None:
    flats, units, _ = _fake(2)
    (tmp_path / "file").write_text("")
    masters = [torch.empty(0) for _ in flats]
    with pytest.raises(OffloadError, match=r"cannot create the parameters' offload files in .*file/x"):
        ParamFiles(tmp_path / "file" / "x", units, flats, masters)  # type: ignore[arg-type]
    files = ParamFiles(tmp_path / "ok", units, flats, masters)  # type: ignore[arg-type]
    (tmp_path / "ok" / "params0001.bin").write_bytes(b"")  # truncated behind its back
    with pytest.raises(
        OffloadError, match=r"the parameters' offload file .*ok/params0001.bin failed mid-run"
    ):
        files.need(flats[1])  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the engine on 2 ranks

KINDS = {
    "zero3": {},
    "params": {"offload_params": True},
    "params:disk": {"offload_params": True, "params_dir": "offload"},
    "optimizer,params": {"offload_params": True, "offload_optimizer": True},
    "optimizer:disk,params:disk": {
        "offload_params": True,
        "offload_optimizer": True,
        "params_dir": "offload",
        "offload_dir": "offload",
    },
}


def _engine(model: torch.nn.Module, kind: str, root: Path) -> Zero:
    options = {k: root / v if k.endswith("_dir") else v for k, v in KINDS[kind].items()}
    return shard_for_zero(model, torch.distributed.group.WORLD, ZeroOptions(stage=3, **options)).optimizer(
        SETTINGS
    )


def _steps(zero: Zero, model: torch.nn.Module, seeds: range) -> list[float]:
    return zero_steps(zero, model, seeds, world=WORLD, seq=SEQ)


def _params(zero: Zero, model: torch.nn.Module) -> dict[str, list]:
    with zero.gathered():
        return {n: p.detach().tolist() for n, p in model.named_parameters()}


def _by_unit(zero: Zero, model: torch.nn.Module) -> dict[str, list]:
    """What an export reads: each unit's parameters in turn (`gathered_by_unit`)."""
    out = {}
    named = dict(model.named_parameters())
    for names in zero.gathered_by_unit():
        out |= {n: named[n].detach().tolist() for n in names}
    return out


def _shard_bytes(zero: Zero) -> int:
    return sum(f.shard.untyped_storage().nbytes() for f in zero.flats)


def worker(rank: int, world: int, tmp: str) -> dict:
    from meshplan.runtime import checkpoint

    out: dict = {}
    runs = {}
    for kind in KINDS:
        root = Path(tmp) / kind.replace(":", "-").replace(",", "+")
        model = build(**MODEL)
        zero = _engine(model, kind, root)
        losses = _steps(zero, model, range(2))
        saved = checkpoint.save(root / "checkpoints", 2, zero)
        losses += _steps(zero, model, range(2, 4))
        between_steps = _shard_bytes(zero)
        files = zero._files
        runs[kind] = losses, _params(zero, model), saved
        out[kind] = {
            "shard_bytes_between_steps": between_steps,
            "files": None if files is None else (files.peak_resident, files.gathers_peak, files.ahead),
            "units": len(zero.units),
            "flats": len(zero.flats),
            "by_unit": _by_unit(zero, model) == runs[kind][1],
            "file_names": sorted(p.name for p in (root / "offload" / f"rank{rank}").glob("*.bin"))
            if files is not None
            else [],
        }
    want_losses, want_params, plain_saved = runs["zero3"]
    for kind, (losses, params, _) in runs.items():
        out[kind] |= {"losses": losses == want_losses, "params": params == want_params}
    # resume: a params:disk checkpoint without offload, and the plain one under params:disk (both)
    for name, saved, kind in (
        ("params:disk->zero3", runs["params:disk"][2], "zero3"),
        ("both->zero3", runs["optimizer:disk,params:disk"][2], "zero3"),
        ("zero3->params:disk", plain_saved, "params:disk"),
        ("zero3->both", plain_saved, "optimizer:disk,params:disk"),
    ):
        fresh = build(seed=1, **MODEL)  # other weights: the checkpoint must replace them all
        engine = _engine(fresh, kind, Path(tmp) / "resumed" / name.replace(":", "-"))
        checkpoint.load(saved, engine)
        held = _shard_bytes(engine)  # written back to the files at once
        out[name] = (
            _steps(engine, fresh, range(2, 4)) == want_losses[2:] and _params(engine, fresh) == want_params,
            held,
        )
    # a write that fails mid-run: the step fails with one error naming the file
    model = build(**MODEL)
    zero = _engine(model, "params:disk", Path(tmp) / "full")
    assert zero._files is not None

    def no_space(i: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    zero._files.state._write_now = no_space  # type: ignore[method-assign]
    try:
        _steps(zero, model, range(1))
        out["failed"] = ""
    except OffloadError as e:
        out["failed"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(worker, WORLD, (str(tmp_path_factory.mktemp("params_disk")),))


@pytest.mark.parametrize("kind", list(KINDS))
def test_bit_identical_to_shards_in_memory_and_plain_zero3(results: list[dict], kind: str) -> None:
    for by_rank in results:
        assert by_rank[kind]["losses"] and by_rank[kind]["params"]
        assert by_rank[kind]["by_unit"]  # an export's walk sees the same weights


@pytest.mark.parametrize("kind", ["params:disk", "optimizer:disk,params:disk"])
def test_shards_are_on_disk_and_at_most_two_units_in_memory(results: list[dict], kind: str) -> None:
    for by_rank in results:
        case = by_rank[kind]
        assert case["units"] == LAYERS + 1 and case["flats"] >= case["units"]  # a bound that says something
        assert case["shard_bytes_between_steps"] == 0
        assert by_rank["params"]["shard_bytes_between_steps"] > 0
        peak, gathers_peak, ahead = case["files"]
        assert gathers_peak <= 2 * ahead  # the unit being gathered and the next one, read meanwhile
        # the step walks the flats: its flat, the next one being read (`DiskState.walk`), with the
        # optimizer's state on disk or in memory
        assert peak <= 2 * ahead
        assert case["file_names"][-1] == f"params{case['flats'] - 1:04d}.bin"


@pytest.mark.parametrize("name", ["params:disk->zero3", "both->zero3", "zero3->params:disk", "zero3->both"])
def test_checkpoints_resume_across_params_disk_and_no_offload(results: list[dict], name: str) -> None:
    for by_rank in results:
        same, held = by_rank[name]
        assert same
        if name.startswith("zero3->"):
            assert held == 0


def test_a_failed_write_names_the_file(results: list[dict]) -> None:
    for rank, by_rank in enumerate(results):
        assert (
            f"full/offload/rank{rank}/params0000.bin failed mid-run: No space left on device"
            in by_rank["failed"]
        )
        assert by_rank["failed"].startswith("the parameters' offload file")
