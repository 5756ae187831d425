"""A list of experts called one by one becomes one experts unit: the calls of each `ExpertList`
joined into the `meshplan.experts` operator, which the passes after it treat as any experts
module's.

Captured under `experts_as_units`, the parent's loop over a list of experts is unrolled: E
calls `expert_rows(rows_e, params, path, e)`, each on the rows the model routed to expert e,
each output weighted and added into the block's output by the model's own code. This pass
puts every expert's rows in one tensor, calls the experts unit once on them (each row with
its expert's index and weight 1: the model weighs them after), and splits its output back
into each expert's rows, so the model's combine reads what it read before:

    rows_0 = index(tokens, [token_0]); y_0 = expert_rows(rows_0, [...], 'layers.0.mlp.experts', 0)
    ... (E calls, each followed by the model's weighting and index_add)

becomes

    rows = cat([rows_0, ..., rows_3]);  index = cat([full((R_0, 1), 0), ..., full((R_3, 1), 3)])
    y = meshplan.experts(rows, index, ones, [...], 'layers.0.mlp.experts')
    y_0, ..., y_3 = split_with_sizes(y, [R_0, ..., R_3])

For that, every expert's rows must exist before any expert's output is used: the nodes that
do not depend on the list's outputs move before the joined call (the model's routing of all
experts first, then its combine), which is a valid order of the same computation. A list
whose experts are not each called exactly once on 2-D rows, or whose rows depend on another
expert's output, is a located error.

How many rows the experts get follows the routing, so the graph cannot say; the routing's
`topk` (or `argmax`) can: the ledger's all-to-all bytes use its (token, slot) pairs, recorded
here (`ROUTING`: the example's count, and k for `check`'s `top_k`).

With a capacity (`experts over ep (capacity_factor=1.25)`), an expert keeps the first C of
its rows in the unit's queue (`runtime/experts.py`), which must be the policy's order: every
token's first choice before any token's second, then by token, whatever order the model's
loop hands the rows in (`torch.where(index == e)` gives them by token; Mistral's reference
code by slot). So each row's (token, slot) is recovered from the graph: its token from the
index the model took it by (`tokens[token]`), its slot from the routing's top-k (the slot
of that token that chose this expert); the joined rows are sorted by (expert, slot, token)
before the unit and put back after it:

    key = expert << 50 | slot << 40 | token;  order = argsort(key)
    y = meshplan.experts(rows[order], index[order], ones, [...], path)[argsort(order)]

A list whose rows are not taken from the routed tokens by an index, or whose routing shows
no top-k, cannot say which pairs to drop: a located error.

Requires: a graph captured under `experts_as_units`. Ensures: no `meshplan.expert_rows` node
is left; each list's calls are one `meshplan.experts` node.

Golden: `tests/compiler/golden/passes/expert-rows.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch
from torch import fx

from meshplan.dsl.check import PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.expert_list import ExpertList

from ... import meta
from ...graph import arg_node, hint, shape
from ...meta import Routing
from .. import Context, Pass
from .capacity import capacity_factor
from .units import MARKER, ROWS_MARKER, argument_error, expert_modules

aten = torch.ops.aten


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    calls: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.target is ROWS_MARKER:
            calls.setdefault(str(node.args[2]), []).append(node)
    if not calls:
        return gm
    rules = expert_modules(ctx.plan, ctx.source.model)
    for path, nodes in calls.items():
        why = _problem(nodes, ctx.source.model.get_submodule(path))
        if why is not None:
            ctx.diagnostics.append(_error(rules[path], path, why))
            continue
        ordered = sorted(nodes, key=lambda n: int(n.args[3]))  # type: ignore[arg-type]
        queue: Queue | None = None
        if capacity_factor(rules[path]) is not None:  # the rows in the queue's order: (token, slot)
            found = _queue(ordered)
            if isinstance(found, str):
                ctx.diagnostics.append(_capacity_error(rules[path], path, found))
                continue
            queue = found
        if not _join(gm.graph, ordered, queue):
            ctx.diagnostics.append(
                Diagnostic(
                    rules[path].pattern_span,
                    f"the all-to-all bytes of `{path}` are not predicted: the block routes its rows with no "
                    "top-k the graph shows, so their count follows the data alone",
                    hint="the program is right; the ledger and `explain` leave its dispatch and combine out",
                    severity="warning",
                )
            )
    gm.graph.lint()
    gm.recompile()
    return gm


def _problem(nodes: list[fx.Node], module: torch.nn.Module) -> str | None:
    assert isinstance(module, ExpertList)
    called = sorted(int(n.args[3]) for n in nodes)  # type: ignore[arg-type]
    if called != list(range(module.num_experts)):
        return (
            f"the model calls its experts {_listing(called)} in one forward, not each of the "
            f"{module.num_experts} once"
        )
    widths = {shape(arg_node(n, 0))[-1] for n in nodes}
    if any(len(shape(arg_node(n, 0))) != 2 for n in nodes) or len(widths) != 1:
        return "its experts are called on tensors other than rows of one width (R, H)"
    outputs = _descendants(nodes)
    for n in nodes:
        if arg_node(n, 0) in outputs:
            return f"the rows of expert {n.args[3]} depend on another expert's output"
    return None


def _listing(called: list[int]) -> str:
    return ", ".join(str(e) for e in called) if called else "never"


def _descendants(nodes: list[fx.Node]) -> set[fx.Node]:
    """Every node that reads, directly or not, one of `nodes`; `nodes` included."""
    seen, todo = set(nodes), list(nodes)
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


class Queue(NamedTuple):
    """What orders a list's rows as a capacity queues them: each expert's row -> token index
    (`tokens[token]`), and the routing's (N, k) top-k indices (None: one slot, an argmax)."""

    tokens: list[fx.Node]
    top_k_index: fx.Node | None


def _queue(calls: list[fx.Node]) -> Queue | str:
    """The `Queue` of a list's calls (in expert order), or why the graph does not show it."""
    routing = find_routing([arg_node(n, 0) for n in calls])
    if routing is None:
        return "its parent routes its tokens with no top-k the graph shows"
    index = routing.index
    routed = shape(index)[0] if index is not None else None
    tokens = []
    for call in calls:
        token = _token_index(arg_node(call, 0))
        if (
            token is None
            or len(shape(token)) != 1
            or token.meta["val"].dtype not in (torch.int64, torch.int32)
        ):
            return (
                f"the rows of expert {call.args[3]} are not taken from the routed tokens by an index "
                "(`tokens[token]`), so which (token, slot) pair each row is cannot be known"
            )
        source = arg_node(_unviewed(arg_node(call, 0)), 0)
        if routed is not None and hint(shape(source)[0]) != hint(routed):
            return f"the rows of expert {call.args[3]} are taken from a tensor other than the routed tokens"
        tokens.append(token)
    return Queue(tokens, index)


def _unviewed(node: fx.Node) -> fx.Node:
    while node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        node = arg_node(node, 0)
    return node


def _token_index(rows: fx.Node) -> fx.Node | None:
    """The 1-D index `rows` were taken by from the routed tokens: `tokens[token]`
    (`aten.index.Tensor(tokens, [token])`) or `tokens.index_select(0, token)`, through views."""
    node = _unviewed(rows)
    if node.target is aten.index.Tensor and len(node.args[1]) == 1:  # type: ignore[arg-type]
        return node.args[1][0]  # type: ignore[index,return-value]
    if node.target is aten.index_select.default and node.args[1] == 0:
        return arg_node(node, 2)
    return None


def _join(graph: fx.Graph, calls: list[fx.Node], queue: Queue | None) -> bool:
    """Replace the list's E calls (in expert order) by one experts unit on all their rows, in
    a capacity's queue order if `queue` says it. Returns whether the routing that makes the
    rows was found (`ROUTING`)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    first = min(calls, key=position.__getitem__)
    after = _descendants(calls)
    # what does not read an expert's output moves before the first call, in its order
    for node in [n for n in _from(first) if n not in after]:
        first.prepend(node)
    rows = [arg_node(n, 0) for n in calls]
    params, path = calls[0].args[1], str(calls[0].args[2])
    fake = rows[0].meta["val"]

    # the joined nodes are the experts module's: traced inside it, as a module's own call is
    stack = {**first.meta.get("nn_module_stack", {}), path.replace(".", "_"): (path, ExpertList)}

    def add(target, args, val):
        node = graph.call_function(target, args)
        node.meta.update(val=val, nn_module_stack=stack, stack_trace=first.meta.get("stack_trace"))
        meta.set_module_tag(node, path)
        meta.set_requires_grad(node, isinstance(val, torch.Tensor) and val.requires_grad)
        return node

    with graph.inserting_before(first), fake.fake_mode:
        sizes = [add(aten.sym_size.int, (r, 0), r.meta["val"].shape[0]) for r in rows]
        tokens = add(aten.cat.default, (rows,), torch.cat([r.meta["val"] for r in rows]))
        fulls = [
            add(aten.full.default, ([s, 1], e), torch.full((s.meta["val"], 1), e))
            for e, s in enumerate(sizes)
        ]
        index = add(
            aten.cat.default, (fulls,), torch.cat([f.meta["val"] for f in fulls])
        )  # (R, 1) each row's expert
        count = add(aten.sym_size.int, (tokens, 0), tokens.meta["val"].shape[0])
        ones = add(
            aten.new_ones.default, (tokens, [count, 1]), tokens.meta["val"].new_ones((count.meta["val"], 1))
        )
        if queue is None:
            out = unit = add(
                MARKER, (tokens, index, ones, params, path), torch.empty_like(tokens.meta["val"])
            )
        else:
            order = _queue_order(add, index, queue)
            apply = [
                add(aten.index.Tensor, (t, [order]), t.meta["val"][order.meta["val"]])
                for t in (tokens, index)
            ]
            unit = add(MARKER, (*apply, ones, params, path), torch.empty_like(apply[0].meta["val"]))
            back = add(aten.argsort.default, (order,), order.meta["val"].argsort())
            out = add(aten.index.Tensor, (unit, [back]), unit.meta["val"][back.meta["val"]])
        split = add(
            aten.split_with_sizes.default,
            (out, sizes),
            torch.split(out.meta["val"], [s.meta["val"] for s in sizes]),
        )
        for e, call in enumerate(calls):
            piece = add(operator.getitem, (split, e), split.meta["val"][e])
            call.replace_all_uses_with(piece)
    routing = find_routing(rows)
    if routing is not None:
        meta.set_routing(unit, routing)
    for call in calls:
        graph.erase_node(call)
    return routing is not None


def _queue_order(add, index: fx.Node, queue: Queue) -> fx.Node:
    """(R,) the joined rows' order in a capacity's queues: by expert, then slot, then token
    (key `expert << 50 | slot << 40 | token`, a call routing under 2^40 tokens to k < 2^10)."""
    val = {n: n.meta["val"] for n in [index, *queue.tokens]}
    token = add(aten.cat.default, (queue.tokens,), torch.cat([val[t] for t in queue.tokens]))  # (R,)
    expert = add(aten.view.default, (index, [-1]), val[index].view(-1))  # (R,)
    key = add(aten.mul.Tensor, (expert, 1 << 50), expert.meta["val"] * (1 << 50))
    if queue.top_k_index is not None:
        chosen = add(
            aten.index.Tensor, (queue.top_k_index, [token]), queue.top_k_index.meta["val"][token.meta["val"]]
        )  # (R, k) each row's token's experts
        mine = add(aten.eq.Tensor, (chosen, index), chosen.meta["val"] == val[index])  # (R, k): one True
        mine = add(aten.to.dtype, (mine, torch.int64), mine.meta["val"].to(torch.int64))
        slot = add(aten.argmax.default, (mine, -1), mine.meta["val"].argmax(-1))  # (R,)
        shifted = add(aten.mul.Tensor, (slot, 1 << 40), slot.meta["val"] * (1 << 40))
        key = add(aten.add.Tensor, (key, shifted), key.meta["val"] + shifted.meta["val"])
    key = add(aten.add.Tensor, (key, token), key.meta["val"] + token.meta["val"])
    return add(aten.argsort.default, (key,), key.meta["val"].argsort())


def _from(node: fx.Node) -> list[fx.Node]:
    """`node` and the nodes after it, the output left out."""
    out, at = [], node
    while at.op != "output":
        out.append(at)
        at = at.next
    return out


def find_routing(rows: list[fx.Node], through_collectives: bool = False) -> Routing | None:
    """The (token, slot) pairs the routing makes (the example's count) and its k, from the
    `topk` (or `argmax`, one slot) that the rows' indices come from; None if there is none.
    `through_collectives`: also through the tensor-parallel walk's collectives (call_module
    nodes), as rows grouped by expert after the walk read a routing it gathered."""
    seen, todo = set(rows), list(rows)
    while todo:
        node = todo.pop(0)
        if node.target in (aten.topk.default, aten.argmax.default):
            val = node.meta["val"]
            picked = val[1] if isinstance(val, tuple) else val.unsqueeze(-1)  # topk: (values, indices)
            sizes = [size for s in picked.shape if (size := hint(s)) is not None]
            if len(sizes) != picked.dim():
                return None
            index = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 1), None)
            return Routing(
                pairs=math.prod(sizes), k=sizes[-1], index=index if isinstance(val, tuple) else None
            )
        for arg in node.all_input_nodes:
            if arg not in seen and (
                arg.op == "call_function" or (through_collectives and arg.op == "call_module")
            ):
                seen.add(arg)
                todo.append(arg)
    return None


def _capacity_error(rule: PlanRule, path: str, why: str) -> Diagnostic:
    return argument_error(
        rule,
        "capacity_factor",
        f"expert capacity (`capacity_factor`) for `{path}` needs each row's (token, slot) pair: {why}",
        hint="take each expert's rows as `tokens[token]` with `token, slot = torch.where(index == e)` "
        "from a torch.topk routing, or remove `capacity_factor` to train dropless",
    )


def _error(rule: PlanRule, path: str, why: str) -> Diagnostic:
    return Diagnostic(
        rule.pattern_span,
        f"`{path}` cannot be split over `{rule.axis}`: {why}",
        hint="a list of experts is split when the model's loop calls each expert once, on the rows routed to it",
    )


PASS = Pass(
    "expert-rows",
    run,
    requires="a graph captured under `experts_as_units`",
    ensures="each list of experts is one experts unit on all its rows, split back to each expert's",
    checks_after_errors=True,
)
