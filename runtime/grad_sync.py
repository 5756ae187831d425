"""Gradient synchronization and the optimizer state that goes with it: one protocol, five engines.

After `finish()`, every rank of the data axis holds the gradient averaged over it, in whatever
form the engine keeps it; the loop reads and scales it only through the protocol:

    engine               where the averaged gradient lives                     module
    Local                `.grad` of each parameter (one replica, nothing to sync) here
    DataParallel         `.grad`, all-reduced in buckets during backward        data_parallel.py
    ExpertDataParallel   `.grad`, one DataParallel per set of axes averaging it  expert_data_parallel.py
    Zero (1/2/3)         this rank's shard of each flat buffer (reduce-scatter) zero.py
    ExpertZero           the same, one Zero per set of axes                     expert_zero.py

`grad_squares(kinds)` is what the global gradient norm needs: the sums of squares of each
kind of parameter (one kind per set of axes that shard them), over the whole data axis. The
loop then sums each kind over the axes that shard it (`Axes.sum_over`).

The engine also says how its optimizer state is kept, so neither the loop, nor checkpoints,
nor an export ask which engine they have:

    optimizer(config)    what the loop steps: the plan's optimizer (`optimizers.py`) over the module
                         where each rank holds whole gradients (`WholeParams`); ZeRO steps itself,
                         the same optimizer over its shards
    own_state()          this rank's parameters, buffers and optimizer state as a checkpoint saves them
    loaded(state)        a checkpoint was read into `own_state()`'s tensors in place
    gathered_by_unit()   groups of parameter names whose values are whole together, for an export:
                         every name at once, or ZeRO-3's units one at a time
    memory()             bytes of training state held now, by kind and in total (`state_bytes`)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import Tensor, nn

from .adafactor import Piece
from .axes import Axes
from .buckets import decays, fusable
from .optimizers import OptimizerChoice, build
from .pieces import Pieces, Placed, whole_size


def held_weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """A bound method as a parameter's hook that holds its object weakly. A parameter keeps its
    hooks on autograd's C++ side, where Python's cycle collector does not look: an engine its
    hooks held (parameter -> hook -> engine -> program -> parameter) would outlive its run, and
    with it the program and its process groups (under gloo, three threads each)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


class OptimizerSettings(Protocol):
    """What builds the optimizer (`train.TrainConfig` has it): which one with its hyperparameters,
    the first LR (the loop sets it each step) and the weight decay of the decayed group."""

    @property
    def lr(self) -> float: ...

    @property
    def weight_decay(self) -> float: ...

    @property
    def optimizer(self) -> OptimizerChoice: ...


class Optimizer(Protocol):
    """What the loop steps, zeroes and sets the LR of (every step): a `torch.optim.Optimizer`,
    or a ZeRO engine."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def step(self) -> object: ...

    def zero_grad(self) -> None: ...


class Elements(NamedTuple):
    """This rank's elements [start, start + len(data)) of parameter `name` flattened, in the
    1-D `data`: a ZeRO shard's part of it. `shape` is the parameter's (this rank's
    tensor-parallel piece, where it has one); a checkpoint places them in the whole tensor."""

    name: str
    shape: torch.Size
    start: int
    data: Tensor


Held = Tensor | Elements  # a tensor this rank holds whole (or its tensor-parallel piece), or Elements


@dataclass(frozen=True)
class TrainingState:
    """This rank's training state as a checkpoint saves it, by the model's names: `model` every
    parameter's value (a tied one under each of its names) and the buffers, `optim` each
    parameter's optimizer state (AdamW's "step", "exp_avg", "exp_avg_sq"; `optimizers.STATE`) by
    its first name, and `kind` the optimizer's name (`checkpoint` saves it). The tensors
    are the engine's own, never copies: a checkpoint loads into them in place."""

    model: dict[str, Held]
    optim: dict[str, dict[str, Held]]
    kind: str = "adamw"
    # this rank's own state that only the same layout resumes, by name: `compress`'s error
    # feedback (`compression.saved_state`)
    local: dict[str, Tensor] = field(default_factory=dict)


class GradSync(Protocol):
    def no_sync(self) -> AbstractContextManager[None]:
        """Backward inside accumulates locally: a micro-step that is not the last."""
        ...

    def finish(self) -> None:
        """Wait for the step's synchronization: the gradient is now the data axis's average."""
        ...

    def grad_squares(self, kinds: Sequence[Collection[str]]) -> Tensor:
        """float64 sums of squares of the averaged gradient: one per kind (parameter names), then
        one for every other parameter. The same on every rank of the data axis."""
        ...

    def scale_grads_(self, factor: Tensor | float) -> None:
        """Multiply the averaged gradient by `factor` (unscaling a loss scale, clipping)."""
        ...

    def optimizer(self, config: OptimizerSettings, axes: Axes | None = None) -> Optimizer:
        """Build the optimizer the loop steps, with `config`'s hyperparameters (once, first);
        `axes` say how parameters are cut (Adafactor's step sums over the pieces)."""
        ...

    def own_state(self) -> TrainingState:
        """This rank's training state, views of what the engine and its optimizer hold."""
        ...

    def loaded(self, state: TrainingState) -> None:
        """A checkpoint was read into `state` (an `own_state()`) in place: take it up."""
        ...

    def restore_local(self, saved: dict[str, Tensor]) -> bool:
        """This rank's `TrainingState.local` as a checkpoint saved it: taken up if it is this
        layout's (True), else left as it starts (False)."""
        ...

    def gathered_by_unit(self) -> Iterator[set[str]]:
        """Groups of parameter names, each whole while it is handed out (every rank of the data
        axis iterates to the end, in the same order: the gathers are collectives)."""
        ...

    def memory(self) -> dict[str, int]:
        """Bytes of params, grads and optimizer state this rank holds now, and their "total":
        each live storage once (a tied weight, views of one flat buffer)."""
        ...


def make_optimizer(
    module: nn.Module, config: OptimizerSettings, axes: Axes | None = None
) -> torch.optim.Optimizer:
    """The plan's optimizer (`optimizers.build`); no weight decay where `decays` says so (ZeRO's
    optimizer follows the same rule). AdamW fused (one kernel over every tensor of a device,
    `fused_adamw`) where PyTorch has the kernel: torch.optim.AdamW's default steps each parameter
    with its own dozen ops, which on a CPU cost a fifth of a small model's step; the values are
    the same up to rounding. Adafactor over parameters `axes` cut is `SplitAdafactor`, each
    parameter this rank's piece of the whole (`whole_pieces`)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if decays(n, p)]
    no_decay = [p for n, p in named if not decays(n, p)]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    split = axes is not None and any(axes.sharded_over(n) for n, _ in named)
    return build(
        config.optimizer,
        [g for g in groups if g["params"]],
        lr=config.lr,
        fused=fusable([p for _, p in named]),
        pieces=whole_pieces(named, axes) if split and axes is not None else None,
    )


def whole_pieces(named: Iterable[tuple[str, Tensor]], axes: Axes) -> dict[int, list[Piece]]:
    """Each tensor of `named` as one `Piece`: this rank's (tensor-parallel) piece of the whole
    parameter, reduced over the axes that cut it (none: every rank holds it whole)."""
    out = {}
    for name, t in named:
        cuts = axes.placed(name)
        shape = whole_size(t.shape, cuts)

        def boxes(x: Tensor, cuts: tuple[Placed, ...] = cuts) -> list[tuple[tuple[int, ...], Tensor]]:
            return list(Pieces.of_local(x, cuts).boxes.items())

        groups = tuple((a, g) for a in axes.sharded_over(name) if (g := axes.group(a)) is not None)
        out[id(t)] = [Piece(name, shape, None, boxes, groups)]
    return out


class WholeParams:
    """The optimizer state of the engines that leave each parameter and its averaged gradient
    whole on every rank of the data axis (`Local`, `DataParallel`, `ExpertDataParallel`): the
    plan's optimizer over `module` (`make_optimizer`), checkpointed through DCP's state-dict API."""

    module: nn.Module
    _optimizer: torch.optim.Optimizer | None = None
    _kind: str = "adamw"

    def optimizer(self, config: OptimizerSettings, axes: Axes | None = None) -> torch.optim.Optimizer:
        self._optimizer, self._kind = make_optimizer(self.module, config, axes), config.optimizer.kind
        return self._optimizer

    def own_state(self) -> TrainingState:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # 1.5 s: checkpoints only

        model_sd, optim_sd = get_state_dict(self.module, self._built())
        return TrainingState(
            cast(dict[str, Held], model_sd),
            cast(dict, optim_sd.get("state", {})),
            self._kind,
            self.own_local(),
        )

    def own_local(self) -> dict[str, Tensor]:
        """`TrainingState.local`: none here (`DataParallel` keeps its compressors')."""
        return {}

    def restore_local(self, saved: dict[str, Tensor]) -> bool:
        return not saved

    def loaded(self, state: TrainingState) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        optimizer = self._built()
        groups = get_state_dict(self.module, optimizer)[1]["param_groups"]  # this run's configuration
        model = cast(dict[str, Any], state.model)  # tensors only: no `Elements` here
        optim: dict[str, Any] = {"state": state.optim, "param_groups": groups}
        set_state_dict(self.module, optimizer, model_state_dict=model, optim_state_dict=optim)

    def gathered_by_unit(self) -> Iterator[set[str]]:
        """Every parameter is whole already: all names at once."""
        yield {name for name, _ in self.module.named_parameters()}

    def memory(self) -> dict[str, int]:
        """`GradSync.memory`: the module's parameters, their gradients (with the buffers that hold
        them, `grad_buffers`) and the optimizer's state, its step counters included."""
        seen: set[int] = set()
        params = list(self.module.parameters())  # a tied weight once
        param_bytes = storage_bytes(params, seen)
        grads = [*self.grad_buffers(), *(p.grad for p in params if p.grad is not None)]
        grad_bytes = storage_bytes(grads, seen)
        state = self._optimizer.state.values() if self._optimizer is not None else ()
        optim_bytes = storage_bytes((t for s in state for t in s.values() if isinstance(t, Tensor)), seen)
        total = param_bytes + grad_bytes + optim_bytes
        return {"params": param_bytes, "grads": grad_bytes, "optimizer": optim_bytes, "total": total}

    def grad_buffers(self) -> Iterable[Tensor]:
        """Buffers the engine keeps the gradients in while `.grad` is None (between steps)."""
        return ()

    def _built(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise RuntimeError("no optimizer yet: call the engine's optimizer(config) first")
        return self._optimizer


class Accumulates:
    """`GradSync.no_sync` of an engine whose gradient hooks reduce only while `_sync` is True
    (`DataParallel`, `Zero`)."""

    _sync: bool

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates local gradients only (gradient accumulation's early
        micro-steps); the next synced backward reduces them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


class LocalParams:
    """`GradSync` of parameters no other rank shares: their gradient is already the average
    (all of `Local`'s; under expert parallelism, experts no other rank holds)."""

    def __init__(self, module: nn.Module, params: Iterable[nn.Parameter]) -> None:
        self.module, self.params = module, list(params)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def finish(self) -> None:
        pass

    def grad_squares(self, kinds: Sequence[Collection[str]]) -> Tensor:
        mine = {id(p) for p in self.params}
        return param_grad_squares(((n, p) for n, p in self.module.named_parameters() if id(p) in mine), kinds)

    def scale_grads_(self, factor: Tensor | float) -> None:
        scale_param_grads_(self.params, factor)


class Local(LocalParams, WholeParams):
    """One replica: the gradient in `.grad` is already the average, of every parameter."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module, module.parameters())


def param_grad_squares(named: Iterable[tuple[str, nn.Parameter]], kinds: Sequence[Collection[str]]) -> Tensor:
    """`GradSync.grad_squares` of gradients held whole in `.grad` (LocalParams, DataParallel):
    summed where the gradients are, in float64, read back once. Each kind's gradients go
    through one foreach norm (one dispatch, not a few ops a tensor); one larger than
    `SQUARES_CHUNK` chunk by chunk. Gradients on several devices (a module a device rule holds on
    the host) are summed on each, read back once per device."""
    by_kind: list[list[Tensor]] = [[] for _ in range(len(kinds) + 1)]
    for name, p in named:
        if p.grad is not None:
            kind = next((i for i, names in enumerate(kinds) if name in names), len(kinds))
            by_kind[kind].append(p.grad.detach())
    devices = list(dict.fromkeys(g.device for grads in by_kind for g in grads)) or [torch.device("cpu")]
    out = torch.zeros(len(by_kind), dtype=torch.float64)
    for device in devices:
        sums = []
        for grads in by_kind:
            total = torch.zeros((), dtype=torch.float64, device=device)
            small = [g for g in grads if g.numel() <= SQUARES_CHUNK and g.device == device]
            if small:
                total = total + torch.stack(torch._foreach_norm(small, 2, dtype=torch.float64)).square().sum()
            for g in grads:
                if g.numel() > SQUARES_CHUNK and g.device == device:
                    total = total + sum_of_squares(g)
            sums.append(total)
        out += torch.stack(sums).cpu()
    return out


SQUARES_CHUNK = 1 << 22  # elements: the float64 copy `sum_of_squares` makes is 32 MiB at most


def sum_of_squares(t: Tensor) -> Tensor:
    """The sum of `t`'s squared elements in float64, on `t`'s device, chunk by chunk: a float64
    copy of a whole embedding's gradient would cost a rank twice its bytes, for a moment."""
    flat = t.detach().reshape(-1)
    if flat.numel() <= SQUARES_CHUNK:
        return flat.double().pow(2).sum()
    return torch.stack([chunk.double().pow(2).sum() for chunk in flat.split(SQUARES_CHUNK)]).sum()


def storage_bytes(tensors: Iterable[Tensor], seen: set[int]) -> int:
    """Bytes of the storages under `tensors` not in `seen` (data pointers), each once; adds them."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def scale_param_grads_(params: Iterable[nn.Parameter], factor: Tensor | float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, float(factor))  # the factor is a CPU scalar: no device sync
