"""The optimizer state's bytes, as the plan's optimizer keeps them (`runtime/optimizers.py`):
what `estimate` counts, `explain` states and `suggest`'s screen assumes.

    optimizer    per parameter p (whole, its own dtype)          per ZeRO shard of n elements (fp32)
    adamw        2 p.nbytes + 4 (step)                           2 * 4n + 4
    sgd          p.nbytes with momentum, else 0                  4n with momentum, else 0
    lion         p.nbytes                                        4n
    adafactor    (rows + cols) x leading dims x itemsize + 4     refused under ZeRO
                 for a matrix (its last two dims); p.nbytes
                 + 4 for a vector

The step counter (AdamW's, Adafactor's) is an fp32 scalar tensor per optimized tensor, a flat
under ZeRO. ZeRO's fp32 master (a copy when the shard is not fp32 or the state is offloaded) is
the engine's, not the optimizer's: `estimate.state_of` adds it. `bench/optimizer_state.py`
holds these numbers to the bytes the engines actually hold.
"""

from __future__ import annotations

import math

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


def whole_state_bytes(spec: OptimizerSpec, p: Tensor) -> int:
    """The state the optimizer keeps for parameter `p` held whole (or its tensor-parallel piece)."""
    step = STEP_COUNTER if spec.kind in _COUNTS_STEPS else 0
    if spec.kind != "adafactor":
        return moments(spec) * p.numel() * p.element_size() + step
    if p.dim() < 2:
        return p.numel() * p.element_size() + step
    *leading, rows, cols = p.shape
    return math.prod(leading) * (rows + cols) * p.element_size() + step


def shard_state_bytes(spec: OptimizerSpec, shard: int) -> int:
    """The state of one ZeRO flat's shard of `shard` elements: fp32, elementwise optimizers only."""
    step = STEP_COUNTER if spec.kind in _COUNTS_STEPS else 0
    return moments(spec) * shard * 4 + step


def describe(spec: OptimizerSpec) -> str:
    """One line saying what the state is, for `estimate`'s and `explain`'s assumptions."""
    return {
        "adamw": "AdamW: two moments and an fp32 step counter per optimized tensor",
        "sgd": "SGD: one momentum buffer per parameter"
        if moments(spec)
        else "SGD without momentum: no state",
        "lion": "Lion: one momentum per parameter",
        "adafactor": "Adafactor: a row and a column second moment per matrix (a full one per vector) "
        "and an fp32 step counter per tensor",
    }[spec.kind]
