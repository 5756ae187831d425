"""A parameter's cast to the compute dtype, made once per pipeline step and shared by the step's
microbatches.

Under mixed precision (`compiler/passes/precision.py`) a weight is cast where it is used, and the
op that reads the cast keeps it for backward: a linear keeps its bf16 weight. A pipeline stage
runs forward on several microbatches before the first one's backward (1F1B keeps up to p in
flight on its first stage), and each forward cast the weight again: p bf16 copies of every
weight of the stage at once. In a stage program (`compiler/stages.py`, `share_casts`) the
cast of a parameter is a `SharedCast` instead, and inside `sharing()` (the pipeline's step,
`runtime/pipeline.py`) its first call casts and the others get the same tensor: one copy per
step, let go after the stage's last backward of the step. Only stages that keep several
microbatches in flight get them (`lower.shared_cast_stages`): with one, a kept cast would only
live longer than its microbatch's.

Autograd is unchanged: the cast's backward (a cast of the gradient to fp32, which keeps no
tensor) is part of every microbatch's graph and adds each microbatch's gradient into the fp32
parameter, as separate casts did; the numbers are bit for bit the same.

    with sharing(stage_programs):
        ...  # the step's forwards and backwards
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

aten = torch.ops.aten


class SharedCast(nn.Module):
    """`aten._to_copy(param, dtype=dtype)`, kept for the rest of the step inside `sharing()`."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.sharing = False
        self.kept: Tensor | None = None

    def forward(self, param: Tensor) -> Tensor:
        if self.kept is not None:
            return self.kept
        out = aten._to_copy.default(param, dtype=self.dtype)
        if self.sharing and torch.is_grad_enabled():
            self.kept = out
        return out

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}"


def let_go(program: nn.Module) -> None:
    """`program`'s shared casts are done with for this step (its last backward has run)."""
    for m in program.modules():
        if isinstance(m, SharedCast):
            m.sharing, m.kept = False, None


@contextlib.contextmanager
def sharing(programs: Iterable[nn.Module]) -> Iterator[None]:
    """Inside, each `SharedCast` of `programs` casts once and shares its result; on leaving, the
    shared casts are let go (the step's backwards hold them no longer)."""
    programs = list(programs)
    casts = [m for p in programs for m in p.modules() if isinstance(m, SharedCast)]
    for c in casts:
        c.sharing = True
    try:
        yield
    finally:
        for p in programs:
            let_go(p)
