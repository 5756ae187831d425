"""Op rules for linear layers (column/row splits, fused blocks, GQA key/value heads), the
vocab-parallel embedding and the vocab-parallel or token-sharded loss."""

from __future__ import annotations

import torch
from torch import fx

from meshplan.dsl.check import PlanRule
from meshplan.dsl.errors import Diagnostic

from ... import meta
from ...graph import (
    arg_node,
    as_node,
    describe,
    module_path,
    optional_arg_node,
    shape,
)
from ...placement import PARTIAL, REPLICATE, Partial, Replicate, Shard
from .pointwise import _elementwise
from .walk import Walk, _through_casts, register
from .weights import source

aten = torch.ops.aten

# ---------------------------------------------------------------------------- linear and embedding


def _kv_group(
    w: Walk, node: fx.Node, x: fx.Node, params: tuple[fx.Node, fx.Node | None], replicas: int
) -> None:
    """A key/value projection with fewer heads than ranks (GQA): every rank computes all kv heads
    from the whole weight, then keeps the one its query heads use, `replicas` ranks per head.
    The weight's and the input's gradients are partial (each rank's heads), summed by f.

        k = linear(copy_to_tp(h), k_proj_weight)      # (B, T, kv * D), weight replicated
        k = self.kv_group_tp(k, -1, replicas)         # (B, T, D): head rank // replicas
    """
    rule = w.spec.params[str(_through_casts(params[0]).target)].rule
    w.use(node, x, w.convert(x, REPLICATE, into_sharded=True, because=rule))
    for p in params:
        if isinstance(p, fx.Node) and w.requires_grad(p):
            w.use(node, p, w.convert(p, REPLICATE, into_sharded=True, because=rule))
    w.set(node, REPLICATE, rule)
    last = len(shape(node)) - 1
    name = w.module_for("kv_group")
    with w.graph.inserting_after(node):
        group = w.graph.call_module(name, (node, last, replicas))
    group.meta.update({k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack")})
    meta.copy_facts(node, group, meta.REQUIRES_GRAD)
    node.replace_all_uses_with(group, delete_user_cb=lambda u: u is not group)
    w.set(group, Shard(last, (), replicas), rule)


@register(aten.linear.default)
def _linear(w: Walk, node: fx.Node) -> None:
    x, weight = arg_node(node, 0), arg_node(node, 1)
    bias = optional_arg_node(node, 2)
    wp = w.placement(weight)
    rule = meta.rule(weight)
    last = len(shape(node)) - 1
    replicas = w.spec.kv_replicas.get(str(_through_casts(weight).target))
    if replicas:
        _kv_group(w, node, x, (weight, bias), replicas)
        return
    if (
        isinstance(wp, Shard) and wp.dim == 0 and wp.padded
    ):  # an LM head over a vocabulary the axis does not divide
        w.use(node, x, w.convert(x, REPLICATE, into_sharded=True, because=rule))
        w.set(node, Shard(last, padded=wp.padded), rule)
        return
    if isinstance(wp, Shard) and wp.dim == 0:  # column (or vocab on an LM head): outputs sharded
        column_product(w, node, x, (weight, bias), weight_dim=0)
        return
    if isinstance(wp, Shard) and wp.dim == 1:  # row: inputs sharded, outputs partial
        if bias is not None:
            node.args = node.args[:2]  # the bias is added once, after the reduction
        row_product(w, node, x, weight, bias)
        return
    # replicated weight: the op is independent per row, so a shard on any dim but the last passes
    xp = w.placement(x)
    if isinstance(xp, Shard) and xp.dim == len(shape(x)) - 1:
        w.use(node, x, w.convert(x, REPLICATE))
        near = w.rule_near(node)
        if near is not None:
            w.diagnostics.append(
                Diagnostic(
                    near.span,
                    f"column split feeds `{module_path(node)}`, which is not split: its input "
                    "is all-gathered",
                    hint=f"add a `row over {w.axis}` rule for `{module_path(node)}`",
                    severity="warning",
                )
            )
        xp = REPLICATE
    if isinstance(xp, Partial):
        xp = w.placement(w.use(node, x, w.reduce_partial(x)))
    for p in (weight, bias):
        if p is not None and isinstance(xp, Shard):
            w.use(node, p, w.convert(p, REPLICATE, into_sharded=True))
    w.set(node, xp)


@register(aten.embedding.default)
def _embedding(w: Walk, node: fx.Node) -> None:
    weight, ids = arg_node(node, 0), node.args[1]
    wp = w.placement(weight)
    rule = meta.rule(weight)
    if isinstance(wp, Shard) and wp.dim == 0:
        padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        args = (weight, ids) if padding_idx in (-1, None) else (weight, ids, padding_idx)
        vocab = w.replace_by_module(node, "vocab_embedding", args, rule)
        w.set(vocab, PARTIAL, rule)
        reduced = w.reduce_partial(vocab)
        for user in list(vocab.users):
            if user is not reduced:
                user.replace_input_with(vocab, reduced)
        return
    if isinstance(wp, Shard):
        w.error(
            node, f"an embedding can only be split over its vocabulary: use `vocab over {w.axis}`", rule=rule
        )
    ip = w.placement(ids)
    if isinstance(ip, Shard):  # ids cut by sequence (context parallelism): each rank looks up its own
        if w.requires_grad(weight):
            w.use(node, weight, w.convert(weight, REPLICATE, into_sharded=True, because=w.rule_near(node)))
        w.set(node, ip, w.rule_near(node))
        return
    w.set(node, REPLICATE)


@register(aten.cross_entropy_loss.default)
def _cross_entropy(w: Walk, node: fx.Node) -> None:
    logits, target = arg_node(node, 0), arg_node(node, 1)
    lp = w.placement(logits)
    ndim = len(shape(logits))
    if isinstance(lp, Shard) and lp.dim == 0 and ndim == 2:
        return _token_sharded_loss(w, node, lp)
    if isinstance(lp, Shard) and lp.dim == ndim - 1 and ndim == 2:
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        ignore_index = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
        if weight is not None:
            w.error(
                node,
                "vocab-parallel cross-entropy takes no class weights",
                hint="replicate the LM head instead",
                rule=meta.rule(logits),
            )
        with w.graph.inserting_before(node):
            ce = w.graph.call_module(
                w.module_for("vocab_cross_entropy"),
                (logits, w_target(w, target), ignore_index)
                + ((reduction,) if reduction != 1 or smoothing or lp.padded else ())
                + ((smoothing,) if smoothing or lp.padded else ())
                + ((lp.padded,) if lp.padded else ()),
            )
        ce.meta.update(node.meta)
        meta.set_collective(
            ce, {"kind": "vocab_cross_entropy", "axis": w.axis, "dim": None, "rule": meta.rule(logits)}
        )
        node.replace_all_uses_with(ce)
        w.graph.erase_node(node)
        w.set(ce, REPLICATE, meta.rule(logits))
        return
    w.default(node)


def _token_sharded_loss(w: Walk, node: fx.Node, placement: Shard) -> None:
    """Cross-entropy of logits sharded by token (sequence parallelism up to the loss): each rank
    sums the loss of its tokens; a mean divides by the valid tokens of the whole batch, counted
    from the replicated targets, so the result is a partial sum, reduced by one all-reduce.

        loss = cross_entropy(logits, targets)          # logits (N/n, V), targets (N,)
    ->
        split = self.split_tp(targets, 0, B)           # this rank's targets
        loss = cross_entropy(logits, split, reduction=sum)
        loss = div(loss, sum(ne(targets, ignore_index)))   # Partial()
    """
    args = list(node.args) + [None] * (6 - len(node.args))
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}
    values = {
        n: node.kwargs.get(n, args[i] if i < len(node.args) else defaults.get(n)) for i, n in enumerate(names)
    }
    if values["weight"] is not None:
        w.error(node, f"{describe(node)}: class weights are not supported on logits sharded by token")
    target = as_node(values["target"], of=node)
    if isinstance(w.placement(target), Partial) or (
        isinstance(w.placement(target), Shard) and w.placement(target) != placement
    ):
        w.error(node, f"{describe(node)}: targets and logits are placed differently over `{w.axis}`")
    local_target = w.convert(target, placement)
    reduction = values["reduction"]
    node.args = (
        values["input"],
        local_target,
        None,
        0 if reduction == 0 else 2,
        values["ignore_index"],
        values["label_smoothing"],
    )
    node.kwargs = {}
    if reduction == 0:  # per token: stays sharded like the logits
        w.set(node, placement, w.rule_near(node))
        return
    out = node
    if reduction == 1:
        valid = _call(w, aten.ne.Scalar, (target, values["ignore_index"]), node)
        count = _call(w, aten.sum.default, (valid,), valid)
        w.set(valid, w.placement(target))
        if isinstance(w.placement(target), Shard):  # targets cut too (context parallelism): sum the counts
            w.set(count, PARTIAL)
            count = w.reduce_partial(count)
        else:
            w.set(count, REPLICATE)
        out = _call(w, aten.div.Tensor, (node, count), count)
        node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out)
    w.set(node, PARTIAL, w.rule_near(node))
    w.set(out, PARTIAL, w.rule_near(node))


def _call(w: Walk, op, args: tuple, after: fx.Node) -> fx.Node:
    """A new call_function node after `after`, with export's `val` computed on fake tensors."""
    with w.graph.inserting_after(after):
        new = w.graph.call_function(op, args)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    new.meta["val"] = op(*vals)
    new.meta["nn_module_stack"] = after.meta.get("nn_module_stack", {})
    meta.set_requires_grad(new, any(w.requires_grad(a) for a in args if isinstance(a, fx.Node)))
    return new


def w_target(w: Walk, target: fx.Node) -> fx.Node:
    if isinstance(w.placement(target), Replicate):
        return target
    return w.convert(target, REPLICATE)


@register(aten.addmm.default, aten.mm.default)
def _matmul_2d(w: Walk, node: fx.Node) -> None:
    """`addmm(bias, x, W)` / `mm(x, W)`: W stored (in, out), as Hugging Face's Conv1D does, or a
    weight's transpose."""
    has_bias = node.target is aten.addmm.default
    bias = arg_node(node, 0) if has_bias else None
    x, weight = (arg_node(node, 1), arg_node(node, 2)) if has_bias else (arg_node(node, 0), arg_node(node, 1))
    if weight_product(w, node, x, weight, bias):
        return
    xp = w.placement(w.summed(node, x))
    if isinstance(xp, Shard) and xp.dim == 1:
        xp = w.placement(w.use(node, x, w.convert(x, REPLICATE)))
    if isinstance(xp, Shard):
        for p in (weight, bias):
            if p is not None:
                w.use(node, p, w.convert(p, REPLICATE, into_sharded=True))
    w.set(node, xp)


def weight_product(w: Walk, node: fx.Node, x: fx.Node, weight: fx.Node, bias: fx.Node | None) -> bool:
    """`x @ weight` (matmul, mm, bmm, addmm with `bias`) where `weight` is a split parameter read
    through casts and transposes (`weights.source`), its last dim the output features: a column
    split if that dim is sharded, a row split if the one before is. Returns whether it decided `node`."""
    wp = w.placement(weight)
    found = source(weight)
    nb = len(shape(weight))
    if not isinstance(wp, Shard) or found is None or nb != 2 or wp.dim not in (0, 1) or wp.padded:
        return False
    if wp.dim == nb - 1:
        column_product(w, node, x, (weight, bias or _added_bias(node)), weight_dim=nb - 1)
        return True
    if bias is not None:  # addmm: the bias is added once, after the reduction
        node.target = aten.mm.default
        node.args = (x, weight)
    row_product(w, node, x, weight, bias)
    return True


def _added_bias(node: fx.Node) -> fx.Node | None:
    """The 1-D parameter added to the product `node` (`x @ W.T + b`), if one is: its blocks
    are the product's."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if user.target is not aten.add.Tensor:
        return None
    other = next((a for a in user.args if isinstance(a, fx.Node) and a is not node), None)
    found = source(other) if other is not None else None
    return other if found is not None and len(shape(found[0])) == 1 else None


def column_product(
    w: Walk, node: fx.Node, x: fx.Node, params: tuple[fx.Node, fx.Node | None], *, weight_dim: int
) -> None:
    """`node` multiplies `x` by a weight split by its output features (its dim `weight_dim`,
    read through casts and transposes): `x` goes in whole (f: all-reduce of its gradient in
    backward), the output is sharded on its last dim, in blocks if the model's code then cuts it
    into pieces (fused q/k/v)."""
    rule = meta.rule(params[0])
    w.use(node, x, w.convert(x, REPLICATE, into_sharded=True, because=rule))
    blocks = w.fuse_blocks(node, len(shape(node)) - 1, params, weight_dim=weight_dim)
    w.set(node, Shard(len(shape(node)) - 1, blocks), rule)


def row_product(w: Walk, node: fx.Node, x: fx.Node, weight: fx.Node, bias: fx.Node | None) -> None:
    """`node` multiplies `x` by a weight split by its input features: `x` must be sharded on its
    last dim (a replicated one is split locally, with a warning), the output is partial sums,
    reduced at once, and `bias` (already dropped from `node`) added after."""
    rule = meta.rule(weight)
    xp = w.placement(x)
    if xp != Shard(len(shape(x)) - 1):
        if not isinstance(xp, Replicate):
            x = w.use(node, x, w.convert(x, REPLICATE, because=rule))
        w.use(node, x, w.convert(x, Shard(len(shape(x)) - 1), because=rule))
        assert rule is not None  # a split weight's placement came from its tensor rule
        w.diagnostics.append(
            Diagnostic(
                rule.span,
                f"row split `{module_path(node)}` gets a replicated input: it is split "
                "locally, which costs an all-gather in backward",
                hint="pair it with a column split before it",
                severity="warning",
            )
        )
    _reduce_row_output(w, node, bias, rule)


def _reduce_row_output(w: Walk, node: fx.Node, bias: fx.Node | None, rule: PlanRule | None) -> None:
    """A row split's partial sums are reduced at once; its bias (dropped from `node`) is added after."""
    w.set(node, PARTIAL, rule)
    reduced = w.reduce_partial(node)
    result = reduced
    if bias is not None:
        with w.graph.inserting_after(reduced):
            result = w.graph.call_function(aten.add.Tensor, (reduced, bias))
        result.meta.update({k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack")})
        meta.copy_facts(node, result, meta.REQUIRES_GRAD)
        _elementwise(w, result)
    for user in list(node.users):
        if user is not reduced:
            user.replace_input_with(node, result)
