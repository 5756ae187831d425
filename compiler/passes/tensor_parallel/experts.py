"""The op rule for an experts unit (`meshplan.experts`, captured by the experts pass) whose
experts' matrices a tensor axis splits (`expert_tensor_rules`).

Each rank of the axis computes, for every token, its slice of each of the token's experts:
the tokens and their routing weights come in whole (Megatron's f: in backward each rank's
gradient is its slice's share, summed over the axis), and the unit's output is a partial
sum, reduced at once (all-reduce, or reduce-scatter onto token shards under sequence
parallelism), as a row split's is. Reducing the unit's (N, H) output, after the combine has
summed each token's k experts, moves k times fewer rows than reducing the experts' outputs.

    tokens = self.copy_to_tp(reshape_1)                                 # f
    weights = self.copy_to_tp(div)                                      # f
    experts = torch.ops.meshplan.experts.default(tokens, getitem_5, weights, [gate_up_proj, down_proj], ...)
    experts_1 = self.all_reduce_tp(experts)                             # (N, H), once
"""

from __future__ import annotations

from torch import fx

from ...graph import RULE, arg_node
from ...placement import PARTIAL, REPLICATE, Replicate, Shard
from ..experts import MARKER
from .walk import Walk, register


def _on_local_rows(
    w: Walk, node: fx.Node, tokens: fx.Node, index: fx.Node, weights: fx.Node, params: list[fx.Node]
) -> None:
    """Experts whole over this axis. Tokens cut by rows over it (sequence parallelism, a context
    axis: `Shard(0, blocks)` of the flattened tokens) stay cut: each rank's unit routes and
    computes its own rows, as every rank of a data axis does, and its output is cut alike.
    The experts' weights then see a shard of the tokens: read through f, their gradients are
    partial over this axis (summed by the gradient sync: `grad_sums.py`). A capacity counts
    the tokens of one call, so a unit with one gets every token (gathered), as one device."""
    rows = w.placement(tokens)
    rule = w.spec.experts.get(str(node.args[4]))
    capacity = rule is not None and any(
        a.name.text == "capacity_factor" for a in getattr(rule.action, "args", ())
    )
    if not (isinstance(rows, Shard) and rows.dim == 0) or capacity:
        w.default(node)  # the unit's inputs gathered if they are not whole
        return
    for routing in (index, weights):
        have = w.placement(routing)
        if have != rows:
            if not isinstance(have, Replicate):
                w.use(node, routing, (routing := w.convert(routing, REPLICATE, because=rule)))
            w.use(node, routing, w.convert(routing, rows, because=rule))
    for p in params:
        w.use(node, p, w.convert(p, REPLICATE, into_sharded=True, because=rule))
    w.set(node, rows, rule)


@register(MARKER)
def _experts(w: Walk, node: fx.Node) -> None:
    tokens, index, weights = (arg_node(node, i) for i in range(3))
    params = [p for p in node.args[3] if isinstance(p, fx.Node)]  # type: ignore[union-attr]
    split = [p for p in params if isinstance(w.placement(p), Shard)]
    if not split:
        _on_local_rows(w, node, tokens, index, weights, params)
        return
    rules = [r for p in split if (r := p.meta.get(RULE)) is not None]
    # the reduction is the row split's: the ledger names its rule
    rule = next((r for r in rules if getattr(r.action, "style", None) == "row"), rules[0] if rules else None)
    w.use(node, tokens, w.convert(tokens, REPLICATE, into_sharded=True, because=rule))
    w.use(node, weights, w.convert(weights, REPLICATE, into_sharded=True, because=rule))
    if not isinstance(w.placement(index), Replicate):
        w.use(node, index, w.convert(index, REPLICATE, because=rule))
    w.set(node, PARTIAL, rule)
    reduced = w.reduce_partial(node)
    for user in list(node.users):
        if user is not reduced:
            user.replace_input_with(node, reduced)
