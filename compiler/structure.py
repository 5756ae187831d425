"""What `meshplan suggest` writes rules over: the model's repeated blocks and the parts a plan
names, found from the module tree and the order the captured graph calls them in.

    shape = model_shape(model, captured)
    shape.blocks          # "model.layers": the nn.ModuleList of identical blocks
    shape.pairs           # Megatron pairs in each block: columns reading the block's width, a row
    shape.norms           # norms in each block (sequence parallel runs them on a sequence shard)
    shape.embedding, shape.head, shape.final_norm, shape.experts

Nothing here is a list of known models: a block is the largest list of modules of one class,
a pair is the linears one module of a block calls in order (the last one brings the width
back), the ends are the embedding and the linear whose outputs are its vocabulary. What the
compiler would refuse is still found out by compiling (`suggest.py` checks every plan it
writes); this only proposes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .capture import Captured
from .passes.experts.units import num_experts
from .passes.tensor_parallel.attention import held_heads


@dataclass(frozen=True)
class Pair:
    """Linears of one module of a block, by path inside the block: `columns` read the block's
    width and are split by output features, `row` (their consumer) by input features."""

    columns: tuple[str, ...]
    row: str
    widths: tuple[int, ...]  # each column's out_features and the row's in_features: tp divides them


@dataclass(frozen=True)
class ModelShape:
    blocks: str | None  # the path of the list of blocks ("layers", "model.layers")
    layers: int
    pairs: tuple[Pair, ...]
    norms: tuple[str, ...]  # norms inside a block, by path inside it
    embedding: str | None
    head: str | None
    final_norm: str | None
    tied: bool  # the head's weight is the embedding's
    vocab: int | None
    hidden: int | None
    heads: int | None  # attention heads (tp must divide them), from the config when it says
    experts: str | None  # the experts module inside a block, by path inside it
    num_experts: int | None
    top_k: int | None
    attention: str | None = None  # the module inside a block calling scaled_dot_product_attention
    kv_width: int | None = None  # its keys' and values' features together (what a context ring passes)
    kv_heads: int | None = None  # its key/value heads (fewer than `heads` under GQA), from the config

    def ulysses(self, cp: int, tp: int) -> bool:
        """Whether Ulysses over `cp` ranks gives each rank whole heads beside `tp` splitting them
        first: the query heads divide by cp x tp, and the key/value heads a tp rank keeps (its
        share, or one where tp outnumbers them) either divide by cp or divide cp, their query
        heads sharing each (as the compiler's `context ulysses` lowering requires)."""
        heads, kv = self.heads, self.kv_heads or self.heads
        if not heads or not kv or heads % (cp * tp):
            return False
        if kv % (cp * tp) == 0:
            return True
        held = held_heads(kv, tp)
        return held is not None and cp % held == 0 and (heads // tp) % held == 0

    def block(self, inner: str = "") -> str:
        """The pattern naming `inner` in every block: `model.layers.*.self_attn`."""
        assert self.blocks is not None
        return f"{self.blocks}.*" + (f".{inner}" if inner else "")

    def tp_sizes(self) -> list[int]:
        """The tensor-parallel degrees every pair, the head count and the vocabulary divide."""
        if not self.pairs:
            return [1]
        widths = [w for pair in self.pairs for w in pair.widths]
        if self.heads:
            widths.append(self.heads)
        if self.vocab and (self.embedding or self.head):
            widths.append(self.vocab)
        return [t for t in (1, 2, 4, 8, 16) if all(w % t == 0 for w in widths)]


_NORM_CLASS_SUFFIXES = ("Norm", "Norm2d", "NormFp32")


def model_shape(model: nn.Module, captured: Captured | None = None) -> ModelShape:
    """The parts of `model` a plan names. `captured`: the order the graph calls modules in
    (which linear of a pair comes last); without it, the order the modules were registered."""
    modules = dict(model.named_modules())
    blocks = _blocks(model)
    order = _call_order(captured, modules)
    pairs: tuple[Pair, ...] = ()
    norms: tuple[str, ...] = ()
    experts = attention = None
    if blocks is not None:
        first = f"{blocks}.0"
        inside = {p[len(first) + 1 :]: m for p, m in modules.items() if p.startswith(first + ".")}
        pairs = _pairs(inside, order, first)
        norms = tuple(p for p, m in inside.items() if _is_norm(m))
        experts = next((p for p, m in inside.items() if _is_experts(p, m, model)), None)
        if experts is not None:  # an expert's own pair is the experts rule's to split
            pairs = tuple(pair for pair in pairs if not _within(pair.row, experts))
        attention = _attention(captured, first)
    embedding = _embedding(modules, blocks)
    table = modules[embedding] if embedding is not None else None
    assert table is None or isinstance(table, nn.Embedding)
    vocab = table.num_embeddings if table is not None else None
    head = _head(modules, blocks, vocab)
    tied = head is not None and table is not None and modules[head].weight is table.weight
    final = _final_norm(modules, blocks, order)
    config = getattr(model, "config", None)
    experts_module = modules[f"{blocks}.0.{experts}"] if experts is not None else None
    return ModelShape(
        blocks=blocks,
        layers=len(list(modules[blocks].children())) if blocks is not None else 0,
        pairs=pairs,
        norms=norms,
        embedding=embedding,
        head=head,
        final_norm=final,
        tied=tied,
        vocab=vocab,
        hidden=table.embedding_dim if table is not None else None,
        heads=_int_attr(config, "num_attention_heads", "n_head", "num_heads"),
        kv_heads=_int_attr(config, "num_key_value_heads", "n_kv_heads", "num_kv_heads"),
        experts=experts,
        num_experts=num_experts(experts_module, model) if experts_module is not None else None,
        top_k=_top_k(model, modules, blocks, experts) if experts is not None else None,
        attention=attention,
        kv_width=_kv_width(pairs, attention),
    )


def _blocks(model: nn.Module) -> str | None:
    """The list of modules of one class holding the most parameters: the repeated blocks."""
    best, most = None, 0
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1 or _is_experts(path, module, model):
            continue
        count = sum(p.numel() for p in module.parameters())
        if count > most:
            best, most = path, count
    return best


def _call_order(captured: Captured | None, modules: dict[str, nn.Module]) -> dict[str, int]:
    """Module path -> when the graph first calls it (or, without a graph, its registration order)."""
    if captured is None:
        return {p: i for i, p in enumerate(modules)}
    order: dict[str, int] = {}
    for i, path in enumerate(captured.node_modules.values()):
        order.setdefault(path, i)
    return order


def _pairs(inside: dict[str, nn.Module], order: dict[str, int], first: str) -> tuple[Pair, ...]:
    """Per module of the block that calls two linears or more: all but the last are columns
    (reading the same width the last one writes), the last is the row."""
    dims = {p: d for p, m in inside.items() if (d := linear_dims(m)) is not None}
    by_parent: dict[str, list[str]] = {}
    for path in dims:
        by_parent.setdefault(path.rpartition(".")[0], []).append(path)
    pairs = []
    for paths in by_parent.values():
        if len(paths) < 2:
            continue
        *columns, row = sorted(paths, key=lambda p: order.get(f"{first}.{p}", 1 << 30))
        width = dims[row][1]
        if any(dims[c][0] != width for c in columns):
            continue  # not a pair over the block's width (a chain of projections): left whole
        widths = (*(dims[c][1] for c in columns), dims[row][0])
        pairs.append(Pair(tuple(columns), row, widths))
    return tuple(pairs)


def _attention(captured: Captured | None, first: str) -> str | None:
    """The module of the first block whose code calls `scaled_dot_product_attention` (the
    module a context rule names), by path inside the block."""
    if captured is None:
        return None
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    for node in captured.graph_module.graph.nodes:
        path = captured.node_modules.get(node.name, "")
        if node.target is sdpa and path.startswith(first + "."):
            return path[len(first) + 1 :]
    return None


def _kv_width(pairs: tuple[Pair, ...], attention: str | None) -> int | None:
    """Keys' and values' output features: the attention pair's columns less the queries' width
    (which the output projection reads back): k + v for separate q, k, v; 2h for a fused qkv."""
    for pair in pairs:
        if attention is not None and _within(pair.row, attention):
            return sum(pair.widths[:-1]) - pair.widths[-1] or None
    return None


def linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear: `nn.Linear`, or a transposed one (GPT-2's `Conv1D`,
    weight (in, out) multiplied as `x @ W`)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(
        _NORM_CLASS_SUFFIXES
    )


def _is_experts(path: str, module: nn.Module, model: nn.Module) -> bool:
    """A module of experts: named so (`mlp.experts`), holding a count of them."""
    named = path.rpartition(".")[2] == "experts" or "Experts" in type(module).__name__
    return named and num_experts(module, model) is not None


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _outside(path: str, blocks: str | None) -> bool:
    return blocks is None or not _within(path, blocks)


def _embedding(modules: dict[str, nn.Module], blocks: str | None) -> str | None:
    embeddings = [
        (m.num_embeddings, p)
        for p, m in modules.items()
        if isinstance(m, nn.Embedding) and _outside(p, blocks)
    ]
    return max(embeddings)[1] if embeddings else None


def _head(modules: dict[str, nn.Module], blocks: str | None, vocab: int | None) -> str | None:
    if vocab is None:
        return None
    heads = [
        p
        for p, m in modules.items()
        if isinstance(m, nn.Linear) and m.out_features == vocab and _outside(p, blocks)
    ]
    return heads[-1] if heads else None


def _final_norm(modules: dict[str, nn.Module], blocks: str | None, order: dict[str, int]) -> str | None:
    """The last norm called after the blocks (not an embedding's own norm, called before them)."""
    after = max((i for p, i in order.items() if blocks is not None and _within(p, blocks)), default=-1)
    norms = [
        p for p, m in modules.items() if _is_norm(m) and _outside(p, blocks) and order.get(p, -1) > after
    ]
    return max(norms, key=lambda p: order[p]) if norms else None


def _int_attr(owner: object, *names: str) -> int | None:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _top_k(model: nn.Module, modules: dict[str, nn.Module], blocks: str | None, experts: str) -> int | None:
    """The experts each token goes to: the router's `top_k` (the experts' parent) or the config's."""
    parent = f"{blocks}.0.{experts}".rpartition(".")[0]
    found = _int_attr(modules.get(parent), "top_k", "num_experts_per_tok")
    return found or _int_attr(getattr(model, "config", None), "num_experts_per_tok", "moe_topk", "top_k")
