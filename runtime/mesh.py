"""Device meshes: named axes over ranks, and the process group of each axis.

Rank layout is row-major over the axes in plan order: the last axis varies fastest,
as in `torch.distributed.device_mesh.init_device_mesh`. For `mesh dp=2, pp=2, tp=2`:

    rank:    0  1  2  3  4  5  6  7
    dp:      0  0  0  0  1  1  1  1
    pp:      0  0  1  1  0  0  1  1
    tp:      0  1  0  1  0  1  0  1

so the tp groups are {0,1} {2,3} {4,5} {6,7} (neighbouring ranks: one node, fast links),
the pp groups {0,2} {1,3} {4,6} {5,7}, and the dp groups {0,4} {1,5} {2,6} {3,7}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# a group of axes acting as one, as an experts rule names it (`experts over dp x tp`): its ranks
# are those sharing every other coordinate, numbered in mesh order (dsl/axes.py writes it alike)
GROUP = " x "


def axes_of(axis: str) -> tuple[str, ...]:
    """The mesh axes an axis name stands for: itself, or a group's (`dp x tp` -> dp, tp)."""
    return tuple(axis.split(GROUP))


@dataclass(frozen=True)
class MeshLayout:
    """Axis names and sizes, in rank-layout order."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        """An axis's size; a group's (`dp x tp`) is their product."""
        return math.prod(self.sizes[self.names.index(a)] for a in axes_of(axis))

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> coordinate on each axis. `coords(5)` of the mesh above: dp=1, pp=0, tp=1."""
        out = {}
        for name, size in reversed(list(zip(self.names, self.sizes, strict=True))):
            out[name] = rank % size
            rank //= size
        return dict(reversed(out.items()))

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for name, size in zip(self.names, self.sizes, strict=True):
            rank = rank * size + coords.get(name, 0)
        return rank

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that share every coordinate with `rank` except `axis`'s (a group's, `node x
        dp`: its axes'), in rank order."""
        c, axes = self.coords(rank), axes_of(axis)
        kept = [a for a in self.names if a not in axes]
        return [r for r in range(self.world_size) if all(self.coords(r)[a] == c[a] for a in kept)]


def init_mesh(layout: MeshLayout, device_type: str = "cpu") -> DeviceMesh:
    """Build the DeviceMesh (and with it every axis's process group) on an initialized world.

    The axis groups wait for a peer as long as the world group does (the `timeout` of
    `init_process_group`, `meshplan run --timeout`): torch creates them with its own default
    of 30 minutes, so a stuck rank would otherwise hang a dp x tp job that long.
    """
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"the mesh has {layout.world_size} ranks but {dist.get_world_size()} processes were started"
        )
    mesh = init_device_mesh(device_type, layout.sizes, mesh_dim_names=layout.names)
    _inherit_timeout(mesh)
    return mesh


def group_over(layout: MeshLayout, axes: Sequence[str], mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The ranks that share every coordinate with this one but those on `axes`, as one process
    group (None if that is this rank alone). For one axis it is the mesh's own group; for several
    (the data-parallel `dp` and the expert `ep` of `mesh dp=2, ep=2, tp=2`: {0,2,4,6} and
    {1,3,5,7}) it is made once per mesh, by every rank at its first ask (a collective of the
    whole world): every rank asks for the same groups in the same order, as every rank binds the
    same program.
    """
    axes = [a for a in axes if layout.size(a) > 1]
    if not axes:
        return None
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    made = mesh.__dict__.setdefault("_meshplan_groups", {})
    key = GROUP.join(axes)
    if key not in made:
        partition: dict[tuple[int, ...], list[int]] = {}
        for rank in range(layout.world_size):
            coords = layout.coords(rank)
            partition.setdefault(tuple(c for a, c in coords.items() if a not in axes), []).append(rank)
        made[key], _ = dist.new_subgroups_by_enumeration(
            list(partition.values()), timeout=_world_timeout(mesh)
        )
    return made[key]


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup | None:
    """The process group of an axis or of a group of axes (`dp x tp`: `group_over`'s, None where
    that is this rank alone)."""
    if GROUP not in axis:
        return mesh.get_group(axis)
    layout = MeshLayout(tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape))
    return group_over(layout, axes_of(axis), mesh)


def _world_timeout(mesh: DeviceMesh):
    """The world group's timeout (`--timeout`), or None (torch's default) where it cannot be read."""
    world = dist.group.WORLD
    try:
        return world._get_backend(torch.device(mesh.device_type)).options._timeout if world else None
    except (AttributeError, RuntimeError):
        return None


def _inherit_timeout(mesh: DeviceMesh) -> None:
    """Give every axis group the world group's timeout (best effort: private torch APIs, guarded)."""
    world = dist.group.WORLD
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if world is None or set_timeout is None:
        return
    try:
        timeout = world._get_backend(torch.device(mesh.device_type)).options._timeout
    except (AttributeError, RuntimeError):
        return
    for name in mesh.mesh_dim_names or ():
        group = mesh.get_group(name)
        if group is not world:
            set_timeout(timeout, group)
