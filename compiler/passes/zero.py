"""ZeRO in the graph: a layer's parameters are gathered before its first use and freed after its last.

Requires: the final graph of the other passes (after activation checkpointing: a
checkpointed layer is one call node whose inputs include its parameters), a plan with
`data_parallel { zero = N }` over an axis of size > 1.
Ensures: every trainable parameter belongs to one *unit*, the layer that owns it (the
first numbered module on its path: `layers.3`, `model.layers.3`, `h.3`) or the root for
the rest (embeddings, final norm, LM head). Each unit gets

- a `ZeroGather` node placed just before the first node that reads its parameters
  (parameter-only nodes, like the precision pass's casts, are first moved down to their
  first user, so nothing reads a parameter ahead of its layer);
- under ZeRO-3, a `ZeroRelease` node right after the last node that reads them, taking
  every value computed since the gather that later nodes use. Its forward frees the
  gathered parameters; its backward (every gradient into the unit flows through these
  values) gathers them again before the unit's backward. The unit released last (the
  root, whose LM head ends forward) keeps its parameters: backward starts with it.

The runtime's ZeRO engine (`runtime.zero`) binds itself to these nodes: it decides what
"gather" means (stage 3: all-gather the unit's flats and prefetch the next unit; stages
1/2: wait for the all-gather of the updated parameters that the optimizer step left
running). Unbound, both nodes are identities, so `meshplan verify` runs the program as is.

After (`zero = 3`, a Llama layer):

    zero_gather_layers_0 = self.zero_gather_layers_0(layers_0_input_layernorm_weight, ...)
    ...
    linear_6 = torch.ops.aten.linear.default(mul_7, layers_0_mlp_down_proj_weight)
    zero_release_layers_0 = self.zero_release_layers_0(add_3, linear_6)
    getitem = zero_release_layers_0[0]
    getitem_1 = zero_release_layers_0[1]
    add_5 = torch.ops.aten.add.Tensor(getitem, getitem_1)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from meshplan.runtime.zero_nodes import ZeroGather, ZeroRelease

from ..graph import COLLECTIVE, is_tensor_node
from ..meta import MODULE
from . import Context, Pass


@dataclass(frozen=True)
class ZeroSpec:
    axis: str
    stage: int
    where: str  # `file:line` of the plan's `data_parallel` block, for printers


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    dp = ctx.plan.data_parallel
    if dp is None or dp.zero == 0 or ctx.layout.size(dp.axis) == 1:
        return gm
    return shard_parameters(gm, ZeroSpec(dp.axis, dp.zero, f"{dp.span.path}:{dp.span.line}"))


PASS = Pass(
    "zero",
    run,
    requires="the final graph, checkpoint regions outlined (a checkpointed layer is one call node)",
    ensures="a gather node before each unit's first parameter use; under ZeRO-3 a release after its last",
)


def unit_of(param: str) -> str:
    """The unit that owns a parameter: its path up to the first numbered part, or the root ('')."""
    parts = param.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def shard_parameters(gm: fx.GraphModule, spec: ZeroSpec) -> fx.GraphModule:
    """Insert the units' gather (and, for ZeRO-3, release) nodes; see the module docstring."""
    graph = gm.graph
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    reads = [n for n in graph.nodes if n.op == "get_attr" and str(n.target) in trainable and n.users]
    _hoist(graph, reads)
    _sink_parameter_nodes(graph, reads)
    order = {n: i for i, n in enumerate(graph.nodes)}
    units: dict[str, list[fx.Node]] = {}
    for node in reads:
        units.setdefault(unit_of(str(node.target)), []).append(node)
    spans = {unit: _span(params, order) for unit, params in units.items()}
    by_start = sorted(units, key=lambda u: order[spans[u][0]])
    last_released = max(by_start, key=lambda u: order[spans[u][1]])
    for unit in by_start:
        params = units[unit]
        first, last = spans[unit]
        name = _target("zero_gather", unit)
        gm.add_submodule(name, ZeroGather(spec.axis, unit, [str(p.target) for p in params]))
        with graph.inserting_before(first):
            gather = graph.call_module(name, tuple(params))
        gather.meta[COLLECTIVE] = {
            "kind": "zero_gather",
            "axis": spec.axis,
            "unit": unit,
            "where": spec.where,
        }
        gather.meta[MODULE] = unit
        if spec.stage == 3 and unit != last_released:
            _release(gm, unit, gather, last, spec)
    graph.lint()
    gm.recompile()
    return gm


def _hoist(graph: fx.Graph, reads: list[fx.Node]) -> None:
    """Move the parameter reads to the top of the graph, in their order.

    A get_attr has no inputs, so this is always legal; it guarantees that every parameter
    of a unit exists before the unit's gather, wherever other passes left the reads (the
    tensor-parallel pass puts a sequence-parallel norm weight's `copy_to` right after its
    read, which can come before the reads of the layer's other parameters).
    """
    anchor = next((n for n in reversed(graph.nodes) if n.op == "placeholder"), None)
    for node in reads:
        if anchor is None:
            next(iter(graph.nodes)).prepend(node)
        elif anchor is not node:
            anchor.append(node)
        anchor = node


def _sink_parameter_nodes(graph: fx.Graph, reads: list[fx.Node]) -> None:
    """Move nodes computed from parameters alone (casts, transposes, the tensor-parallel
    `copy_to` of a sequence-parallel norm weight) down to their first user."""
    derived: list[fx.Node] = []
    sources = set(reads)
    for node in graph.nodes:
        if (
            node.op in ("call_function", "call_module")
            and node.all_input_nodes
            and all(a in sources for a in node.all_input_nodes)
        ):
            sources.add(node)
            derived.append(node)
    for node in reversed(derived):
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_user = min(node.users, key=order.__getitem__, default=None)
        if first_user is not None and first_user is not node.next:
            first_user.prepend(node)


def _span(params: list[fx.Node], order: dict[fx.Node, int]) -> tuple[fx.Node, fx.Node]:
    """The first and last node reading the unit's parameters (directly or through casts)."""
    readers: set[fx.Node] = set()
    frontier = list(params)
    while frontier:
        for user in frontier.pop().users:
            if user not in readers:
                readers.add(user)
                if user.op in ("call_function", "call_module") and all(
                    a in readers or a in params for a in user.all_input_nodes
                ):
                    # a cast of a parameter, or the tensor-parallel pass's `copy_to` (the
                    # identity forward of a sequence-parallel bias): its users read it too
                    frontier.append(user)
    ranked = sorted(readers, key=order.__getitem__)
    return ranked[0], ranked[-1]


def _release(gm: fx.GraphModule, unit: str, gather: fx.Node, last: fx.Node, spec: ZeroSpec) -> None:
    """After `last`: pass every value made since `gather` and used later through a ZeroRelease."""
    graph = gm.graph
    inside: list[fx.Node] = []
    node = gather.next
    while True:
        inside.append(node)
        if node is last:
            break
        node = node.next
    members = set(inside)
    leaving = [
        n
        for n in inside
        if n.op in ("call_function", "call_module", "call_method")
        and is_tensor_node(n)
        and any(u not in members for u in n.users)
    ]
    if not leaving:
        return
    name = _target("zero_release", unit)
    position = next(i for i, n in enumerate(graph.nodes) if n is last)  # releases in graph order
    gm.add_submodule(name, ZeroRelease(spec.axis, unit, position))
    with graph.inserting_after(last):
        release = graph.call_module(name, tuple(leaving))
    release.meta[MODULE] = unit
    release.meta[COLLECTIVE] = {"kind": "zero_release", "axis": spec.axis, "unit": unit, "where": spec.where}
    if len(leaving) == 1:
        release.meta["val"] = leaving[0].meta.get("val")
        outs = [release]
    else:
        release.meta["val"] = tuple(n.meta.get("val") for n in leaving)
        outs = []
        anchor = release
        for i, n in enumerate(leaving):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (release, i))
            anchor.meta["val"] = n.meta.get("val")
            anchor.meta[MODULE] = unit
            outs.append(anchor)
    for n, out in zip(leaving, outs, strict=True):
        n.replace_all_uses_with(out, delete_user_cb=lambda u: u not in members and u is not release)


def _target(kind: str, unit: str) -> str:
    return f"{kind}_{unit.replace('.', '_')}" if unit else f"{kind}_root"
