"""The collective ledger as a table: `meshplan explain` prints it after the rules, a compile
writes it as `ledger.txt`, and `inspect` shows that file beside the program."""

from __future__ import annotations

from .compile import Compiled
from .ledger import PHASES, plan_line


def ledger_table(compiled: Compiled) -> str:
    """The collective ledger as a table, one line per (op, phase, axis, shape, rule)."""
    agg: dict[tuple, list[int]] = {}
    for r in compiled.ledger.rows:
        key = (r.phase, r.op, r.axis, r.shape, plan_line(r.rule))
        entry = agg.setdefault(key, [0, r.bytes])
        entry[0] += r.count
    width = max([5, *(len(key[2]) for key in agg)])  # `dp x ep` under expert parallelism
    header = f"{'phase':<9} {'op':<15} {'axis':<{width}} {'shape':<16} {'bytes':>10} {'count':>6}  rule"
    lines = [header, "-" * len(header)]
    for (phase, op, axis, shp, rule), (count, nbytes) in sorted(
        agg.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0][4], kv[0][1])
    ):
        lines.append(
            f"{phase:<9} {op:<15} {axis:<{width}} {tuple(shp)!s:<16} {nbytes:>10} {count:>6}  {rule}"
        )
    lines.append("-" * len(header))
    lines.append(compiled.ledger.summary())
    return "\n".join(lines) + "\n"
