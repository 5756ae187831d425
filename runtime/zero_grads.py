"""ZeRO's gradient path: each flat's gradients reduced over the data axis as soon as backward
has produced all of them (the engine's hooks call `start`), and the averaged gradient this
rank then holds, read and scaled through `GradSync` (`grad_squares`, `scale_`).

    stage  reduction (per flat)    what this rank keeps afterwards
    1      all-reduce              the whole averaged flat (`Flat.full_grad`; p.grad are views of it)
    2, 3   reduce-scatter          its (S,) shard of it (`Flat.grad_shard`)

On gloo, stages 2 and 3 issue their reduce-scatter as an all-reduce of which each rank
keeps its shard: gloo's own reduce-scatter is slower than its all-reduce of the same
tensor (11.2 vs 8.5 ms for 8 MB on 2 CPU ranks). Ledgers still list the reduce-scatter;
NCCL runs the real one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import watchdog
from .collectives import reduce_scatter_single
from .grad_sync import sum_of_squares
from .zero_flats import Flat
from .zero_nodes import MAX_IN_FLIGHT


class _Pending(NamedTuple):
    """A gradient reduction in flight: wait for `work`, then `finish` (which keeps the result)."""

    work: Any
    finish: Callable[[], None]
    buffer: Tensor  # the full-size gradients being reduced (counted by `Zero.memory()`)
    op: str


class ShardedGrads:
    """The gradients of `flats`, averaged over `group`: launched per flat, at most
    `MAX_IN_FLIGHT` reductions running at once; `record(op, nbytes)` counts each collective."""

    def __init__(
        self,
        flats: Sequence[Flat],
        group: dist.ProcessGroup,
        *,
        stage: int,
        reduce_dtype: torch.dtype | None,
        record: Callable[[str, int], None],
        axis: str,
        divisor: int | None = None,
    ) -> None:
        self.flats, self.group, self.stage, self.axis = flats, group, stage, axis
        self.reduce_dtype = reduce_dtype  # None: the params' dtype
        self.world = dist.get_world_size(group)
        self.divisor = divisor or self.world  # `DataParallel`'s
        self._record = record
        self._gloo = dist.get_backend(group) == "gloo"
        self.pending: list[_Pending] = []  # gradient reductions in flight

    def dtype(self, f: Flat) -> torch.dtype:
        return self.reduce_dtype or f.dtype

    def wire_bytes(self, f: Flat) -> int:
        """Bytes of one reduction of `f`, as the ledger counts them (the full padded tensor)."""
        return f.padded * torch.empty((), dtype=self.dtype(f)).element_size()

    def start(self, f: Flat) -> None:
        """Launch the reduction of one flat's grads and free the full-size grads (stages 2/3)."""
        flat = f.flat_grads(self.dtype(f))  # (padded,)
        for p in f.params:
            p.grad = None
        op = "all_reduce" if self.stage == 1 else "reduce_scatter"
        self._record(op, flat.nbytes)
        finish: Callable[[], None]
        if self.stage == 1:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            finish = functools.partial(self._finish_all_reduce, f, flat)
        elif self._gloo:  # gloo's reduce-scatter is slower than its all-reduce: reduce all, keep ours
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            own = slice(f.rank * f.shard_numel, (f.rank + 1) * f.shard_numel)
            finish = lambda: self._finish_reduce_scatter(f, flat[own].clone())  # noqa: E731
        else:
            out = flat.new_empty(f.shard_numel)  # (S,)
            work = reduce_scatter_single(out, flat, group=self.group, async_op=True)
            finish = functools.partial(self._finish_reduce_scatter, f, out)
        self.pending.append(_Pending(work, finish, flat, op))
        f.reduced = True
        self.drain(keep=MAX_IN_FLIGHT)

    def drain(self, keep: int) -> None:
        """Finish the oldest reductions until `keep` are left: bounds the full-size buffers alive."""
        while len(self.pending) > keep:
            pending = self.pending.pop(0)
            watchdog.note(pending.op, self.axis, watchdog.size_text(pending.buffer.nbytes), self.group)
            pending.work.wait()
            pending.finish()

    def finish(self, *, sync: bool) -> None:
        """Reduce what backward did not (params without grads, or hooks that never fired), then wait.
        `sync=False` (inside `no_sync`) launches nothing and only waits for what runs."""
        if sync:
            for f in self.flats:
                if not f.reduced and any(p.grad is not None for p in f.params):
                    self.start(f)
                    if self.stage == 3:
                        f.free_full()
        self.drain(keep=0)

    def _finish_all_reduce(self, f: Flat, flat: Tensor) -> None:
        f.full_grad = flat.div_(self.divisor).to(f.dtype)  # (padded,) averaged
        for p, off, n in zip(f.params, f.offsets, f.numels, strict=True):
            p.grad = f.full_grad[off : off + n].view_as(p)

    def _finish_reduce_scatter(self, f: Flat, shard: Tensor) -> None:
        shard.div_(self.divisor)  # (S,) averaged, in the reduce dtype
        f.grad_shard = shard if f.grad_shard is None else f.grad_shard + shard

    # ------------------------------------------------------------ the averaged gradient

    def squares(self, kinds: Sequence[Collection[str]], device: torch.device) -> Tensor:
        """`GradSync.grad_squares` of the reduced gradients (call `finish` first): each rank sums
        the part of each param inside its own shard, then one all-reduce adds the shards."""
        squares = torch.zeros(len(kinds) + 1, dtype=torch.float64, device=device)
        for f in self.flats:
            g = f.own_grad()
            if g is None:
                continue
            for name, start, end in f.own_ranges():
                kind = next((i for i, names in enumerate(kinds) if name in names), len(kinds))
                squares[kind] += sum_of_squares(g[start:end])
        self._record("all_reduce", squares.nbytes)
        dist.all_reduce(squares, group=self.group)
        return squares.cpu()

    def scale_(self, factor: Tensor | float) -> None:
        """Multiply this rank's reduced gradient shards by `factor` (call `finish` first)."""
        for f in self.flats:
            g = f.own_grad()
            if g is not None:
                g.mul_(factor.to(g.dtype) if isinstance(factor, Tensor) else factor)

    def drop(self) -> None:
        """Forget every gradient: the params' full grads, the reduced ones and the shards."""
        for f in self.flats:
            for p in f.params:
                p.grad = None
            f.full_grad = f.grad_shard = None
            f.reduced = False
