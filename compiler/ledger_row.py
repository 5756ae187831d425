"""A row of the collective ledger (`ledger.py`): one collective (or device copy) a compiled
program issues per step, its bytes and the plan line behind it. Its own module so that every
part of the ledger that makes rows shares one value."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshplan.dsl.errors import Span
from meshplan.runtime.device_copy import DeviceCopy

COPY = DeviceCopy.kind  # the kind of a device copy's rows: not a collective, a copy within the rank


@dataclass(frozen=True)
class LedgerRow:
    node: str  # the graph node that issues it (`bucket 3` for a data-parallel bucket)
    kind: str  # the collective module's kind (copy_to, all_reduce, zero_gather, dp_bucket, ...)
    op: str  # the collective on the wire: all_reduce, all_gather, reduce_scatter
    phase: str  # forward, backward, or step (after the optimizer step)
    axis: str
    shape: tuple[int | torch.SymInt, ...]  # the full tensor's (a data-dependent size stays symbolic)
    bytes: int
    count: int
    group_size: int
    rule: Span | None  # where the plan rule (or block) behind it is
    recompute: bool = False  # re-issued in backward by activation checkpointing's recomputation

    @property
    def traffic(self) -> float:
        if self.kind == COPY:  # one copy, not a ring
            return self.bytes * self.count
        n = self.group_size
        factor = 2 * (n - 1) / n if self.op == "all_reduce" else (n - 1) / n
        return factor * self.bytes * self.count


def plan_line(span: Span | None) -> str:
    """`llama.plan:7`: the plan line a row comes from, as the table and `ledger.json` print it
    ("" for none)."""
    return f"{span.path}:{span.line}" if span is not None else ""
