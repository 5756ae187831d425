"""Mesh axes in a checked plan: the mesh's named axes, and the groups of axes an experts rule names."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import Span

# how an experts rule names a group of axes (`experts over dp x tp`): the rule's `axis` is that
# text, which `runtime.mesh.MeshLayout` reads alike (the two layers share no code)
GROUP = " x "


def axes_of(axis: str) -> tuple[str, ...]:
    """The mesh axes an axis name stands for: itself, or a group's (`dp x tp` -> dp, tp)."""
    return tuple(axis.split(GROUP))


@dataclass(frozen=True)
class Axis:
    name: str
    size: int | None  # None until a world size resolves `*`
    span: Span


@dataclass(frozen=True)
class MeshSpec:
    """Named axes in rank-layout order: the last axis varies fastest."""

    axes: tuple[Axis, ...]
    span: Span

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def size(self, name: str) -> int | None:
        """An axis's size; of a group of axes (`dp x tp`, as an experts rule names it) their product."""
        sizes = [next(a.size for a in self.axes if a.name == part) for part in axes_of(name)]
        return None if None in sizes else math.prod(sizes)  # type: ignore[arg-type]

    def axis(self, name: str) -> Axis:
        return next(a for a in self.axes if a.name == name)

    @property
    def world_size(self) -> int | None:
        sizes = [a.size for a in self.axes]
        return None if None in sizes else math.prod(s for s in sizes if s is not None)
