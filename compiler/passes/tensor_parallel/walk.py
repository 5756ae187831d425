"""The walk of one tensor axis over the graph: every node visited in order, its placement
decided by the op rule registered for its target (the other modules of this package register
them; DTensor's strategies decide an op with none) or by running it on whole tensors; the
conversions it needs are `conversions.py`'s."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.fx.node import Argument, Target

from meshplan.dsl.check import PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.collectives import LAYOUT_KEEPING, AllToAll, CopyToAxis
from meshplan.runtime.ring_attention import RingAttention  # (it registers the ring collective)
from meshplan.runtime.watchdog import size_text

from ... import meta
from ...graph import (
    arg_node,
    as_int,
    as_list,
    describe,
    guard_error,
    hint,
    is_guard_error,
    is_tensor_node,
    known_equal,
    module_path,
    shape,
    value,
)
from ...placement import REPLICATE, Partial, Placement, Replicate, Shard
from . import weights
from .conversions import Conversions, _uneven
from .spec import ParamPlacement, TensorParallelSpec
from .strategies import Strategy, ask

aten = torch.ops.aten
# ops whose output is a new constant, whatever their input (read for its shape or dtype only):
# no gradient flows through them
_FRESH = frozenset(
    {
        aten.new_ones.default,
        aten.new_zeros.default,
        aten.new_full.default,
        aten.new_empty.default,
        aten.ones_like.default,
        aten.zeros_like.default,
        aten.full_like.default,
        aten.empty_like.default,
    }
)


# ---------------------------------------------------------------------------- the walk


class Walk(Conversions):
    def __init__(self, gm: fx.GraphModule, spec: TensorParallelSpec):
        super().__init__(gm, spec)
        self.whole_modules: set[str] = set()  # modules warned about running on whole tensors
        self.repeated: set[fx.Node] = set()  # GQA repeats cut to this rank's query heads
        # sequence rule -> the whole modules its shards were gathered into (`gather_entering`)
        self.gathered_whole: dict[PlanRule, list[str]] = {}
        # modules no rule of this axis splits, which attend over the whole sequence (`whole_attention`)
        self.whole_attention = _whole_attention(gm, spec) if spec.sequence_parallel else set()
        asked = any(getattr(r.action, "layout", None) == "balanced" for r in spec.context_modules.values())
        if spec.balanced and not asked and not _attends_causally(gm, spec.context_modules):
            spec.balanced = False  # nothing to balance: every rank's attention is the same work

    # -- driver
    def run(self) -> None:
        if self.spec.context_modules:
            self.refuse_without_tokens()
        for node in list(self.graph.nodes):
            self.walking = node
            self.mark_requires_grad(node)
            if node.op == "placeholder":
                self.set(node, REPLICATE)
                if self.spec.context_modules and _is_token_input(node):
                    self.cut_by_sequence(node)
            elif node.op == "get_attr":
                pp = self.spec.params.get(str(node.target))
                self.set(node, pp.placement if pp else REPLICATE, pp.rule if pp else None)
            elif node.op == "call_function":
                if self.whole_attention:
                    self.gather_entering(node)
                if self.reads_padding(node):
                    self.run_whole(node, [a for a in node.all_input_nodes if is_tensor_node(a)])
                    continue
                try:
                    _RULES.get(node.target, Walk.default)(self, node)
                except Exception as e:
                    if is_guard_error(e):  # a decision that would hold only for the example shape
                        raise guard_error(node, e) from e
                    if not isinstance(e, GuardOnDataDependentSymNode):
                        raise
                    self.error(
                        node,
                        f"{describe(node)} would need a data-dependent size (e.g. a per-expert token "
                        f"count) of a tensor sharded over `{self.axis}`",
                        hint="keep tensors whose sizes depend on the data replicated over this axis",
                    )
            elif node.op == "call_module":
                self.other_axis_module(node)
            elif node.op == "output":
                outs = node.args[0]
                flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
                new = [self.convert(o, REPLICATE) if is_tensor_node(o) else o for o in flat]
                node.args = (type(outs)(new) if isinstance(outs, (list, tuple)) else new[0],)
        self.whole_attention_warnings()

    def gather_entering(self, node: fx.Node) -> None:
        """A module left whole whose attention needs the whole sequence, between modules on
        sequence shards (norms under a `sequence` rule, attention not split): what enters it
        cut by sequence is all-gathered at its door, once per tensor, and it runs whole; the
        modules after it take their rows of its output again (a local slice). The ledger lists
        the gather under the sequence rule that cut the tensor, with a warning once per rule."""
        path = module_path(node)
        whole = next((m for m in self.whole_attention if path == m or path.startswith(f"{m}.")), None)
        if whole is None:
            return
        for arg in node.all_input_nodes:
            p = self.placement(arg)
            inside = module_path(arg) == whole or module_path(arg).startswith(f"{whole}.")
            if inside or arg.op == "get_attr" or not (isinstance(p, Shard) and p.dim == self.spec.seq_dim):
                continue
            rule = meta.rule(arg) or self.sequence_rule_near(node)
            self.use(node, arg, self.convert(arg, REPLICATE, because=rule))
            if rule is not None:
                self.gathered_whole.setdefault(rule, []).append(whole)

    def whole_attention_warnings(self) -> None:
        """One warning per sequence rule whose shards `gather_entering` gathered."""
        for rule, modules in self.gathered_whole.items():
            names = list(dict.fromkeys(modules))
            more = f" and {len(names) - 1} more like it" if len(names) > 1 else ""
            self.diagnostics.append(
                Diagnostic(
                    rule.span,
                    f"`{names[0]}`{more} {'are' if more else 'is'} not split over `{self.axis}` and "
                    f"{'attend' if more else 'attends'} over the whole sequence: what enters "
                    f"{'them' if more else 'it'} on sequence shards is all-gathered, and "
                    f"{'they run' if more else 'it runs'} whole on every rank",
                    hint=f"split attention by heads (`column`/`row over {self.axis}`), or give it "
                    "`context ring` for long sequences",
                    severity="warning",
                )
            )

    def refuse_without_tokens(self) -> None:
        """A context rule cuts the sequence of the token inputs ((B, T) integer ids); a model fed
        none (images, say) would have nothing cut and the rule would do nothing: refused."""
        inputs = [n for n in self.graph.nodes if n.op == "placeholder" and is_tensor_node(n)]
        if not any(_is_token_input(n) for n in inputs):
            shapes = ", ".join(f"{n.name} {tuple(shape(n))}" for n in inputs) or "none"
            self.error(
                inputs[0] if inputs else next(iter(self.graph.nodes)),
                f"`context` over `{self.axis}` cuts the sequence of the model's token inputs ((B, T) "
                f"integer ids), and this model takes none ({shapes}): nothing would be cut",
                hint="context parallelism is for models fed token sequences: remove the `context` rule",
                rule=self.spec.fallback_rule,
            )

    def cut_by_sequence(self, tokens: fx.Node) -> None:
        """Context parallelism: every reader of the token input `tokens` (ids, labels, position
        ids: (B, T) integers) gets this rank's slice of the sequence, so everything computed from
        them is cut by sequence too. Under the load-balanced layout the slice is chunks r and
        2n-1-r of 2n; every collective of the axis uses that layout (`spec.balanced`), so a
        replicated tensor met later (positions from `arange`, rotary tables, a mask) is split
        the same way, and gathers put the chunks back in sequence order."""
        users = list(tokens.users)
        seq = hint(shape(tokens)[self.spec.seq_dim])
        if seq is not None and seq % self.n:
            self.error(
                tokens,
                f"the sequence length {seq} is not divisible by {self.n} ranks over `{self.axis}`",
                hint=f"compile for a sequence length that is a multiple of {self.n} (--seq), "
                f"or use a `{self.axis}` size dividing {seq}",
                rule=self.spec.fallback_rule,
            )
        if seq is not None and self.spec.balanced and seq % (2 * self.n):
            self.error(
                tokens,
                f"the sequence length {seq} is not divisible by {2 * self.n} = 2 x {self.n} ranks over "
                f"`{self.axis}`: causal attention's load-balanced layout gives each rank two chunks "
                f"(r and {2 * self.n - 1} - r of {2 * self.n})",
                hint=f"compile for a sequence length that is a multiple of {2 * self.n} (--seq)",
                rule=self.spec.fallback_rule,
            )
        local = self.convert(tokens, Shard(self.spec.seq_dim), because=self.spec.fallback_rule)
        for user in users:
            user.replace_input_with(tokens, local)

    def other_axis_module(self, node: fx.Node) -> None:
        """A node an earlier axis's walk inserted. Its collectives move data over their own axis
        only, so this axis's layout of the input passes through; anything else (a vocab-parallel
        embedding or loss) sees whole tensors over this axis."""
        module = self.gm.get_submodule(str(node.target))
        inputs = [a for a in node.all_input_nodes if is_tensor_node(a)]
        if isinstance(module, LAYOUT_KEEPING) and module.axis != self.axis and inputs:
            if self.nested_under(node, module):
                # it moves a dim this axis cuts inside its cut (a context axis's gather of the
                # sequence this tensor axis's norms cut again): whole over this axis first
                self.use(node, inputs[0], self.convert(inputs[0], REPLICATE, because=meta.rule(inputs[0])))
                self.set(node, REPLICATE)
            else:
                # and the rule behind the input's placement here (a split weight's, read through
                # the f of a context axis walked before this one)
                self.set(node, self.placement(inputs[0]), meta.rule(inputs[0]))
        elif isinstance(module, RingAttention) and _heads_alike(*(self.placement(a) for a in node.args[:3])):
            # attention is independent per head: q, k, v split alike by heads stay so
            self.set(node, self.placement(node.args[0]))
        elif all(isinstance(self.placement(a), Replicate) for a in inputs):
            self.set(node, REPLICATE)
        else:
            self.run_whole(node, inputs)

    def nested_under(self, node: fx.Node, module: torch.nn.Module) -> bool:
        """Whether another axis's collective `node` (`module`) moves a dim that this axis cuts
        again inside that axis's cut (`Conversions.check_nested`): its gather would interleave
        our pieces."""
        x = node.args[0]
        p = self.placement(x)
        if not isinstance(p, Shard) or not isinstance(x, fx.Node):
            return False
        if meta.heads_inside(node) == p.dim:  # Ulysses' cut of this axis's heads: inside ours
            return False
        moved = node.args[1:3] if isinstance(module, AllToAll) else node.args[1:2]
        ndim = len(shape(x))
        return any(isinstance(d, int) and d % ndim == p.dim for d in moved)

    def mark_requires_grad(self, node: fx.Node) -> None:
        if node.op == "get_attr":
            attr = _get_attr(self.gm, str(node.target))
            meta.set_requires_grad(node, isinstance(attr, torch.nn.Parameter) and attr.requires_grad)
        elif node.op == "call_function":
            val = node.meta.get("val")
            constant = node.target in _FRESH or (
                isinstance(val, torch.Tensor) and not val.is_floating_point()
            )
            meta.set_requires_grad(
                node, not constant and any(self.requires_grad(a) for a in node.all_input_nodes)
            )

    def reads_padding(self, node: fx.Node) -> bool:
        """Whether `node` reads a padded shard (a vocabulary not divisible by the axis) in a way
        that could mix the padding into real values: only the LM head's and embedding's own
        weights, the loss (which masks it) and layout-only ops may; anything else runs whole."""
        padded = [a for a in node.all_input_nodes if isinstance(p := self.placement(a), Shard) and p.padded]
        if not padded or node.target in _PADDING_SAFE:
            return False
        weights: dict[Target, tuple[Argument, ...]] = {
            aten.linear.default: node.args[1:3],
            aten.embedding.default: node.args[:1],
        }
        return any(a not in weights.get(node.target, ()) for a in padded)

    def default(self, node: fx.Node) -> None:
        """Ops without a hand rule: replicated inputs give a replicated output; otherwise
        DTensor's strategy for the op decides (`strategies.py`)."""
        inputs = [a for a in node.all_input_nodes if is_tensor_node(a)]
        if all(isinstance(self.placement(a), Replicate) for a in inputs):
            self.set(node, REPLICATE)
            return
        if self.heads_shared(node, inputs):
            return
        strategy = ask(node.target, node.args, node.kwargs, {a: self.placement(a) for a in inputs}, self.n)
        if strategy is not None and self.partial_from_whole(strategy):
            # DTensor would cut a whole input into a partial one (a loss partial over `cp` plus
            # a router's loss computed whole): sum the partial ones here instead
            for a in inputs:
                if isinstance(self.placement(a), Partial):
                    self.use(node, a, self.reduce_partial(a))
            inputs = [a for a in node.all_input_nodes if is_tensor_node(a)]
            strategy = ask(
                node.target, node.args, node.kwargs, {a: self.placement(a) for a in inputs}, self.n
            )
        if strategy is None:
            self.run_whole(node, inputs)
            return
        into_sharded = not isinstance(strategy.output, Replicate)
        because = self.rule_for_module(node) or self.rule_near(node)
        for a, target in strategy.inputs.items():
            have = self.placement(a)
            if have != target:
                self.use(node, a, self.convert(a, target, into_sharded=into_sharded, because=because))
            elif into_sharded and isinstance(have, Replicate) and self.requires_grad(a):
                # f: its gradient is partial (a norm weight under sequence parallelism)
                self.use(node, a, self.convert(a, REPLICATE, into_sharded=True, because=because))
        self.set(node, strategy.output, self.rule_near(node))

    def partial_from_whole(self, strategy: Strategy) -> bool:
        """Whether `strategy` asks for an input that is not partial to become partial, which
        no collective does (DTensor would divide it over the ranks)."""
        return any(
            isinstance(t, Partial) and not isinstance(self.placement(a), Partial)
            for a, t in strategy.inputs.items()
        )

    def heads_shared(self, node: fx.Node, inputs: list[fx.Node]) -> bool:
        """Key/value heads shared by several ranks (`Shard(d, replicas=m)`) through an op that
        DTensor shards on `d` (complex RoPE on k: view_as_complex, mul, view_as_real): each rank's
        chunk is computed like any shard's, so ask DTensor as if it were `Shard(d)` and keep the
        sharing. Only when no other input would have to move. Returns whether it decided `node`."""
        shared = {a: p for a in inputs if isinstance(p := self.placement(a), Shard) and p.replicas > 1}
        if not shared or len({p.replicas for p in shared.values()}) > 1:
            return False
        (replicas,) = {p.replicas for p in shared.values()}
        plain = {
            a: Shard(shared[a].dim, shared[a].blocks) if a in shared else self.placement(a) for a in inputs
        }
        # as many distinct chunks as ranks / replicas: that many pieces is what must divide
        strategy = ask(node.target, node.args, node.kwargs, plain, self.n // replicas)
        if (
            strategy is None
            or any(strategy.inputs.get(a, plain[a]) != plain[a] for a in inputs)
            or not isinstance(strategy.output, Shard)
        ):
            return False
        out = strategy.output
        self.set(node, Shard(out.dim, out.blocks, replicas), self.rule_near(node))
        return True

    def run_whole(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        """No rule can run `node` on shards: gather its inputs and run it on whole tensors (every
        rank computes the same), with a warning naming the op and what the gather costs."""
        gathered = 0
        for a in inputs:
            p = self.placement(a)
            if isinstance(p, Shard) and _uneven(p):
                self.error(
                    node,
                    f"{describe(node)} uses a fused projection's output ({p}) as a whole",
                    hint="use the fused output only through its split into q, k and v",
                )
            if not isinstance(p, Replicate):
                if isinstance(p, Shard):  # at the example shape
                    gathered += (hint(value(a).numel()) or 0) * value(a).element_size()
                self.use(node, a, self.convert(a, REPLICATE))
        rule = self.rule_for_module(node) or self.rule_near(node)
        # at the model's top level (a label shift) no rule is near: said at the plan's first rule
        top = not module_path(node)
        span = rule.span if rule is not None else self.spec.fallback_span if top else None
        if span is not None and gathered and module_path(node) not in self.whole_modules:
            self.whole_modules.add(module_path(node))
            self.diagnostics.append(
                Diagnostic(
                    span,
                    f"{describe(node)} has no sharding rule: its inputs are all-gathered over "
                    f"`{self.axis}` ({size_text(gathered)}) and it runs on whole tensors",
                    hint="correct, but each rank repeats the work; report the op if it should shard",
                    severity="warning",
                )
            )
        self.set(node, REPLICATE, rule)

    def fuse_blocks(
        self, node: fx.Node, dim: int, params: tuple[fx.Node, fx.Node | None], *, weight_dim: int
    ) -> tuple[int, ...]:
        """The blocks a column-split output is cut into downstream: fused q/k/v, fused gate/up.

        A fused projection's output is split into q, k and v; each must be sharded by heads,
        so every rank holds its chunk of each block. Seen here, the weight and bias take
        `Shard(dim, blocks=sizes)` and `build_rank_program` cuts them that way.
        """
        blocks = _downstream_blocks(node, dim)
        if blocks:
            if any(b % self.n for b in blocks):
                self.error(
                    node,
                    f"{describe(node)}: the fused output's blocks {blocks} do not divide by "
                    f"{self.n} ranks over `{self.axis}`",
                )
            for param, dim_of_operand in zip(params, (weight_dim, 0), strict=False):
                found = weights.source(param) if param is not None else None
                if found is not None:
                    param, dims = found
                    pdim = dims[dim_of_operand]
                    placement = Shard(pdim, blocks)
                    name = str(param.target)
                    self.spec.params[name] = ParamPlacement(placement, self.spec.params[name].rule)
                    self.set(param, placement)
        return blocks


# ---------------------------------------------------------------------------- the op rules

# op -> the rule deciding its placement (`Walk.run` dispatches on it; an op without one goes to
# `Walk.default`); the op-rule modules of this package fill it with `register`
Rule = Callable[[Walk, fx.Node], None]
_RULES: dict[object, Rule] = {}


def register(*targets) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for t in targets:
            _RULES[t] = fn
        return fn

    return deco


def _through_casts(node: fx.Node) -> fx.Node:
    """The node a chain of dtype casts starts from (a parameter behind its compute-dtype cast),
    and behind the f (`copy_to`) an earlier axis's walk put on it: a context axis walked before
    this tensor axis (`mesh cp=2, tp=4`) reads every parameter through one."""
    while node.target in (aten._to_copy.default, aten.to.dtype) or (
        node.op == "call_module" and isinstance(_module(node), CopyToAxis)
    ):
        node = arg_node(node, 0)
    return node


def _module(node: fx.Node) -> torch.nn.Module | None:
    owner = node.graph.owning_module
    return owner.get_submodule(str(node.target)) if owner is not None else None


def _get_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _heads_alike(q: Placement, k: Placement, v: Placement) -> bool:
    """q, k and v placed alike over an axis, so attention stays per rank: the same placement,
    or q split by heads and k, v by key/value heads shared by neighbouring ranks (GQA with
    fewer kv heads than ranks, each rank keeping the one its query heads use)."""

    def alike(kv: Placement) -> bool:
        shared = isinstance(q, Shard) and isinstance(kv, Shard) and kv.replicas > 1
        return kv == q or (shared and q == Shard(1) and kv.dim == 1 and not kv.blocks)  # type: ignore[union-attr]

    return alike(k) and alike(v)


def _whole_attention(gm: fx.GraphModule, spec: TensorParallelSpec) -> set[str]:
    """The modules, outermost first, that hold an attention (`scaled_dot_product_attention`)
    and nothing a rule of this axis splits or cuts: under sequence parallelism they run whole."""
    ruled = {name.rpartition(".")[0] for name in spec.params} | set(spec.sequence_modules)
    ruled |= set(spec.context_modules)
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        parts = module_path(node).split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if not any(r == prefix or r.startswith(f"{prefix}.") for r in ruled):
                found.add(prefix)
                break
    return found


def _attends_causally(gm: fx.GraphModule, modules: dict[str, PlanRule]) -> bool:
    """Whether an attention of the context modules is causal (`is_causal`, or a mask of the
    model's own, which may be): only then do contiguous chunks load the ranks unevenly."""
    for node in gm.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        path = module_path(node)
        if not any(path == m or path.startswith(f"{m}.") for m in modules):
            continue
        causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if causal or isinstance(mask, fx.Node):
            return True
    return False


def _is_token_input(node: fx.Node) -> bool:
    """A (B, T) integer input: token ids, labels or position ids."""
    val = node.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and val.dim() == 2
        and not val.is_floating_point()
        and not val.is_complex()
        and val.dtype != torch.bool
    )


def _norm_dim(dim: Argument, ndim: int) -> int:
    """A dim argument (an `int` by the op's schema) counted from the front."""
    dim = as_int(dim)
    return dim + ndim if dim < 0 else dim


# ops that may read a padded shard: they move or cast it, never mix the padding into real values
_PADDING_SAFE = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten._to_copy.default,
    aten.to.dtype,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
    aten.cross_entropy_loss.default,
}


def _downstream_blocks(node: fx.Node, dim: int) -> tuple[int, ...]:
    """Block sizes when the output's `dim` is cut into pieces downstream, else ().

    Follows the dim through views that keep its size and through ops that only move dims
    (transpose, permute, (un)squeeze, copies, casts), then looks for a split into equal parts
    (GPT-2's q/k/v, fused gate/up, a state-space model's input projection chunked into the
    stream and its gate) or slices that partition the dim (Phi-3's q/k/v with fewer kv heads).
    A view that splits the dim into (k, ...) starts k blocks, if what follows separates that
    new dim into its k entries (timm's `reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`,
    nn.MultiheadAttention's `unflatten(-1, (3, E))` then `[0]`, `[1]`, `[2]`).
    """
    size = shape(node)[dim]
    # the callers ask about a column split's output features: a weight's size, never data-dependent
    assert isinstance(size, int)
    current, current_dim = node, dim
    pieces = 0  # after a view split the dim: into how many blocks, on `current_dim`
    while len(current.users) == 1:
        (user,) = current.users
        moved = _moved_dim(user, current, current_dim)
        if moved is not None:
            current, current_dim = user, moved
            continue
        if pieces or user.target not in _VIEWS:
            break
        matches = [i for i, s in enumerate(shape(user)) if known_equal(s, size)]
        if len(matches) == 1:
            current, current_dim = user, matches[0]
            continue
        split = _split_outermost(shape(current), shape(user), current_dim, size)
        if split is None:
            return ()
        current, (current_dim, pieces) = user, split
    if pieces:
        return (size // pieces,) * pieces if _separates(list(current.users), current_dim, pieces) else ()
    users = list(current.users)
    ndim = len(shape(current))
    splits = (aten.split.Tensor, aten.chunk.default, aten.split_with_sizes.default)
    if len(users) == 1 and users[0].target in splits:
        user = users[0]
        split_dim = _norm_dim(user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0), ndim)
        if split_dim == current_dim:
            if (
                user.target is aten.split.Tensor
                and isinstance(user.args[1], int)
                and size % user.args[1] == 0
            ):
                return (user.args[1],) * (size // user.args[1]) if size // user.args[1] > 1 else ()
            if user.target is aten.chunk.default:
                chunks = as_int(user.args[1], of=user)
                if size % chunks == 0 and chunks > 1:
                    return (size // chunks,) * chunks
            if user.target is aten.split_with_sizes.default:
                sizes = as_list(user.args[1], of=user)
                if len(sizes) > 1:
                    return tuple(as_int(s, of=user) for s in sizes)
    if len(users) > 1 and all(u.target is aten.slice.Tensor for u in users):
        ranges = []
        for u in users:
            if _norm_dim(u.args[1], ndim) != current_dim or (len(u.args) > 4 and u.args[4] != 1):
                return ()
            start = as_int(u.args[2], of=u) if len(u.args) > 2 and u.args[2] is not None else 0
            end = min(as_int(u.args[3], of=u) if len(u.args) > 3 and u.args[3] is not None else size, size)
            ranges.append((start, end))
        ranges.sort()
        if (
            ranges[0][0] == 0
            and ranges[-1][1] == size
            and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        ):
            return tuple(end - start for start, end in ranges)
    return ()


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int)
_SAME_LAYOUT = (
    aten._to_copy.default,
    aten.to.dtype,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
)


def _moved_dim(user: fx.Node, x: fx.Node, dim: int) -> int | None:
    """Where `user`, an op that only moves or copies `x`'s dims, puts `x`'s `dim`; None for other ops.
    A bias added (`x @ W.T + b`) leaves them in place."""
    if user.target is aten.add.Tensor and x in user.args and known_equal_shapes(shape(user), shape(x)):
        return dim
    if not user.args or user.args[0] is not x:
        return None
    ndim = len(shape(x))
    if user.target in _SAME_LAYOUT:
        return dim
    if user.target is aten.transpose.int:
        a, b = (_norm_dim(d, ndim) for d in user.args[1:3])
        return b if dim == a else a if dim == b else dim
    if user.target in (aten.t.default, aten.numpy_T.default):
        return ndim - 1 - dim
    if user.target is aten.permute.default:
        return [_norm_dim(d, ndim) for d in as_list(user.args[1], of=user)].index(dim)
    if user.target is aten.unsqueeze.default:
        added = _norm_dim(user.args[1], ndim + 1)
        return dim + (added <= dim)
    if user.target is aten.squeeze.dim:
        dropped = _norm_dim(user.args[1], ndim)
        if dropped == dim or not known_equal(shape(x)[dropped], 1):
            return None if dropped == dim else dim
        return dim - (dropped < dim)
    return None


def known_equal_shapes(a, b) -> bool:
    return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b, strict=True))


def _split_outermost(in_shape, out_shape, dim: int, size: int) -> tuple[int, int] | None:
    """If a view of `in_shape` to `out_shape` splits `dim` (of `size`) into consecutive dims
    whose outermost has k > 1 entries, (that dim, k); else None."""
    before = math.prod(in_shape[:dim])
    for j in range(len(out_shape)):
        if not known_equal(math.prod(out_shape[:j]), before):
            continue
        product, end = 1, j
        while end < len(out_shape) and isinstance(out_shape[end], int) and product < size:
            product *= out_shape[end]
            end += 1
        k = out_shape[j]
        if product == size and end - j >= 2 and isinstance(k, int) and k > 1:
            return j, k
        return None
    return None


def _separates(users: list[fx.Node], dim: int, pieces: int) -> bool:
    """Whether `users` take a tensor's `dim` of `pieces` entries apart: an unbind, a split or
    chunk into ones, or a select of each entry."""
    if len(users) == 1 and users[0].target is aten.unbind.int:
        ndim = len(shape(arg_node(users[0], 0)))
        return _norm_dim(users[0].args[1] if len(users[0].args) > 1 else 0, ndim) == dim
    if users and all(u.target is aten.select.int for u in users):
        ndim = len(shape(arg_node(users[0], 0)))
        taken = {_norm_dim(u.args[2], pieces) for u in users}
        return all(_norm_dim(u.args[1], ndim) == dim for u in users) and taken == set(range(pieces))
    return False
