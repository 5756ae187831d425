"""A tensor as one rank holds it, in the whole tensor's coordinates: the boxes of it this rank
has and a view of each box's data. What checkpoints write and read (`runtime/checkpoint.py`),
so that each rank saves only its own shards and a load reshards to any layout.

    pieces = Pieces.of_local(local, cuts)          # a tensor-parallel shard: its box(es) of the whole
    pieces = Pieces.of_range(data, 4096, shape, cuts)   # a ZeRO shard's elements [4096, 4096 + len)
                                                   # of the flattened (tensor-parallel) shard

`cuts` are `(Cut, rank, n)` in the order the cuts were applied (`Axes.placed`). A box is a
rectangle of the whole tensor (offsets and sizes per dim): a plain shard is one box, a blocked
one (fused q/k/v) one box per block, a padded one (a vocabulary of 511 over 2 ranks) loses its
padding, and a contiguous run of a flattened tensor is at most 2·dims − 1 boxes (a partial row,
full rows, a partial row). Every box's data is a view of this rank's memory, never a copy:
`torch.distributed.checkpoint` writes from them and loads into them in place.

`Pieces` speaks DCP's protocol for tensors that are not whole (what DTensor implements:
`__create_write_items__`, `__create_chunk_list__`, `size()`); `SavePlanner`/`LoadPlanner`
below look a box up by its offsets. DCP itself dedups boxes several ranks hold (replicas over
data parallelism, tied weights of two pipeline stages), checks that the boxes of all ranks
cover each tensor exactly once, and reads each box a load needs from the overlapping saved
boxes, whatever layout wrote them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .shards import Cut, full_shape

Placed = tuple[Cut, int, int]  # a cut over one axis, this rank's place on that axis, the axis's size


class Box(NamedTuple):
    offsets: tuple[int, ...]  # in the whole tensor
    data: Tensor  # a view of this rank's memory; its shape is the box's sizes


class Pieces:
    """The boxes of one whole tensor (of `size` and `dtype`) this rank holds."""

    def __init__(self, size: Sequence[int], dtype: torch.dtype, boxes: list[Box]) -> None:
        self._size = torch.Size(size)
        self.dtype = dtype
        self.boxes = {b.offsets: b.data for b in boxes}

    @classmethod
    def of_local(cls, local: Tensor, cuts: Sequence[Placed]) -> Pieces:
        """This rank's tensor-parallel shard `local` (the whole tensor when `cuts` is empty)."""
        box = Box((0,) * local.dim(), local)
        return cls._placed([box], tuple(local.shape), local.dtype, cuts)

    @classmethod
    def of_range(cls, data: Tensor, start: int, shape: Sequence[int], cuts: Sequence[Placed]) -> Pieces:
        """Elements [start, start + len(data)) of a shard of `shape` flattened, held in the 1-D `data`."""
        boxes = []
        for offsets, sizes in _range_boxes(tuple(shape), start, start + data.numel()):
            first = _ravel(offsets, shape) - start
            boxes.append(Box(offsets, data[first : first + math.prod(sizes)].view(sizes)))
        return cls._placed(boxes, tuple(shape), data.dtype, cuts)

    @classmethod
    def _placed(
        cls, boxes: list[Box], shape: tuple[int, ...], dtype: torch.dtype, cuts: Sequence[Placed]
    ) -> Pieces:
        """Boxes of a shard of `shape`, moved into the whole tensor by undoing `cuts`, last first."""
        for cut, rank, n in reversed(cuts):
            boxes = [moved for box in boxes for moved in _undo(box, shape, cut, rank, n)]
            shape = full_shape(shape, cut, n)
        return cls(shape, dtype, boxes)

    def size(self) -> torch.Size:
        """The whole tensor's shape (DCP compares it with the saved one)."""
        return self._size

    def box(self, offsets: Sequence[int]) -> Tensor:
        return self.boxes[tuple(offsets)]

    # torch.distributed.checkpoint's protocol (as DTensor's)

    def __create_write_items__(self, fqn: str, _: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), data.shape),
                    properties=TensorProperties.create_from_tensor(data),
                    size=self._size,
                ),
            )
            for offsets, data in self.boxes.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), d.shape) for o, d in self.boxes.items()]


class SavePlanner(DefaultSavePlanner):
    """DCP's planner, which finds a box of a `Pieces` by its offsets."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if isinstance(value, Pieces):
            return _exact(value.box(index.offset or ()))
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, which loads into a box of a `Pieces` found by its offsets."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's without its first step, which gives meta tensors memory and
        # replaces every value it does not know (a `Pieces`) with None, in the caller's dict
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, Pieces):
            return value.box(index.offset or ())
        return super().lookup_tensor(index)


def _exact(t: Tensor) -> Tensor:
    """`t` as a tensor whose storage is exactly its bytes, sharing its memory.

    DCP's file writer clones a tensor that views a larger storage and keeps every tensor of a
    file until the file is closed: the boxes of a ZeRO shard (views of one flat buffer) would
    be a second copy of this rank's whole training state while saving. A contiguous CPU box is
    wrapped in place instead; anything else (a strided box, device memory) is left to DCP."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes:
        return t
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()  # exactly t's bytes, shared
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape) if raw.size else t


def whole_size(shape: Sequence[int], cuts: Sequence[Placed]) -> torch.Size:
    """The whole tensor's shape, of which this rank's piece placed by `cuts` has `shape`."""
    out = tuple(shape)
    for cut, _, n in reversed(cuts):
        out = full_shape(out, cut, n)
    return torch.Size(out)


def _undo(box: Box, shape: tuple[int, ...], cut: Cut, rank: int, n: int) -> list[Box]:
    """`box` of this rank's piece (of `shape`) cut by `cut`, in the coordinates before the cut."""
    d, offset, size = cut.dim, box.offsets[cut.dim], box.data.shape[cut.dim]
    if not cut.blocks:
        start = rank * shape[d] + offset  # shape[d]: every rank's chunk (padded ones too)
        if cut.size:  # the padding is nobody's
            size = min(size, cut.size - start)
            if size <= 0:
                return []
        return [Box(_at(box.offsets, d, start), box.data.narrow(d, 0, size))]
    out = []
    mine = whole = 0  # where block j starts in this rank's piece and in the whole
    for block in cut.blocks:
        chunk = block // n
        lo, hi = max(offset, mine), min(offset + size, mine + chunk)
        if lo < hi:
            at = whole + rank * chunk + (lo - mine)
            out.append(Box(_at(box.offsets, d, at), box.data.narrow(d, lo - offset, hi - lo)))
        mine, whole = mine + chunk, whole + block
    return out


def _at(offsets: tuple[int, ...], dim: int, value: int) -> tuple[int, ...]:
    return (*offsets[:dim], value, *offsets[dim + 1 :])


def _range_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the boxes that make up elements [start, stop) of a row-major `shape`."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first, r0 = divmod(start, row)
    last, r1 = divmod(stop, row)
    if first == last:  # inside one row
        return [((first, *o), (1, *s)) for o, s in _range_boxes(shape[1:], r0, r1)]
    out = []
    if r0:  # the end of a row
        out += [((first, *o), (1, *s)) for o, s in _range_boxes(shape[1:], r0, row)]
        first += 1
    if last > first:  # full rows
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    if r1:  # the start of a row
        out += [((last, *o), (1, *s)) for o, s in _range_boxes(shape[1:], 0, r1)]
    return out


def _ravel(offsets: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for o, n in zip(offsets, shape, strict=True):
        index = index * n + o
    return index
