"""Op rules for ops that move dims or sizes: views and reshapes (local sizes, blocked
sequence shards), flatten, transpose, permute, (un)squeeze, expand, slices, getitem, cat."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx
from torch.fx.node import Argument

from ...graph import (
    arg_node,
    as_int,
    as_list,
    describe,
    divides,
    hint,
    known_equal,
    shape,
)
from ...placement import REPLICATE, Replicate, Shard
from .conversions import _uneven
from .walk import Walk, _norm_dim, register

aten = torch.ops.aten

# ---------------------------------------------------------------------------- shapes


def _view_dim(in_shape, out_shape, dim: int) -> int | None:
    """Where a shard on input `dim` lands after reshaping `in_shape` to `out_shape`.

    Walks both shapes in groups of equal product; the shard must be the outermost
    non-trivial dim of its group on both sides (then contiguous chunks stay contiguous).
    Returns None when it does not. Sizes that follow from the token shape are grouped by
    their example values, and a group counts only if its products are equal for every shape.
    """
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        pi = in_shape[i] if i < len(in_shape) else 1
        pj = out_shape[j] if j < len(out_shape) else 1
        while not known_equal(pi, pj):
            hi, hj = hint(pi), hint(pj)
            if hi is None or hj is None or hi == hj:
                return None  # equal only at the example shape, or data-dependent
            if hi < hj and i + 1 < len(in_shape):
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            elif hj < hi and j + 1 < len(out_shape):
                j += 1
                gj.append(j)
                pj *= out_shape[j]
            else:
                return None
        if dim in gi:
            first_in = next(k for k in gi if k < len(in_shape) and not known_equal(in_shape[k], 1))
            first_out = next((k for k in gj if k < len(out_shape) and not known_equal(out_shape[k], 1)), None)
            if first_in != dim or first_out is None:
                return None
            return first_out
        i += 1
        j += 1
    return None


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view(w: Walk, node: fx.Node) -> None:
    x = w.summed(node, arg_node(node, 0))
    p = w.placement(x)
    if not isinstance(p, Shard):
        w.set(node, REPLICATE)
        return
    out_dim = _view_dim(shape(x), shape(node), p.dim)
    if p.padded:  # padded logits keep their vocab dim whole: (B, T, V) -> (B*T, V)
        if out_dim is None or shape(node)[out_dim] != p.padded:
            w.run_whole(node, [x])
            return
        out = p.at(out_dim)
        node.args = (node.args[0], w.local_sizes(node.args[1], out), *node.args[2:])
        w.set(node, out, w.rule_near(node))
        return
    blocks = p.blocks
    merged = _merged_blocks(shape(x), shape(node), p.dim) if p.replicas == 1 else None
    if out_dim is None and not blocks and merged:
        if node.target is aten.view.default:  # a sequence shard (a collective's output) may be strided
            node.target = aten.reshape.default
        _set_merged(w, node, x, merged, p)
        node.args = (node.args[0], w.local_sizes(node.args[1], w.placement(node)), *node.args[2:])
        return
    if out_dim is not None and blocks and not known_equal(shape(node)[out_dim], shape(x)[p.dim]):
        if len(set(blocks)) == 1 and known_equal(shape(node)[out_dim], len(blocks)):
            out_dim, blocks = out_dim + 1, ()  # (.., 3*H) -> (.., 3, heads, D): the shard is the heads dim
        elif not _uneven(p):
            w.run_whole(node, [x])
            return
        else:
            w.error(node, f"{describe(node)} reshapes a fused projection's output across its blocks {blocks}")
    if p.replicas > 1 and x in w.repeated and out_dim is not None:
        # (B, kv, rep, T, D) -> (B, kv * rep, T, D) after a repeat cut to this rank's query
        # heads: the merged dim is the heads dim, plainly sharded
        out = Shard(out_dim)
        node.args = (node.args[0], w.local_sizes(node.args[1], out), *node.args[2:])
        w.set(node, out, w.rule_near(node))
        return
    if out_dim is None or _never_divides(shape(node)[out_dim], w.n // p.replicas):
        w.error(
            node,
            f"{describe(node)} reshapes {list(shape(x))} -> {list(shape(node))}, which splits "
            f"the dim sharded over `{w.axis}` across ranks",
            hint=f"the sharded dim ({shape(x)[p.dim]}) must stay outermost in its group and divisible by "
            f"{w.n} (e.g. a head count divisible by the tensor-parallel size)",
        )
    out = Shard(out_dim, blocks, p.replicas)
    node.args = (node.args[0], w.local_sizes(node.args[1], out), *node.args[2:])
    w.set(node, out, w.rule_near(node))


def _never_divides(size, pieces: int) -> bool:
    """Whether `size` does not divide into `pieces`: for a size that follows from the token
    shape, at the example (the run checks its own shape, see `Walk.cut`)."""
    known = hint(size)
    return divides(pieces, size) is False or (known is not None and known % pieces != 0)


def _set_merged(w: Walk, node: fx.Node, x: fx.Node, merged: tuple[int, tuple[int, ...]], p: Shard) -> None:
    out_dim, blocks = merged
    if blocks[0] % w.pieces(x, p):
        w.error(node, f"{describe(node)} merges a dim sharded over `{w.axis}` whose size does not divide")
    w.set(node, Shard(out_dim, blocks), w.rule_near(node))
    if p.dim == w.spec.seq_dim and out_dim == 0:
        w.flat_tokens = (sum(blocks), blocks)


@register(aten.flatten.using_ints)
def _flatten(w: Walk, node: fx.Node) -> None:
    x = arg_node(node, 0)
    p = w.placement(x)
    ndim = len(shape(x))
    start = _norm_dim(node.args[1] if len(node.args) > 1 else 0, ndim)
    end = _norm_dim(node.args[2] if len(node.args) > 2 else -1, ndim)
    if isinstance(p, Shard) and p.padded and start < p.dim <= end:
        w.run_whole(node, [x])  # a padded dim merged into an outer one would interleave the padding
        return
    if isinstance(p, Shard):
        merged = (
            _merged_blocks(shape(x), shape(node), p.dim) if start < p.dim <= end and not p.blocks else None
        )
        if merged:
            _set_merged(w, node, x, merged, p)
            return
        if start < p.dim <= end and all(known_equal(s, 1) for s in shape(x)[start : p.dim]):
            w.set(node, p.at(start), w.rule_near(node))  # (1, T, V) -> (T, V): only ones before it
            return
        if start < p.dim <= end:
            w.error(node, f"{describe(node)} flattens a dim sharded over `{w.axis}` into an inner position")
        out = p.dim if p.dim <= start else p.dim - (end - start)
        w.set(node, p.at(out), w.rule_near(node))
    else:
        w.set(node, p)


def _move_shard(w: Walk, node: fx.Node, x: Argument, moved: Callable[[int], int]) -> None:
    """Place `node`, an op that reorders the dims of its input `x` or adds or drops dims of
    size 1, as `x` is placed, a shard's dim `d` moved to `moved(d)`."""
    p = w.placement(x)
    if isinstance(p, Shard):
        w.set(node, p.at(moved(p.dim)), w.rule_near(node))
    else:
        w.set(node, p)


@register(aten.transpose.int)
def _transpose(w: Walk, node: fx.Node) -> None:
    x = arg_node(node, 0)
    a, b = (_norm_dim(d, len(shape(x))) for d in node.args[1:3])
    _move_shard(w, node, x, lambda d: b if d == a else a if d == b else d)


@register(aten.t.default)
def _t(w: Walk, node: fx.Node) -> None:
    p = w.placement(node.args[0])
    w.set(node, p.at(1 - p.dim) if isinstance(p, Shard) else p, w.rule_near(node))


@register(aten.permute.default)
def _permute(w: Walk, node: fx.Node) -> None:
    dims = as_list(node.args[1], of=node)
    _move_shard(w, node, arg_node(node, 0), [_norm_dim(d, len(dims)) for d in dims].index)


@register(aten.unsqueeze.default)
def _unsqueeze(w: Walk, node: fx.Node) -> None:
    added = _norm_dim(node.args[1], len(shape(node)))
    _move_shard(w, node, node.args[0], lambda d: d + (added <= d))


@register(aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(w: Walk, node: fx.Node) -> None:
    x = arg_node(node, 0)
    requested = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    ndim = len(shape(x))
    dropped = [_norm_dim(r, ndim) for r in requested if known_equal(shape(x)[_norm_dim(r, ndim)], 1)]
    _move_shard(w, node, x, lambda d: d - sum(r < d for r in dropped))


@register(aten.expand.default, aten.broadcast_to.default)
def _expand(w: Walk, node: fx.Node) -> None:
    x = arg_node(node, 0)
    p = w.placement(x)
    if isinstance(p, Shard):
        out = p.at(p.dim + len(shape(node)) - len(shape(x)))
        sizes = w.local_sizes(node.args[1], out)
        if p.replicas > 1:  # GQA's repeat of each kv head: keep only this rank's query heads
            repeat = out.dim + 1
            if repeat >= len(sizes) or not known_equal(
                shape(x)[repeat - len(shape(node)) + len(shape(x))], 1
            ):
                w.error(node, f"{describe(node)} expands key/value heads replicated over `{w.axis}`")
            heads = as_int(sizes[repeat], of=node)
            if heads % p.replicas:
                w.error(
                    node,
                    f"{describe(node)}: {heads} query heads per key/value head do not divide by "
                    f"{p.replicas} ranks sharing it over `{w.axis}`",
                )
            sizes[repeat] = heads // p.replicas
            w.repeated.add(node)
        node.args = (x, sizes, *node.args[2:])
        w.set(node, out, w.rule_near(node))
    else:
        w.set(node, p)


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default)
def _new_sized(w: Walk, node: fx.Node) -> None:
    """A fresh tensor of the size its arguments give, the whole tensor's (the graph's sizes are
    global), whatever its input's placement (read for its dtype and device only): whole on every
    rank (T5 shifts its labels right into `labels.new_zeros(labels.shape)`)."""
    w.set(node, REPLICATE)


@register(
    aten.slice.Tensor,
    aten.narrow.default,
    aten.select.int,
    aten.chunk.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
)
def _slice_like(w: Walk, node: fx.Node) -> None:
    x = arg_node(node, 0)
    p = w.placement(w.summed(node, x))
    if not isinstance(p, Shard):
        w.set(node, p)
        return
    ndim = len(shape(x))
    default_dim = 0
    dim_arg = node.args[1] if node.target in (aten.slice.Tensor,) and len(node.args) > 1 else None
    if node.target in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default):
        dim_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    elif node.target in (aten.narrow.default, aten.select.int, aten.unbind.int):
        dim_arg = node.args[1] if len(node.args) > 1 else 0
    dim = _norm_dim(dim_arg if dim_arg is not None else default_dim, ndim)
    if dim == p.dim:
        if p.blocks and _split_local_blocks(w, node, p.blocks):
            w.set(node, Shard(dim), w.rule_near(node))
            return
        # a slice across shards (T5's labels shifted right) needs rows of other ranks: whole
        w.run_whole(node, [x])
        return
    out = p.dim - (node.target in (aten.select.int, aten.unbind.int) and dim < p.dim)
    w.set(node, p.at(out), w.rule_near(node))


def _split_local_blocks(w: Walk, node: fx.Node, blocks: tuple[int, ...]) -> bool:
    """If `node` cuts a blocked shard exactly at its block boundaries, make its sizes local.

    Each rank's tensor is [q_r, k_r, v_r]: splitting it where the full tensor splits, with
    every size divided by the axis size, yields this rank's shard of each block.
    """
    n = w.n
    args = list(node.args)
    if node.target is aten.split.Tensor and isinstance(args[1], int) and set(blocks) == {args[1]}:
        args[1] //= n
    elif (
        node.target is aten.split_with_sizes.default
        and isinstance(args[1], (list, tuple))
        and list(args[1]) == list(blocks)
    ):
        args[1] = [b // n for b in blocks]
    elif node.target is aten.chunk.default and args[1] == len(blocks) and len(set(blocks)) == 1:
        pass
    elif node.target is aten.slice.Tensor:
        total = sum(blocks)
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        end = min(as_int(args[3], of=node) if len(args) > 3 and args[3] is not None else total, total)
        bounds = [sum(blocks[:i]) for i in range(len(blocks) + 1)]
        step = args[4] if len(args) > 4 else 1
        if not isinstance(start, int) or start not in bounds or end not in bounds or step != 1:
            return False
        args = [args[0], args[1], start // n, end // n]
    else:
        return False
    node.args = tuple(args)
    return True


@register(operator.getitem)
def _getitem(w: Walk, node: fx.Node) -> None:
    w.set(node, w.placement(node.args[0]), w.rule_near(node))


@register(aten.cat.default)
def _cat(w: Walk, node: fx.Node) -> None:
    parts = as_list(node.args[0], of=node)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape(node)))
    placements = {w.placement(p) for p in parts}
    if len(placements) == 1:
        (p,) = placements
        if isinstance(p, Shard) and p.dim == dim:
            w.error(node, f"{describe(node)} concatenates along dim {dim}, which is sharded over `{w.axis}`")
        w.set(node, p, w.rule_near(node))
        return
    shards = {p for p in placements if isinstance(p, Shard)}
    if len(shards) == 1 and all(isinstance(p, Shard | Replicate) for p in placements):
        (shard,) = shards
        if shard.dim != dim:  # whole parts join the shards: each rank takes its chunk of them
            rule = w.rule_near(node)  # (GPT-OSS's attention sinks, one per head, beside the scores)
            for part in parts:
                if isinstance(part, fx.Node) and isinstance(w.placement(part), Replicate):
                    w.use(node, part, w.convert(part, shard, because=rule))
            w.set(node, shard, rule)
            return
    w.error(node, f"{describe(node)} concatenates tensors with different placements over `{w.axis}`")


def _merged_blocks(in_shape, out_shape, dim: int) -> tuple[int, tuple[int, ...]] | None:
    """Where a shard on `dim` lands when a reshape merges `dim` with outer dims into one output
    dim, and the blocks it is then cut in: (B, T, H) Shard(1) -> (B*T, H) is (0, (T,) * B).

    Each rank's rows stay in place: its chunk of every block. None if the reshape does not
    merge `dim` that way (or sizes are not static).
    """
    if not all(isinstance(s, int) for s in (*in_shape, *out_shape)):
        return None
    prefix_in = [1]
    for s in in_shape:
        prefix_in.append(prefix_in[-1] * s)
    prefix_out = 1
    for j, size in enumerate(out_shape):
        if prefix_out in prefix_in and prefix_out * size in prefix_in:
            first, last = prefix_in.index(prefix_out), prefix_in.index(prefix_out * size) - 1
            while first < len(in_shape) and in_shape[first] == 1 and first < dim:
                first += 1
            if first < dim <= last:
                outer = prefix_in[dim] // prefix_in[first]
                return j, (prefix_in[last + 1] // prefix_in[dim],) * outer
        prefix_out *= size
    return None
