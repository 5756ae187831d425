"""How far `meshplan verify`'s partitioned run is from the float64 reference, beside the
one-device yardstick's distance: the measures, their limits, and why (`cli/verify.py`'s
docstring says what each run is)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TENSOR_FACTOR = 4  # a single tensor may be this many times further off than the --tolerance ratio
FLOOR = 2.0**-23  # float32 epsilon: a distance below it is no distance
# without a float64 reference: relative differences a correct float32 program stays within
# after a few AdamW steps; a dropped reduction or a wrong shard is 1e-2 or more
FALLBACK = {"losses": 1e-5, "gradient norms": 1e-4, "weights (whole model)": 1e-3, "worst tensor": 1e-2}


@dataclass(frozen=True)
class Trajectory:
    """One training: the mean loss and gradient norm (before clipping) of each step, the final weights."""

    losses: list[float]
    grad_norms: list[float]
    weights: dict[str, Any]  # name -> full tensor, every name of the model's named_parameters


@dataclass(frozen=True)
class Measure:
    """How far the partitioned program (and the yardstick) are from the reference."""

    what: str
    partitioned: float
    yardstick: float | None  # None: no float64 reference, the yardstick is the reference
    limit: float  # the largest `partitioned` accepted

    @property
    def ok(self) -> bool:
        return self.partitioned <= self.limit


def relative(a, b, flip: float = 0.0) -> float:
    """||a - b|| / ||b|| (0 when both are 0). `flip` > 0: without the one element farthest off,
    if it is at most `flip` away (an Adam step that 16-bit rounding turned the other way)."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = float(b.norm())
    d = (a - b).flatten()
    if flip and d.numel() > 1:
        worst = int(d.abs().argmax())
        if abs(float(d[worst])) <= flip:
            d = torch.cat([d[:worst], d[worst + 1 :]])
    diff = float(d.norm())
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


def adam_flip(compute: str, lr: float, steps: int) -> float:
    """How far one element ends up when rounding turns its every Adam step the other way,
    2 lr x steps, under 16-bit compute (else 0). Adam moves an element about `lr` a step whatever
    its gradient's size, so an element whose true gradient is within bf16's rounding of zero
    (a bias that starts at zero) goes either way, one device or many: that element alone then
    holds most of its tensor's distance, in the yardstick as in the program, in whichever
    tensors rounding picks. A tensor's distance leaves out its one element farthest off when it
    is no farther than this; a wrong shard or sum moves every element, and losses, gradient
    norms and the whole model's weights keep every element."""
    return 2 * lr * steps if compute in ("bf16", "fp16") else 0.0


def measure(
    partitioned: Trajectory,
    reference: Trajectory,
    yardstick: Trajectory | None,
    tolerance: float,
    spread: Trajectory | None = None,
    flip: float = 0.0,
) -> list[Measure]:
    """Distances to the reference, with their limits (see the module docstring). `spread`: the
    yardstick trained from weights one rounding away, whose distance to the yardstick is a
    second sample of each tensor's rounding. `flip`: see `adam_flip`."""
    names = list(reference.weights)
    missing = [n for n in names if n not in partitioned.weights]
    if missing:
        raise RuntimeError(f"the partitioned program's weights lack {', '.join(missing[:3])}")

    def worst_step(run: Trajectory, key: str) -> float:
        return max(relative(x, r) for x, r in zip(getattr(run, key), getattr(reference, key), strict=True))

    def whole(run: Trajectory) -> float:
        diff = sum(
            relative(run.weights[n], reference.weights[n]) ** 2 * _sq(reference.weights[n]) for n in names
        )
        norm = sum(_sq(reference.weights[n]) for n in names)
        return (diff / norm) ** 0.5 if norm else 0.0

    def limited(kind: str, what: str, of: Callable, factor: float = 1.0, floor: float = FLOOR) -> Measure:
        if yardstick is None:
            return Measure(what, of(partitioned), None, FALLBACK[kind])
        theirs = of(yardstick)
        return Measure(what, of(partitioned), theirs, factor * tolerance * max(theirs, floor))

    # one device's rounding in the whole model: the larger of its two samples, as a tensor's is (an
    # element whose first gradient is within float32's rounding of zero, below Adam's eps, moves
    # lr x its rounding / eps: in whichever sample rounding picks)
    model_floor = max(FLOOR, whole(yardstick), whole(spread) if spread else 0.0) if yardstick else FLOOR
    tensors = [
        limited(
            "worst tensor",
            f"worst tensor: {n}",
            lambda run, n=n: relative(run.weights[n], reference.weights[n], flip),
            TENSOR_FACTOR,
            max(model_floor, relative(spread.weights[n], yardstick.weights[n]))
            if spread and yardstick
            else model_floor,
        )
        for n in names
    ]
    return [
        limited("losses", "losses", lambda run: worst_step(run, "losses")),
        # after the first step a gradient norm is a function of the weights, and carries their
        # rounding: its floor is the yardstick's distance in weights, as a tensor's is
        limited(
            "gradient norms", "gradient norms", lambda run: worst_step(run, "grad_norms"), floor=model_floor
        ),
        limited("weights (whole model)", "weights (whole model)", whole, floor=model_floor),
        max(tensors, key=lambda m: m.partitioned / m.limit),
    ]


def _sq(t) -> float:
    return float(t.double().norm()) ** 2
