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

Under `compress` each flat has a compressor (`compression.py`, whose docstring has the table
of what each stage sends): stage 1, and PowerSGD at every stage, reduce the whole flat as
plain data parallelism reduces a bucket (stages 2/3 then keep their shard of it); bf16 under
stages 2/3 is a bf16 reduce-scatter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import watchdog
from .buckets import zero_compressed_wire
from .collectives import reduce_scatter_single
from .compression import Bf16Feedback, BucketCompressor, Compression, compressor
from .grad_sync import sum_of_squares
from .zero_flats import Flat
from .zero_nodes import MAX_IN_FLIGHT


class _Pending(NamedTuple):
    """A gradient reduction in flight: `wait` for it, then `finish` (which keeps the result)."""

    wait: Callable[[], Any]
    finish: Callable[[], None]
    buffer: Tensor  # the full-size gradients being reduced (counted by `Zero.memory()`)
    op: str


@dataclass(frozen=True)
class Replicas:
    """HSDP's other group: the ranks holding the same shard of the state (`zero = 3 over dp` of
    `data_parallel over node x dp`: this rank's peers over `node`), over which each reduced
    shard is all-reduced once more."""

    group: dist.ProcessGroup
    axis: str  # its axes' name, for the ledger and the watchdog (`node`)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)


class ShardedGrads:
    """The gradients of `flats`, averaged over `group`: launched per flat, at most
    `MAX_IN_FLIGHT` reductions running at once; `record(op, nbytes)` counts each collective
    (`replicas=True`: one over `replicas`, HSDP's second reduction of each shard).
    `compression`: each flat's reduction made lossy (the module docstring), in the gradients' dtype."""

    def __init__(
        self,
        flats: Sequence[Flat],
        group: dist.ProcessGroup,
        *,
        stage: int,
        reduce_dtype: torch.dtype | None,
        record: Callable[..., None],
        axis: str,
        divisor: int | None = None,
        compression: Compression | None = None,
        replicas: Replicas | None = None,
    ) -> None:
        if compression is not None and reduce_dtype is not None:
            raise ValueError("ZeRO: a compressed flat is reduced in the gradients' dtype, not another")
        if compression is not None and replicas is not None and compression.method != "bf16":
            raise ValueError("ZeRO: under HSDP only bf16 compresses a shard (PowerSGD needs whole matrices)")
        self.flats, self.group, self.stage, self.axis = flats, group, stage, axis
        self.compression = compression
        # each flat's compressor, seeded by its index (the same on every rank), keeping its state across steps
        self.compressors = (
            {id(f): compressor(compression, f.params, i, f.padded) for i, f in enumerate(flats)}
            if compression
            else {}
        )
        self.reduce_dtype = reduce_dtype  # None: the params' dtype
        self.replicas = replicas
        self.world = dist.get_world_size(group)
        # HSDP under `compress = bf16`: the copies' all-reduce of what each rank keeps, in bf16 with
        # its own error feedback (the whole flat under stage 1, the shard under 2 and 3)
        self.across = (
            {id(f): Bf16Feedback(f.padded if stage == 1 else f.shard_numel) for f in flats}
            if compression is not None and replicas is not None
            else {}
        )
        self.divisor = divisor or self.world * (replicas.size if replicas else 1)  # `DataParallel`'s
        self._record = record
        self._gloo = dist.get_backend(group) == "gloo"
        self.pending: list[_Pending] = []  # gradient reductions in flight

    def dtype(self, f: Flat) -> torch.dtype:
        return self.reduce_dtype or f.dtype

    def wire(self, f: Flat) -> list[tuple[str, int]]:
        """(op, bytes) of each collective reducing `f` once, as the ledger counts them (the full
        padded tensor; under `compress`, `buckets.zero_compressed_wire`'s, after PowerSGD's warm-up)."""
        if self.compression is None:
            op = "all_reduce" if self.stage == 1 else "reduce_scatter"
            nbytes = f.padded * torch.empty((), dtype=self.dtype(f)).element_size()
            rows = [(op, nbytes)] if self.world > 1 else []  # over this rank alone: nothing sent
            if self.replicas is not None:
                rows.append(("all_reduce", nbytes if self.stage == 1 else nbytes // self.world))
            return rows
        method, rank = self.compression.method, self.compression.rank
        rows = [(op, b) for op, _, b in zero_compressed_wire(f.params, f.padded, self.stage, method, rank)]
        rows = rows if self.world > 1 else []
        if id(f) in self.across:
            rows.append(("all_reduce", self.across[id(f)].numel * torch.bfloat16.itemsize))
        return rows

    def feedback(self) -> list[Bf16Feedback | BucketCompressor]:
        """Every compressor whose state a checkpoint keeps: each flat's, then HSDP's across copies."""
        return [*self.compressors.values(), *self.across.values()]

    def state(self) -> list[Tensor]:
        """The compressors' tensors kept across steps (`compression.py`: a full-size residual per flat)."""
        return [t for c in self.feedback() for t in c.state()]

    def start(self, f: Flat) -> None:
        """Launch the reduction of one flat's grads and free the full-size grads (stages 2/3)."""
        flat = f.flat_grads(self.dtype(f))  # (padded,)
        for p in f.params:
            p.grad = None
        if id(f) in self.compressors:
            self._start_compressed(f, flat)
            f.reduced = True
            self.drain(keep=MAX_IN_FLIGHT)
            return
        op = "all_reduce" if self.stage == 1 else "reduce_scatter"
        self._record(op, flat.nbytes)
        own = slice(f.rank * f.shard_numel, (f.rank + 1) * f.shard_numel)
        finish: Callable[[], None]
        across = self._across_replicas
        if self.stage == 1:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            finish = lambda: self._keep_full(f, across(flat).div_(self.divisor))  # noqa: E731
        elif self._gloo:  # gloo's reduce-scatter is slower than its all-reduce: reduce all, keep ours
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            finish = lambda: self._keep_shard(f, across(flat[own].clone()).div_(self.divisor))  # noqa: E731
        else:
            out = flat.new_empty(f.shard_numel)  # (S,)
            work = reduce_scatter_single(out, flat, group=self.group, async_op=True)
            finish = lambda: self._keep_shard(f, across(out).div_(self.divisor))  # noqa: E731
        self.pending.append(_Pending(work.wait, finish, flat, op))
        f.reduced = True
        self.drain(keep=MAX_IN_FLIGHT)

    def _start_compressed(self, f: Flat, flat: Tensor) -> None:
        """`start` under `compress`: bf16 under stages 2/3 as a bf16 reduce-scatter; otherwise the
        whole (padded,) flat reduced as plain data parallelism reduces a bucket, of which stages
        2/3 keep their shard (PowerSGD's M_hat is whole until then: `compression.py`)."""
        c = self.compressors[id(f)]
        own = slice(f.rank * f.shard_numel, (f.rank + 1) * f.shard_numel)
        finish: Callable[[], None]
        across = functools.partial(self._across_compressed, f)
        if self.stage > 1 and isinstance(c, Bf16Feedback):
            op = "reduce_scatter"
            reduction, shard = c.launch_scatter(flat, self.group, self.divisor, via_all_reduce=self._gloo)
            finish = lambda: self._keep_shard(f, across(shard))  # noqa: E731
        else:
            op = "all_reduce"
            reduction = c.launch(flat, self.group, self.divisor)
            if self.stage == 1:
                finish = lambda: self._keep_full(f, across(flat))  # noqa: E731
            else:
                finish = lambda: self._keep_shard(f, flat[own].clone())  # noqa: E731
        for nbytes in reduction.launched:
            self._record(op, nbytes)

        def wait() -> None:
            for nbytes in reduction.wait():  # PowerSGD's Q, all-reduced once P is
                self._record("all_reduce", nbytes)

        self.pending.append(_Pending(wait, finish, flat, op))

    def _across_replicas(self, reduced: Tensor) -> Tensor:
        """HSDP: `reduced` (this rank's shard, summed over its own group) summed over the ranks
        holding the same shard, each of which reduced its own part of the batch; in place."""
        if self.replicas is not None:
            self._record("all_reduce", reduced.nbytes, replicas=True)
            dist.all_reduce(reduced, group=self.replicas.group)
        return reduced

    def _across_compressed(self, f: Flat, reduced: Tensor) -> Tensor:
        """HSDP under `compress = bf16`: `reduced` (already divided by every data rank) summed over
        the copies in bf16, the rounding kept for the next step; in place. Without copies, as is."""
        c = self.across.get(id(f))
        if c is not None and self.replicas is not None:
            reduction = c.launch(reduced, self.replicas.group, 1)
            for nbytes in reduction.launched:
                self._record("all_reduce", nbytes, replicas=True)
            reduction.wait()
        return reduced

    def drain(self, keep: int) -> None:
        """Finish the oldest reductions until `keep` are left: bounds the full-size buffers alive."""
        while len(self.pending) > keep:
            pending = self.pending.pop(0)
            watchdog.note(pending.op, self.axis, watchdog.size_text(pending.buffer.nbytes), self.group)
            pending.wait()
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

    def _keep_full(self, f: Flat, averaged: Tensor) -> None:
        """Stage 1: `averaged` (padded,) is the flat's gradient; the params' grads view it."""
        f.full_grad = averaged.to(f.dtype)
        for p, off, n in zip(f.params, f.offsets, f.numels, strict=True):
            p.grad = f.full_grad[off : off + n].view_as(p)

    def _keep_shard(self, f: Flat, averaged: Tensor) -> None:
        """Stages 2/3: `averaged` (S,), in the reduce dtype, is this rank's shard of the gradient."""
        f.grad_shard = averaged if f.grad_shard is None else f.grad_shard + averaged

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
