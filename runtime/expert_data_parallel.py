"""Gradient averaging under expert parallelism: the batch is split over every data axis, the
expert axes included, and each parameter is averaged over the data axes that do not shard it.

    sync = expert_data_parallel(program, axes, lambda over: group_over(layout, over, mesh))
    train(program, loss_of, batches, config, axes=axes, sync=sync)

`mesh dp=2, ep=2` (ranks dp-major: 0 = (dp 0, ep 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)):
the dense parameters are averaged over all four ranks (one `DataParallel` over dp x ep), an
expert's over the ranks holding the same experts, {0, 2} and {1, 3} (over dp). `mesh dp=2`
with `experts over dp`: the dense ones over dp, the experts over nothing (each rank holds
others; `grad_sync.LocalParams`). The all-to-all's backward already summed an expert's gradient over
the ranks of its axis, and the experts unit divided it by their number
(`runtime/experts.py`), so averaging it over the other data axes gives the global mean.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .axes import Axes
from .compression import BucketCompressor, Compression, restore_state, saved_state
from .data_parallel import DataParallel
from .grad_sync import LocalParams, WholeParams


class _Engine(Protocol):
    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    def finish(self) -> None: ...

    def grad_squares(self, kinds: Sequence[Collection[str]]) -> Tensor: ...

    def scale_grads_(self, factor: Tensor | float) -> None: ...


E = TypeVar("E", bound=_Engine)


class PerGroup(Generic[E]):
    """The gradient sync of several engines over one module, each over its own parameters and
    group: every call goes to each. Each parameter is in one engine, whose `grad_squares` covers
    the ranks that average it; the loop then sums a kind cut over an expert axis over that axis."""

    def __init__(self, module: nn.Module, engines: Sequence[E]) -> None:
        self.module, self.engines = module, list(engines)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self._in_each(lambda engine: engine.no_sync())

    def finish(self) -> None:
        for engine in self.engines:
            engine.finish()

    def grad_squares(self, kinds: Sequence[Collection[str]]) -> Tensor:
        return torch.stack([engine.grad_squares(kinds) for engine in self.engines]).sum(0)

    def scale_grads_(self, factor: Tensor | float) -> None:
        for engine in self.engines:
            engine.scale_grads_(factor)

    @contextlib.contextmanager
    def _in_each(self, context: Callable[[E], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
        """Inside `context(engine)` of every engine at once (entered in order, left in reverse)."""
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(context(engine))
            yield


class ExpertDataParallel(PerGroup["DataParallel | LocalParams"], WholeParams):
    """Data parallelism when experts are split over an axis that is data parallel for the rest.

    Every data axis splits the batch; a parameter's gradient is averaged over the data axes
    that do not shard it: the dense ones over all of them (`dp` x `ep`), an expert's over the
    others (`dp`; none when the experts borrow the only data axis). Each set of axes is one
    `DataParallel` engine over its own parameters; this is the `GradSync` of all of them, with
    one AdamW over the whole module (`WholeParams`).

        mesh dp=2, ep=2: dense over {0,1,2,3}; experts over dp: {0,2} (experts 0..E/2) and {1,3}
    """

    def own_local(self) -> dict[str, Tensor]:
        """`compress`'s state of every engine's buckets, numbered across the engines in order."""
        return saved_state(self._compressors())

    def restore_local(self, saved: dict[str, Tensor]) -> bool:
        return restore_state(self._compressors(), saved)

    def _compressors(self) -> list[BucketCompressor]:
        return [c for e in self.engines if isinstance(e, DataParallel) for c in e.compressors()]

    def grad_buffers(self) -> list[Tensor]:
        """Every `DataParallel` engine's gradient buckets (`WholeParams.memory` counts them)."""
        return [t for e in self.engines if isinstance(e, DataParallel) for t in e.grad_buffers()]

    def ledger(self) -> list[tuple[str, int, int]]:
        """(axes, bytes, all-reduces per optimizer step) for each bucket of each engine."""
        return [
            (engine.axis, nbytes, count)
            for engine in self.engines
            if isinstance(engine, DataParallel)
            for nbytes, count in engine.ledger()
        ]


def averaged_over(module: nn.Module, axes: Axes) -> dict[tuple[str, ...], list[nn.Parameter]]:
    """The trainable parameters (tied ones once) by the axes their gradient is reduced over
    (`Axes.reduced_over`: `axes.data` minus the axes that shard them, and the axes it is partial
    over), sorted (the same order on every rank). Each set's engine divides the sum by its data
    ranks only (`data_ranks`): over a partial axis the sum is the gradient."""
    by_axes: dict[tuple[str, ...], list[nn.Parameter]] = {}
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            by_axes.setdefault(axes.reduced_over(name), []).append(p)
    return dict(sorted(by_axes.items()))


def data_ranks(axes: Axes, over: tuple[str, ...]) -> int:
    """How many of the ranks of `over` split the batch: what a gradient summed over them is
    divided by."""
    return math.prod(axes.size(a) for a in over if a in axes.data)


def expert_data_parallel(
    module: nn.Module,
    axes: Axes,
    groups: Callable[[tuple[str, ...]], dist.ProcessGroup | None],
    *,
    bucket_bytes: int = 25_000_000,
    reduce_dtype: torch.dtype | None = None,
    late: Collection[nn.Parameter] = (),
    compression: Compression | None = None,
    compressed: Collection[str] = (),
) -> ExpertDataParallel:
    """One engine per set of data axes a parameter is averaged over (`averaged_over`);
    `groups(axes)` is the process group of those axes together. `late`: `DataParallel`'s.
    `compression`: the buckets of each set that takes in an axis of `compressed` (the plan's
    data-parallel axes) made lossy; a sum over other axes alone stays exact."""
    engines: list[DataParallel | LocalParams] = []
    for over, params in averaged_over(module, axes).items():
        group = groups(over)
        if group is None:
            engines.append(LocalParams(module, params))
            continue
        engines.append(
            DataParallel(
                module,
                group,
                bucket_bytes=bucket_bytes,
                reduce_dtype=reduce_dtype,
                axis=" x ".join(over),
                params=params,
                divisor=data_ranks(axes, over),
                late=[p for p in late if any(p is q for q in params)],
                compression=compression if any(a in compressed for a in over) else None,
            )
        )
    return ExpertDataParallel(module, engines)
