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
the model's parameters and buffers and the optimizer's state (AdamW's `step`, `exp_avg`,
`exp_avg_sq`; SGD's `momentum_buffer`, ...: `optimizers.STATE`), keyed by parameter name, the
number of optimizer steps done (the LR schedule and the data position are functions of it: see
`runtime/data.py`), each rank's RNG state, and each rank's own state that only its layout can
resume (`TrainingState.local`: `compress`'s error feedback, under `local/rank<r>/`; a run resumed
on another layout starts it afresh and `Restored.notes` says so). The optimizer's kind is saved as the name of a
key (`train/optimizer/sgd`), so `.metadata` alone tells it and resuming with another optimizer
is one message before anything is read (a checkpoint without it was AdamW's). The optimizer's
param groups (learning rate, betas, ...) are configuration, not state: a resumed run takes them
from its own command line and plan.

    replicated/model/layers.0.mlp.up_proj.weight            fp32, shape of the whole tensor
    replicated/optim/state/layers.0.mlp.up_proj.weight/exp_avg
    train/step, rng/rank0, rng/rank1, ...

Each rank writes only what it holds (`runtime/pieces.py`), as its gradient sync engine says
(`GradSync.own_state`): its tensor-parallel shard of a parameter and, under ZeRO, its
elements of the fp32 master and moments, each placed in the whole tensor as boxes (offsets
and sizes), which DCP records in `.metadata`. Nothing is gathered: saving costs a rank its
own shards' bytes, not the model's, so a model that needs ZeRO-3 to fit can be checkpointed.
A box several ranks hold (a replica over data parallelism, a weight tied across pipeline
stages) is written once. Loading reads each box
this rank holds in the new run from the saved boxes it overlaps, so the checkpoint does not
depend on the layout: a run saved with dp=2 x tp=2 and ZeRO-3 resumes with dp=4 and ZeRO-1,
or without ZeRO, or with tp=4 (the data stream depends on the global batch only), and
checkpoints written whole by earlier meshplan versions load the same way.

Integrity: before the rename, rank 0 writes `checksums.json` (every file's size and
SHA-256); loading verifies them first, so a damaged, truncated or incomplete checkpoint is
one message naming the file (`CheckpointError`), never a model silently trained from
corrupt weights. A checkpoint that does not fit the model (another model, a layout that
cannot be resharded) is one message too, naming the first tensor that does not fit.

Trust: DCP reads `.metadata` (and any non-tensor value) with pickle, so a checkpoint
folder is trusted input, like a model file: load only checkpoints you wrote. meshplan
only loads from the run folder given on the command line, never from a path in a plan
file, and calls no `torch.load` of its own (any added must pass `weights_only=True`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .axes import Axes
from .grad_sync import Elements, GradSync, Held, TrainingState
from .optimizers import PARAMETER_SHAPED
from .pieces import Box, LoadPlanner, Pieces, SavePlanner

_FINAL = re.compile(r"^step(\d{8})$")
TMP_PREFIX = ".tmp-"
CHECKSUMS = "checksums.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: damaged, incomplete, or not this model's (one line)."""


@dataclass(frozen=True)
class Restored:
    step: int  # optimizer steps completed when the checkpoint was written
    path: Path
    notes: tuple[str, ...] = ()  # what did not resume as it was (a person is told)


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


def before(path: Path) -> Path | None:
    """The newest complete checkpoint older than `path`, in the same folder, or None."""
    older = [
        (int(m.group(1)), p)
        for p in path.parent.iterdir()
        if (m := _FINAL.match(p.name)) and (p / ".metadata").is_file() and p.name < path.name
    ]
    return max(older)[1] if older else None


def save(
    root: str | Path,
    step: int,
    sync: GradSync,
    *,
    axes: Axes | None = None,
    keep: int = 2,
) -> Path:
    """Write the checkpoint of `step` atomically (all ranks call this); return its final path.
    `sync`: the engine training the model, whose optimizer (`sync.optimizer`) is built."""
    tmp = write_temporary(root, step, sync, axes=axes)
    final = Path(root) / checkpoint_name(step)
    if _rank() == 0:
        write_checksums(tmp)
        publish(tmp, final)
        prune(root, keep=keep)
    _barrier()  # nobody goes on (or reads `latest`) before the rename
    return final


def write_temporary(root: str | Path, step: int, sync: GradSync, *, axes: Axes | None = None) -> Path:
    """The first half of `save`: every rank writes into `.tmp-stepN`. Nothing is published yet."""
    tmp = Path(root) / (TMP_PREFIX + checkpoint_name(step))
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        tmp.mkdir(parents=True)
    _barrier()
    with _single_process_quiet():
        dcp.save(
            _state(sync, step, axes)[0],
            checkpoint_id=str(tmp),
            planner=SavePlanner(),
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


def write_checksums(folder: Path) -> None:
    """Record every file's size and SHA-256 in `folder/checksums.json` (rank 0, before publishing)."""
    sums = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(folder.iterdir())}
    (folder / CHECKSUMS).write_text(json.dumps(sums, indent=1) + "\n", encoding="utf-8")


def verify_checksums(folder: Path) -> None:
    """Raise `CheckpointError` naming the first file that is missing, truncated or changed.
    A checkpoint without `checksums.json` (written before meshplan recorded them) is loaded as is."""
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return
    try:
        sums = json.loads(listing.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder} is damaged: {CHECKSUMS} cannot be read ({e})") from None
    for name, want in sums.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is incomplete: {name} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {folder} is damaged: {name} has {size} bytes, {want['bytes']} were written"
            )
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {folder} is damaged: {name} does not match the checksum written with it"
            )


def _verified_once(folder: Path) -> None:
    """`verify_checksums` on rank 0 only (every rank would read the whole checkpoint again),
    its verdict sent to the others so that all stop, or none."""
    problem = None
    if _rank() == 0:
        try:
            verify_checksums(folder)
        except CheckpointError as e:
            problem = str(e)
    if _distributed():
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        problem = verdict[0]
    if problem is not None:
        raise CheckpointError(problem)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def prune(root: str | Path, *, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (keep <= 0 keeps everything)."""
    if keep <= 0:
        return
    found = sorted(p for p in Path(root).iterdir() if _FINAL.match(p.name))
    for old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: str | Path, sync: GradSync, *, axes: Axes | None = None) -> Restored:
    """Restore the model and optimizer `sync` trains and this rank's RNG from a checkpoint
    folder (trusted input)."""
    _verified_once(Path(path))
    state, own = _state(sync, 0, axes)
    mismatch = optimizer_mismatch(Path(path), own.kind)
    if mismatch:
        raise CheckpointError(mismatch)
    del state["train"]["optimizer"]  # told by its key's name, read above
    # a checkpoint written where there was no GPU holds no CUDA generator state: this run keeps
    # its seeded one (and one written on a GPU resumes on a CPU, which ignores it)
    cuda_key = "cuda_" + _rng_key()
    if cuda_key in state["rng"] and f"rng.{cuda_key}" not in _saved_keys(Path(path)):
        del state["rng"][cuda_key]
    state.pop(_LOCAL, None)  # read as saved, whatever this run holds (`_local`)
    local = _local(Path(path))
    if local:
        state[_LOCAL] = {_rng_key(): local}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), planner=LoadPlanner(), no_dist=not _distributed())
    except dist.DistError:
        raise  # a peer lost while loading: not the checkpoint's fault
    except (Exception, CheckpointException) as e:  # DCP's report: every rank's error, with tracebacks
        raise CheckpointError(
            f"checkpoint {path} does not fit this run: {_first_cause(e, Path(path))}"
        ) from None
    sync.loaded(own)  # read in place into the engine's tensors
    notes: tuple[str, ...] = ()
    if (local or own.local) and not sync.restore_local(local):
        notes = (
            "the gradient compression's error feedback was saved by another layout (or none): "
            "it starts from zero, so this run is not the uninterrupted one bit for bit",
        )
    if _rng_key() in state["rng"]:  # a rank that did not exist when saving keeps its seeded state
        torch.set_rng_state(state["rng"][_rng_key()])
    if "cuda_" + _rng_key() in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda_" + _rng_key()])
    return Restored(int(state["train"]["step"]), Path(path), notes)


class SavedModel:
    """The model's weights in a checkpoint folder, read as pretrained weights (`--init FOLDER`):
    each tensor's shape from `.metadata`, and any box of it loaded from the saved boxes it
    overlaps, whatever layout wrote them (DCP reads only the files holding those boxes). Meets
    `compiler.pretrained.Source`; the optimizer state, step and RNG are not read: a run started
    from it is a new run."""

    def __init__(self, folder: Path, *, verify: bool = True) -> None:
        if verify:
            verify_checksums(folder)
        self.path = folder
        self.reader = _ReadOnce(str(folder))
        try:
            saved = self.reader.read_metadata().state_dict_metadata
        except Exception as e:  # a `.metadata` that does not unpickle
            raise CheckpointError(f"checkpoint {folder}: its .metadata cannot be read ({e})") from None
        prefix = f"{_REPLICATED}.model."
        self.tensors = {
            fqn[len(prefix) :]: meta
            for fqn, meta in saved.items()
            if fqn.startswith(prefix) and hasattr(meta, "chunks")  # a tensor, not a value
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(meta.size) for name, meta in self.tensors.items()}

    def array(self, key: str) -> _SavedTensor:
        return _SavedTensor(self, key)


class _SavedTensor:
    """One tensor of a `SavedModel`: `[slices]` loads just that box."""

    def __init__(self, saved: SavedModel, key: str) -> None:
        self.saved, self.key = saved, key

    def __getitem__(self, box: tuple[slice, ...]) -> torch.Tensor:
        meta = self.saved.tensors[self.key]
        offsets = tuple(s.start for s in box)
        out = torch.empty([s.stop - s.start for s in box], dtype=meta.properties.dtype)
        state = {_REPLICATED: {"model": {self.key: Pieces(meta.size, out.dtype, [Box(offsets, out)])}}}
        with _single_process_quiet():
            dcp.load(state, storage_reader=self.saved.reader, planner=LoadPlanner(), no_dist=True)
        return out


class _ReadOnce(dcp.FileSystemReader):
    """A reader that unpickles `.metadata` once, not once per box loaded."""

    def read_metadata(self, *args: object, **kwargs: object):
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def _first_cause(error: BaseException, path: Path) -> str:
    """What does not fit, from DCP's report (every rank's error with its traceback): a key the
    checkpoint lacks or a tensor saved with another shape."""
    text = str(error)
    missing = re.search(r"Missing key in checkpoint state_dict: ([\w.]+?)\.?$", text, re.M)
    if missing:
        key = _key(missing.group(1))
        return _stacked_experts(key, path) or f"it holds no `{key}` (saved from another model?)"
    size = re.search(
        r"Size mismatch between saved (torch\.Size\(\[[^]]*\]\)) and current: "
        r"(torch\.Size\(\[[^]]*\]\)) for ([\w.]+)",
        text,
    )
    if size:
        saved, current, key = size.groups()
        return f"`{_key(key)}` was saved as {saved[11:-1]}, this run's is {current[11:-1]}"
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(" ")]
    return lines[-1] if lines else type(error).__name__


def optimizer_mismatch(path: Path, kind: str) -> str:
    """Why a run whose optimizer is `kind` cannot resume from the checkpoint at `path` ('' where
    it can): the launcher says it before any worker starts, a worker (own torchrun) on loading."""
    saved = _saved_optimizer(path)
    if saved is None or saved == kind:
        return ""
    return (
        f"checkpoint {path} holds {saved}'s state, but this run's optimizer is {kind} "
        f"(hint: resume with `optimizer = {saved}` in the plan's `train` block, or start a new run)"
    )


def _saved_optimizer(path: Path) -> str | None:
    """The optimizer whose state the checkpoint at `path` holds: the name under `train.optimizer`,
    "adamw" where there is none (written before the choice existed), None where its metadata
    cannot be read (DCP's load then says why)."""
    keys = _saved_keys(path)
    if not keys:
        return None
    prefix = "train.optimizer."
    return next((k[len(prefix) :] for k in keys if k.startswith(prefix)), "adamw")


def _local(path: Path) -> dict[str, torch.Tensor]:
    """Empty tensors of the shapes and dtypes this rank's `TrainingState.local` was saved with
    (none where the checkpoint has none for this rank), to read it into."""
    prefix = f"{_LOCAL}.{_rng_key()}."
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:
        return {}
    return {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in saved.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def _saved_keys(path: Path) -> set[str]:
    """The flattened keys the checkpoint at `path` holds (`rng.rank0`, ...); empty where its
    metadata cannot be read (DCP's load then says why)."""
    try:
        return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:
        return set()


def _stacked_experts(key: str, path: Path) -> str | None:
    """Why `key` is missing when the checkpoint holds a list of experts stacked and this run
    holds it as a list (`runtime.expert_list`), or the other way round; None otherwise."""
    saved = {_key(k) for k in _saved_keys(path)}
    if not saved:  # unreadable metadata: DCP's own message stands
        return None
    listed = re.fullmatch(r"(.+)\.\d+\.(.+)", key)
    if listed and f"{listed[1]}.{listed[2]}" in saved:
        return (
            f"it holds the experts of `{listed[1]}` stacked (saved by a plan that splits them over an "
            "expert axis), this run holds them as a list; resume with an `experts` rule for them"
        )
    for k in saved:
        parts = re.fullmatch(r"(.+)\.\d+\.(.+)", k)
        if parts and key == f"{parts[1]}.{parts[2]}":
            return (
                f"it holds the experts of `{parts[1]}` as a list (saved by a plan that does not split "
                "them), this run holds them stacked; resume with a plan without an `experts` rule for them"
            )
    return None


def _key(fqn: str) -> str:
    """A state-dict key as the model names it (without the checkpoint's grouping prefix)."""
    for prefix in (f"{_REPLICATED}.model.", f"{_REPLICATED}.optim.state.", f"{_REPLICATED}."):
        if fqn.startswith(prefix):
            return fqn[len(prefix) :]
    return fqn


_REPLICATED = "replicated"  # the key of the layout-free state (a name older checkpoints share)
_LOCAL = "local"  # each rank's state only its layout resumes (`TrainingState.local`), by rank


def _state(sync: GradSync, step: int, axes: Axes | None = None) -> tuple[dict, TrainingState]:
    """What DCP writes or reads (every sharded tensor as this rank's `Pieces` of the whole), and
    the engine's state with this rank's tensors themselves (what a load then hands back to it)."""
    own = sync.own_state()
    rng = {_rng_key(): torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda_" + _rng_key()] = torch.cuda.get_rng_state()
    state = {
        _REPLICATED: _placed(own, axes or Axes()),
        "train": {"step": torch.tensor(step, dtype=torch.int64), "optimizer": {own.kind: torch.tensor(0)}},
        "rng": rng,
    }
    if own.local:
        state[_LOCAL] = {_rng_key(): own.local}
    return state, own


def _placed(own: TrainingState, axes: Axes) -> dict:
    """`own` with each sharded tensor (a parameter or one of its moments) as this rank's
    `Pieces` of the whole tensor: a tensor-parallel shard, or ZeRO's `Elements` of one (under
    a tied parameter's every name, placed by its first). New dicts: the engine's own state is
    left as it is."""

    def place(name: str, t: Held) -> Pieces | torch.Tensor:
        if isinstance(t, Elements):
            return Pieces.of_range(t.data, t.start, t.shape, axes.placed(t.name))
        cuts = axes.placed(name)
        return Pieces.of_local(t.detach(), cuts) if cuts else t

    model = {name: place(name, t) for name, t in own.model.items()}
    state = {
        name: {key: place(name, t) if key in PARAMETER_SHAPED else t for key, t in moments.items()}
        for name, moments in own.optim.items()
    }
    return {"model": model, "optim": {"state": state}}


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
