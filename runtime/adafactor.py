"""Adafactor over parameters that ranks hold in pieces: a tensor-parallel slice, a ZeRO shard's
element range, or both. Each step is torch.optim.Adafactor's step of the whole parameter.

Adafactor's step reads three things of a whole parameter that no piece has alone (for a matrix,
its last two dims; leading dims, an experts stack's, are a batch of matrices):

    row_var, col_var   the mean of g² over each row and each column, decayed
    alpha              the parameter's RMS (times the relative step size)
    denom              the update's RMS

so each is a sum of per-element terms over the whole parameter, and a sum over pieces is a sum
over ranks. Every rank adds its pieces' terms into tensors of the whole parameter's rows and
columns (zeros where it holds nothing) and all-reduces them over the groups whose ranks hold the
other pieces (the ZeRO group, the tensor-parallel and experts axes that cut the parameter):

    round 1   row sums of g², column sums of g², sum of p²       (rows + cols + 1 per matrix)
    round 2   sum of update²                                     (1 per parameter)

all parameters of one set of groups in one buffer, one all-reduce per group and round. So
`row_var` and `col_var` are the whole parameter's, the same on every rank (replicated state, a
checkpoint saves them once, whole, as torch's Adafactor does); a vector's `variance` is
elementwise and kept per piece, like AdamW's moments. Every rank takes part in every round for
every parameter, holding elements of it or not, so the buffers line up; a parameter without a
gradient this step (on every rank alike) is left as it was; a stepped tensor without one takes no
part (the same on every rank: `ShardedOptimizer` steps flats from disk one at a time).

    optimizer = SplitAdafactor(groups, pieces, lr=1e-2, beta2_decay=-0.8, eps=(2**-23, 1e-3), d=1.0)

`pieces[id(t)]` are the parameters a stepped tensor `t` holds pieces of (`Piece`): one covering
all of a tensor-parallel slice (`grad_sync.WholeParams` with a split rule), or one per parameter of
a ZeRO flat's shard (`zero_optim.ShardedOptimizer`). Where nothing is split, `optimizers.build`
uses torch.optim.Adafactor itself; this is that step, summed differently (float64 `verify`
holds the two to rounding, `tests/runtime/test_adafactor.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import watchdog

# a tensor shaped like a piece -> its boxes of the whole parameter: (offsets there, a view of the tensor)
Boxes = Callable[[Tensor], list[tuple[tuple[int, ...], Tensor]]]


@dataclass(frozen=True)
class Piece:
    """Parameter `name`'s elements in a stepped tensor: `at` (a slice of the tensor flattened;
    None: the whole tensor), placed in the whole parameter of `shape` by `boxes`. `groups`: the
    mesh axes whose ranks hold its other pieces, with their process groups (each reduced over
    in turn)."""

    name: str
    shape: torch.Size
    at: slice | None
    boxes: Boxes
    groups: tuple[tuple[str, dist.ProcessGroup], ...] = ()

    @property
    def factored(self) -> bool:
        return len(self.shape) >= 2

    def of(self, t: Tensor) -> Tensor:
        """This piece's elements of `t` (a stepped tensor, or one shaped like it)."""
        return t if self.at is None else t.reshape(-1)[self.at]


class SplitAdafactor(torch.optim.Optimizer):
    """torch.optim.Adafactor's arithmetic over `Piece`s (the module docstring). Its state, by
    piece (`factors`): "step", and "row_var" and "col_var" (whole, replicated) for a matrix, or
    "variance" (this piece's elements) for a vector. Where a stepped tensor is one whole piece,
    that dict is `state[t]` itself, in torch's layout (what DCP's state-dict API saves and
    loads). Names in `skip` are left untouched by the next step (`ShardedOptimizer`: no
    gradient anywhere this step)."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        pieces: Mapping[int, Sequence[Piece]],
        *,
        lr: float,
        beta2_decay: float,
        eps: tuple[float, float],
        d: float,
    ) -> None:
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": eps, "d": d, "weight_decay": 0.0}
        super().__init__(groups, defaults)
        self.pieces = pieces
        self.skip: frozenset[str] = frozenset()
        self._by_name: dict[str, dict[str, Tensor]] = {}
        for t in (t for group in self.param_groups for t in group["params"]):
            own = self.pieces[id(t)]
            for piece in own:
                state = _initial(piece, t)
                if len(own) == 1 and piece.at is None:
                    self.state[t] = state
                else:  # one dict per piece; `state[t]` names them all (what `memory()` counts)
                    self._by_name[piece.name] = state
                    self.state[t].update({f"{piece.name}/{k}": v for k, v in state.items()})

    def factors(self, t: Tensor, piece: Piece) -> dict[str, Tensor]:
        """The state of `piece` of stepped tensor `t`, looked up now (a load through DCP's
        state-dict API replaces `state[t]`)."""
        return self._by_name[piece.name] if piece.name in self._by_name else self.state[t]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [
            _Work(t, piece, group, self.factors(t, piece), live=piece.name not in self.skip)
            for group in self.param_groups
            for t in group["params"]
            if t.grad is not None  # (the same on every rank of its groups)
            for piece in self.pieces[id(t)]
        ]
        _reduce(work, _Work.first_sums, "Adafactor's row and column sums")
        for w in work:
            w.moments()
        _reduce(work, _Work.update_sums, "Adafactor's update norm")
        for w in work:
            w.apply()
        self.skip = frozenset()
        return loss


class _Work:
    """One piece's step: its sums (`first_sums`, then `update_sums`), which the caller sums
    over the piece's groups into `sums`, then its moments and updates (`moments`), then the
    step itself (`apply`)."""

    def __init__(
        self, t: Tensor, piece: Piece, group: dict[str, Any], state: dict[str, Tensor], *, live: bool
    ) -> None:
        self.piece, self.group, self.state = piece, group, state
        assert t.grad is not None
        self.live = live
        self.value, self.grad = piece.of(t), piece.of(t.grad)
        self.sums = self.grad.new_zeros(0)  # after a round: what the groups summed
        self.alpha = 0.0
        self.updates: list[tuple[Tensor, Tensor]] = []  # (a box of the value, its update)

    def first_sums(self) -> Tensor:
        """The row sums and the column sums of g² (a matrix's, flattened), then the sum of p²."""
        p, g = self.piece, self.grad
        parts = []
        if p.factored:
            rows, cols = g.new_zeros((*p.shape[:-1], 1)), g.new_zeros((*p.shape[:-2], 1, p.shape[-1]))
            for offsets, box in p.boxes(g):
                square = box.square()
                _at(rows, offsets, box.shape).add_(square.sum(-1, keepdim=True))
                _at(cols, offsets, box.shape).add_(square.sum(-2, keepdim=True))
            parts += [rows.reshape(-1), cols.reshape(-1)]
        squares = [box.square().sum().reshape(1) for _, box in p.boxes(self.value)]
        return torch.cat([*parts, torch.stack(squares).sum().reshape(1) if squares else g.new_zeros(1)])

    def moments(self) -> None:
        """torch's step up to the update: the step count, the relative step size `alpha` (from
        the whole parameter's RMS, before weight decay), the weight decay, the second moments
        (from the whole parameter's row and column sums) and each box's update."""
        if not self.live:
            return
        p, state, sums = self.piece, self.state, self.sums
        eps1, eps2 = self.group["eps"]
        lr, step = float(self.group["lr"]), float(state["step"].add_(1))
        weight = step ** self.group["beta2_decay"]
        rms = math.sqrt(float(sums[-1]) / math.prod(p.shape))
        self.alpha = max(eps2, rms) * min(lr, 1 / math.sqrt(step))
        values = dict(p.boxes(self.value))
        if self.group["weight_decay"]:
            for box in values.values():
                box.mul_(1 - lr * self.group["weight_decay"])
        if p.factored:
            rows, cols = state["row_var"], state["col_var"]
            rows.lerp_(sums[: rows.numel()].view(rows.shape) / p.shape[-1], weight)
            cols.lerp_(sums[rows.numel() : -1].view(cols.shape) / p.shape[-2], weight)
            mean_rows = rows.mean(dim=-2, keepdim=True).clamp_(min=eps1)
            for offsets, g in p.boxes(self.grad):
                estimate = _at(rows, offsets, g.shape) * _at(cols, offsets, g.shape)
                estimate.div_(_at(mean_rows, offsets, g.shape))
                self.updates.append((values[offsets], estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)))
        else:
            variances = dict(p.boxes(state["variance"]))
            for offsets, g in p.boxes(self.grad):
                variance = variances[offsets].lerp_(g.square(), weight)
                self.updates.append((values[offsets], variance.clamp(min=eps1 * eps1).rsqrt_().mul_(g)))

    def update_sums(self) -> Tensor:
        """The sum of the update's squares (zero where this rank holds none of the parameter)."""
        squares = [u.square().sum().reshape(1) for _, u in self.updates]
        return torch.stack(squares).sum().reshape(1) if squares else self.grad.new_zeros(1)

    def apply(self) -> None:
        """The update, scaled by alpha over the whole update's RMS (at least 1) over `d`."""
        if not self.updates:
            return
        rms = math.sqrt(float(self.sums[0]) / math.prod(self.piece.shape))
        denom = max(1.0, rms / self.group["d"])
        for box, update in self.updates:
            box.add_(update, alpha=-self.alpha / denom)


def _reduce(work: Sequence[_Work], sums: Callable[[_Work], Tensor], what: str) -> None:
    """Each piece's `sums(w)`, summed over its groups, into `w.sums`: the pieces of one set of
    groups in one float64 buffer (in the same order on every rank), one all-reduce per group."""
    by_groups: dict[tuple[tuple[str, dist.ProcessGroup], ...], list[tuple[_Work, Tensor]]] = {}
    for w in work:
        by_groups.setdefault(w.piece.groups, []).append((w, sums(w)))
    for groups, items in by_groups.items():
        if not groups:
            for w, s in items:
                w.sums = s
            continue
        # on the device the group's backend reduces on (a module placed `on cpu` aside)
        device = next((s.device for _, s in items if s.device.type != "cpu"), torch.device("cpu"))
        flat = torch.cat([s.to(device, torch.float64) for _, s in items])
        for axis, group in groups:
            watchdog.note("all_reduce", axis, what, group)
            dist.all_reduce(flat, group=group)
        for (w, s), summed in zip(items, flat.split([s.numel() for _, s in items]), strict=True):
            w.sums = summed.to(s.dtype)


def _at(t: Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> Tensor:
    """The box of `t` at `offsets` of `sizes` (coordinates of the whole parameter); a dim where
    `t` has size 1 (a row or column moment's reduced dim) is taken whole."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if t.shape[dim] != 1:
            t = t.narrow(dim, offset, size)
    return t


def _initial(piece: Piece, t: Tensor) -> dict[str, Tensor]:
    """torch.optim.Adafactor's state of `piece` (in stepped tensor `t`), made now: a float32
    step count on the CPU, and zeros in `t`'s dtype."""
    step = torch.tensor(0.0)
    if not piece.factored:
        return {"step": step, "variance": torch.zeros_like(piece.of(t))}
    shape = piece.shape
    return {
        "step": step,
        "row_var": t.new_zeros((*shape[:-1], 1)),
        "col_var": t.new_zeros((*shape[:-2], 1, shape[-1])),
    }
