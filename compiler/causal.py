"""Attention masks that are the causal mask, written as `is_causal=True`.

Hugging Face's models build their causal mask out of the sequence length when they are traced
(`arange`, comparisons, `expand`: a (batch, 1, seq, seq) tensor) and hand it to
`scaled_dot_product_attention` as `attn_mask`. Eagerly the same models pass `is_causal=True`
and no mask. With a mask, PyTorch cannot use its flash kernel: the captured program attends
more slowly on a GPU, and keeps a seq x seq mask per sequence, than the model it came from.

A mask is replaced when it is a function of the inputs' shapes alone (every tensor it reads
reaches it through `sym_size`) and, evaluated at two different (batch, sequence) sizes, it is
the causal mask: True (or 0.0) on and below the diagonal, False (or -inf) above. A padding mask,
a sliding window, a document mask made from the data: each reads values, or differs, and stays.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_SHAPES = aten.sym_size.int
_SIZES = ((2, 5), (3, 7))  # (batch, sequence) the mask is evaluated at: two, so no size is special


def causal_masks(gm: fx.GraphModule) -> int:
    """Rewrite each attention whose mask is the causal mask as `is_causal=True`; the mask's
    nodes go where nothing else reads them. Returns how many attentions changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        if not isinstance(mask, fx.Node) or causal or not _is_causal(gm, mask):
            continue
        args = list(node.args[:3])
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "is_causal")}
        for i, name in ((4, "dropout_p"), (6, "scale"), (7, "enable_gqa")):
            if len(node.args) > i:
                kwargs[name] = node.args[i]
        node.args, node.kwargs = tuple(args), {**kwargs, "is_causal": True}
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed


def _is_causal(gm: fx.GraphModule, mask: fx.Node) -> bool:
    nodes = _shape_only_ancestors(mask)
    if nodes is None:
        return False
    symbols = _symbols(gm)  # none: a graph captured for one shape, evaluated at it
    for batch, seq in _SIZES if symbols else ((0, 0),):
        values = {symbol: batch if role == "batch" else seq for symbol, role in symbols.items()}
        try:
            out = _evaluate(nodes, mask, values)
        except Exception:  # an op the evaluation cannot run at these sizes: the mask stays
            return False
        if not _causal(out):
            return False
    return True


def _shape_only_ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """`mask` and the nodes it is computed from, in graph order, where every tensor of the
    graph's inputs, weights or earlier values is read only through `sym_size`; else None."""
    seen: dict[fx.Node, None] = {}
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op in ("placeholder", "get_attr") or node.op != "call_function":
            return None  # read as a value
        seen[node] = None
        if node.target is _SHAPES:
            continue  # reads the shape only: its input need not be known
        stack.extend(n for n in node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _symbols(gm: fx.GraphModule) -> dict[str, str]:
    """Each symbolic size of the inputs (by its symbol) -> "batch" or "seq": the batch is the
    first dim of the token inputs, the sequence their second."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != 2 or val.is_floating_point():
            continue
        for dim, role in ((0, "batch"), (1, "seq")):
            size = val.shape[dim]
            if isinstance(size, torch.SymInt):
                found.setdefault(str(size.node.expr), role)
    return found


def _evaluate(nodes: list[fx.Node], mask: fx.Node, symbols: dict[str, int]) -> torch.Tensor:
    """The mask at sizes `symbols`, computed on the CPU."""
    env: dict[fx.Node, object] = {}
    for node in nodes:
        if node.target is _SHAPES:
            source, dim = node.args
            val = source.meta.get("val") if isinstance(source, fx.Node) else None
            size = val.shape[int(dim)] if isinstance(val, torch.Tensor) and isinstance(dim, int) else None
            env[node] = _size(size, symbols)
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)  # type: ignore[arg-type]
        kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
        args = tuple(torch.device("cpu") if isinstance(a, torch.device) else a for a in args)
        env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    out = env[mask]
    assert isinstance(out, torch.Tensor)
    return out


def _size(size, symbols: dict[str, int]) -> int:
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        values = {s: symbols[str(s)] for s in expr.free_symbols if str(s) in symbols}
        if len(values) != len(expr.free_symbols):
            raise ValueError(f"a size of another symbol: {expr}")
        return int(expr.subs(values))
    raise ValueError("a size without a value")


def _causal(mask: torch.Tensor) -> bool:
    """Whether `mask` (..., seq, seq) lets each position attend to itself and those before it only."""
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    seq = mask.shape[-1]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == allowed).all())
    if mask.is_floating_point():  # added to the scores: 0 kept, the dtype's lowest (or -inf) dropped
        dropped = mask <= torch.finfo(mask.dtype).min / 2
        return bool(((mask == 0) == allowed).all()) and bool((dropped == ~allowed).all())
    return False
