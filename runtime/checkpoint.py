"""Distributed checkpoints of a training run, written atomically; resume continues bit-identically.

    meshplan run examples/tiny_dp.plan --steps 200 --save-every 50 --out runs/demo
    meshplan run examples/tiny_dp.plan --steps 200 --save-every 50 --out runs/demo --resume

Layout on disk (one folder per checkpoint, written with `torch.distributed.checkpoint`):

    runs/demo/checkpoints/step00000050/   .metadata + __0_0.distcp, __1_0.distcp, ...
    runs/demo/checkpoints/step00000100/
    runs/demo/checkpoints/.tmp-step00000150/    a save in progress (or one that crashed)

Atomicity: every rank writes into `.tmp-stepN`; when `dcp.save` returns on the
coordinator (it gathers every rank's write results before writing `.metadata`), rank 0
renames the folder to `stepN`. A rename within one filesystem is atomic, so a job killed
mid-save leaves only a `.tmp-` folder, which `latest()` never picks: the previous
checkpoint still loads. (Multi-node runs need `--out` on a filesystem all nodes share.)

What is saved, so that a resumed run is the same computation as an uninterrupted one:
the model's state dict and the optimizer's (keyed by parameter name, via
`torch.distributed.checkpoint.state_dict`), the number of optimizer steps done (the LR
schedule and the data position are functions of it: see `runtime/data.py`), and each
rank's RNG state.

Under ZeRO the `optimizer` passed in is the `runtime.zero.Zero`: its `state_dict()` (fp32
master, exp_avg, exp_avg_sq per flat, as Shard(0) DTensors over the dp group, so each dp
rank writes only its shard) replaces both the model's parameters and the optimizer's
state; the model's buffers are saved as usual. Loading fills those shards in place and
`Zero.load_state_dict` puts the params in line with them. The dp size may change; the
stage, bucket size and tp layout may not.

Keys and sharding, without ZeRO: parameters and Adam moments are saved as full tensors
keyed by parameter name. Tensor-parallel shards are all-gathered over the tensor axis
(`TensorLayout`), so every rank holds the same value for a key and DCP writes it once;
loading reads the full tensor and keeps this rank's piece. The checkpoint does not
depend on the layout: a run saved with dp=2 x tp=2 resumes with dp=4, or tp=4 (the
data stream depends on the global batch only). The cost is a full copy of each tensor
on each rank while saving or loading.

Under ZeRO the state is per flat buffer, which depends on the layout: state that
differs between ranks (a tensor-parallel rank's buffers) must not share a key, so the
caller passes `shard_key`, e.g. "tp1" for tp coordinate 1. Resuming a ZeRO checkpoint
on a different tp layout, stage or bucket size is not supported.

Trust: DCP reads `.metadata` (and any non-tensor value) with pickle, so a checkpoint
folder is trusted input, like a model file: load only checkpoints you wrote. meshplan
only loads from the run folder given on the command line, never from a path in a plan
file, and calls no `torch.load` of its own (any added must pass `weights_only=True`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .export import full_shape, shard_of, unshard
from .zero import Zero

_FINAL = re.compile(r"^step(\d{8})$")
TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class TensorLayout:
    """How this rank's parameters are cut over the tensor axis: name -> (dim, block sizes)."""

    tp: dist.ProcessGroup | None = None
    sharding: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Restored:
    step: int  # optimizer steps completed when the checkpoint was written
    path: Path


def checkpoint_name(step: int) -> str:
    return f"step{step:08d}"


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (a published `stepN` with `.metadata`), or None."""
    folder = Path(root)
    if not folder.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _FINAL.match(p.name)) and (p / ".metadata").is_file()
    ]
    return max(found)[1] if found else None


def save(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Zero,
    *,
    shard_key: str = "",
    layout: TensorLayout | None = None,
    keep: int = 2,
) -> Path:
    """Write the checkpoint of `step` atomically (all ranks call this); return its final path."""
    tmp = write_temporary(root, step, model, optimizer, shard_key=shard_key, layout=layout)
    final = Path(root) / checkpoint_name(step)
    if _rank() == 0:
        publish(tmp, final)
        prune(root, keep=keep)
    _barrier()  # nobody goes on (or reads `latest`) before the rename
    return final


def write_temporary(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Zero,
    *,
    shard_key: str = "",
    layout: TensorLayout | None = None,
) -> Path:
    """The first half of `save`: every rank writes into `.tmp-stepN`. Nothing is published yet."""
    tmp = Path(root) / (TMP_PREFIX + checkpoint_name(step))
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        tmp.mkdir(parents=True)
    _barrier()
    with _single_process_quiet():
        dcp.save(
            _state(model, optimizer, step, shard_key, layout),
            checkpoint_id=str(tmp),
            no_dist=not _distributed(),
        )
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """The second half of `save` (rank 0): the atomic rename that makes a checkpoint visible."""
    if final.exists():  # saved again at the same step (e.g. after a resume): swap, then drop the old one
        old = final.with_name(TMP_PREFIX + "old-" + final.name)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def prune(root: str | Path, *, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (keep <= 0 keeps everything)."""
    if keep <= 0:
        return
    found = sorted(p for p in Path(root).iterdir() if _FINAL.match(p.name))
    for old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Zero,
    *,
    shard_key: str = "",
    layout: TensorLayout | None = None,
) -> Restored:
    """Restore model, optimizer and this rank's RNG from a checkpoint folder (trusted input)."""
    state = _state(model, optimizer, 0, shard_key, layout, for_load=True)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    shard = state[_shard(shard_key)]
    if isinstance(optimizer, Zero):
        optimizer.load_state_dict(shard["zero"])
        model.load_state_dict(shard["buffers"], strict=False)
    else:
        _keep_local(shard, layout)
        set_state_dict(model, optimizer, model_state_dict=shard["model"], optim_state_dict=shard["optim"])
    if _rng_key() in state["rng"]:  # a rank that did not exist when saving keeps its seeded state
        torch.set_rng_state(state["rng"][_rng_key()])
    if "cuda_" + _rng_key() in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda_" + _rng_key()])
    return Restored(int(state["train"]["step"]), Path(path))


def _state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Zero,
    step: int,
    shard_key: str,
    layout: TensorLayout | None = None,
    *,
    for_load: bool = False,
) -> dict:
    if isinstance(optimizer, Zero):
        # the params live in the zero state (stage 3 holds no full copy to save)
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        buffers = {k: v for k, v in model.state_dict().items() if k not in params}
        shard = {"zero": optimizer.state_dict(), "buffers": buffers}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        shard = {"model": model_sd, "optim": optim_sd}
        if layout is not None and layout.tp is not None:
            _make_full(shard, layout, for_load=for_load)
        shard_key = ""  # full tensors: the same on every rank, whatever the layout
    rng = {_rng_key(): torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda_" + _rng_key()] = torch.cuda.get_rng_state()
    return {
        _shard(shard_key): shard,
        "train": {"step": torch.tensor(step, dtype=torch.int64)},
        "rng": rng,
    }


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _make_full(shard: dict, layout: TensorLayout, *, for_load: bool) -> None:
    """Replace each tensor-parallel shard (parameter and Adam moments) by the full tensor:
    gathered when saving, an empty full-size buffer for DCP to fill when loading."""
    tp = layout.tp
    assert tp is not None
    n = dist.get_world_size(tp)

    def full(name: str, local: torch.Tensor) -> torch.Tensor:
        dim, blocks = layout.sharding[name]
        if for_load:
            return local.new_empty(full_shape(local, dim, n))
        return unshard(local.detach(), dim, blocks, tp)

    for name in [k for k in shard["model"] if k in layout.sharding]:
        shard["model"][name] = full(name, shard["model"][name])
    for name, moments in shard["optim"].get("state", {}).items():
        if name in layout.sharding:
            for key in _MOMENTS:
                if key in moments:
                    moments[key] = full(name, moments[key])


def _keep_local(shard: dict, layout: TensorLayout | None) -> None:
    """After loading full tensors, keep this rank's piece of each sharded one."""
    if layout is None or layout.tp is None:
        return
    n, rank = dist.get_world_size(layout.tp), dist.get_rank(layout.tp)

    def local(name: str, full: torch.Tensor) -> torch.Tensor:
        dim, blocks = layout.sharding[name]
        return shard_of(full, dim, blocks, rank, n).contiguous()

    for name in [k for k in shard["model"] if k in layout.sharding]:
        shard["model"][name] = local(name, shard["model"][name])
    for name, moments in shard["optim"].get("state", {}).items():
        if name in layout.sharding:
            for key in _MOMENTS:
                if key in moments:
                    moments[key] = local(name, moments[key])


def _shard(shard_key: str) -> str:
    return f"shard_{shard_key}" if shard_key else "replicated"


def _rng_key() -> str:
    return f"rank{_rank()}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX: a rename is persisted by syncing the parent)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
