"""ZeRO's optimizer state: the plan's optimizer (`optimizers.build`: a real torch.optim.AdamW or
SGD, `Lion`, or `SplitAdafactor`) over this rank's fp32 shards of the flats, and this rank's
elements of it by parameter name for checkpoints. An elementwise optimizer
(`optimizers.ELEMENTWISE`) steps a shard as it would the whole; Adafactor steps each parameter's
elements in the shard as a piece of the whole parameter (`adafactor.Piece`: placed by its
element range and its tensor-parallel cuts, its sums taken over the ZeRO group and the axes
that cut it), its row and column moments whole on every rank of the group.

The master copy is the shard itself when the shard is fp32 and on the optimizer's device;
otherwise (bf16/fp16 parameters, or the state offloaded to the CPU or to disk) an fp32 copy that
each step writes back into the shard. LR schedulers work on `ShardedOptimizer.optimizer` unchanged.

Offloaded to disk (`disk`: this rank's folder), the masters and moments live in files between
steps (`runtime/disk_offload.py`) and the step goes flat by flat, each one `optimizer.step()`
over the only master with a gradient: the same elementwise arithmetic as one step over all of
them, so a run is bit-identical to the same run offloaded to the CPU.

Checkpoints do not see flats: `own_elements()` gives, per parameter name, where this rank's
elements lie in the parameter and views of its value and moments there, and `training_state`
puts them under the same keys as a run without ZeRO, so each rank writes only its own and any
stage, bucket size or dp size (or no ZeRO) resumes it (`runtime/checkpoint.py` places them in
the whole tensor).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .adafactor import Piece, SplitAdafactor
from .axes import Axes
from .buckets import fusable
from .disk_offload import DiskState
from .grad_sync import Elements, Held, OptimizerSettings, TrainingState
from .optimizers import ELEMENTWISE, build, initial_state
from .pieces import Pieces, Placed, whole_size
from .zero_flats import Flat

MASTER = "master"


class Walker(Protocol):
    """Files the step reads flat by flat (`DiskState`, `ParamFiles`): `walk()` yields each flat's
    index once it is in memory, and writes it back after."""

    def walk(self) -> Iterator[int]: ...


# name -> "master" and each state key: 1-D views (Adafactor's row and column moments: whole tensors)
OwnElements = dict[str, dict[str, Held]]


class ShardedOptimizer:
    """The plan's optimizer over the fp32 masters of `flats` (this rank's shards); decayed and
    undecayed flats (`decays` by id of a flat's first param: a flat holds only one class) in two
    param groups. `offload` keeps the state on the CPU; `disk` (a folder) in files there."""

    def __init__(
        self,
        flats: Sequence[Flat],
        group: dist.ProcessGroup,
        decays: dict[int, bool],
        *,
        device: torch.device,
        offload: bool,
        config: OptimizerSettings,
        disk: Path | None = None,
        axes: Axes | None = None,
    ) -> None:
        self.flats, self.group, self.choice = flats, group, config.optimizer
        self.elementwise = self.choice.kind in ELEMENTWISE
        self.opt_device = torch.device("cpu") if offload or disk is not None else device
        self.on_disk = disk is not None
        self.masters = [self._master_for(f) for f in flats]
        param_groups: list[dict[str, Any]] = [
            {
                "params": [
                    m for f, m in zip(flats, self.masters, strict=True) if decays[id(f.params[0])] == decayed
                ],
                "weight_decay": config.weight_decay if decayed else 0.0,
            }
            for decayed in (True, False)
        ]
        self.optimizer = build(
            self.choice,
            [g for g in param_groups if g["params"]],
            lr=config.lr,
            fused=fusable(self.masters),  # AdamW: one kernel per flat, as `grad_sync.make_optimizer`
            pieces=None if self.elementwise else self._pieces(axes or Axes()),
        )
        for m in self.masters:  # eager state: memory() and checkpoints are right before step 1
            if self.elementwise:  # (SplitAdafactor makes its own)
                self.optimizer.state[m] = initial_state(self.choice, m)
        self.disk = None
        # `params:disk` with the state in memory: the parameter shards' files, which the step
        # walks flat by flat as it walks the state's under `optimizer:disk` (`ParamFiles.walk`)
        self.walker: Walker | None = None
        if disk is not None:
            keys = self.choice.state_keys
            self.disk = DiskState(
                disk, [[m, *(self.optimizer.state[m][k] for k in keys)] for m in self.masters]
            )

    def _pieces(self, axes: Axes) -> dict[int, list[Piece]]:
        """Each master's parameters as `Piece`s of the whole parameters, every parameter of its
        flat (an empty piece where this rank holds none of it: it still takes part in the sums)."""
        out = {}
        self._where: dict[
            str, tuple[torch.Size, int]
        ] = {}  # name -> its local shape, where our elements start
        for f, master in zip(self.flats, self.masters, strict=True):
            lo, pieces = f.rank * f.shard_numel, []
            for name, p, off, n in zip(f.names, f.params, f.offsets, f.numels, strict=True):
                start, end = max(off, lo), min(off + n, lo + f.shard_numel)
                at, first = (slice(start - lo, end - lo), start - off) if start < end else (slice(0, 0), 0)
                cuts, self._where[name] = axes.placed(name), (p.shape, first)

                def boxes(
                    x: Tensor,
                    first: int = first,
                    shape: torch.Size = p.shape,
                    cuts: tuple[Placed, ...] = cuts,
                ) -> list[tuple[tuple[int, ...], Tensor]]:
                    return list(Pieces.of_range(x, first, shape, cuts).boxes.items())

                split = tuple((a, g) for a in axes.sharded_over(name) if (g := axes.group(a)) is not None)
                groups = ((f.axis, self.group), *split)
                pieces.append(Piece(name, whole_size(p.shape, cuts), at, boxes, groups))
            out[id(master)] = pieces
        return out

    def _master_for(self, f: Flat) -> Tensor:
        """The fp32 tensor the optimizer updates: the shard itself when it is fp32 and already in place."""
        if f.dtype == torch.float32 and f.shard.device == self.opt_device and not self.on_disk:
            return f.shard
        return f.shard.detach().to(self.opt_device, torch.float32, copy=True)

    def step(self) -> None:
        """One optimizer step on each master from its flat's reduced gradient shard (zero if
        none), written back into the shard when the master is a copy. A parameter that got no
        gradient at all this step (`Flat.missing`) is left as it was, value and state, as the
        optimizer on one device leaves a parameter whose `.grad` is None (no weight decay, no
        moment decay)."""
        walker = self.disk or self.walker
        if walker is None:
            self._step(range(len(self.flats)))
        else:
            for i in walker.walk():  # flat i in memory, i + 1 being read, i - 1 written
                self._step([i])

    def _step(self, indices: Iterable[int]) -> None:
        """`step` over the flats at `indices` (the others have no gradient, so the optimizer skips them)."""
        chosen = [(self.flats[i], self.masters[i]) for i in indices]
        for f, master in chosen:
            grad = f.own_grad()
            master.grad = (
                torch.zeros_like(master) if grad is None else grad.to(self.opt_device, torch.float32)
            )
        untouched = self._untouched(chosen)
        if isinstance(self.optimizer, SplitAdafactor):
            self.optimizer.skip = frozenset[str]().union(*(f.missing for f, _ in chosen))
        self.optimizer.step()
        with torch.no_grad():
            for t, kept in untouched:
                t.copy_(kept)
        for f, master in chosen:
            master.grad = None
            if master is not f.shard:
                with torch.no_grad():
                    f.shard.copy_(master)  # fp32 master -> bf16 shard, or CPU -> device

    def _untouched(self, chosen: Sequence[tuple[Flat, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """(view, copy of it) of this rank's elements of each parameter without a gradient, in
        the master and its state of the `chosen` flats: what `step` puts back after the optimizer's."""
        missing = frozenset[str]().union(*(f.missing for f, _ in chosen))
        if not missing:
            return []
        return [
            (held.data, held.data.clone())
            for name, elements in self._elements(chosen).items()
            if name in missing
            for held in elements.values()
        ]

    def own_elements(self) -> OwnElements:
        """This rank's elements of every parameter's fp32 value ("master") and its state
        (`OptimizerChoice.state_keys`), by name, as views of the masters and the optimizer's
        state (`Zero.own_elements`). Offloaded to disk, every flat is mapped onto its file,
        where a checkpoint reads or writes it in place (`DiskState.map_all`), until the next step."""
        if self.disk is not None:
            self.disk.map_all()
        return self._elements(list(zip(self.flats, self.masters, strict=True)))

    def _elements(self, chosen: Sequence[tuple[Flat, Tensor]]) -> OwnElements:
        """`own_elements` of the `chosen` (flat, master) pairs, which must be in memory."""
        if isinstance(self.optimizer, SplitAdafactor):
            return self._factored(self.optimizer, chosen)
        out: OwnElements = {}
        for f, master in chosen:
            state = self.optimizer.state[master]
            tensors = {MASTER: master} | {key: state[key] for key in self.choice.state_keys}
            shapes = dict(zip(f.names, (p.shape for p in f.params), strict=True))
            for name, mine, theirs in f.own_slices():
                out[name] = {
                    key: Elements(name, shapes[name], theirs.start, t[mine]) for key, t in tensors.items()
                }
        return out

    def _factored(self, optimizer: SplitAdafactor, chosen: Sequence[tuple[Flat, Tensor]]) -> OwnElements:
        """`_elements` under Adafactor: per parameter this rank holds elements of, those of its
        master and its vector's `variance`, and its whole row and column moments."""
        out: OwnElements = {}
        for _, master in chosen:
            for piece in optimizer.pieces[id(master)]:
                assert piece.at is not None
                if piece.at.start == piece.at.stop:
                    continue
                local, start = self._where[piece.name]
                state = optimizer.factors(master, piece)
                held: dict[str, Held] = {MASTER: Elements(piece.name, local, start, piece.of(master))}
                for key, t in state.items():
                    if key == "variance":
                        held[key] = Elements(piece.name, local, start, t)
                    elif key != "step":
                        held[key] = t
                out[piece.name] = held
        return out

    def steps(self) -> dict[str, Tensor]:
        """Every parameter's step count: its flat's (one tensor per flat, shared; Adafactor's
        its own); none where the optimizer counts no steps (SGD, Lion)."""
        if not self.choice.counts_steps:
            return {}
        if isinstance(self.optimizer, SplitAdafactor):  # one per parameter
            adafactor = self.optimizer
            return {
                piece.name: adafactor.factors(m, piece)["step"]
                for m in self.masters
                for piece in adafactor.pieces[id(m)]
            }
        return {
            name: self.optimizer.state[m]["step"]
            for f, m in zip(self.flats, self.masters, strict=True)
            for name in f.names
        }

    def loaded(self, steps: Mapping[str, Tensor]) -> None:
        """After a checkpoint was read into `own_elements()`'s views: each flat's step, and the
        masters copied into the shards they stand for (the caller refreshes gathered copies);
        offloaded to disk, the state written back to its files."""
        with torch.no_grad():
            for name, step in self.steps().items() if not self.elementwise else ():
                step.copy_(torch.as_tensor(steps[name]))
            for f, master in zip(self.flats, self.masters, strict=True):
                if self.choice.counts_steps and self.elementwise:
                    step = torch.as_tensor(steps[f.names[0]]).to(master.device, torch.float32, copy=True)
                    self.optimizer.state[master]["step"] = step
                if master is not f.shard:
                    f.shard.copy_(master)
        if self.disk is not None:
            self.disk.put_back()


def training_state(
    module: nn.Module, elements: OwnElements, steps: Mapping[str, Tensor], kind: str
) -> TrainingState:
    """The same keys as without ZeRO: each param by every name it has (tied ones too), its
    state and step by its first name, and `module`'s buffers; each param's value and state
    this rank's `elements` of them, views of the engine's fp32 masters and state; `kind` the
    optimizer's."""
    values: dict[str, Held] = {}
    moments: dict[str, dict[str, Held]] = {}
    for name, held in elements.items():
        values[name] = held[MASTER]
        moments[name] = {key: t for key, t in held.items() if key != MASTER}
    for name, step in steps.items():
        moments.setdefault(name, {})["step"] = step
    first = {id(p): n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    params = {
        n: values[first[id(p)]]
        for n, p in module.named_parameters(remove_duplicate=False)
        if first[id(p)] in values
    }
    return TrainingState(params | _buffers(module, module.state_dict()), moments, kind)


def read_steps(state: TrainingState) -> dict[str, Tensor]:
    """The step counts a checkpoint read into a `training_state`: a tensor per parameter (none
    where the optimizer counts no steps)."""
    steps = {}
    for name, moments in state.optim.items():
        if "step" not in moments:
            continue
        step = moments["step"]
        assert isinstance(step, Tensor), f"{name}: a step count is one tensor"
        steps[name] = step
    return steps


def load_buffers(module: nn.Module, state: TrainingState) -> None:
    """The buffers a checkpoint read into a `training_state`, into `module`."""
    module.load_state_dict(_buffers(module, state.model), strict=False)


def _buffers(module: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `state` that are the module's buffers (not parameters)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in state.items() if k not in params and k in module.state_dict()}
