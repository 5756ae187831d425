"""How a tensor is laid out over one mesh axis, named as `torch.distributed.tensor` names it.

Replicate()   every rank holds the whole tensor
Shard(dim)    rank r holds the r-th of `size` equal chunks along `dim`
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

    def __str__(self) -> str:
        return f"Shard({self.dim})" if not self.blocks else f"Shard({self.dim}, blocks={self.blocks})"


@dataclass(frozen=True, slots=True)
class Partial:
    def __str__(self) -> str:
        return "Partial()"


Placement: TypeAlias = Replicate | Shard | Partial
REPLICATE = Replicate()
PARTIAL = Partial()
