"""Op rules for elementwise ops, reductions, softmax and layer norm."""

from __future__ import annotations

import torch
from torch import fx

from ... import meta
from ...graph import (
    arg_node,
    as_list,
    describe,
    divides,
    hint,
    is_tensor_node,
    known_equal,
    shape,
)
from ...placement import PARTIAL, REPLICATE, Partial, Shard
from .walk import Walk, _norm_dim, register

aten = torch.ops.aten

# ---------------------------------------------------------------------------- elementwise


_ELEMENTWISE = [
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.neg.default,
    aten.pow.Tensor_Scalar,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.exp.default,
    aten.log.default,
    aten.silu.default,
    aten.gelu.default,
    aten.relu.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.dropout.default,
    aten.alias.default,
    aten.where.self,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.maximum.default,
    aten.minimum.default,
    aten.erf.default,
    aten.reciprocal.default,
    aten.abs.default,
    aten.add.Scalar,
    aten.mul.Scalar,
    aten.sub.Scalar,
    aten.div.Scalar,
    aten.pow.Tensor_Tensor,
    aten.detach.default,
    aten.to.dtype_layout,
    aten.to.device,
    aten.softplus.default,
    aten.square.default,
]


@register(*_ELEMENTWISE)
def _elementwise(w: Walk, node: fx.Node) -> None:
    out_ndim = len(shape(node))
    tensors = [a for a in node.all_input_nodes if is_tensor_node(a)]
    for a in tensors:
        if isinstance(w.placement(a), Partial):
            w.use(node, a, w.reduce_partial(a))
    tensors = [a for a in node.all_input_nodes if is_tensor_node(a)]
    dims = set()
    blocks = {(p.blocks, p.replicas, p.padded) for a in tensors if isinstance(p := w.placement(a), Shard)}
    for a in tensors:
        p = w.placement(a)
        if isinstance(p, Shard):
            dims.add(p.dim + out_ndim - len(shape(a)))  # align by broadcasting from the right
    if not dims:
        w.set(node, REPLICATE, w.rule_near(node))
        return
    if len(dims) > 1 or len(blocks) > 1:
        w.error(node, f"{describe(node)} combines tensors sharded differently over `{w.axis}`")
    (dim,) = dims
    ((nblocks, replicas, padded),) = blocks
    for a in tensors:
        p = w.placement(a)
        if isinstance(p, Shard):
            continue
        a_dim = dim - (out_ndim - len(shape(a)))
        spans = a_dim >= 0 and not known_equal(shape(a)[a_dim], 1)
        because = w.rule_for_module(node) or w.rule_near(node)
        if spans:
            w.use(node, a, w.convert(a, Shard(a_dim, nblocks, replicas, padded), because=because))
        elif w.requires_grad(a):
            w.use(node, a, w.convert(a, REPLICATE, into_sharded=True, because=because))
    w.set(node, Shard(dim, nblocks, replicas, padded), w.rule_near(node))


@register(aten.type_as.default)
def _type_as(w: Walk, node: fx.Node) -> None:
    # the second argument only supplies a dtype
    w.set(node, w.placement(node.args[0]), w.rule_near(node))


# ---------------------------------------------------------------------------- reductions


@register(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default)
def _reduce(w: Walk, node: fx.Node) -> None:
    x = w.summed(node, arg_node(node, 0))
    p = w.placement(x)
    ndim = len(shape(x))
    requested = node.args[1] if len(node.args) > 1 else None
    dims = (
        list(range(ndim))
        if requested in (None, [])
        else [_norm_dim(d, ndim) for d in as_list(requested, of=node)]
    )
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if isinstance(p, Shard):
        if p.dim in dims and node.target in (aten.mean.dim, aten.sum.dim_IntList) and not p.padded:
            _summed_over_shards(w, node, p)
            return
        if p.dim in dims:
            w.error(
                node,
                f"{describe(node)} reduces over dim {p.dim}, which is sharded over `{w.axis}`",
                hint="this module cannot run on shards; replicate it or change the split",
            )
        out = p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)
        w.set(node, p.at(out), w.rule_near(node))
    else:
        w.set(node, REPLICATE)


def _summed_over_shards(w: Walk, node: fx.Node, p: Shard) -> None:
    """A sum or mean over the sharded dim (attention weights averaged over split heads): each
    rank's result is a summand of the whole one, scaled so that the ranks' summands add up to it
    (a mean of equal chunks: each chunk's mean over n; chunks on m ranks each: over m), then
    reduced at once."""
    scale = w.n if node.target is aten.mean.dim else p.replicas
    w.set(node, PARTIAL, w.rule_near(node))
    summand = node
    if scale > 1:
        with w.graph.inserting_after(node):
            summand = w.graph.call_function(aten.div.Tensor, (node, scale))
        summand.meta.update({k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack")})
        meta.copy_facts(node, summand, meta.REQUIRES_GRAD)
        node.replace_all_uses_with(summand, delete_user_cb=lambda u: u is not summand)
        w.set(summand, PARTIAL, w.rule_near(node))
    # whole, not scattered by sequence: the reduced tensor (a norm's statistic of features tp
    # cuts: OLMo 2's q-norm) meets the features it was reduced from, whose sequence is whole
    reduced = w.reduce_partial(summand, whole=True)
    for user in list(summand.users):
        if user is not reduced:
            user.replace_input_with(summand, reduced)


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def _softmax(w: Walk, node: fx.Node) -> None:
    x = w.summed(node, arg_node(node, 0))
    p = w.placement(x)
    dim = _norm_dim(node.args[1], len(shape(x)))
    if isinstance(p, Shard) and p.dim == dim:  # move the shard to another dim: one all-to-all
        other = _another_dim(w, x, p, dim)
        if other is None:
            w.error(node, f"{describe(node)} normalizes over dim {dim}, which is sharded over `{w.axis}`")
        p = Shard(other)
        w.use(node, x, w.convert(x, p, because=w.rule_near(node)))
    w.set(node, p, w.rule_near(node))


def _another_dim(w: Walk, x: fx.Node, p: Shard, busy: int) -> int | None:
    """The dim a plain shard of `x` can move to when an op needs `busy` whole: the largest other
    dim the axis divides (the all-to-all's pieces stay large), or None."""
    if p.blocks or p.replicas > 1 or p.padded:
        return None
    sizes = shape(x)
    # a size that follows from the token shape counts at its example value; that it divides
    # for the run's shape is noted when the shard is placed (`Walk.cut`)
    examples = [hint(s) for s in sizes]
    free = [
        d
        for d, (s, e) in enumerate(zip(sizes, examples, strict=True))
        if d != busy and e is not None and e % w.n == 0 and divides(w.n, s) is not False
    ]
    return max(free, key=lambda d: (examples[d], d), default=None)


@register(aten.layer_norm.default)
def _layer_norm(w: Walk, node: fx.Node) -> None:
    p, normalized = w.placement(w.summed(node, arg_node(node, 0))), node.args[1]
    ndim = len(shape(node))
    if isinstance(p, Shard) and p.dim >= ndim - len(as_list(normalized, of=node)):
        w.error(node, f"{describe(node)} normalizes over a dim sharded over `{w.axis}`")
    if isinstance(p, Shard):
        for param in node.args[2:4]:
            if isinstance(param, fx.Node) and w.requires_grad(param):
                w.use(
                    node,
                    param,
                    w.convert(param, REPLICATE, into_sharded=True, because=w.rule_for_module(node)),
                )
    w.set(node, p, w.rule_near(node))
