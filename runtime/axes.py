"""This rank's mesh as training sees it: the process group of every axis, by the axis's name,
the axes the batch is split over, and how each parameter is cut over the axes that shard it.

Nothing in the runtime knows an axis by its name or its place in the mesh: the session
(`meshplan.session`) reads the roles from the plan, so `mesh tp=2, dp=2`, `mesh dp=2, tp=2`
and `mesh dp=2, cp=1, tp=2` train the same model.

    axes = Axes(groups={"dp": dp_group, "tp": tp_group}, data=("dp",),
                sharding={"layers.0.mlp.up_proj.weight": (AxisCut("tp", Cut(0)),)})
    axes.sharded_over("layers.0.mlp.up_proj.weight")    # ("tp",)
    axes.unshard(name, local)                           # the whole tensor, on every rank
    axes.placed(name)                                   # ((Cut(0), tp rank, 2),): where this rank's piece lies
    axes.sum_over(squares, ("tp",), "gradient norm")    # summed over every rank of those axes

A pipeline axis (`stages`) is neither data nor sharding: each of its ranks holds the
parameters of other stages, so a sum over the whole model (the gradient norm) adds them up;
a weight several stages share (an embedding tied to the LM head) is counted by one of them,
the others hold `copies`.

An axis of one rank has no group here: every reduction over it is the identity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor

from . import watchdog
from .pieces import Placed
from .shards import Sharding, unshard


@dataclass(frozen=True)
class Axes:
    groups: Mapping[str, dist.ProcessGroup] = field(default_factory=dict)  # axes of more than one rank
    data: tuple[str, ...] = ()  # the batch is split over these: losses are averaged over them
    sharding: Sharding = field(default_factory=dict)  # parameter -> its cuts over the axes
    stages: tuple[str, ...] = ()  # pipeline axes: each rank holds other parameters (its stages)
    # parameters this rank holds a copy of that another pipeline rank counts (a tied weight)
    copies: frozenset[str] = frozenset()
    # parameter -> axes its gradient is partial over (each rank's shard of the activations'
    # share), summed there by the gradient sync: `compiler/passes/tensor_parallel/grad_sums.py`
    summed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        return self.groups.get(axis)

    def size(self, axis: str) -> int:
        group = self.groups.get(axis)
        return dist.get_world_size(group) if group is not None else 1

    @property
    def data_size(self) -> int:
        """How many ranks split the batch: each computes its part of the global batch."""
        return math.prod(self.size(axis) for axis in self.data)

    @property
    def data_rank(self) -> int:
        """This rank's place among the ranks that split the batch: its coordinates on the data
        axes, the first varying slowest (`mesh dp=2, ep=2`: dp 1, ep 0 is data rank 2)."""
        rank = 0
        for axis in self.data:
            group = self.groups.get(axis)
            rank = rank * self.size(axis) + (dist.get_rank(group) if group is not None else 0)
        return rank

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The group gradients are synchronized over (one data axis today)."""
        groups = [g for axis in self.data if (g := self.groups.get(axis)) is not None]
        if len(groups) > 1:
            raise NotImplementedError("gradient synchronization over more than one data axis")
        return groups[0] if groups else None

    def reduced_over(self, name: str) -> tuple[str, ...]:
        """The axes (of more than one rank) parameter `name`'s gradient is reduced over, in mesh
        order: averaged over the data axes that do not cut it, summed over those it is partial
        over (`summed`)."""
        summed, cut = self.summed.get(name, ()), self.sharded_over(name)
        return tuple(
            a for a in self.groups if (a in self.data and a not in cut) or (a in summed and a not in cut)
        )

    def sharded_over(self, name: str) -> tuple[str, ...]:
        """The axes (of more than one rank) over which parameter `name` is cut; () if it is whole."""
        return tuple(c.axis for c in self.sharding.get(name, ()) if c.axis in self.groups)

    def unshard(self, name: str, local: Tensor) -> Tensor:
        """The whole parameter from this rank's piece (every rank of its axes takes part)."""
        for axis, cut in reversed(self.sharding.get(name, ())):
            group = self.groups.get(axis)
            if group is not None:
                watchdog.note("all_gather", axis, name, group)
                local = unshard(local, cut, group)
        return local

    def placed(self, name: str) -> tuple[Placed, ...]:
        """Parameter `name`'s cuts over axes of more than one rank, each with this rank's place on
        the axis and the axis's size, in the order applied (`runtime/pieces.py`)."""
        return tuple(
            (cut, dist.get_rank(group), dist.get_world_size(group))
            for axis, cut in self.sharding.get(name, ())
            if (group := self.groups.get(axis)) is not None
        )

    def sum_over(self, x: Tensor, axes: tuple[str, ...], what: str) -> Tensor:
        """`x` summed over every rank of `axes` (one all-reduce per axis of more than one rank)."""
        x = x.clone()
        for axis in axes:
            group = self.groups.get(axis)
            if group is not None:
                watchdog.note("all_reduce", axis, what, group)
                dist.all_reduce(x, group=group)
        return x

    def mean_over_data(self, x: Tensor, what: str) -> Tensor:
        """The mean of `x` over the ranks that split the batch."""
        return self.sum_over(x, self.data, what) / self.data_size
