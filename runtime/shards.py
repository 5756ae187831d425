"""How a parameter is cut over the tensor axis, and the two directions between a whole tensor
and a rank's piece of it: the one cutting rule that rank programs (`compiler.compile`),
checkpoints and exports all use.

    cut = Cut(dim=0, size=511)                       # a vocabulary of 511 rows over 2 ranks
    shard_of(full, cut, rank=1, n=2)                 # rows 256..510 and one zero row: (256, H)
    unshard(local, cut, tp_group)                    # all-gathered, padding dropped: (511, H)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import all_gather


class Cut(NamedTuple):
    """How a parameter is cut over the tensor axis: along `dim`, each rank holding its chunk of
    every block (`()` is one block). `size` is the dim's global size when it does not divide by
    the axis (a vocabulary of 511 over 2 ranks): chunks are ceil(size / n) long, the last ones
    zero-padded; 0 when it divides."""

    dim: int
    blocks: tuple[int, ...] = ()
    size: int = 0


Sharding = dict[str, Cut]  # parameter name -> its cut over the tensor axis


def unshard(local: Tensor, cut: Cut, tp: dist.ProcessGroup) -> Tensor:
    """All-gather along the cut's dim; a blocked shard [q_r, k_r, v_r] is gathered block by block,
    a padded one loses its padding."""
    n = dist.get_world_size(tp)
    if not cut.blocks:
        whole = all_gather(local, cut.dim, tp)
        return whole.narrow(cut.dim, 0, cut.size) if cut.size else whole
    pieces = local.split([b // n for b in cut.blocks], cut.dim)  # this rank's chunk of each block
    return torch.cat([all_gather(piece.contiguous(), cut.dim, tp) for piece in pieces], cut.dim)


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


def full_shape(local: Tensor, cut: Cut, n: int) -> tuple[int, ...]:
    shape = list(local.shape)
    shape[cut.dim] = cut.size or shape[cut.dim] * n
    return tuple(shape)
