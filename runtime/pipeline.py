"""Running a pipeline rank's stages by its action list: forward, backward, send, receive.

The compiler cuts the program into stage programs (`compiler/stages.py`); a schedule
(`schedules.py`, checked by simulation before it gets here) says in which order this
rank runs its stages on each microbatch. `PipelineStep` carries the list out:

    F(s, i)   receive stage s's inputs for microbatch i (from the rank of stage s - 1, or
              from this rank's own earlier stage), run it, keep what backward needs, and
              send its outputs on (detached) to the rank of stage s + 1
    B(s, i)   receive the gradients of stage s's outputs (the last stage starts from its
              loss, divided by the number of microbatches), run autograd through the stage,
              and send the gradients of its received inputs back to stage s - 1
    I(s, i)   as B, for the received inputs' gradients only (`split_backward.py`)
    W(s, i)   the weight gradients that I(s, i) left, whenever the schedule finds room

Sends are asynchronous (`isend`, waited for at the end of the step) and receives block, so
a list that the simulation accepts cannot deadlock: every receive's send is issued by an
action that does not itself wait on this one. Messages are tagged by (direction, stage,
microbatch, index), so sends and receives pair up whatever order two ranks issue them in.
The first microbatch's message across each boundary starts with a header of the values'
shapes and dtypes: they depend on the run's batch and sequence length and on how the other
axes shard the activations, and the receiver learns them instead of being told.
A stage's inputs are the microbatch's inputs followed by what it receives; its output is a
tuple of what it sends, or the loss for the last stage.

Gradients accumulate in the stages' parameters over the microbatches, exactly as
gradient accumulation does: with m microbatches of a batch, each microbatch's loss is
divided by m, so the gradients equal those of the whole batch (for a mean-reduced loss over
equally many tokens per microbatch). Under data parallelism, every backward but a stage's
last of the step runs inside the engine's `no_sync`: each gradient bucket is all-reduced
once, launched by the last backward that completes it, overlapping the backward that follows.

`idle` is the measured bubble of the last step on this rank: the fraction of the step's
pipeline time spent waiting in receives and for the sends to complete (the schedule's
bubble, plus transfer time, plus whatever a slower neighbour adds).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import watchdog
from .schedules import Schedule
from .shared_cast import let_go, sharing
from .split_backward import Pending, backward_input, backward_weight

# values per message (the last tag is the header's); tags are (((direction * stages) + stage) * microbatches + i) * MAX + j
_MAX_VALUES = 64


# a value's description in a header: ndim, up to 8 sizes, dtype index
_DESC = 10
_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
)


class PipelineStep:
    """Forward and backward of one optimizer step (all its microbatches) on this rank's stages."""

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        schedule: Schedule,
        *,
        rank: int,
        ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        axis: str = "pp",
        no_sync: Callable[[], AbstractContextManager[None]] | None = None,
    ):
        """`stages`: this rank's stage programs by stage index; `rank`: this rank's position on the pipeline axis `axis`; `ranks`: the
        global ranks of the pipeline group, by position; `group`: that group; `no_sync`:
        the data-parallel engine's, so that a stage's gradients are synchronized once, by
        its last backward of the step, not once per microbatch."""
        self.stages = dict(stages)
        self.schedule = schedule
        # where messages are received (NCCL sends and receives device memory only)
        self.device = _device_of(self.stages.values())
        # what each (direction, stage) message holds, learnt from the header its first
        # microbatch carries: shapes depend on the run's batch and sequence and on the
        # sharding of the other axes, which the compiled graph keeps symbolic
        self._shapes: dict[tuple[str, int], list[tuple[tuple[int, ...], torch.dtype]]] = {}
        self.idle = 0.0  # of the last `run`: the fraction of its time spent waiting for neighbours
        self.rank = rank
        self.ranks = tuple(ranks)
        self.group = group
        self.axis = axis
        self.actions = schedule.actions[rank]
        self.no_sync = no_sync or contextlib.nullcontext
        last: dict[int, int] = {}
        for at, action in enumerate(self.actions):
            if action.kind in ("B", "W"):
                last[action.stage] = at
        self._syncs = frozenset(last.values())  # the actions after which a stage's gradients are final
        self._done = {at: stage for stage, at in last.items()}  # a stage's last backward of the step

    @property
    def last(self) -> int:
        return self.schedule.stages - 1

    def run(self, microbatches: Sequence[tuple[Tensor, ...]], scale: float = 1.0) -> Tensor:
        """Run this rank's actions over `microbatches` (each the stage programs' leading
        inputs). Returns the sum over microbatches of loss / m on the rank of the last
        stage and 0 elsewhere (sum it over the pipeline group for the loss). With a loss
        scale, backward starts from the scaled loss. A weight's cast to the compute dtype is
        made once for all the microbatches (`shared_cast.py`)."""
        with sharing(self.stages.values()):
            return self._run(microbatches, scale)

    def _run(self, microbatches: Sequence[tuple[Tensor, ...]], scale: float) -> Tensor:
        m = self.schedule.microbatches
        assert len(microbatches) == m, f"{len(microbatches)} microbatches for a schedule of {m}"
        self._local: dict[tuple[str, int, int], list[Tensor]] = {}
        self._pending: list[tuple[dist.Work, Tensor]] = []
        self._waited = 0.0
        started = time.perf_counter()
        saved: dict[tuple[int, int], tuple[list[Tensor], tuple[Tensor, ...]]] = {}
        pending: dict[tuple[int, int], Pending] = {}  # after I, what W needs
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # read once, by the caller
        for at, action in enumerate(self.actions):
            s, i = action.stage, action.microbatch
            if action.kind == "F":
                received = self._take("F", s, i) if s > 0 else []
                for t in received:
                    if t.is_floating_point():
                        t.requires_grad_()
                out = self.stages[s](*microbatches[i], *received)
                outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                if s == self.last:
                    loss = _loss(outs) / m
                    total += loss.detach().double()
                    saved[(s, i)] = (received, (loss * scale if scale != 1.0 else loss,))
                else:
                    saved[(s, i)] = (received, outs)
                    self._give("F", s + 1, i, [o.detach() for o in outs])
            elif action.kind in ("B", "I"):
                received, outs = saved.pop((s, i))
                grads: list[Tensor | None] = list(self._take("B", s, i)) if s != self.last else [None]
                pairs = [(o, g) for o, g in zip(_floating(outs), grads, strict=True) if o.requires_grad]
                if action.kind == "I":
                    pending[(s, i)] = backward_input(
                        [o for o, _ in pairs],
                        [g for _, g in pairs],
                        _floating(received),
                        list(self.stages[s].parameters()),
                    )
                else:
                    with self.no_sync() if at not in self._syncs else contextlib.nullcontext():
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                if s > 0:
                    self._give("B", s - 1, i, [_grad(t) for t in _floating(received)])
            else:
                with self.no_sync() if at not in self._syncs else contextlib.nullcontext():
                    backward_weight(pending.pop((s, i)))
            if at in self._done:
                let_go(self.stages[s])
        t0 = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self._waited += time.perf_counter() - t0
        elapsed = time.perf_counter() - started
        self.idle = self._waited / elapsed if elapsed > 0 else 0.0
        return total

    # -- messages

    def _owner(self, stage: int) -> int:
        return self.schedule.owner[stage]

    def _give(self, direction: str, stage: int, i: int, values: list[Tensor]) -> None:
        """Hand `values` to stage `stage` (inputs of its F, or gradients for its B)."""
        dst = self._owner(stage)
        if dst == self.rank:
            self._local[(direction, stage, i)] = values
            return
        if i == 0:
            self._send(_header(values).to(self.device), dst, self._tag(direction, stage, i, _MAX_VALUES - 1))
        for j, v in enumerate(values):
            self._send(v.contiguous(), dst, self._tag(direction, stage, i, j))

    def _send(self, v: Tensor, dst: int, tag: int) -> None:
        work = dist.isend(v, self.ranks[dst], group=self.group, tag=tag)
        assert work is not None
        # the buffer must live until the send completes; those that have are let go as the
        # step goes, so a rank holds the messages in flight, not every message of the step
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        self._pending.append((work, v))

    def _take(self, direction: str, stage: int, i: int) -> list[Tensor]:
        """What stage `stage` gets for microbatch i: from this rank or the neighbour's."""
        key = (direction, stage, i)
        if key in self._local:
            return self._local.pop(key)
        src = self.ranks[self._owner(stage - 1 if direction == "F" else stage + 1)]
        watchdog.note("pipeline recv", self.axis, f"{direction}{stage}.{i}", self.group)
        t0 = time.perf_counter()
        if i == 0:
            header = torch.empty(1 + (_MAX_VALUES - 1) * _DESC, dtype=torch.int64, device=self.device)
            dist.recv(header, src, group=self.group, tag=self._tag(direction, stage, i, _MAX_VALUES - 1))
            self._shapes[(direction, stage)] = _described(header)
        out = []
        for j, (shape, dtype) in enumerate(self._shapes[(direction, stage)]):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src, group=self.group, tag=self._tag(direction, stage, i, j))
            out.append(t)
        self._waited += time.perf_counter() - t0
        return out

    def _tag(self, direction: str, stage: int, i: int, j: int) -> int:
        d = 0 if direction == "F" else 1
        return ((d * self.schedule.stages + stage) * self.schedule.microbatches + i) * _MAX_VALUES + j


def _header(values: Sequence[Tensor]) -> Tensor:
    """The shapes and dtypes of `values`, as one int64 tensor of a fixed size."""
    assert len(values) < _MAX_VALUES, f"more than {_MAX_VALUES - 1} values cross one stage boundary"
    header = torch.zeros(1 + (_MAX_VALUES - 1) * _DESC, dtype=torch.int64)
    header[0] = len(values)
    for j, v in enumerate(values):
        assert v.dim() <= _DESC - 2, f"a {v.dim()}-dimensional value crosses a stage boundary"
        at = 1 + j * _DESC
        header[at] = v.dim()
        header[at + 1 : at + 1 + v.dim()] = torch.tensor(v.shape, dtype=torch.int64)
        header[at + _DESC - 1] = _DTYPES.index(v.dtype)
    return header


def _described(header: Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    values = header.tolist()  # one read of the device's memory, not one per number
    out = []
    for j in range(values[0]):
        at = 1 + j * _DESC
        ndim = values[at]
        out.append((tuple(values[at + 1 : at + 1 + ndim]), _DTYPES[values[at + _DESC - 1]]))
    return out


def _device_of(stages: Iterable[nn.Module]) -> torch.device:
    """Where the stages' weights live: the device their messages are received on."""
    for stage in stages:
        for t in itertools.chain(stage.parameters(), stage.buffers()):
            return t.device
    return torch.device("cpu")


def _loss(outs: tuple[Tensor, ...]) -> Tensor:
    scalars = [o for o in outs if isinstance(o, Tensor) and o.dim() == 0 and o.is_floating_point()]
    assert len(scalars) == 1, "the last stage returns one scalar loss"
    return scalars[0]


def _floating(values: Sequence[Tensor]) -> list[Tensor]:
    return [v for v in values if v.is_floating_point()]


def _grad(t: Tensor) -> Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def split_microbatches(inputs: Sequence[Tensor], m: int) -> list[tuple[Tensor, ...]]:
    """Split each input along dim 0 (the batch) into m equal microbatches."""
    for x in inputs:
        if x.shape[0] % m:
            raise ValueError(f"a batch of {x.shape[0]} does not split into {m} microbatches")
    parts = [x.chunk(m, dim=0) for x in inputs]
    return [tuple(p[i] for p in parts) for i in range(m)]
