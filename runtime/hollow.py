"""Hollow parameters: a rank's parameter with its shape, dtype and device and no bytes yet, whose
value is made only when the ZeRO engine that shards it asks, and only for as long as it copies
its own piece out.

    p = nn.Parameter(hollow(shape, torch.float32))
    defer(p, make)          # make() -> the rank's whole (tensor-parallel-local) value of p
    ...
    value_of(p)             # make() now (and forgotten); a parameter that is not hollow: itself
    fill(module)            # the hollow parameters no engine took get their values

Why: under ZeRO-3 a rank keeps 1/dp of each of its parameters. Making every parameter whole first
and sharding afterwards holds the rank's whole (tensor-parallel-local) model once at start-up: in
fp32 under AdamW at dp=2, half the rank's training state on top of it. A flat (`zero_flats.Flat`)
takes each value as it lays its parameters out and keeps only its shard, so start-up holds the
rank's state, one unit whole and one module being initialized (`bench/start_memory.py`: a 0.38B
Llama's ZeRO-3 start-up 0.97 -> 0.87 of the state, the rest being torch and that state).

Only values that are the same on every rank by construction are deferred: a meta-built model's
(each module initialized from the run's seed and its path, `compiler/materialize.py`) and a
pretrained file's. They need no broadcast from the group's first rank, which a hollow parameter
could not take (`data_parallel.broadcast_parameters` skips them).

A hollow tensor's storage has zero bytes; `moved` gives one on another device (what `place` does
with it) without reading anything. The makers are held by the tensor's identity, weakly: a
parameter dropped before it was filled takes its maker with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

_makers: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # hollow tensor -> () -> its value


def hollow(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Tensor:
    """A contiguous tensor of `shape` and `dtype` on `device` that holds no bytes (allocated and
    given back at once: the host's pages are never touched)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def is_hollow(t: Tensor) -> bool:
    """A tensor with elements and no bytes behind them: hollow, or a ZeRO-3 parameter between a
    free and the next gather (whose storage is resized to nothing)."""
    return t.device.type != "meta" and t.numel() > 0 and t.untyped_storage().nbytes() == 0


def defer(t: Tensor, make: Callable[[], Tensor]) -> None:
    """Give the hollow `t` its value, `make()`, when `value_of` or `fill` asks."""
    assert is_hollow(t), "only a hollow tensor's value is deferred"
    _makers[t] = make


def is_deferred(t: Tensor) -> bool:
    return t in _makers


def value_of(t: Tensor) -> Tensor:
    """`t`'s value: a deferred one made now (its maker is then forgotten: a flat takes each value
    once), else `t` itself, detached."""
    make = _makers.pop(t, None)
    if make is None:
        return t.detach()
    value = make()
    if tuple(value.shape) != tuple(t.shape):
        raise ValueError(f"a deferred value of shape {tuple(value.shape)} for a tensor of {tuple(t.shape)}")
    return value


def moved(t: Tensor, device: torch.device) -> Tensor:
    """The hollow `t` on `device` (nothing to copy); its maker stays with the parameter, whose
    `.data` `nn.Module._apply` sets to this."""
    return hollow(t.shape, t.dtype, device)


def fill(module: nn.Module) -> None:
    """Every deferred parameter of `module` that is still hollow gets its value (one no engine
    took: frozen, or not sharded)."""
    with torch.no_grad():
        for p in module.parameters():
            if is_deferred(p):
                value = value_of(p)
                p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device).copy_(value)
