"""How a tensor is laid out over one mesh axis, named as `torch.distributed.tensor` names it.

Replicate()   every rank holds the whole tensor
Shard(dim)    rank r holds the r-th of `size` equal chunks along `dim`
Shard(dim, replicas=m)  rank r holds chunk r // m of size / m: each chunk on m neighbouring
              ranks (key/value heads under GQA when the tensor-parallel size exceeds them)
Partial()     every rank holds a summand; the tensor is their sum
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int
    blocks: tuple[int, ...] = ()  # global sizes of the blocks along `dim`; () is one block
    replicas: int = 1  # neighbouring ranks holding the same chunk

    def __str__(self) -> str:
        extra = (f", blocks={self.blocks}" if self.blocks else "") + (
            f", replicas={self.replicas}" if self.replicas > 1 else ""
        )
        return f"Shard({self.dim}{extra})"

    def at(self, dim: int) -> Shard:
        """The same layout on another dim (a transpose, view or unsqueeze moved it)."""
        return Shard(dim, self.blocks, self.replicas)


@dataclass(frozen=True, slots=True)
class Partial:
    def __str__(self) -> str:
        return "Partial()"


Placement: TypeAlias = Replicate | Shard | Partial
REPLICATE = Replicate()
PARTIAL = Partial()
