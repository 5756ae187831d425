"""A stage's backward in two halves: input gradients now, weight gradients later.

Zero-bubble schedules run the input gradient I(s, i) as soon as the next stage's gradient
arrives (the previous stage waits for it) and the weight gradient W(s, i) whenever the rank
would otherwise idle. Both halves come from the one autograd graph of the stage's forward:

    I   autograd from the outputs to the received inputs only. The engine runs just the
        nodes on the input path; for each node where a weight's path joins it (the matmul
        whose operands are an activation and a weight, say) a pre-hook keeps the gradient
        flowing into it. The graph is retained.
    W   autograd from those kept gradients, at those same nodes, to the weights: the nodes
        on the weights' side only, each run once. Gradients accumulate into `.grad` by the
        usual accumulation nodes, so the data-parallel engines' hooks fire as they do for a
        whole backward.

Weights whose every path joins the input path at some node (all of them, in a transformer
layer) are split this way. Where the inputs need no gradient (the first stage receives token
ids), I is nothing and W is the whole backward. Where some weight reaches the outputs without
meeting the input path, W runs autograd from the outputs to the weights again (correct, at
the cost of the input path twice). Either way weight gradients accumulate in W only, so a
data-parallel engine sees each stage's gradients complete at its last W of the step.

Weights are grouped by the nodes they join at (a weight used twice joins at two nodes; two
weights joining at one node share it); each group's W runs autograd once, with the kept
gradients pinned at its nodes so that a node reached both directly and through another of the
group's nodes is not counted twice.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node


@dataclass
class _Group:
    params: list[Tensor]
    joins: list[Node]
    grads: dict[Node, tuple[Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class Pending:
    """What W(s, i) needs after I(s, i): the groups with their kept gradients, or, where the
    weights could not be split off, autograd from the `outputs` to the `params` again."""

    groups: list[_Group] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    grads: list[Tensor | None] = field(default_factory=list)
    params: list[Tensor] = field(default_factory=list)


def backward_input(
    outputs: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
) -> Pending:
    """Gradients of `inputs` (into their `.grad`) from `outputs` with gradients `grads` (None
    for a scalar loss); returns what `backward_weight` needs for the `params`' gradients."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    inputs = [t for t in inputs if t.requires_grad]
    if not outputs:
        return Pending()
    roots = [_node(o) for o in outputs]
    consumers = _consumers(roots)
    reached = [p for p in params if p.requires_grad and (_node(p) in consumers or _node(p) in roots)]
    whole = Pending(outputs=outputs, grads=grads, params=reached)
    if not inputs:  # the first stage: nothing to send back, so all of it waits for W
        return whole
    on_input_path = _downstream([_node(t) for t in inputs], consumers, stop=frozenset())
    groups = _groups(reached, consumers, on_input_path, set(roots))
    if groups is None:  # a weight reaching an output off the input path: W goes from the outputs
        found = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
        _accumulate(inputs, found)
        return whole

    def keep(group: _Group, node: Node):
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            group.grads[node] = grad_outputs

        return hook

    handles = [node.register_prehook(keep(g, node)) for g in groups for node in g.joins]
    try:
        found = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    _accumulate(inputs, found)
    return Pending(groups=groups)


def backward_weight(pending: Pending) -> None:
    """Accumulate the weight gradients that `backward_input` left for later."""
    if pending.outputs:
        if pending.params:
            torch.autograd.backward(pending.outputs, pending.grads, inputs=pending.params)
        pending.outputs.clear()
        return
    for n, group in enumerate(pending.groups):
        roots, root_grads = [], []
        for node in group.joins:
            for k, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    roots.append(GradientEdge(node, k))
                    root_grads.append(g)
        if not roots:
            continue
        # a node reached from another of the group's nodes already has its whole gradient
        handles = [
            node.register_prehook(lambda _, kept=group.grads[node]: kept)
            for node in group.joins
            if node in group.grads
        ]
        try:
            torch.autograd.backward(
                roots, root_grads, inputs=group.params, retain_graph=n < len(pending.groups) - 1
            )
        finally:
            for h in handles:
                h.remove()
    pending.groups.clear()


def _accumulate(tensors: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    for t, g in zip(tensors, grads, strict=True):
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g


# ---------------------------------------------------------------------------- the graph


def _node(t: Tensor) -> Node:
    """The autograd node that receives `t`'s gradient (its accumulator for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    view = t.view_as(t).grad_fn
    assert view is not None, "a tensor that requires grad has an autograd node"
    accumulator = view.next_functions[0][0]
    assert accumulator is not None
    return accumulator


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """For every node the outputs depend on, the nodes that use its result (forward edges)."""
    consumers: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(roots)
    queue = collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _downstream(starts: list[Node], consumers: dict[Node, list[Node]], stop: frozenset[Node]) -> set[Node]:
    """The nodes computed from `starts` (forward), not going past the nodes in `stop`."""
    out = set(starts)
    queue = collections.deque(starts)
    while queue:
        for user in consumers.get(queue.popleft(), ()):
            if user not in out and user not in stop:
                out.add(user)
                queue.append(user)
    return out


def _groups(
    params: list[Tensor], consumers: dict[Node, list[Node]], on_input_path: set[Node], roots: set[Node]
) -> list[_Group] | None:
    """The weights grouped by the input-path nodes their paths join at; None if some weight
    reaches an output by a path that never joins the input path."""
    joins_of: dict[int, set[Node]] = {}
    stop = frozenset(on_input_path)
    for i, p in enumerate(params):
        node = _node(p)
        own = _downstream([node], consumers, stop=stop)
        if own & roots:
            return None
        joins = {u for n in own for u in consumers.get(n, ()) if u in on_input_path}
        joins_of[i] = joins
    # union the weights that share a join node
    parent = list(range(len(params)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Node, int] = {}
    for i, joins in joins_of.items():
        for n in joins:
            if n in owner:
                parent[root(i)] = root(owner[n])
            else:
                owner[n] = i
    groups: dict[int, _Group] = {}
    for i, joins in joins_of.items():
        g = groups.setdefault(root(i), _Group([], []))
        g.params.append(params[i])
        g.joins.extend(n for n in joins if n not in g.joins)
    return list(groups.values())
