"""Overlap: the linears that read an entry collective's output become one `Linears` node, whose
backward issues the entry's reduction before computing the weight gradients.

An entry collective (its module class says `overlap_entry`) starts sharded compute: f
(`copy_to`: identity forward, all-reduce of the input gradient backward) or, under sequence
parallelism, the all-gather whose backward reduce-scatters it. Its users are typically the
column-split linears of one block (q, k and v; gate and up; the LM head). Left as separate
autograd nodes, each linear computes its input and weight gradient together and the entry
reduces only after all of them: the reduction overlaps nothing. Grouped, the backward is
(`runtime/linears.py`):

    grad_x = sum_i grad_i @ w_i                 input gradient of the group
    issue the entry's reduction of grad_x       async: f's all-reduce, SP's reduce-scatter
    grad_w_i = grad_i^T x                       the weight gradients, while it runs
    the entry's backward waits                  where the reduced gradient is first used

    copy_to_tp = self.copy_to_tp(mul_1)                             # waits for the issued all-reduce
    linears = self.linears(copy_to_tp, q_weight, None, k_weight, None, v_weight, None)
    linear, linear_1, linear_2 = linears[0], linears[1], linears[2]

An entry is grouped when every user is a linear layer reading it as the input: `aten.linear`,
or `aten.addmm`/`aten.mm` with the weight stored (in, out) as GPT-2's Conv1D does (the group
reads its transpose). A user of any other kind would need the whole reduced gradient first. The node goes where the first
linear was; a later linear's weight that is computed after that point (a cast to the compute
dtype at its use) is moved before it when it depends on no linear of the group and has no
side effects; otherwise the entry is left as it was. The ledger is unchanged: the entry's
backward collective is the same collective, issued earlier. Runs last, on the graph and on
each checkpointed region (a recomputed region issues in its own backward likewise).

Golden: `tests/compiler/golden/passes/overlap.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from meshplan.runtime.collectives import COLLECTIVES
from meshplan.runtime.linears import Linears

from .. import meta
from ..graph import shape
from . import Context, Pass
from .checkpoint import region_modules

aten = torch.ops.aten

TARGET = "linears"  # the submodule every grouped node calls (stateless: one per graph)
# Zero-bubble schedules split each backward at the nodes where weights join the input path
# (`runtime/split_backward.py`): a group would be such a node, computing every gradient twice.
SPLIT_BACKWARD = ("zero_bubble", "zbv")


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    pipeline = ctx.plan.pipeline
    if pipeline is not None and pipeline.schedule in SPLIT_BACKWARD:
        return gm
    for graph_module in (gm, *(region for _, region in region_modules(gm))):
        graph_module.add_submodule(TARGET, Linears())
        grouped = [group_linears(graph_module, entry) for entry in list(graph_module.graph.nodes)]
        if not any(grouped):
            graph_module.delete_submodule(TARGET)
        graph_module.recompile()
    return gm


def group_linears(gm: fx.GraphModule, entry: fx.Node) -> bool:
    """Replace the linears reading `entry` by one `Linears` node, if `entry` is an entry
    collective read only by linears; whether it did."""
    info = meta.collective(entry)
    if info is None or not is_entry(info["kind"]) or _in_blocks(entry):
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    users = sorted(entry.users, key=order.__getitem__)
    found = [_weight_and_bias(u, entry) for u in users]
    if not users or any(f is None for f in found):
        return False
    if len({meta.stage(u) for u in users}) > 1:
        return False
    first = users[0]
    sides = [f for f in found if f is not None]
    needed = [n for w, b, _ in sides for n in (w, b) if isinstance(n, fx.Node)]
    if not _hoist(needed, first, set(users), order):
        return False
    graph = gm.graph
    params: list[fx.Node | None] = []
    with graph.inserting_before(first):
        for w, b, stored_in_out in sides:
            if stored_in_out:  # (in, out), as GPT-2's Conv1D keeps it: its transpose is the weight
                stored = w.meta.get("val")
                w = graph.call_function(aten.t.default, (w,))
                if stored is not None:
                    w.meta["val"] = stored.t()
            params += [w, b]
        node = graph.call_module(TARGET, (entry, *params))
    node.meta["val"] = tuple(u.meta.get("val") for u in users)
    meta.set_module_tag(node, _common_path([meta.module_tag(u) or "" for u in users]))
    meta.set_requires_grad(node, True)
    meta.copy_facts(first, node, meta.STAGE)
    at = node
    for i, u in enumerate(users):  # each linear becomes its output of the group, name and facts kept
        u.target, u.args, u.kwargs = operator.getitem, (node, i), {}
        at.append(u)
        at = u
    return True


def is_entry(kind: str) -> bool:
    """Whether collectives of `kind` are entries (`overlap_entry` on their module class)."""
    declared = COLLECTIVES.get(kind)
    return declared is not None and declared.overlap_entry


def issued_reduction(kind: str) -> str:
    """The reduction of the input gradient an entry of `kind` has issued early: its backward op."""
    return COLLECTIVES[kind].backward_wire[0].op


def _weight_and_bias(user: fx.Node, entry: fx.Node) -> tuple[fx.Node, fx.Node | None, bool] | None:
    """(weight, bias, whether the weight is stored (in, out)) of a user computing a linear layer
    of `entry`: `aten.linear(entry, w[, b])` (w: (out, in)), or `aten.addmm(b, entry, w)` and
    `aten.mm(entry, w)` (w: (in, out), GPT-2's Conv1D on the flattened tokens); None for any
    other user, or one reading `entry` as something else too."""
    args = user.args
    if user.op != "call_function" or user.kwargs:
        return None
    if user.target == aten.linear.default and args[0] is entry:
        w, b, stored_in_out = args[1], args[2] if len(args) > 2 else None, False
    elif user.target == aten.addmm.default and len(args) == 3 and args[1] is entry:
        w, b, stored_in_out = args[2], args[0], True
        if not isinstance(b, fx.Node) or len(shape(b)) != 1:  # a bias per output feature only
            return None
    elif user.target == aten.mm.default and args[0] is entry:
        w, b, stored_in_out = args[1], None, True
    else:
        return None
    if not isinstance(w, fx.Node) or w is entry or b is entry:
        return None
    return w, b, stored_in_out  # type: ignore[return-value]


def _in_blocks(entry: fx.Node) -> bool:
    """An all-gather of blocks (a sequence shard flattened with the batch): its output is a view,
    not the gather's, so nothing could issue for it."""
    blocks = entry.args[2] if len(entry.args) > 2 else entry.kwargs.get("blocks", 1)
    return bool(blocks != 1)


def _hoist(needed: list[fx.Node], before: fx.Node, group: set[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Move the nodes computing `needed` that come after `before` (and what they read after it)
    to just before it. False, and nothing moved, when one of them reads the group's output or
    has side effects."""
    start = order[before]
    moving: set[fx.Node] = set()
    stack = [n for n in needed if order[n] >= start]  # `before` is the group's first linear
    while stack:
        n = stack.pop()
        if n in moving:
            continue
        if n in group or n.op not in ("call_function", "get_attr") or n.is_impure() or meta.collective(n):
            return False
        moving.add(n)
        stack += [a for a in n.all_input_nodes if order[a] >= start]
    for n in sorted(moving, key=order.__getitem__):
        before.prepend(n)
    return True


def _common_path(paths: list[str]) -> str:
    """The module path the group's linears share (`layers.0.self_attn` for q, k and v)."""
    parts = [p.split(".") for p in paths]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


PASS = Pass(
    "overlap",
    run,
    requires="the final graph: collectives inserted, regions outlined, ZeRO nodes placed",
    ensures="the linears reading an entry collective (f, SP's all-gather) are one `Linears` node whose "
    "backward issues the entry's reduction before the weight gradients; the entry waits for it",
)
