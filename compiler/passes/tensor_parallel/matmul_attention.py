"""Attention written with matmuls, rewritten as the `scaled_dot_product_attention` it computes,
where a `context ring` or `context ulysses` rule governs it: those modes replace that one op
(`attention.py`), and plain PyTorch models (nanoGPT) and Hugging Face's `eager` attention
spell it out instead:

    scores = (q @ k.transpose(-2, -1)) * scale        # or / d; or no scale (then 1)
    scores = scores + mask                            # additive, or masked_fill(m, -inf)
    probs = softmax(scores, -1)                       # in fp32, cast back: both kept as sdpa does
    probs = dropout(probs, 0.0)                       # Hugging Face's, at p = 0
    out = probs @ v

becomes `out = scaled_dot_product_attention(q, k, v, mask, scale=scale)` with the mask as
sdpa takes it (additive as is, a masked_fill's condition negated: sdpa keeps True). Every
intermediate must have no other reader; a chain that does not match is left alone, and the
walk refuses it with a hint. `context all_gather` needs no rewrite: it gathers the right-hand
sides of the matmuls themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from meshplan.dsl.check import PlanRule

from ... import meta
from ...graph import arg_node, innermost, module_path, shape

aten = torch.ops.aten

REWRITTEN = ("ring", "ulysses")  # the context modes that replace an sdpa call
_CASTS = (aten.to.dtype, aten._to_copy.default)
_SOFTMAX = (aten.softmax.int, aten._softmax.default)


@dataclass
class _Attention:
    q: fx.Node
    k: fx.Node  # (B, H, T, D), before the transpose
    v: fx.Node
    mask: fx.Node | None
    negate: bool  # a masked_fill condition (True: masked), which sdpa wants as True: kept
    scale: float
    chain: list[fx.Node]  # the nodes the sdpa call replaces, output first


def attention_as_sdpa(gm: fx.GraphModule, modules: dict[str, PlanRule]) -> int:
    """Rewrite every matching matmul attention under a module of a ring or Ulysses context rule
    (`modules`: path -> its context rule). Returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.target is not aten.matmul.default or not _under_rewritten(node, modules):
            continue
        found = _match(node)
        if found is not None:
            _rewrite(gm.graph, node, found)
            rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _under_rewritten(node: fx.Node, modules: dict[str, PlanRule]) -> bool:
    rule = innermost(module_path(node), modules)
    return rule is not None and getattr(rule.action, "mode", None) in REWRITTEN


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _match(out: fx.Node) -> _Attention | None:
    """`out = probs @ v` with everything behind `probs` the chain above, or None."""
    chain = [out]
    x, v = arg_node(out, 0), arg_node(out, 1)
    if x.target is aten.dropout.default and len(x.args) > 1 and x.args[1] == 0.0:
        chain.append(x)
        x = arg_node(x, 0)
    while x.target in _CASTS:
        chain.append(x)
        x = arg_node(x, 0)
    if x.target not in _SOFTMAX or x.args[1] not in (-1, len(shape(x)) - 1):
        return None
    chain.append(x)
    x = arg_node(x, 0)
    while x.target in _CASTS:
        chain.append(x)
        x = arg_node(x, 0)
    mask, negate = None, False
    if x.target is aten.add.Tensor and isinstance(x.args[1], fx.Node):
        chain.append(x)
        mask, x = arg_node(x, 1), arg_node(x, 0)
    elif x.target is aten.masked_fill.Scalar and x.args[2] == -math.inf:
        chain.append(x)
        mask, negate, x = arg_node(x, 1), True, arg_node(x, 0)
    scale = 1.0
    if x.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(x.args[1], int | float):
        chain.append(x)
        scale = float(x.args[1]) if x.target is aten.mul.Tensor else 1.0 / float(x.args[1])
        x = arg_node(x, 0)
    if x.target is not aten.matmul.default:
        return None
    chain.append(x)
    q, kt = arg_node(x, 0), arg_node(x, 1)
    if kt.target is not aten.transpose.int or {d % 4 for d in kt.args[1:3]} != {2, 3}:  # type: ignore[operator]
        return None
    chain.append(kt)
    if any(len(t.users) != 1 for t in chain[1:]) or any(len(shape(t)) != 4 for t in (q, v)):
        return None
    return _Attention(q, arg_node(kt, 0), v, mask, negate, scale, chain)


def _rewrite(graph: fx.Graph, out: fx.Node, a: _Attention) -> None:
    fake = out.meta["val"]
    mask = a.mask
    with graph.inserting_before(out):
        if mask is not None and a.negate:
            mask = graph.call_function(aten.logical_not.default, (mask,))
            with fake.fake_mode:
                mask.meta["val"] = torch.logical_not(a.mask.meta["val"])  # type: ignore[union-attr]
            _like(mask, out, requires_grad=False)
        sdpa = graph.call_function(
            aten.scaled_dot_product_attention.default, (a.q, a.k, a.v, mask, 0.0, False), {"scale": a.scale}
        )
    with fake.fake_mode:
        vals = [t.meta["val"] if t is not None else None for t in (a.q, a.k, a.v, mask)]
        sdpa.meta["val"] = aten.scaled_dot_product_attention.default(*vals, 0.0, False, scale=a.scale)
    _like(sdpa, out, requires_grad=meta.requires_grad(out))
    out.replace_all_uses_with(sdpa)
    for node in a.chain:  # output first: each one's reader is gone when it goes
        graph.erase_node(node)


def _like(node: fx.Node, model: fx.Node, *, requires_grad) -> None:
    """The facts later passes read, as the node it stands for has them."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in model.meta:
            node.meta[key] = model.meta[key]
    if requires_grad is not None:
        meta.set_requires_grad(node, requires_grad)
