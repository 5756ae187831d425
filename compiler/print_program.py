"""The program every rank runs, as readable Python: a compile folder's `program.py`, each
collective, ZeRO node, grouped linears and checkpointed region marked on the right with what
it issues and the plan line behind it; `inspect` shows it under a rank's mesh coordinates
(`rank_line`), as text or as a self-contained HTML page with the ledger (`to_html`).
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from pathlib import Path

from meshplan.dsl.check import PlanRule
from meshplan.runtime.mesh import MeshLayout

from . import meta
from .compile import Compiled
from .graph import shape_text
from .meta import Collective, DeviceCopyFact
from .passes import overlap
from .passes.checkpoint import region_modules


def rank_line(names: Sequence[str], sizes: Sequence[int], rank: int) -> str:
    """`# meshplan rank 5 of 8: dp=1, pp=0, tp=1`: where a rank sits in the mesh."""
    layout = MeshLayout(tuple(names), tuple(sizes))
    coords = ", ".join(f"{k}={v}" for k, v in layout.coords(rank).items())
    return f"# meshplan rank {rank} of {layout.world_size}: {coords}"


def annotated_code(compiled: Compiled) -> str:
    """The program every rank runs (SPMD) as Python, each collective and checkpointed region
    marked on the right, followed by the code of each checkpointed region. A rank binds its
    own shards and process groups (its mesh coordinates) when the program is built."""
    layout = compiled.layout
    mesh = ", ".join(f"{n}={s}" for n, s in zip(layout.names, layout.sizes, strict=True))
    header = [
        f"# meshplan program for every rank of `mesh {mesh}` ({layout.world_size} ranks)",
        f"# plan: {Path(compiled.plan.path).name}",
        "# parameters are each rank's shards; collectives are marked on the right",
    ]
    sums = getattr(compiled, "grad_sums", {})
    sections = [_annotated(compiled.graph, compiled.ledger, sums)]
    for call, region in region_modules(compiled.graph):
        info = meta.checkpoint_region(call)
        assert info is not None, "a region's call node carries its region"
        sections.append(
            f"# checkpointed region {info.path} ({info.mode}): {info.target}, run again in backward\n"
            + _annotated(region, compiled.ledger, sums)
        )
    return "\n".join(header) + "\n\n" + "\n\n".join(sections) + "\n"


def _annotated(gm, ledger, sums: dict[str, tuple[str, ...]]) -> str:
    notes = {}
    for node in gm.graph.nodes:
        info, region, copy = meta.collective(node), meta.checkpoint_region(node), meta.device_copy(node)
        if copy is not None:
            notes[node.name] = _copy_note(node, copy, ledger)
        elif node.op == "get_attr" and (where := meta.device(node)) is not None:
            where = "the host" if where == "cpu" else where
            notes[node.name] = f"  # held on {where} by a device rule, with its gradient and optimizer state"
        elif node.op == "get_attr" and str(node.target) in sums:
            axes = " x ".join(sums[str(node.target)])
            notes[node.name] = (
                f"  # its gradient is partial over {axes}: summed by the gradient sync, in a bucket"
            )
        elif info and info["kind"] in ("zero_gather", "zero_release"):
            notes[node.name] = _zero_note(node, info, ledger)
        elif info and info["kind"] == "experts":
            sent = sum(r.bytes * r.count for r in ledger.rows if r.node == node.name and r.phase == "forward")
            notes[node.name] = (
                f"  # experts over {info['axis']}: all_to_all dispatch and combine, {sent:,} B{_where(info)}"
            )
        elif info:
            notes[node.name] = f"  # {info['kind']} over {info['axis']}, {shape_text(node)}{_where(info)}"
            if any(u.op == "call_module" and u.target == overlap.TARGET for u in node.users):
                notes[node.name] += (
                    f"; backward waits for the {overlap.issued_reduction(info['kind'])} issued below"
                )
        elif node.op == "call_module" and node.target == overlap.TARGET:
            entry = node.args[0]
            op = overlap.issued_reduction(meta.collective(entry)["kind"])  # type: ignore[index,arg-type]
            n = len(node.meta["val"])
            notes[node.name] = (
                f"  # {n} linear{'s' if n > 1 else ''} on {entry}: backward issues its {op} "
                "of the input gradient, then computes the weight gradients"
            )
        elif region:
            notes[node.name] = f"  # checkpoint {region.mode}: {region.path}{_line(region.rule)}"
    body = []
    for line in gm.code.strip("\n").splitlines():
        m = re.match(r"\s+(\w+) = ", line)
        body.append(line.split(";  ")[0] + notes[m.group(1)] if m and m.group(1) in notes else line)
    return "\n".join(body)


def _copy_note(node, copy: DeviceCopyFact, ledger) -> str:
    """`# copy to the host, (2, 16, 64) 8,192 B; backward copies the gradient back <- p.plan:4`."""
    where = {"cpu": "the host", "device": "the rank's device"}.get(copy.to, copy.to)
    nbytes = sum(
        r.bytes for r in ledger.rows if r.node == node.name and r.phase == "forward" and not r.recompute
    )
    back = "; backward copies the gradient back" if copy.grad else ""
    return f"  # copy to {where} ({copy.module}), {shape_text(node)} {nbytes:,} B{back}{_line(copy.rule)}"


def _where(info: Collective) -> str:
    rule = info.get("rule")
    if rule is not None:
        return _line(rule)
    return f" <- {info['where']}" if info.get("where") else ""


def _line(rule: PlanRule | None) -> str:
    """` <- llama.plan:7`: the plan line behind a note."""
    return f" <- {rule.span.path}:{rule.span.line}" if rule is not None else ""


def _zero_note(node, info: Collective, ledger) -> str:
    """`# ZeRO gather over dp: layers.0, all_gather 0.135 MB` (the bytes its unit's flats move)."""
    unit = info["unit"] or "root"
    if info["kind"] == "zero_release":
        return f"  # ZeRO release: {unit} freed; backward gathers it again{_where(info)}"
    rows = [r for r in ledger.rows if r.node == node.name and r.op == "all_gather" and r.phase == "forward"]
    if not rows:  # stages 1/2: the all-gather ran after the optimizer step
        return f"  # ZeRO: {unit} waits for its updated params{_where(info)}"
    nbytes = sum(r.bytes for r in rows)
    return f"  # ZeRO gather over {info['axis']}: {unit}, all_gather {nbytes / 1e6:.3f} MB{_where(info)}"


def to_html(code: str, ledger: str, title: str) -> str:
    """A self-contained page: the rank's code with collective lines highlighted, and the ledger."""
    rows = []
    for line in code.splitlines():
        escaped = html.escape(line)
        cls = ' class="coll"' if "  # " in line and " over " in line else ""
        rows.append(f"<span{cls}>{escaped}</span>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
pre {{ background: #fafafa; border: 1px solid #ddd; padding: 1em; font-size: 12px; line-height: 1.35; overflow-x: auto; }}
.coll {{ background: #fde2e2; font-weight: bold; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<h2>Collectives per step</h2>
<pre>{html.escape(ledger)}</pre>
<h2>Program</h2>
<pre>{chr(10).join(rows)}</pre>
</body></html>
"""
