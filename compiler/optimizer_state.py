"""The optimizer state's bytes, as the plan's optimizer keeps them (`runtime/optimizers.py`):
what `estimate` counts, `explain` states and `suggest`'s screen assumes.

    optimizer    per parameter p (whole, its own dtype)          per ZeRO shard of n elements (fp32)
    adafactor    (rows + cols) x leading dims x itemsize + 4     per parameter of the flat: its whole
                 for a matrix (its last two dims); p.nbytes      (rows + cols) x leading dims x 4 + 4,
                 + 4 for a vector                                a vector's elements / ZeRO's ranks x 4 + 4
    adamw        2 p.nbytes + 4 (step)                           2 * 4n + 4
    sgd          p.nbytes with momentum, else 0                  4n with momentum, else 0
    lion         p.nbytes                                        4n

Adafactor's row and column moments are of the whole matrix on every rank that holds a piece of
it (`runtime/adafactor.py`): a tensor-parallel slice's rows and columns are the whole
parameter's, and ZeRO does not divide them.

The step counter (AdamW's, Adafactor's) is an fp32 scalar tensor per optimized tensor, a flat
under ZeRO. ZeRO's fp32 master (a copy when the shard is not fp32 or the state is offloaded) is
the engine's, not the optimizer's: `estimate.state_of` adds it. `bench/optimizer_state.py`
holds these numbers to the bytes the engines actually hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor

from meshplan.dsl.optimizer import OptimizerSpec

STEP_COUNTER = 4  # an fp32 scalar tensor per optimized tensor (fused or not)
_COUNTS_STEPS = ("adamw", "adafactor")


def moments(spec: OptimizerSpec) -> int:
    """How many tensors the size of a parameter an elementwise optimizer keeps beside it."""
    if spec.kind == "adamw":
        return 2
    if spec.kind == "sgd":
        return 1 if spec.args["momentum"] else 0
    return 1 if spec.kind == "lion" else 0


def whole_state_bytes(spec: OptimizerSpec, p: Tensor, whole: Sequence[int] | None = None) -> int:
    """The state the optimizer keeps for parameter `p` held whole, or its tensor-parallel piece
    of a parameter of shape `whole` (None: `p` is whole)."""
    step = STEP_COUNTER if spec.kind in _COUNTS_STEPS else 0
    if spec.kind != "adafactor":
        return moments(spec) * p.numel() * p.element_size() + step
    if p.dim() < 2:
        return p.numel() * p.element_size() + step
    return _factored(whole or p.shape) * p.element_size() + step


def shard_state_bytes(
    spec: OptimizerSpec, shard: int, members: Sequence[tuple[Sequence[int], int]] = (), world: int = 1
) -> int:
    """The state of one ZeRO flat's shard of `shard` elements over `world` ranks, in fp32.
    Adafactor's is per parameter of the flat, `members`: (its whole shape, its local numel)."""
    step = STEP_COUNTER if spec.kind in _COUNTS_STEPS else 0
    if spec.kind != "adafactor":
        return moments(spec) * shard * 4 + step
    return sum(
        (_factored(whole) if len(whole) >= 2 else math.ceil(numel / world)) * 4 + step
        for whole, numel in members
    )


def _factored(shape: Sequence[int]) -> int:
    """Elements of a matrix's row and column moments (a stack of matrices': each one's)."""
    *leading, rows, cols = shape
    return math.prod(leading) * (rows + cols)


def describe(spec: OptimizerSpec) -> str:
    """One line saying what the state is, for `estimate`'s and `explain`'s assumptions."""
    return {
        "adamw": "AdamW: two moments and an fp32 step counter per optimized tensor",
        "sgd": "SGD: one momentum buffer per parameter"
        if moments(spec)
        else "SGD without momentum: no state",
        "lion": "Lion: one momentum per parameter",
        "adafactor": "Adafactor: a row and a column second moment per matrix, whole on every rank "
        "holding a piece of it (a full one per vector, cut as it is) and an fp32 step counter per "
        "parameter",
    }[spec.kind]
