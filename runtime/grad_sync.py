"""Gradient synchronization: one protocol, three engines.

After `finish()`, every rank of the data axis holds the gradient averaged over it, in whatever
form the engine keeps it; the loop reads and scales it only through the protocol:

    engine           where the averaged gradient lives                       module
    Local            `.grad` of each parameter (one replica, nothing to sync)  here
    DataParallel     `.grad`, all-reduced in buckets during backward          data_parallel.py
    Zero (1/2/3)     this rank's shard of each flat buffer (reduce-scatter)   zero.py

`grad_squares(kinds)` is what the global gradient norm needs: the sums of squares of each
kind of parameter (one kind per set of axes that shard them), over the whole data axis. The
loop then sums each kind over the axes that shard it (`Axes.sum_over`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import Tensor, nn


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


class Local:
    """One replica: the gradient in `.grad` is already the average."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def finish(self) -> None:
        pass

    def grad_squares(self, kinds: Sequence[Collection[str]]) -> Tensor:
        return param_grad_squares(self.module.named_parameters(), kinds)

    def scale_grads_(self, factor: Tensor | float) -> None:
        scale_param_grads_(self.module.parameters(), factor)


def param_grad_squares(named: Iterable[tuple[str, nn.Parameter]], kinds: Sequence[Collection[str]]) -> Tensor:
    """`GradSync.grad_squares` of gradients held whole in `.grad` (Local, DataParallel)."""
    squares = torch.zeros(len(kinds) + 1, dtype=torch.float64)
    for name, p in named:
        if p.grad is not None:
            kind = next((i for i, names in enumerate(kinds) if name in names), len(kinds))
            squares[kind] += p.grad.detach().double().pow(2).sum().cpu()
    return squares


def scale_param_grads_(params: Iterable[nn.Parameter], factor: Tensor | float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, float(factor))  # the factor is a CPU scalar: no device sync
