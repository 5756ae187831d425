"""The graph as a picture for `meshplan inspect --format dot` (and `svg`, Graphviz's drawing of
it): a compile writes the graph as records (`graph.json`: each node's op, inputs, module,
placement, collective and rule), and `inspect` draws them without compiling again."""

from __future__ import annotations

from . import meta
from .compile import Compiled
from .graph import module_path


def graph_records(compiled: Compiled) -> list[dict]:
    """The graph as JSON-friendly records, for `inspect` to draw without recompiling."""
    out = []
    for node in compiled.graph.graph.nodes:
        info = meta.collective(node)
        rule = (info or {}).get("rule") or meta.rule(node)
        out.append(
            {
                "name": node.name,
                "op": node.op,
                "target": getattr(node.target, "__name__", str(node.target)),
                "inputs": [a.name for a in node.all_input_nodes],
                "module": module_path(node),
                "placement": {k: str(v) for k, v in meta.placement(node).items()},
                "collective": {k: v for k, v in (info or {}).items() if k != "rule"} or None,
                "rule": f"{rule.span.path}:{rule.span.line}" if rule is not None else None,
            }
        )
    return out


def to_dot(records: list[dict], title: str) -> str:
    """Graphviz DOT: collectives red, sharded values blue, replicated grey; parameters omitted."""
    lines = [f'digraph "{title}" {{', '  rankdir=TB; node [shape=box, fontname="monospace", fontsize=10];']
    shown = {r["name"] for r in records if r["op"] not in ("get_attr",)}
    for r in records:
        if r["name"] not in shown:
            continue
        placement = ", ".join(f"{k}: {v}" for k, v in r["placement"].items())
        label = f"{r['name']}\\n{r['target']}" + (f"\\n{placement}" if placement else "")
        if r["collective"]:
            style = 'style=filled, fillcolor="#f4a6a6"'
        elif "Shard" in placement:
            style = 'style=filled, fillcolor="#b8d4f0"'
        else:
            style = 'style=filled, fillcolor="#eeeeee"'
        lines.append(f'  "{r["name"]}" [label="{label}", {style}];')
        for src in r["inputs"]:
            if src in shown:
                lines.append(f'  "{src}" -> "{r["name"]}";')
    lines.append("}")
    return "\n".join(lines) + "\n"
