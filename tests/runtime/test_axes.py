"""`Axes`: process groups by axis name, and parameters cut over several axes at once.

On a 2 x 2 mesh of gloo processes, with the axes in either order: a weight cut over both axes
(rows over one, columns over the other, as an expert's matrix will be over `ep` and `tp`)
goes to its pieces and back, each piece placed in the whole tensor (where checkpoints write it), and the global gradient norm counts every piece once. Both orders
run in one spawn of four processes, each on its own mesh.
"""

from __future__ import annotations

import pytest
import torch
from gloo_pool import spawn
from torch import nn

from meshplan.runtime.axes import Axes
from meshplan.runtime.grad_sync import Local
from meshplan.runtime.mesh import MeshLayout, init_mesh
from meshplan.runtime.pieces import Pieces
from meshplan.runtime.shards import AxisCut, Cut, shard_of
from meshplan.runtime.train import global_grad_norm

WHOLE = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
CUTS = {"w": (AxisCut("rows", Cut(0)), AxisCut("cols", Cut(1, blocks=(2, 4))))}
ORDERS = [("rows", "cols"), ("cols", "rows")]


def worker(rank: int, world_size: int) -> dict[tuple[str, ...], dict]:
    return {names: one_order(rank, names) for names in ORDERS}


def one_order(rank: int, names: tuple[str, ...]) -> dict:
    layout = MeshLayout(names, (2, 2))
    mesh = init_mesh(layout)
    axes = Axes(groups={n: mesh.get_group(n) for n in names}, data=(), sharding=CUTS)
    coords = layout.coords(rank)
    local = WHOLE
    for axis, cut in CUTS["w"]:
        local = shard_of(local, cut, coords[axis], 2)
    rows = WHOLE.chunk(2, 0)[coords["rows"]]
    expected = torch.cat([block.chunk(2, 1)[coords["cols"]] for block in rows.split([2, 4], 1)], 1)
    pieces = Pieces.of_local(local, axes.placed("w"))  # where a checkpoint writes them
    in_place = [
        torch.equal(data, WHOLE[tuple(slice(o, o + n) for o, n in zip(at, data.shape, strict=True))])
        for at, data in pieces.boxes.items()
    ]

    model = nn.Module()
    model.w = nn.Parameter(local.clone())
    model.b = nn.Parameter(torch.ones(3))  # whole: the same on every rank
    model.w.grad, model.b.grad = local.clone(), torch.ones(3)
    norm = global_grad_norm(Local(model), axes, ["w", "b"])
    return {
        "piece": torch.equal(local, expected),
        "whole": torch.equal(axes.unshard("w", local), WHOLE),
        "pieces": (tuple(pieces.size()), sum(d.numel() for d in pieces.boxes.values()), all(in_place)),
        "sharded_over": axes.sharded_over("w"),
        "norm": float(norm),
        "sum": float(axes.sum_over(torch.tensor(1.0), names, "test")),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[str, ...], dict]]:
    return spawn(worker, 4, (), timeout_s=120)


@pytest.mark.parametrize("names", ORDERS)
def test_a_weight_cut_over_two_axes(results: list[dict], names: tuple[str, ...]) -> None:
    expected_norm = float((WHOLE.double().pow(2).sum() + 3).sqrt())
    for by_order in results:
        r = by_order[names]
        assert r["piece"] and r["whole"]
        assert r["pieces"] == ((8, 6), 12, True)
        assert r["sharded_over"] == ("rows", "cols")
        assert r["norm"] == pytest.approx(expected_norm, rel=1e-12)
        assert r["sum"] == 4.0


def test_an_axis_of_one_rank_has_no_group() -> None:
    axes = Axes(groups={}, data=("dp",), sharding=CUTS)
    assert axes.sharded_over("w") == ()
    assert axes.data_size == 1
    assert torch.equal(axes.unshard("w", WHOLE), WHOLE)
    assert axes.mean_over_data(torch.tensor(3.0), "loss") == 3.0
