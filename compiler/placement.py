"""How a tensor is laid out over one mesh axis, named as `torch.distributed.tensor` names it.

Replicate()   every rank holds the whole tensor
Shard(dim)    rank r holds the r-th of `size` equal chunks along `dim`
Shard(dim, replicas=m)  rank r holds chunk r // m of size / m: each chunk on m neighbouring
              ranks (key/value heads under GQA when the tensor-parallel size exceeds them)
Shard(dim, padded=V)    `dim` has V entries, which do not divide: each rank holds ceil(V / size),
              the last chunks zero-padded (a vocabulary not divisible by the axis)
Partial()     every rank holds a summand; the tensor is their sum

Over a context axis in the load-balanced causal layout (`TensorParallelSpec.balanced`: the
axis's collectives are built `balanced`), Shard(dim) holds two chunks of 2 x size: rank r
chunks r and 2 size - 1 - r, in that order (size 2, T = 8: rank 0 positions 0 1 6 7, rank 1
2 3 4 5). The layout is the axis's, so a placement does not repeat it.
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
    padded: int = 0  # the dim's true global size when its chunks are zero-padded to divide; 0 if even

    def __str__(self) -> str:
        extra = (
            (f", blocks={self.blocks}" if self.blocks else "")
            + (f", replicas={self.replicas}" if self.replicas > 1 else "")
            + (f", padded={self.padded}" if self.padded else "")
        )
        return f"Shard({self.dim}{extra})"

    def chunk(self, size: int, n: int) -> int:
        """Each rank's length of the sharded dim, `size` long globally, over `n` ranks."""
        return -(-size // (n // self.replicas))  # rounded up: a padded shard's chunk holds its padding

    def at(self, dim: int) -> Shard:
        """The same layout on another dim (a transpose, view or unsqueeze moved it)."""
        return Shard(dim, self.blocks, self.replicas, self.padded)


@dataclass(frozen=True, slots=True)
class Partial:
    def __str__(self) -> str:
        return "Partial()"


Placement: TypeAlias = Replicate | Shard | Partial
REPLICATE = Replicate()
PARTIAL = Partial()
