"""The liveness walk of `meshplan estimate`: a program's stages run forward and backward on the
meta device (no weights, no data; collectives on a fake process group), a dispatch mode adding
up the storages the ops create while they live.

    walks = walk_stages(stages, inputs)       # per stage: bytes kept for backward, peaks, where
    in_flight(schedule, stage)                # microbatches whose activations a stage keeps at once

A storage counts from the op that creates it (an output no alias annotation ties to an input,
as `runtime/train.py`'s CPU tracker counts) until it dies; parameters and the engine's state
are not created by the step and are the caller's to add.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, fx, nn
from torch.utils._python_dispatch import TorchDispatchMode


class Observer(Protocol):
    """Sees every op the walk runs (`compiler/step_time.py`'s `OpCosts` prices them); `where`
    names the node for collectives only."""

    def begin(self, stage: int, phase: str) -> None: ...

    def __call__(self, func: Any, args: Any, kwargs: Any, out: Any, where: str) -> None: ...


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create while they live, on any device (meta included), their
    peak and the op at the peak. `where()` names the op being run (set by the walk)."""

    def __init__(self, where: Callable[[], str], observer: Observer | None = None) -> None:
        super().__init__()
        self._observe = observer
        self.live = self.peak = 0
        self.peak_at = ""
        self._where = where
        self._storages: dict[int, tuple[int, weakref.ref]] = {}
        self._fresh: dict[Any, list[bool]] = {}

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._storages.clear()

    def reset_peak(self) -> None:
        self.peak, self.peak_at = self.live, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._observe is not None:
            self._observe(func, args, kwargs or {}, out, self._where() if func.namespace == "c10d" else "")
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = [r.alias_info is None for r in func._schema.returns]
        if any(fresh):
            results = out if isinstance(out, tuple) else (out,)
            for result, new in zip(results, fresh, strict=False):
                if new:
                    for t in result if isinstance(result, list) else (result,):
                        if isinstance(t, Tensor) and t.layout == torch.strided:
                            self._add(t.untyped_storage(), func)
        return out

    def _add(self, storage: torch.UntypedStorage, func) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if not nbytes or key in self._storages:
            return
        self._storages[key] = (nbytes, weakref.ref(storage, functools.partial(self._dead, key)))
        self.live += nbytes
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, f"{self._where()} ({func.__name__})"

    def _dead(self, key: int, _: object = None) -> None:
        nbytes, _ = self._storages.pop(key, (0, None))
        self.live -= nbytes


@dataclass
class StageWalk:
    """One stage's (or the whole program's) forward and backward on one microbatch."""

    saved: int = 0  # created in forward, alive when it ends: what backward reads
    forward_peak: int = 0
    backward_peak: int = 0  # over the live bytes when backward starts (the saved ones included)
    peak_at: str = ""
    received: int = 0  # bytes of the values it receives from the stage before
    sends: list[Any] = field(default_factory=list)


class _Where(fx.Interpreter):
    """Runs a graph and says which node is running (the peak's op)."""

    def __init__(self, module: fx.GraphModule, note: list[str]) -> None:
        super().__init__(module)
        self.note = note

    def run_node(self, n: fx.Node) -> Any:
        self.note[0] = f"{n.name} (forward)"
        return super().run_node(n)


def _where_backward(note: list[str]) -> Callable[[], str]:
    def where() -> str:
        node = torch._C._current_autograd_node()
        return f"{node.name()} (backward)" if node is not None else note[0]

    return where


def walk_stages(
    stages: Sequence[fx.GraphModule],
    inputs: Sequence[Any],
    free_grads: Callable[[nn.Parameter], None] | None = None,
    observer: Observer | None = None,
) -> list[StageWalk]:
    """Each stage run forward on `inputs` (plus what the one before sends), then backward from
    the last (the loss) to the first, on whatever device the tensors are (meta: no data);
    `observer` sees every op, told the stage and phase first."""
    note = ["start"]
    walks = [StageWalk() for _ in stages]
    outputs: list[Any] = []
    received: list[list[Tensor | None]] = []  # per stage, one per value it receives
    handles = []
    if free_grads is not None:
        for st in stages:
            for p in st.parameters():
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(free_grads))
    tracker = LiveBytes(_where_backward(note), observer)
    begin = observer.begin if observer is not None else (lambda stage, phase: None)
    try:
        with tracker:
            sends: Sequence[Any] = ()
            for s, stage in enumerate(stages):
                recv = [
                    t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, Tensor) else t
                    for t in sends
                ]
                received.append([t if isinstance(t, Tensor) and t.requires_grad else None for t in recv])
                walks[s].received = sum(_nbytes(t) for t in recv if isinstance(t, Tensor))
                start = tracker.live
                tracker.reset_peak()
                begin(s, "forward")
                out = _Where(stage, note).run(*inputs, *recv)
                walks[s].forward_peak = tracker.peak - start
                walks[s].peak_at = tracker.peak_at
                walks[s].saved = tracker.live - start
                outputs.append(out)
                sends = out if isinstance(out, (tuple, list)) else (out,)
            for s in reversed(range(len(stages))):
                out = outputs[s]
                values = list(out) if isinstance(out, (tuple, list)) else [out]
                roots: list[Tensor] = []
                grads: list[Tensor | None] = []
                if s == len(stages) - 1:
                    roots, grads = [next(v for v in values if isinstance(v, Tensor))], [None]
                else:
                    for v, r in zip(values, received[s + 1], strict=False):
                        if isinstance(v, Tensor) and r is not None and r.grad is not None:
                            roots.append(v)
                            grads.append(r.grad)
                start = tracker.live
                tracker.reset_peak()
                note[0] = f"stage {s} backward"
                begin(s, "backward")
                if roots and any(r.requires_grad for r in roots):
                    torch.autograd.backward(roots, grads)
                peak = tracker.peak - start
                walks[s].backward_peak = peak + walks[s].saved
                if walks[s].backward_peak > walks[s].forward_peak:
                    walks[s].peak_at = tracker.peak_at
                outputs[s] = None
                if s + 1 < len(stages):
                    for r in received[s + 1]:
                        if r is not None:
                            r.grad = None
    finally:
        for h in handles:
            h.remove()
    return walks


def in_flight(schedule, stage: int) -> int:
    """The most microbatches of `stage` whose forward has run and whose activations are not yet
    freed (by its full backward `B`, or its weight half `W` under a split backward), in its
    owner's action list: how many microbatches' activations the stage keeps at once."""
    live = most = 0
    for a in schedule.actions[schedule.owner[stage]]:
        if a.stage != stage:
            continue
        if a.kind == "F":
            live += 1
            most = max(most, live)
        elif a.kind in ("B", "W"):
            live -= 1
    return max(most, 1)
