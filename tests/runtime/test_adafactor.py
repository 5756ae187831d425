"""`SplitAdafactor` is torch.optim.Adafactor's step, whatever pieces the ranks hold.

On one process, whole tensors, against torch.optim.Adafactor in float64. On four (dp=2 x tp=2),
each parameter cut over tp as a rule cuts it (rows, columns, an experts stack's leading dim, a
padded vocabulary, fused q/k/v blocks, or not at all), its tensor-parallel pieces then packed
into one flat and cut into element ranges over dp as ZeRO cuts it; every rank's pieces after
three steps are the same elements of torch's whole-tensor result. One rank holding no element
of a parameter still takes part in its sums.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from gloo_pool import spawn
from torch import Tensor

from meshplan.runtime.adafactor import Piece, SplitAdafactor
from meshplan.runtime.pieces import Pieces
from meshplan.runtime.shards import Cut, shard_of

ARGS = {"lr": 1e-2, "beta2_decay": -0.8, "eps": (2.0**-23, 1e-3), "d": 1.0}
# name -> (whole shape, the cut over tp or None, weight decay)
PARAMS = {
    "column": ((6, 5), Cut(0), 0.1),
    "row": ((4, 6), Cut(1), 0.1),
    "experts": ((4, 3, 5), Cut(0), 0.1),
    "vocab": ((7, 4), Cut(0, size=7), 0.1),  # 8 rows over 2 ranks, one of padding
    "qkv": ((12, 3), Cut(0, blocks=(4, 4, 4)), 0.1),
    "bias": ((6,), Cut(0), 0.0),
    "norm": ((5,), None, 0.0),
    "scale": ((), None, 0.0),
}
STEPS = 3


def _whole(seed: int) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Each parameter's whole value and a gradient of it per step, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    values = {n: torch.randn(shape, dtype=torch.float64, generator=g) for n, (shape, _, _) in PARAMS.items()}
    grads = [
        {n: torch.randn(shape, dtype=torch.float64, generator=g) for n, (shape, _, _) in PARAMS.items()}
        for _ in range(STEPS)
    ]
    return values, grads


def _torch(values: dict[str, Tensor], grads: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    ts = {n: v.clone() for n, v in values.items()}
    groups = [
        {"params": [ts[n] for n in PARAMS if PARAMS[n][2] == wd], "weight_decay": wd} for wd in (0.1, 0.0)
    ]
    optimizer = torch.optim.Adafactor(groups, lr=ARGS["lr"], eps=ARGS["eps"])
    for step in grads:
        for n, t in ts.items():
            t.grad = step[n].clone()
        optimizer.step()
    return ts


def test_whole_tensors_step_as_torch_adafactor() -> None:
    values, grads = _whole(0)
    expected = _torch(values, grads)
    ts = {n: v.clone() for n, v in values.items()}
    pieces = {id(t): [Piece(n, t.shape, None, lambda x: [((0,) * x.dim(), x)])] for n, t in ts.items()}
    groups = [
        {"params": [ts[n] for n in PARAMS if PARAMS[n][2] == wd], "weight_decay": wd} for wd in (0.1, 0.0)
    ]
    optimizer = SplitAdafactor(groups, pieces, **ARGS)
    for step in grads:
        for n, t in ts.items():
            t.grad = step[n].clone()
        optimizer.step()
    for n, t in ts.items():
        torch.testing.assert_close(t, expected[n], rtol=1e-13, atol=1e-15, msg=n)
    # torch's state layout, so DCP's state-dict API and torch's own checkpoints agree
    torch_state = torch.optim.Adafactor([values["column"].clone().requires_grad_()]).state_dict()
    assert set(optimizer.state[ts["column"]]) == {"step", "row_var", "col_var"}
    assert set(optimizer.state[ts["bias"]]) == {"step", "variance"}
    assert torch_state["param_groups"]  # the same optimizer interface: LR schedulers, param groups


def _split_worker(rank: int, world_size: int) -> dict[str, list[tuple[tuple[int, ...], Tensor]]]:
    dp_rank, tp_rank = divmod(rank, 2)
    groups = {
        "dp": [dist.new_group([t, t + 2]) for t in range(2)][tp_rank],
        "tp": [dist.new_group([2 * d, 2 * d + 1]) for d in range(2)][dp_rank],
    }
    values, grads = _whole(0)
    local = {
        n: shard_of(values[n], cut, tp_rank, 2) if cut else values[n].clone()
        for n, (_, cut, _) in PARAMS.items()
    }
    cuts = {n: ((cut, tp_rank, 2),) if cut else () for n, (_, cut, _) in PARAMS.items()}
    # ZeRO: every local piece flattened into one flat (padded to 2 ranks), this rank's half of it
    sizes = [t.numel() for t in local.values()]
    shard_numel = math.ceil(sum(sizes) / 2)
    flat = torch.cat([t.reshape(-1) for t in local.values()] + [torch.zeros(2 * shard_numel - sum(sizes))])
    shard = flat[dp_rank * shard_numel : (dp_rank + 1) * shard_numel].clone().double()
    pieces, offset, lo = [], 0, dp_rank * shard_numel
    for (n, t), size in zip(local.items(), sizes, strict=True):
        start, end = max(offset, lo), min(offset + size, lo + shard_numel)
        at = slice(start - lo, end - lo) if start < end else slice(0, 0)
        first, shape = (start - offset if start < end else 0), t.shape

        def boxes(x: Tensor, first=first, shape=shape, n=n) -> list[tuple[tuple[int, ...], Tensor]]:
            return list(Pieces.of_range(x, first, shape, cuts[n]).boxes.items())

        reduce = (("dp", groups["dp"]), ("tp", groups["tp"])) if cuts[n] else (("dp", groups["dp"]),)
        pieces.append(Piece(n, values[n].shape, at, boxes, reduce))
        offset += size
    # ZeRO keeps decayed and undecayed params in flats of their own: here one flat, stepped once
    # per decay class with that class's pieces (the others' elements are not read)
    results = {}
    for wd in (0.1, 0.0):
        mine = shard.clone()
        chosen = [p for p in pieces if PARAMS[p.name][2] == wd]
        optimizer = SplitAdafactor([{"params": [mine], "weight_decay": wd}], {id(mine): chosen}, **ARGS)
        for step in grads:
            g = torch.cat(
                [
                    shard_of(step[n], c, tp_rank, 2).reshape(-1) if c else step[n].reshape(-1)
                    for n, (_, c, _) in PARAMS.items()
                ]
                + [torch.zeros(2 * shard_numel - sum(sizes))]
            )
            mine.grad = g[dp_rank * shard_numel : (dp_rank + 1) * shard_numel].clone().double()
            optimizer.step()
        for p in chosen:
            results[p.name] = [(o, b.clone()) for o, b in p.boxes(p.of(mine))]
    return results


@pytest.mark.slow
def test_split_pieces_step_as_the_whole_parameter() -> None:
    values, grads = _whole(0)
    expected = _torch(values, grads)
    by_rank = spawn(_split_worker, 4, (), timeout_s=120)
    for name, whole in expected.items():
        covered = torch.zeros(whole.shape, dtype=torch.int64)
        for results in by_rank:
            for offsets, box in results[name]:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, box.shape, strict=True))
                torch.testing.assert_close(box, whole[index], rtol=1e-12, atol=1e-14, msg=name)
                covered[index] += 1
        # a cut parameter's every element on one rank of four; a whole one's on each tp rank
        assert (covered == (1 if PARAMS[name][1] else 2)).all(), name
