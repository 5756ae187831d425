"""The collective ledger: every collective a compiled program issues per step, and why.

Each inserted collective node becomes rows: op, mesh axis, the tensor's full shape,
bytes of that tensor, how many times per step in forward and in backward, and the plan
line that caused it. Bytes are what each rank contributes to the collective (the full
tensor for an all-reduce, the full gathered tensor for all-gather and reduce-scatter);
`traffic` is what a ring algorithm moves per rank: 2(n-1)/n x bytes for all-reduce,
(n-1)/n x bytes for all-gather and reduce-scatter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from meshplan.runtime.mesh import MeshLayout

from .graph import COLLECTIVE, shape, value
from .passes.checkpoint import collective_nodes

# kind -> ((op, count) in forward, (op, count) in backward)
_STEPS: dict[str, tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]] = {
    "copy_to": ((), (("all_reduce", 1),)),
    "all_reduce": ((("all_reduce", 1),), ()),
    "all_gather": ((("all_gather", 1),), (("reduce_scatter", 1),)),
    "gather_replicated": ((("all_gather", 1),), ()),
    "reduce_scatter": ((("reduce_scatter", 1),), (("all_gather", 1),)),
    "split": ((), (("all_gather", 1),)),
    "vocab_embedding": ((), ()),
    "vocab_cross_entropy": ((("all_reduce", 3),), ()),
}


@dataclass(frozen=True)
class LedgerRow:
    node: str  # the graph node that issues it
    kind: str  # the collective module's kind (copy_to, all_reduce, ...)
    op: str  # the collective on the wire: all_reduce, all_gather, reduce_scatter
    phase: str  # forward or backward
    axis: str
    shape: tuple[int, ...]  # the full tensor's shape
    bytes: int
    count: int
    group_size: int
    rule: str  # `file:line` of the plan rule behind it, or ""
    recompute: bool = False  # re-issued in backward by activation checkpointing's recomputation

    @property
    def traffic(self) -> float:
        n = self.group_size
        factor = 2 * (n - 1) / n if self.op == "all_reduce" else (n - 1) / n
        return factor * self.bytes * self.count


@dataclass(frozen=True)
class Ledger:
    rows: tuple[LedgerRow, ...]

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(
            r.count for r in self.rows if (op is None or r.op == op) and (phase is None or r.phase == phase)
        )

    def total_bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(
            r.bytes * r.count
            for r in self.rows
            if (op is None or r.op == op) and (phase is None or r.phase == phase)
        )

    def to_json(self) -> list[dict]:
        return [
            {
                "node": r.node,
                "kind": r.kind,
                "op": r.op,
                "phase": r.phase,
                "axis": r.axis,
                "shape": list(r.shape),
                "bytes": r.bytes,
                "count": r.count,
                "group_size": r.group_size,
                "rule": r.rule,
            }
            for r in self.rows
        ]


def build_ledger(gm: fx.GraphModule, layout: MeshLayout) -> Ledger:
    rows = []
    for node, recomputed in collective_nodes(gm):
        info = node.meta[COLLECTIVE]
        kind, axis = info["kind"], info["axis"]
        val = value(node)
        full = shape(node)
        nbytes = math.prod(full) * val.element_size()
        if kind == "vocab_cross_entropy":  # three all-reduces of one float per token
            logits = node.args[0]
            full = shape(logits)[:-1]
            nbytes = math.prod(full) * 4
        rule = info.get("rule")
        where = f"{rule.span.path}:{rule.span.line}" if rule is not None else ""
        forward, backward = _STEPS[kind]
        phases = [("forward", forward, False), ("backward", backward, False)]
        if recomputed:  # a checkpointed region runs its forward again during backward
            phases.append(("backward", forward, True))
        for phase, steps, again in phases:
            for op, count in steps:
                rows.append(
                    LedgerRow(
                        node.name, kind, op, phase, axis, full, nbytes, count, layout.size(axis), where, again
                    )
                )
    return Ledger(tuple(rows))
