"""How a parameter is cut over the mesh axes that shard it, and the two directions between a
whole tensor and a rank's piece of it: the one cutting rule that rank programs
(`compiler.compile`), checkpoints and exports all use.

    cut = Cut(dim=0, size=511)                       # a vocabulary of 511 rows over 2 ranks
    shard_of(full, cut, rank=1, n=2)                 # rows 256..510 and one zero row: (256, H)
    unshard(local, cut, tp_group)                    # all-gathered, padding dropped: (511, H)

A parameter may be cut over several axes (an expert's matrix: experts over `ep`, columns over
`tp`): its `Sharding` entry lists one `AxisCut` per axis, in the order the cuts are applied;
they are undone in the reverse order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import all_gather


class Cut(NamedTuple):
    """How a parameter is cut over one mesh axis: along `dim`, each rank holding its chunk of
    every block (`()` is one block). `size` is the dim's global size when it does not divide by
    the axis (a vocabulary of 511 over 2 ranks): chunks are ceil(size / n) long, the last ones
    zero-padded; 0 when it divides."""

    dim: int
    blocks: tuple[int, ...] = ()
    size: int = 0


class AxisCut(NamedTuple):
    axis: str  # the mesh axis, by name
    cut: Cut


Sharding = dict[str, tuple[AxisCut, ...]]  # parameter name -> its cuts, in the order applied


def unshard(local: Tensor, cut: Cut, group: dist.ProcessGroup) -> Tensor:
    """All-gather along the cut's dim; a blocked shard [q_r, k_r, v_r] is gathered block by block,
    a padded one loses its padding."""
    n = dist.get_world_size(group)
    if not cut.blocks:
        whole = all_gather(local, cut.dim, group)
        return whole.narrow(cut.dim, 0, cut.size) if cut.size else whole
    pieces = local.split([b // n for b in cut.blocks], cut.dim)  # this rank's chunk of each block
    return torch.cat([all_gather(piece.contiguous(), cut.dim, group) for piece in pieces], cut.dim)


def shard_of(full: Tensor, cut: Cut, rank: int, n: int) -> Tensor:
    """This rank's piece of a full tensor cut over `n` ranks (its chunk of each block)."""
    if cut.size:  # chunks of ceil(size / n), the last ones zero-padded
        chunk = -(-cut.size // n)
        start = min(rank * chunk, cut.size)
        mine = full.narrow(cut.dim, start, min(chunk, cut.size - start))
        pad = [0, 0] * (full.dim() - 1 - cut.dim) + [0, chunk - mine.shape[cut.dim]]
        return torch.nn.functional.pad(mine, pad)
    pieces = full.split(list(cut.blocks), cut.dim) if cut.blocks else (full,)
    return torch.cat([piece.chunk(n, cut.dim)[rank] for piece in pieces], cut.dim)


def full_shape(local: Sequence[int], cut: Cut, n: int) -> tuple[int, ...]:
    """The shape of the whole tensor whose piece on one of `n` ranks has shape `local`."""
    shape = list(local)
    shape[cut.dim] = cut.size or shape[cut.dim] * n
    return tuple(shape)
