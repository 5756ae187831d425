"""Where a rank's piece of a parameter lies in the whole tensor (`runtime/pieces.py`): the boxes
of every rank cover the whole exactly once, each box holds the whole tensor's values at its
offsets, and DCP reads any layout's boxes from any other's (one process, a real checkpoint)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.runtime.pieces import Box, LoadPlanner, Pieces, SavePlanner
from meshplan.runtime.shards import Cut, shard_of


@st.composite
def cut_tensors(draw) -> tuple[torch.Tensor, Cut, int]:
    """A whole tensor, a cut of it over n ranks (plain, blocked or padded), and n."""
    n = draw(st.sampled_from([1, 2, 3, 4]))
    dims = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(dims)]
    dim = draw(st.integers(0, dims - 1))
    kind = draw(st.sampled_from(["plain", "blocks", "padded"]))
    if kind == "blocks":
        blocks = tuple(n * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
        shape[dim] = sum(blocks)
        cut = Cut(dim, blocks)
    elif kind == "padded":
        shape[dim] = draw(st.integers(1, 4 * n))
        cut = Cut(dim, size=shape[dim])
    else:
        shape[dim] *= n
        cut = Cut(dim)
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape), cut, n


def coverage(full: torch.Tensor, pieces: list[Pieces]) -> torch.Tensor:
    """How often each element of `full` is in a box, checking each box's values on the way."""
    seen = torch.zeros(full.shape, dtype=torch.int64)
    for p in pieces:
        assert p.size() == full.shape
        for offsets, data in p.boxes.items():
            where = tuple(slice(o, o + s) for o, s in zip(offsets, data.shape, strict=True))
            assert torch.equal(data, full[where]), (offsets, data.shape)
            seen[where] += 1
    return seen


@settings(max_examples=200, deadline=None)
@given(cut_tensors())
def test_the_ranks_pieces_of_a_cut_tensor_cover_it_once(case) -> None:
    full, cut, n = case
    pieces = [Pieces.of_local(shard_of(full, cut, r, n), [(cut, r, n)]) for r in range(n)]
    assert torch.equal(coverage(full, pieces), torch.ones_like(full, dtype=torch.int64))


@settings(max_examples=200, deadline=None)
@given(cut_tensors(), st.integers(1, 4))
def test_zero_ranges_of_tensor_parallel_shards_cover_the_tensor_once(case, zero: int) -> None:
    """ZeRO's shards of each rank's (flattened, tensor-parallel) piece, as contiguous ranges."""
    full, cut, n = case
    pieces = []
    for r in range(n):
        local = shard_of(full, cut, r, n)
        flat, chunk = local.reshape(-1), -(-local.numel() // zero)
        for z in range(zero):
            start, stop = min(z * chunk, flat.numel()), min((z + 1) * chunk, flat.numel())
            pieces.append(Pieces.of_range(flat[start:stop], start, local.shape, [(cut, r, n)]))
    assert torch.equal(coverage(full, pieces), torch.ones_like(full, dtype=torch.int64))


def test_a_range_is_at_most_2_dims_minus_1_boxes_and_views_its_data() -> None:
    data = torch.arange(100.0)
    pieces = Pieces.of_range(data[7:93], 7, (4, 5, 5), [])
    assert len(pieces.boxes) <= 5
    for box in pieces.boxes.values():
        assert box.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()  # no copy


@pytest.mark.parametrize("saved", ["columns", "whole"])
@pytest.mark.parametrize("layout", ["rows", "zero"])
def test_a_checkpoint_saved_in_one_layout_loads_in_another(tmp_path, saved: str, layout: str) -> None:
    """Saved as two column shards with blocks (fused q/k/v over tp=2), or whole (as meshplan
    wrote every tensor before checkpoints were sharded); loaded as row shards over three
    ranks, or as ZeRO ranges of the flattened whole: DCP reads the overlaps."""
    full = torch.randn(6, 8)
    cut = Cut(1, (4, 4))
    pieces = [Pieces.of_local(shard_of(full, cut, r, 2), [(cut, r, 2)]) for r in range(2)]
    both = Pieces(full.shape, full.dtype, [Box(o, d) for p in pieces for o, d in p.boxes.items()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        if saved == "columns":
            dcp.save({"w": both}, checkpoint_id=str(tmp_path), planner=SavePlanner(), no_dist=True)
        else:
            dcp.save({"w": full.clone()}, checkpoint_id=str(tmp_path), no_dist=True)
        if layout == "rows":
            rows = Cut(0)
            out = [torch.zeros(2, 8) for _ in range(3)]
            for r in range(3):
                target = {"w": Pieces.of_local(out[r], [(rows, r, 3)])}
                dcp.load(target, checkpoint_id=str(tmp_path), planner=LoadPlanner(), no_dist=True)
            assert torch.equal(torch.cat(out), full)
        else:
            flat = torch.zeros(48)
            for start, stop in ((0, 17), (17, 34), (34, 48)):
                target = {"w": Pieces.of_range(flat[start:stop], start, (6, 8), [])}
                dcp.load(target, checkpoint_id=str(tmp_path), planner=LoadPlanner(), no_dist=True)
            assert torch.equal(flat.view(6, 8), full)
