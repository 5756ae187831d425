"""The op rule for an experts unit (`meshplan.experts`, captured by the experts pass) on one
walk's axis. Three cases, then the default (its inputs gathered, the unit run whole):

1. The axis splits the experts' matrices (`layers.*.mlp.experts.gate_up_proj: column over tp`,
   `expert_tensor_rules`). Each rank computes, for every token, its slice of each of the
   token's experts: the tokens and their routing weights come in whole (Megatron's f: in
   backward each rank's gradient is its slice's share, summed over the axis), and the unit's
   output is a partial sum, reduced at once (all-reduce, or reduce-scatter onto token shards
   under sequence parallelism), as a row split's is. Reducing the unit's (N, H) output, after
   the combine has summed each token's k experts, moves k times fewer rows than reducing the
   experts' outputs:

       tokens = self.copy_to_tp(reshape_1)                                 # f
       weights = self.copy_to_tp(div)                                      # f
       experts = torch.ops.meshplan.experts.default(tokens, getitem_5, weights, [gate_up_proj, down_proj], ...)
       experts_1 = self.all_reduce_tp(experts)                             # (N, H), once

2. The experts borrow the axis (`experts over tp`): each rank routes its own rows of the
   tokens the axis's ranks share (`_split_over_experts`).
3. The experts are whole over the axis: each rank's unit routes its own rows, those the tokens
   come in cut by (sequence or context parallelism) or its split of whole tokens, gathered
   back after (`_whole_over_the_axis`).
"""

from __future__ import annotations

import torch
from torch import fx

from meshplan.dsl.axes import axes_of
from meshplan.dsl.check import PlanRule

from ... import meta
from ...graph import arg_node, divides, hint, shape
from ...placement import PARTIAL, REPLICATE, Replicate, Shard
from ..experts.units import MARKER
from .walk import Walk, register


def _whole_over_the_axis(
    w: Walk, node: fx.Node, tokens: fx.Node, index: fx.Node, weights: fx.Node, params: list[fx.Node]
) -> None:
    """Experts whole over this axis (cases 2 and 3). Tokens cut by rows over it (sequence
    parallelism, a context axis: `Shard(0, blocks)` of the flattened tokens) stay cut: each
    rank's unit routes and computes its own rows, as every rank of a data axis does, and its
    output is cut alike. Whole tokens (attention split over tp, no sequence rule) are cut by
    rows here, and the output gathered back: otherwise every rank of the axis would route,
    send and compute the same tokens' experts (tp times the work, and the all-to-all bytes).
    The experts' weights then see a shard of the tokens: read through f, their gradients are
    partial over this axis (summed by the gradient sync: `grad_sums.py`). A capacity counts
    the tokens of one call: the ranks of this axis queue their rows together (`ROWS_CUT`:
    each gathers the others' routing, N k ints), unless the tokens are cut in the
    load-balanced layout or over another axis already: then the unit gets them all, gathered."""
    have = w.placement(tokens)
    rule = w.spec.experts.get(str(node.args[4]))
    if rule is not None and rule.axis is not None and w.axis in axes_of(rule.axis):  # they borrow this axis
        _split_over_experts(w, node, tokens, index, weights, rule)
        return
    capacity = rule is not None and any(
        a.name.text == "capacity_factor" for a in getattr(rule.action, "args", ())
    )
    # a capacity queues the rows of every rank of one axis together: of one axis only, and not
    # in the load-balanced layout (its chunks are not in the tokens' order)
    queues = not capacity or (not meta.rows_cut(node) and not w.spec.balanced)
    whole = queues and isinstance(have, Replicate) and _rows_divide(w, node, tokens, rule)
    if not queues or not (whole or (isinstance(have, Shard) and have.dim == 0)):
        w.default(node)  # the unit's inputs gathered if they are not whole
        return
    rows = have if isinstance(have, Shard) else Shard(0)
    if whole:  # each rank computes its split of the tokens, not all of them again
        w.use(node, tokens, w.convert(tokens, rows, because=rule))
    _routing_cut_like(w, node, (index, weights), rows, rule)
    for p in params:
        w.use(node, p, w.convert(p, REPLICATE, into_sharded=True, because=rule))
    w.set(node, rows, rule)
    meta.add_rows_cut(node, w.axis)
    if capacity:  # the ranks of this axis queue their rows together, as one device's tokens
        meta.set_token_chunks(node, len(rows.blocks) or 1)
    if whole:
        _gathered_for_users(w, node, rule)


def _split_over_experts(
    w: Walk, node: fx.Node, tokens: fx.Node, index: fx.Node, weights: fx.Node, rule: PlanRule
) -> None:
    """`experts over tp` on an axis tensor rules use: its ranks hold other experts and share the
    tokens, so each routes its own rows of them (its sequence shard, or its split of whole
    tokens) to the ranks of their experts, and the output comes back cut alike. The experts'
    weights are whole over the axis here (the experts pass cuts them by expert); their
    gradients are complete, every rank's rows summed by the all-to-all's backward."""
    have = w.placement(tokens)
    whole = not (isinstance(have, Shard) and have.dim == 0)
    rows = have if isinstance(have, Shard) and not whole else Shard(0)
    if whole:  # each rank takes its split of the tokens, and the output is gathered back
        if not isinstance(have, Replicate):
            tokens = w.use(node, tokens, w.convert(tokens, REPLICATE, because=rule))
        w.use(node, tokens, w.convert(tokens, rows, because=rule))
    _routing_cut_like(w, node, (index, weights), rows, rule)
    w.set(node, rows, rule)
    # a capacity counts the tokens its ranks share: each rank's rows are chunks of them, in
    # order (one chunk of whole tokens, or under sequence parallelism one per sequence)
    meta.set_token_chunks(node, len(rows.blocks) or 1)
    if whole:
        _gathered_for_users(w, node, rule)


def _rows_divide(w: Walk, node: fx.Node, tokens: fx.Node, rule: PlanRule | None) -> bool:
    """Whether whole tokens can be cut into equal rows over the axis: at the example shape, and
    (noted for the run to check, as a sequence cut is) at the shapes the program serves. A list's
    rows are one per routed (token, slot) pair: N k, N the routing's tokens (`ROUTING`)."""
    size = shape(tokens)[0]
    routing = meta.routing(node)
    if hint(size) is None and routing is not None and routing.index is not None:
        size = shape(routing.index)[0] * routing.k
    example = hint(size)
    if example is None or example % w.n:
        return False  # the rows stay whole: every rank computes them (correct, the work repeated)
    if divides(w.n, size) is None and isinstance(size, torch.SymInt):
        w.spec.cuts.setdefault((size.node.expr, w.n), rule)
    return True


def _gathered_for_users(w: Walk, node: fx.Node, rule: PlanRule | None) -> None:
    """The unit's output, cut by rows, gathered back whole for every user (as its tokens came)."""
    gathered = w.convert(node, REPLICATE, because=rule)
    for user in list(node.users):
        if user is not gathered:
            user.replace_input_with(node, gathered)


def _routing_cut_like(
    w: Walk, node: fx.Node, routing: tuple[fx.Node, ...], rows: Shard, rule: PlanRule | None
) -> None:
    """The unit's top_k_index and top_k_weights cut by rows as its tokens are."""
    for arg in routing:
        have = w.placement(arg)
        if have != rows:
            if not isinstance(have, Replicate):
                arg = w.use(node, arg, w.convert(arg, REPLICATE, because=rule))
            w.use(node, arg, w.convert(arg, rows, because=rule))


def _bias_share(w: Walk, node: fx.Node, bias: fx.Node, rule: PlanRule | None) -> None:
    """A bias the experts add after their row matrices: each rank's unit adds 1/n of it to its
    partial sum, so the reduction over the axis adds it once. Read through f, its gradient (1/n
    of the whole on each rank) is summed over the axis (by the gradient sync: `grad_sums.py`).

        down_proj_bias = self.copy_to_tp(down_proj_bias)      # f
        down_proj_bias = torch.ops.aten.div.Tensor(down_proj_bias, 2)
    """
    read = w.convert(bias, REPLICATE, into_sharded=True, because=rule)
    with w.graph.inserting_after(read):
        share = w.graph.call_function(torch.ops.aten.div.Tensor, (read, w.n))
    share.meta.update({k: v for k, v in read.meta.items() if k in ("val", "nn_module_stack")})
    meta.copy_facts(read, share, meta.REQUIRES_GRAD)
    meta.set_placement(share, w.other_axes(read))
    w.set(share, REPLICATE, rule)
    w.use(node, bias, share)


@register(MARKER)
def _experts(w: Walk, node: fx.Node) -> None:
    tokens, index, weights = (arg_node(node, i) for i in range(3))
    params = [p for p in node.args[3] if isinstance(p, fx.Node)]  # type: ignore[union-attr]
    split = [p for p in params if isinstance(w.placement(p), Shard)]
    if not split:
        _whole_over_the_axis(w, node, tokens, index, weights, params)
        return
    rules = [r for p in split if (r := meta.rule(p)) is not None]
    # the reduction is the row split's: the ledger names its rule
    rule = next((r for r in rules if getattr(r.action, "style", None) == "row"), rules[0] if rules else None)
    w.use(node, tokens, w.convert(tokens, REPLICATE, into_sharded=True, because=rule))
    if meta.requires_grad(weights) is not False:  # a list's rows are weighed after, by the model
        w.use(node, weights, w.convert(weights, REPLICATE, into_sharded=True, because=rule))
    if not isinstance(w.placement(index), Replicate):
        w.use(node, index, w.convert(index, REPLICATE, because=rule))
    for p in params:
        if p.op == "get_attr" and str(p.target) in w.spec.row_biases:
            _bias_share(w, node, p, rule)
    w.set(node, PARTIAL, rule)
    reduced = w.reduce_partial(node)
    for user in list(node.users):
        if user is not reduced:
            user.replace_input_with(node, reduced)
