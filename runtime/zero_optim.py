"""ZeRO's optimizer state: the plan's optimizer (`optimizers.build`: a real torch.optim.AdamW or
SGD, or `Lion`) over this rank's fp32 shards of the flats, and this rank's elements of it by
parameter name for checkpoints. Only elementwise optimizers step a shard as they would the whole
(`optimizers.ELEMENTWISE`): Adafactor is refused here, as the plan checker refuses it.

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

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .buckets import fusable
from .disk_offload import DiskState
from .grad_sync import Elements, Held, OptimizerSettings, TrainingState
from .optimizers import ELEMENTWISE, build, initial_state
from .zero_flats import Flat

MASTER = "master"
OwnElements = dict[str, dict[str, Elements]]  # name -> "master" and each state key: 1-D views


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
    ) -> None:
        if config.optimizer.kind not in ELEMENTWISE:
            raise ValueError(
                f"ZeRO shards cut through parameters: {config.optimizer.kind} is not elementwise "
                f"(the elementwise optimizers are {', '.join(sorted(ELEMENTWISE))})"
            )
        self.flats, self.group, self.choice = flats, group, config.optimizer
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
        )
        for m in self.masters:  # eager state: memory() and checkpoints are right before step 1
            self.optimizer.state[m] = initial_state(self.choice, m)
        self.disk = None
        if disk is not None:
            keys = self.choice.state_keys
            self.disk = DiskState(
                disk, [[m, *(self.optimizer.state[m][k] for k in keys)] for m in self.masters]
            )

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
        if self.disk is None:
            self._step(range(len(self.flats)))
        else:
            for i in self.disk.walk():  # flat i in memory, i + 1 being read, i - 1 written
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
        state (`Zero.own_elements`). Offloaded to disk, every flat is read into memory first,
        where a checkpoint reads or writes it, until the next step writes it back."""
        if self.disk is not None:
            self.disk.fetch_all()
        return self._elements(list(zip(self.flats, self.masters, strict=True)))

    def _elements(self, chosen: Sequence[tuple[Flat, Tensor]]) -> OwnElements:
        """`own_elements` of the `chosen` (flat, master) pairs, which must be in memory."""
        out = {}
        for f, master in chosen:
            state = self.optimizer.state[master]
            tensors = {MASTER: master} | {key: state[key] for key in self.choice.state_keys}
            shapes = dict(zip(f.names, (p.shape for p in f.params), strict=True))
            for name, mine, theirs in f.own_slices():
                out[name] = {
                    key: Elements(name, shapes[name], theirs.start, t[mine]) for key, t in tensors.items()
                }
        return out

    def steps(self) -> dict[str, Tensor]:
        """Every parameter's step count: its flat's (one tensor per flat, shared); none where
        the optimizer counts no steps (SGD, Lion)."""
        if not self.choice.counts_steps:
            return {}
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
            for f, master in zip(self.flats, self.masters, strict=True):
                if self.choice.counts_steps:
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
