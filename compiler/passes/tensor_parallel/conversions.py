"""What a walk knows of its axis, and how it moves a tensor over it: each node's placement
and the rule behind it, the sizes a shard cuts (checked at the example shape, noted for the
run), and the conversions between placements, each a collective node over the axis
(`copy_to`, `all_gather`, `reduce_scatter`, ...) made once per producer and reused by its
readers. `walk.Walk` decides the placements, one node after another, with these."""

from __future__ import annotations

import math
import operator
from typing import NoReturn

import torch
from torch import fx
from torch.fx.node import Argument

from meshplan.dsl.check import PlanRule
from meshplan.dsl.errors import Diagnostic, Span
from meshplan.runtime.collectives import COLLECTIVES

from ... import meta
from ...graph import (
    as_int,
    as_list,
    describe,
    divides,
    hint,
    innermost,
    is_tensor_node,
    known_equal,
    module_path,
    shape,
)
from ...placement import REPLICATE, Partial, Placement, Replicate, Shard
from ...stages import aliased_input, written
from .spec import TensorParallelError, TensorParallelSpec

aten = torch.ops.aten


class Conversions:
    """One tensor axis's placements over a graph, and the collectives that convert between them."""

    def __init__(self, gm: fx.GraphModule, spec: TensorParallelSpec):
        self.gm, self.graph, self.spec = gm, gm.graph, spec
        self.axis, self.n = spec.axis, spec.size
        self.diagnostics: list[Diagnostic] = []
        self.converted: dict[tuple[fx.Node, str, int | None, int, int | None], fx.Node] = {}
        # (rows, blocks) of the token dim once a sequence shard is flattened with the batch:
        # (B, T/n, H) -> (B*T/n, H) is Shard(0, blocks=(T,) * B)
        self.flat_tokens: tuple[int, tuple[int, ...]] | None = None
        self.walking: fx.Node | None = None  # the node the walk decides (`Walk.run` sets it)

    # -- facts
    def placement(self, node: Argument) -> Placement:
        if not isinstance(node, fx.Node):
            return REPLICATE
        return meta.placement(node).get(self.axis, REPLICATE)

    def set(self, node: fx.Node, placement: Placement, rule: PlanRule | None = None) -> None:
        if isinstance(placement, Shard):
            self.check_nested(node, placement, rule)
        meta.set_axis_placement(node, self.axis, placement)
        if rule is not None:
            meta.set_rule(node, rule)
        if isinstance(placement, Shard) and is_tensor_node(node):
            self.cut(node, placement, rule)

    def check_nested(self, node: fx.Node, placement: Shard, rule: PlanRule | None) -> None:
        """A sequence a context axis cuts may be cut again over this tensor axis (each rank's
        slice, Megatron's sequence parallelism inside context parallelism): every collective of
        this axis moves the local tensor along the dim, and `Walk.nested_under` gathers ours
        before a context axis's collective moves the dim. Other nestings are refused: two
        tensor axes' cuts would need an order the placements do not keep, and a padded or
        replicated chunk is sized from the global dim. Ulysses' cut of heads a tensor axis split
        first is inside that axis's shard, on the local heads (`meta.HEADS_INSIDE`): any."""
        if meta.heads_inside(node) == placement.dim:
            return
        for other, p in self.other_axes(node).items():
            if not (isinstance(p, Shard) and p.dim == placement.dim):
                continue
            uneven = next((q for q in (p, placement) if q.padded or q.replicas > 1), None)
            if uneven is not None or other not in self.spec.nested:
                self.error(
                    node,
                    f"{describe(node)} would be sharded along dim {placement.dim} over both `{other}` and "
                    f"`{self.axis}`; meshplan nests a tensor axis's even shards inside a context axis's only",
                    hint="split each dim over one axis here",
                    rule=rule,
                )

    def cut_with(self, node: fx.Node, placement: Shard) -> dict[str, int]:
        """The other axes that already cut the dim this axis cuts (`check_nested`): their pieces
        (their size, over the ranks sharing each piece)."""
        return {
            a: n // p.replicas
            for a, n in self.spec.nested.items()
            if isinstance(p := self.other_axes(node).get(a), Shard) and p.dim == placement.dim
        }

    def pieces(self, node: fx.Node, placement: Shard) -> int:
        """What the global dim must divide by once this axis cuts it: this axis's pieces (two
        chunks a rank under the load-balanced layout), and the product of every axis's ranks
        that cut the dim (each rank's slice is cut again)."""
        own = self.n // placement.replicas
        together = own * math.prod(self.cut_with(node, placement).values())
        return math.lcm(own * (2 if self.spec.balanced else 1), together)

    def cut(self, node: fx.Node, placement: Shard, rule: PlanRule | None) -> None:
        """Check a shard of a size that follows from the token shape (a sequence over the axis):
        one that does not divide at the example shape is a located error; one that divides for
        some shapes only is noted, for the run to check its own (`capture.TokenShapes`)."""
        sizes = shape(node)
        if placement.dim >= len(sizes) or placement.padded or placement.blocks:
            return  # padded and blocked sizes are constants, checked where they are decided
        size = sizes[placement.dim]
        example = hint(size)
        if example is None:
            return  # a data-dependent size: never sharded into (the rules refuse it)
        pieces = self.pieces(node, placement)
        ok = divides(pieces, size)
        because = (
            (self.rule_for_module(node) or self.sequence_rule_near(node))
            if self.spec.sequence_parallel
            else None
        ) or (rule or self.rule_near(node))
        if ok is False or example % pieces:
            what = (
                f"{pieces} chunks (2 per rank: the load-balanced layout)"
                if self.spec.balanced
                else f"{pieces} shards"
            )
            over = " x ".join(f"`{a}`" for a in [*self.cut_with(node, placement), self.axis])
            self.error(
                node,
                f"{describe(node)} cuts dim {placement.dim} (size {example}) into {what} "
                f"over {over}, and {example} does not divide by {pieces}",
                hint="compile and run with a --seq (and --batch) that the plan's splits divide",
                rule=because,
            )
        if ok is None and isinstance(size, torch.SymInt):
            self.spec.cuts.setdefault((size.node.expr, pieces), because)

    def other_axes(self, node: fx.Node) -> dict[str, Placement]:
        """`node`'s placements over the other axes: what a node this walk derives from it keeps."""
        return {k: v for k, v in meta.placement(node).items() if k != self.axis}

    def requires_grad(self, node: Argument) -> bool:
        return isinstance(node, fx.Node) and bool(meta.requires_grad(node))

    def error(
        self,
        node: fx.Node,
        message: str,
        hint: str | None = None,
        rule: PlanRule | None = None,
        related: list[tuple[Span, str]] | None = None,
    ) -> NoReturn:
        """A located error at `rule` (else the rule near `node`), with notes at other lines."""
        rule = rule or self.rule_near(node)
        span = rule.span if rule else self.spec.fallback_span
        raise TensorParallelError(Diagnostic(span, message, hint, related=related or []))

    def rule_near(self, node: fx.Node) -> PlanRule | None:
        for arg in node.all_input_nodes:
            rule = meta.rule(arg)
            if rule is not None:
                return rule
        return None

    def rule_for_module(self, node: fx.Node) -> PlanRule | None:
        """The `sequence` rule of the module `node` runs in, if any (it is why the node is sharded)."""
        return innermost(module_path(node), self.spec.sequence_modules)

    def sequence_rule_near(self, node: fx.Node) -> PlanRule | None:
        """The `sequence` rule that put a tensor on sequence shards near `node`: its module's own,
        else the one whose module shares the longest path prefix with it (the layer's norm)."""
        own = self.rule_for_module(node)
        if own is not None or not self.spec.sequence_modules:
            return own
        parts = module_path(node).split(".")

        def shared(path: str) -> int:
            return next(
                (i for i, (a, b) in enumerate(zip(parts, path.split("."), strict=False)) if a != b),
                len(parts),
            )

        best = max(self.spec.sequence_modules, key=shared)
        return self.spec.sequence_modules[best]

    # -- conversions
    def use(self, node: fx.Node, old: fx.Node, new: fx.Node) -> fx.Node:
        """Make `node` read `new` where it read `old`; returns `new`."""
        if new is not old:
            node.replace_input_with(old, new)
        return new

    def convert(
        self, arg: fx.Node, target: Placement, *, into_sharded: bool = False, because: PlanRule | None = None
    ) -> fx.Node:
        """A node holding `arg` in `target` placement; `into_sharded` marks use by sharded compute,
        whose gradient w.r.t. `arg` is partial and must be summed in backward (Megatron's f).
        `because` is the rule that demands the conversion, for the ledger and `explain`."""
        have = self.placement(arg)
        if isinstance(have, Partial):
            arg = self.reduce_partial(arg)
            have = self.placement(arg)
        if (isinstance(have, Shard) and _uneven(have) and have != target) or (
            isinstance(target, Shard) and _uneven(target) and have != target
        ):
            self.error(
                arg,
                f"{describe(arg)} is a fused projection's output ({have}); meshplan can only split it "
                "into its blocks",
                hint="use the fused output only through its split into q, k and v",
            )
        if have != target and any(isinstance(p, Shard) and p.replicas > 1 for p in (have, target)):
            if isinstance(target, Shard) and target.replicas > 1 and self.walking is not None:
                # a whole tensor to meet key/value heads several ranks share (OLMo 2's k-norm
                # weight, over every key/value head): said at the op, where the rule splits them
                self.error(
                    self.walking,
                    f"{describe(self.walking)} reads {describe(arg)} whole beside key/value heads "
                    f"replicated over `{self.axis}` ({target}): meshplan cuts a whole tensor to "
                    "such heads only through attention's repeat of them",
                    hint=f"a `{self.axis}` size that divides the key/value heads",
                )
            self.error(
                arg,
                f"{describe(arg)} holds key/value heads replicated over `{self.axis}` ({have}); "
                "it can only be repeated to the query heads",
            )
        if isinstance(target, Shard) and target.padded and have != target:
            self.error(
                arg, f"cannot move {describe(arg)} from {have} to a padded {target} over `{self.axis}`"
            )
        if have == target:
            if isinstance(target, Replicate) and into_sharded and self.requires_grad(arg):
                return self.collective("copy_to", arg, None, REPLICATE, because)
            return arg
        if isinstance(have, Shard) and isinstance(target, Replicate):
            kind = "all_gather" if into_sharded else "gather_replicated"
            whole = self.collective(kind, arg, have.dim, REPLICATE, because, blocks=len(have.blocks) or 1)
            return self.unpadded(whole, have) if have.padded else whole
        if isinstance(have, Replicate) and isinstance(target, Shard):
            return self.collective("split", arg, target.dim, target, because, blocks=len(target.blocks) or 1)
        if isinstance(have, Shard) and isinstance(target, Shard) and not (have.blocks or target.blocks):
            return self.collective("all_to_all", arg, have.dim, target, because, to=target.dim)
        self.error(
            arg,
            f"cannot move {describe(arg)} from {have} to {target} over `{self.axis}`",
            hint="a blocked shard (a fused projection's, or a sequence flattened with the batch) "
            "moves to another dim only through a whole tensor",
        )
        raise AssertionError("unreachable")

    def unpadded(self, whole: fx.Node, was: Shard) -> fx.Node:
        """A gathered padded shard without its padding: the first `was.padded` entries of its dim."""
        key = (whole, "unpad", was.dim, 1, None)
        if key not in self.converted:
            with self.graph.inserting_after(whole):
                node = self.graph.call_function(aten.slice.Tensor, (whole, was.dim, 0, was.padded))
            node.meta.update({k: v for k, v in whole.meta.items() if k in ("val", "nn_module_stack")})
            meta.copy_facts(whole, node, meta.REQUIRES_GRAD)
            meta.set_placement(node, self.other_axes(whole))
            self.set(node, REPLICATE, meta.rule(whole))
            self.converted[key] = node
        return self.converted[key]

    def summed(self, node: fx.Node, arg: fx.Node) -> fx.Node:
        """What `node` reads for `arg`: a partial `arg` summed first (`reduce_partial`), for the
        ops a partial sum cannot pass through; `arg` itself otherwise."""
        if isinstance(self.placement(arg), Partial):
            return self.use(node, arg, self.reduce_partial(arg))
        return arg

    def reduce_partial(self, arg: fx.Node, *, whole: bool = False) -> fx.Node:
        """Sum a partial result right where it is made (the rule behind it made it partial):
        under sequence parallelism scattered by sequence, unless `whole`."""
        because = meta.rule(arg)
        rows = shape(arg)[:1]
        if whole:
            return self.collective("all_reduce", arg, None, REPLICATE, because)
        if (
            self.spec.sequence_parallel
            and self.flat_tokens
            and rows
            and known_equal(rows[0], self.flat_tokens[0])
        ):
            _, blocks = self.flat_tokens  # tokens flattened with the batch: scatter each sequence
            return self.collective("reduce_scatter", arg, 0, Shard(0, blocks), because, blocks=len(blocks))
        if self.spec.sequence_parallel and len(shape(arg)) > self.spec.seq_dim:
            return self.collective(
                "reduce_scatter", arg, self.spec.seq_dim, Shard(self.spec.seq_dim), because
            )
        return self.collective("all_reduce", arg, None, REPLICATE, because)

    def collective(
        self,
        kind: str,
        arg: fx.Node,
        dim: int | None,
        out: Placement,
        because: PlanRule | None = None,
        *,
        blocks: int = 1,
        to: int | None = None,
    ) -> fx.Node:
        """A `kind` collective of `arg` over the axis; `blocks` > 1 runs it on each of that many
        equal blocks of `dim` (a sequence shard flattened with the batch); `to` is an all-to-all's
        destination dim."""
        key = (arg, kind, dim, blocks, to)
        if key in self.converted:
            return self.converted[key]
        name = self.module_for(kind)
        args: tuple[Argument, ...] = (
            (arg,) if dim is None else (arg, dim) if blocks == 1 else (arg, dim, blocks)
        )
        if to is not None:
            args = (arg, dim, to)
        with self.graph.inserting_after(self.written_last(arg)):
            node = self.graph.call_module(name, args)
        node.meta.update({k: v for k, v in arg.meta.items() if k in ("val", "nn_module_stack")})
        meta.copy_facts(arg, node, meta.REQUIRES_GRAD)
        meta.set_placement(node, self.other_axes(arg))
        meta.set_collective(node, {"kind": kind, "axis": self.axis, "dim": dim, "rule": because})
        sequence = self.spec.sequence_parallel and isinstance(out, Shard) and kind == "reduce_scatter"
        self.set(node, out, self.sequence_rule_near(arg) if sequence else meta.rule(arg))
        self.converted[key] = node
        return node

    def written_last(self, arg: fx.Node) -> fx.Node:
        """Where a conversion of `arg` goes: right after it, unless the graph fills it in place
        before the node being walked reads it (DeepSeek-V3's keys: `new_empty`, then its two
        halves copied in through slices), then after the last of those writes: a split taken
        before them would read uninitialized memory. A node converting its own output (a row
        split's all-reduce) precedes any such write: its conversion goes right after it, and
        the writes, walked later, read the conversion (Falcon adds its attention output into
        the MLP's row output in place)."""
        if arg is self.walking or not any(aliased_input(u) is arg or arg in written(u) for u in arg.users):
            return arg  # nothing views or writes it: the common case, no scan
        aliases, last, node = {arg}, arg, arg.next
        while node is not self.walking and node.op != "root":
            if aliased_input(node) in aliases:
                aliases.add(node)
            if any(a in aliases for a in written(node)):
                last = node
            node = node.next
        return last

    def replace_by_module(
        self,
        node: fx.Node,
        kind: str,
        args: tuple[Argument, ...],
        rule: PlanRule | None,
        dim: int | None = None,
    ) -> fx.Node:
        """Replace `node` by a call of the axis's `kind` module on `args`: an op that runs over
        the axis as a whole (the vocabulary-parallel embedding, ring attention)."""
        with self.graph.inserting_before(node):
            call = self.graph.call_module(self.module_for(kind), args)
        call.meta.update(node.meta)
        meta.set_collective(call, {"kind": kind, "axis": self.axis, "dim": dim, "rule": rule})
        node.replace_all_uses_with(call)
        self.graph.erase_node(node)
        return call

    def module_for(self, kind: str) -> str:
        """The name of the graph's submodule for collective `kind` on this axis, created on first use.

        The compiled graph holds group-less instances; `build_rank_program` binds each
        rank's process groups.
        """
        name = f"{kind}_{self.axis}"
        if not hasattr(self.gm, name):
            self.gm.add_submodule(name, COLLECTIVES[kind](None, self.axis, balanced=self.spec.balanced))
        return name

    # -- shapes
    def local_sizes(self, sizes: Argument, out: Placement) -> list[Argument]:
        """A size list with the sharded dim divided by the axis size (-1 stays -1). A size the
        graph computes from the token shape (a `sym_size` node: the whole sequence) is divided
        by a node of its own: the run's size, whatever it is, over the axis."""
        local = as_list(sizes)
        size_node = local[out.dim] if isinstance(out, Shard) else None
        if isinstance(out, Shard) and isinstance(size_node, fx.Node):
            if out.padded or out.replicas > 1:
                raise AssertionError("padded and replicated shards cut constant sizes")
            local[out.dim] = self.divided(size_node, self.n)
        elif isinstance(out, Shard) and local[out.dim] != -1:
            size = as_int(local[out.dim])  # a data-dependent size is never sharded into
            if size % (self.n // out.replicas) and not out.padded:
                raise AssertionError("divisibility is checked when the placement is decided")
            local[out.dim] = out.chunk(size, self.n)
        return local

    def divided(self, size: fx.Node, n: int) -> fx.Node:
        """A node computing `size // n` right after `size` (one per size node and axis size).
        That it divides is noted when the shard is placed (`cut`)."""
        key = (size, "floordiv", None, n, None)
        if key not in self.converted:
            with self.graph.inserting_after(size):
                node = self.graph.call_function(operator.floordiv, (size, n))
            node.meta["val"] = size.meta["val"] // n
            self.converted[key] = node
        return self.converted[key]


def _uneven(p: Shard) -> bool:
    """A blocked shard whose blocks differ in size (Phi-3's q/k/v under GQA): only the split
    into its blocks can use it. Equal blocks are a strided layout collectives handle."""
    return len(set(p.blocks)) > 1
