"""Op rules for attention and batched matmuls, factories, repeat_interleave, 2-D matmuls."""

from __future__ import annotations

import torch
from torch import fx

from ...graph import (
    RULE,
    arg_node,
    describe,
    known_equal,
    shape,
)
from ...placement import REPLICATE, Partial, Shard
from .linear import _reduce_row_output
from .walk import _RULES, Walk, _norm_dim, register

aten = torch.ops.aten

# ---------------------------------------------------------------------------- attention


@register(aten.scaled_dot_product_attention.default)
def _sdpa(w: Walk, node: fx.Node) -> None:
    q, k, v = node.args[:3]
    ps = {w.placement(t) for t in (q, k, v)}
    if ps == {REPLICATE}:
        w.set(node, REPLICATE)
        return
    if ps != {Shard(1)}:
        if any(isinstance(p, Shard) and p.dim == 2 for p in ps):
            w.error(
                node,
                f"{describe(node)} would attend over a sequence sharded over `{w.axis}`",
                hint="attention needs the whole sequence: use `context ring over AXIS` for long sequences",
            )
        w.error(
            node,
            f"{describe(node)}: q, k and v must all be split by heads over `{w.axis}` "
            f"(got {', '.join(str(w.placement(t)) for t in (q, k, v))})",
            hint="split q_proj, k_proj and v_proj with the same column rule",
        )
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node) and len(shape(mask)) >= 3 and not known_equal(shape(mask)[-3], 1):
        w.use(node, mask, w.convert(mask, Shard(len(shape(mask)) - 3)))
    w.set(node, Shard(1), w.rule_near(node))


@register(aten.matmul.default, aten.bmm.default)
def _matmul(w: Walk, node: fx.Node) -> None:
    a, b = arg_node(node, 0), arg_node(node, 1)
    pa, pb = w.placement(a), w.placement(b)
    if pa == pb == REPLICATE:
        w.set(node, REPLICATE)
        return
    nd = len(shape(node))
    if (  # both sharded on a batch dim
        isinstance(pa, Shard)
        and isinstance(pb, Shard)
        and pa.dim < len(shape(a)) - 2
        and pb.dim < len(shape(b)) - 2
    ):
        out = pa.dim + nd - len(shape(a))
        if out == pb.dim + nd - len(shape(b)):
            w.set(node, Shard(out), w.rule_near(node))
            return
    w.error(
        node,
        f"{describe(node)} multiplies tensors placed {pa} and {pb} over `{w.axis}`",
        hint="only batched matmuls over a shared sharded batch dim (attention heads) are supported",
    )


def _factory(w: Walk, node: fx.Node) -> None:
    w.set(node, REPLICATE)


for _t_ in (
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.tril.default,
    aten.triu.default,
    aten.ones_like.default,
    aten.zeros_like.default,
):
    _RULES[_t_] = _factory


@register(aten.repeat_interleave.self_int)
def _repeat_interleave(w: Walk, node: fx.Node) -> None:
    # Repeating each element in place keeps contiguous chunks contiguous, so a shard on the
    # repeated dim stays a shard: GQA's kv-head repeat maps kv-head shards onto head shards.
    x = arg_node(node, 0)
    p = w.placement(x)
    if isinstance(p, Shard):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim is None:
            w.error(node, f"{describe(node)} flattens a tensor sharded over `{w.axis}`")
        if p.replicas > 1:  # each rank's one kv head, repeated for its own query heads only
            repeats = node.args[1]
            if not isinstance(repeats, int) or repeats % p.replicas or _norm_dim(dim, len(shape(x))) != p.dim:
                w.error(node, f"{describe(node)} repeats key/value heads replicated over `{w.axis}`")
            node.args = (x, repeats // p.replicas, *node.args[2:])
            p = Shard(p.dim)
    w.set(node, p, w.rule_near(node))


@register(aten.addmm.default, aten.mm.default)
def _matmul_2d(w: Walk, node: fx.Node) -> None:
    """`addmm(bias, x, W)` / `mm(x, W)` with W stored (in, out), as Hugging Face's Conv1D does."""
    has_bias = node.target is aten.addmm.default
    bias = arg_node(node, 0) if has_bias else None
    x, weight = (arg_node(node, 1), arg_node(node, 2)) if has_bias else (arg_node(node, 0), arg_node(node, 1))
    wp = w.placement(weight)
    rule = weight.meta.get(RULE)
    if isinstance(wp, Shard) and wp.dim == 1:  # column
        w.use(node, x, w.convert(x, REPLICATE, into_sharded=True, because=rule))
        blocks = w.fuse_blocks(node, 1, (weight, bias), weight_dim=1)
        w.set(node, Shard(1, blocks), rule)
        return
    if isinstance(wp, Shard) and wp.dim == 0:  # row
        if w.placement(x) != Shard(1):
            x = w.use(node, x, w.convert(x, REPLICATE, because=rule))
            w.use(node, x, w.convert(x, Shard(1), because=rule))
        if has_bias:
            node.target = aten.mm.default
            node.args = (node.args[1], node.args[2])  # the bias is added once, after the reduction
        _reduce_row_output(w, node, bias, rule)
        return
    xp = w.placement(x)
    if isinstance(xp, Partial):
        xp = w.placement(w.use(node, x, w.reduce_partial(x)))
    if isinstance(xp, Shard) and xp.dim == 1:
        xp = w.placement(w.use(node, x, w.convert(x, REPLICATE)))
    if isinstance(xp, Shard):
        for p in (weight, bias):
            if p is not None:
                w.use(node, p, w.convert(p, REPLICATE, into_sharded=True))
    w.set(node, xp)
