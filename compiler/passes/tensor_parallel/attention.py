"""Op rules for attention and batched matmuls, factories, repeat_interleave."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from ... import meta
from ...graph import (
    arg_node,
    describe,
    innermost,
    known_equal,
    module_path,
    shape,
)
from ...placement import REPLICATE, Shard
from .linear import weight_product
from .walk import _RULES, Walk, _norm_dim, register

if TYPE_CHECKING:
    from meshplan.dsl.check import PlanRule
    from meshplan.dsl.errors import Span

aten = torch.ops.aten

# ---------------------------------------------------------------------------- attention


@register(aten.scaled_dot_product_attention.default)
def _sdpa(w: Walk, node: fx.Node) -> None:
    q, k, v = node.args[:3]
    ps = {w.placement(t) for t in (q, k, v)}
    if w.spec.context_modules and (
        any(isinstance(p, Shard) and p.dim == SEQ for p in ps)
        # whole (a sequence remade whole on the way: T5's decoder inputs, shifted from the
        # labels): cut by the rule of the module it runs in, not repeated on every rank
        or (ps == {REPLICATE} and w.rule_for_module(node) is not None)
    ):
        _context_attention(w, node)
        return
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
        heads = Shard(len(shape(mask)) - 3)
        if meta.heads_inside(mask) == heads.dim and w.placement(mask) == REPLICATE:
            # Ulysses cut the mask's heads inside ours (`_ulysses_mask`): ours goes first
            whole = arg_node(mask, 0)
            w.use(mask, whole, w.convert(whole, heads))
            w.set(mask, heads)
        elif w.placement(mask) != heads:
            w.use(node, mask, w.convert(mask, heads))
    w.set(node, Shard(1), w.rule_near(node))


# ---------------------------------------------------------------------------- context parallelism

SEQ = 2  # attention's (batch, heads, seq, head_dim)
_SDPA_OPTIONAL = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False}  # its 4th to 6th, defaults


def _context_attention(w: Walk, node: fx.Node) -> None:
    """Attention of queries cut by sequence over a context axis, by the mode of the module's
    `context` rule:

        all_gather   k, v gathered whole (backward: reduce-scatter of their gradients), before
                     the model's GQA repeat of their heads when it has one; the causal mask is
                     this rank's rows of the whole one
                     k = self.all_gather_cp(k, 2); v = self.all_gather_cp(v, 2)
                     rows = self.split_cp(arange(T), 0)      # this rank's query positions
                     out = sdpa(q, k, v, attn_mask=rows[:, None] >= arange(T))
        ring         k, v blocks passed around the ring with an online softmax (one module)
        ulysses      q, k, v moved by all-to-all from sequence shards to head shards, attention
                     over the whole sequence with this rank's heads, and back; fewer key/value
                     heads than ranks (GQA) are gathered and each rank keeps its query heads' one
    """
    q, k, v = (arg_node(node, i) for i in range(3))
    rule = w.rule_for_module(node)
    if rule is None:
        w.error(
            node,
            f"{describe(node)} attends over a sequence cut over `{w.axis}`, but no `context` rule "
            "names its module",
            hint=f"add `{module_path(node)}: context all_gather over {w.axis}` (or ulysses)",
            rule=w.spec.fallback_rule,
        )
    mode = rule.action.mode  # type: ignore[union-attr]
    # the queries' rows are this rank's; all_gather reads whole keys and values (which a model
    # may already hold whole: DeepSeek-V3's, filled in place: cut and gathered all the same, so
    # that their gradients, this rank's queries' part, are summed), the ring their sequence
    # shards; Ulysses cuts whole ones by heads where they are (backward: the heads gathered)
    for t in (q, k, v):
        if w.placement(t) != Shard(SEQ) and not (mode == "ulysses" and w.placement(t) == REPLICATE):
            w.use(node, t, w.convert(t, Shard(SEQ), because=rule))
    q, k, v = (arg_node(node, i) for i in range(3))
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if mode == "ulysses":
        heads = shape(q)[1]
        split, split_rule = _heads_split(w, node)
        if not isinstance(heads, int) or heads % (w.n * split):
            w.error(
                node,
                f"{describe(node)} has {heads} query heads, not divisible by {w.n} ranks over `{w.axis}`: "
                "Ulysses gives each rank whole heads"
                if split == 1
                else _split_twice(node, "query", heads, split, split_rule, w),
                hint="use `context ring` or `context all_gather` for this module, or "
                + (
                    f"a `{w.axis}` size dividing {heads}"
                    if split == 1
                    else f"axes whose sizes multiply to a divisor of {heads}"
                ),
                rule=rule,
                related=_split_here(split_rule),
            )
        w.use(node, q, _nested(w.convert(q, Shard(1), because=rule), split))
        for t in (k, v):
            grouped = _grouped(w, t)
            if grouped is None:
                _ulysses_key_value(w, node, t, heads, rule)
                continue
            # move the key/value heads, then repeat this rank's to its query heads
            _ulysses_key_value(w, t, grouped, heads, rule)
            _repeat_interleave(w, t)
        if isinstance(mask, fx.Node):
            _ulysses_mask(w, node, mask, split, rule)
        w.set(node, Shard(1), rule)
        back = _nested(w.convert(node, Shard(SEQ), because=rule), split)
        node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        return
    causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    if mode == "ring":
        _ring(w, node, rule, mask, causal)
        return
    for t in (k, v):
        grouped = _grouped(w, t)
        if grouped is not None:  # gather the key/value heads, repeat them after
            t.replace_input_with(grouped, w.convert(grouped, REPLICATE, into_sharded=True, because=rule))
            w.set(t, REPLICATE, rule)
        else:
            w.use(node, t, w.convert(t, REPLICATE, into_sharded=True, because=rule))
    if isinstance(mask, fx.Node):  # this rank's query rows of the model's own mask
        rows = len(shape(mask)) - 2
        if not known_equal(shape(mask)[rows], 1) and w.placement(mask) != Shard(rows):
            w.use(node, mask, w.convert(mask, Shard(rows), because=rule))
    elif causal:
        whole = arg_node(node, 1)  # the gathered keys
        mask = _causal_rows(w, node, whole, rule)
        # attn_mask, dropout_p and is_causal positional (the model may have passed any by keyword)
        given = dict(zip(_SDPA_OPTIONAL, node.args[3:6], strict=False)) | dict(node.kwargs)
        args = [*node.args[:3], *(given.get(k, default) for k, default in _SDPA_OPTIONAL.items())]
        args[3], args[5] = mask, False
        node.args = tuple(args)
        node.kwargs = {k: a for k, a in node.kwargs.items() if k not in _SDPA_OPTIONAL}
    w.set(node, Shard(SEQ), rule)


def _heads_split(w: Walk, node: fx.Node) -> tuple[int, PlanRule | None]:
    """How many ways tensor axes split the heads of the Ulysses module `node` is in (1: none),
    and the first rule that does (`TensorParallelSpec.heads_split`)."""
    return innermost(module_path(node), w.spec.heads_split) or (1, None)


def _split_twice(node: fx.Node, kind: str, count: object, split: int, rule: PlanRule | None, w: Walk) -> str:
    """Why Ulysses cannot cut heads that tensor axes split first (`split` ways)."""
    axes = f"`{rule.axis}`" if rule is not None else "tensor axes"
    if kind == "query":
        return (
            f"the {count} query heads of `{module_path(node)}` are split over {split} ranks of {axes}, "
            f"and Ulysses over `{w.axis}` would split each rank's share again over {w.n}: "
            f"{split * w.n} does not divide {count}, and a rank must hold whole heads"
        )
    return (
        f"the {count} key/value heads of `{module_path(node)}` are split over {split} ranks of {axes}, "
        f"and what each keeps is neither a multiple of {w.n} ranks over `{w.axis}` nor dividing it "
        "with its query heads: Ulysses cannot give each rank the key/value heads its query heads use"
    )


def held_heads(kv: object, split: int) -> int | None:
    """The key/value heads one rank of the tensor axes keeps of `kv` split `split` ways: its
    share, or one where they keep fewer heads than their ranks; None where neither divides."""
    if not isinstance(kv, int):
        return None
    if kv % split == 0:
        return kv // split
    return 1 if split % kv == 0 else None


def _split_here(rule: PlanRule | None) -> list[tuple[Span, str]]:
    """The note at the tensor rule that split the heads first."""
    return [(rule.span, f"`{rule.axis}` splits the heads here")] if rule is not None else []


def _nested(a2a: fx.Node, split: int) -> fx.Node:
    """A Ulysses all-to-all of heads that tensor axes split first (`split` > 1): it cuts (or
    joins) each of their ranks' heads, inside their shard, so their walks keep their cut through
    it (`Walk.nested_under`)."""
    if split > 1 and a2a.op == "call_module":
        meta.set_heads_inside(a2a, 1)
    return a2a


def _ulysses_mask(w: Walk, node: fx.Node, mask: fx.Node, split: int, rule) -> None:
    """The model's own mask of attention over the whole sequence: its rows and columns whole;
    one with a heads dim (T5's relative position bias, (B, H, T, T)) cut like the queries' heads,
    inside a tensor axis's cut where one split them first (its walk cuts the mask before ours)."""
    heads = len(shape(mask)) - 3
    placement = REPLICATE if heads < 0 or known_equal(shape(mask)[heads], 1) else Shard(heads)
    if w.placement(mask) != placement:
        w.use(node, mask, _nested(w.convert(mask, placement, because=rule), split))


def _ulysses_key_value(w: Walk, node: fx.Node, t: fx.Node, heads: int, rule) -> None:
    """Keys or values to Ulysses' head shards. As many heads as the queries, or a multiple of
    the ranks: an all-to-all like the queries'. Fewer key/value heads than ranks (GQA reaching
    attention with `enable_gqa`), when they divide the ranks: each rank needs the one head its
    query heads use, shared by m = n / kv ranks, so the sequence is gathered whole and each
    rank keeps its head, Shard(1, replicas=m) (backward: the ranks' gradients of a head are
    summed by the gather's reduce-scatter)

        k = self.all_gather_cp(k, 2)           # (B, kv, T, D)
        k = self.kv_group_cp(k, 1, m)          # (B, 1, T, D): head rank // m

    Where tensor axes split the heads first (`split` ways), the counts are a rank's of theirs:
    kv / split heads (one, where they keep fewer heads than their ranks, each rank its own),
    and the group picks among those.
    """
    kv = shape(t)[1]
    split, split_rule = _heads_split(w, node)
    if isinstance(kv, int) and kv % (w.n * split) == 0:
        w.use(node, t, _nested(w.convert(t, Shard(1), because=rule), split))
        return
    held = held_heads(kv, split)
    if held is None or w.n % held or (heads // split) % held:
        w.error(
            node,
            f"{describe(node)} has {kv} key/value heads in {describe(t)} for {heads} query heads: "
            f"neither a multiple of {w.n} ranks over `{w.axis}` nor dividing it, so Ulysses cannot "
            "give each rank the key/value heads its query heads use"
            if split == 1
            else _split_twice(node, "key/value", kv, split, split_rule, w),
            hint=f"use `context ring` or `context all_gather` for this module, or a `{w.axis}` size "
            f"that {kv} divides or that divides {kv}"
            if split == 1
            else "use `context ring` or `context all_gather` for this module, or tensor and context "
            "axes whose sizes fit the heads",
            rule=rule,
            related=_split_here(split_rule),
        )
    replicas = w.n // held
    whole = w.convert(t, REPLICATE, into_sharded=True, because=rule)
    with w.graph.inserting_after(whole):
        group = _nested(w.graph.call_module(w.module_for("kv_group"), (whole, 1, replicas)), split)
    group.meta.update({k: a for k, a in whole.meta.items() if k in ("val", "nn_module_stack")})
    meta.copy_facts(whole, group, meta.REQUIRES_GRAD)
    meta.set_placement(group, w.other_axes(whole))
    w.set(group, Shard(1, (), replicas), rule)
    w.use(node, t, group)


def _ring(w: Walk, node: fx.Node, rule, mask, causal) -> None:
    """Ring attention (`runtime/ring_attention.py`): the key/value blocks travel, the queries stay;
    a mask of the model's own goes along as this rank's rows. Key/value heads the model repeats
    for GQA travel unrepeated (the ring repeats them where it computes).

        out = self.ring_attention_cp(q, k, v, True, scale)
        out = self.ring_attention_cp(q, k, v, False, scale, split_cp(mask, 2))
    """
    dropout = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    if dropout:
        w.error(
            node,
            f"{describe(node)} drops attention probabilities out: ring attention does not draw them",
            hint="train with attention dropout 0, or use `context all_gather` for this module",
            rule=rule,
        )
    scale = node.kwargs.get("scale", node.args[6] if len(node.args) > 6 else None)
    q, k, v = (arg_node(node, i) for i in range(3))
    repeats = list(dict.fromkeys(t for t in (k, v) if _grouped(w, t) is not None))
    k, v = (_grouped(w, t) or t for t in (k, v))  # the ring repeats them where it computes
    args: tuple = (q, k, v, bool(causal), scale)
    if isinstance(mask, fx.Node):
        rows = len(shape(mask)) - 2
        if not known_equal(shape(mask)[rows], 1) and w.placement(mask) != Shard(rows):
            mask = w.convert(mask, Shard(rows), because=rule)
        args += (mask,)
    ring = w.replace_by_module(node, "ring_attention", args, rule, dim=SEQ)
    for t in repeats:
        w.graph.erase_node(t)
    w.set(ring, Shard(SEQ), rule)


def _grouped(w: Walk, t: fx.Node) -> fx.Node | None:
    """The key/value heads behind `t` when `t` is the model's GQA repeat of them to the query
    heads (`repeat_interleave(kv, r, dim=1)`) and attention is its only reader: the heads the
    context collectives then move instead, r times fewer bytes. None otherwise."""
    if t.target is not aten.repeat_interleave.self_int or len(t.users) != 1:
        return None
    dim = t.args[2] if len(t.args) > 2 else t.kwargs.get("dim")
    kv = arg_node(t, 0)
    if dim is None or _norm_dim(dim, len(shape(t))) != 1 or w.placement(kv) != Shard(SEQ):
        return None
    return kv


def _causal_rows(w: Walk, node: fx.Node, keys: fx.Node, rule) -> fx.Node:
    """This rank's rows of the causal mask over the whole sequence: query position >= key position."""
    fake = keys.meta["val"]
    with w.graph.inserting_before(node):
        length = w.graph.call_function(aten.sym_size.int, (keys, SEQ))
        positions = w.graph.call_function(aten.arange.default, (length,), {"device": fake.device})
    length.meta["val"] = fake.shape[SEQ]
    with fake.fake_mode:
        positions.meta["val"] = torch.arange(fake.shape[SEQ], device=fake.device)
    for n in (length, positions):
        n.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        meta.set_placement(n, {})
    w.set(length, REPLICATE)
    w.set(positions, REPLICATE)
    mine = w.convert(positions, Shard(0), because=rule)
    with w.graph.inserting_before(node):
        column = w.graph.call_function(aten.unsqueeze.default, (mine, 1))
        mask = w.graph.call_function(aten.ge.Tensor, (column, positions))
    with fake.fake_mode:
        column.meta["val"] = mine.meta["val"].unsqueeze(1)
        mask.meta["val"] = column.meta["val"] >= positions.meta["val"]
    for n in (column, mask):
        n.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        meta.set_placement(n, w.other_axes(mine))
    w.set(column, Shard(0), rule)
    w.set(mask, Shard(0), rule)
    return mask


@register(aten.matmul.default, aten.bmm.default)
def _matmul(w: Walk, node: fx.Node) -> None:
    a, b = arg_node(node, 0), arg_node(node, 1)
    pa, pb = w.placement(a), w.placement(b)
    if pa == pb == REPLICATE:
        w.set(node, REPLICATE)
        return
    if weight_product(w, node, a, b, None):  # a linear layer written as a matmul
        return
    nd = len(shape(node))
    if pb == REPLICATE and isinstance(pa, Shard) and pa.dim < len(shape(a)) - 1 and len(shape(b)) == 2:
        # a whole weight: each row of `a` is multiplied alone, so a shard of rows (tokens on
        # sequence shards) passes through (a linear layer written as a matmul, not split); the
        # weight's gradient is each rank's rows' part: f sums it
        if w.requires_grad(b):
            w.use(node, b, w.convert(b, REPLICATE, into_sharded=True, because=w.rule_near(node)))
        w.set(node, pa.at(pa.dim + nd - len(shape(a))), w.rule_near(node))
        return
    if w.spec.context_modules and pa == Shard(len(shape(a)) - 2) and w.rule_for_module(node) is not None:
        _context_matmul(w, node, a, b)
        return
    if (  # both sharded on a batch dim
        isinstance(pa, Shard)
        and isinstance(pb, Shard)
        and pa.dim < len(shape(a)) - 2
        and pb.dim < len(shape(b)) - 2
    ):
        out = pa.dim + nd - len(shape(a))
        if out == pb.dim + nd - len(shape(b)) and pa.blocks == pb.blocks:
            w.set(node, Shard(out, pa.blocks), w.rule_near(node))
            return
    placed = next((r for t in (b, a) if (r := meta.rule(t)) is not None), None)
    w.error(
        node,
        f"{describe(node)} multiplies tensors placed {pa} and {pb} over `{w.axis}`",
        hint="a split weight must be the right-hand side, split by its last dim (column) or the "
        "one before (row, with the left-hand side split by its last dim); other matmuls must "
        "share a sharded batch dim (attention heads)",
        rule=placed,
    )


def _context_matmul(w: Walk, node: fx.Node, a: fx.Node, b: fx.Node) -> None:
    """Attention written with matmuls (`softmax(q @ k.transpose(-2, -1)) @ v`) in a module of a
    `context all_gather` rule, the queries' rows cut by sequence: the right-hand side, keys or
    values, is gathered whole (backward: reduce-scatter of its gradient), so each rank's rows
    of the scores, and of the output, are its own queries'

        scores = q @ self.all_gather_cp(k.transpose(-2, -1), 3)   # (B, H, T/n, T)
        out = probs @ self.all_gather_cp(v, 2)                    # (B, H, T/n, D)

    Key/value heads the model repeats for GQA (`repeat_interleave`, or Hugging Face's expand +
    reshape, which capture writes as one) are gathered before the repeat. A mask of the
    model's own meets the scores' rows as this rank's rows of it. Ring and Ulysses replace
    one `scaled_dot_product_attention` call: attention in matmuls reaches them as one
    (`matmul_attention.py`), unless it is written in a way that rewrite does not recognize."""
    rule = w.rule_for_module(node)  # a context axis's sequence modules are its context rules'
    mode = rule.action.mode  # type: ignore[union-attr]
    if mode != "all_gather":
        w.error(
            node,
            f"{describe(node)} is attention written with matmuls in a form `context {mode}` does not "
            "recognize as one attention: (q @ k.transpose(-2, -1)) times or over a number, plus a mask "
            "or masked_fill(-inf), softmax over the last dim, @ v, each step read by the next only",
            hint="use `context all_gather` for this module, or write its attention with "
            "torch.nn.functional.scaled_dot_product_attention (Hugging Face models: "
            'attn_implementation="sdpa")',
            rule=rule,
        )
    through = b if b.target is aten.transpose.int and len(b.users) == 1 else None
    repeat = arg_node(b, 0) if through is not None else b
    grouped = _grouped(w, repeat)
    if grouped is None:
        w.use(node, b, w.convert(b, REPLICATE, into_sharded=True, because=rule))
    else:  # gather the key/value heads, repeat them (and transpose the keys) after
        repeat.replace_input_with(grouped, w.convert(grouped, REPLICATE, into_sharded=True, because=rule))
        for t in (repeat, through):
            if t is not None:
                w.set(t, REPLICATE, rule)
    w.set(node, Shard(len(shape(node)) - 2), rule)


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
):
    _RULES[_t_] = _factory


@register(aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default)
def _factory_like(w: Walk, node: fx.Node) -> None:
    """A constant of its input's shape: of each rank's shard if the input is sharded (the
    shards of the whole constant), else whole."""
    p = w.placement(arg_node(node, 0))
    w.set(node, p if isinstance(p, Shard) else REPLICATE)


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
