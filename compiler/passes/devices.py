"""Module placement: `lm_head: on cpu` computes a module in host memory, `layers.7: on cuda:1` on
another device of the rank's process (naive model parallelism); `on cuda` is the rank's own
device (the default, to carve a module out of a placed parent).

What moves, and when. A placed module's parameters and buffers live where the rule puts them
from the start (`compiler.lower.place` leaves them there when it moves the rest of the rank's
program to its device) and stay there: their gradients are made there, their optimizer state
is made beside them (AdamW steps each tensor where it lives), and a data-parallel gradient
sync reduces them apart from the device's, in an engine of their own (`cli/session/sync.py`:
buckets, or under ZeRO flats sharded at most as ZeRO-2 shards them, on the host, over a gloo
group where the device's is NCCL). Nothing else moves but activations: each value that crosses
a placed module's boundary goes through one `DeviceCopy` node (`runtime/device_copy.py`), whose
backward copies its gradient back. The program shows the copies and the ledger counts them,
forward and backward, with their bytes (`compiler/ledger.py`). Why compute on the host rather
than stream the weights to the device for each use: the point of `on cpu` is a module whose
weights, gradients and AdamW state do not fit beside the rest (a large vocabulary's embedding
and head); streaming them would move the weights twice a step and the gradients once, against
the activations at the boundary here (for an LM head, the hidden states in and the logits out,
and their gradients back), and the module's optimizer step runs where its state is.

The targets a copy names are device-agnostic (`"cpu"`, `"device"`: the rank's own, `"cuda:N"`),
so the compiled program (`program.pt`) serves every rank; on a machine without CUDA every copy
is a no-op at run time, and `on cuda:N` is refused at its rule.

Requires: the tensor-parallel and experts passes' collectives in the graph (a placed module
must issue none), before checkpointing (a copy belongs to the region of the module that reads
it, and is recomputed with it) and before ZeRO (which leaves placed parameters out of its units).
Ensures: every node placed off the rank's device says where (`meta.device`, kept in
`program.pt`); every tensor an op reads is on the op's device, through a `DeviceCopy` node
shared by the readers of one value on one device.

Refused, each a located error at the rule: `on cuda:N` where this machine has no such device,
or under data parallelism (its gradients would be reduced from a device not the rank's);
a placed module whose ops communicate (a tensor, sequence, context or experts rule inside it:
collectives from another device are not lowered); a trainable weight read on two devices (a
weight tied across the boundary: it would be copied every step); a pipeline; a placed module's
gradients under a gradient sync per set of axes (expert parallelism, or weights whose gradient
is partial over a sequence or context axis, with data parallelism).

Before (`lm_head: on cpu`):

    mul_19 = torch.ops.aten.mul.Tensor(norm_weight, type_as_4)
    linear_14 = torch.ops.aten.linear.default(mul_19, lm_head_weight)
    flatten = torch.ops.aten.flatten.using_ints(linear_14, 0, 1)

After:

    to_host = self.to_host(mul_19)
    linear_14 = torch.ops.aten.linear.default(to_host, lm_head_weight)
    to_device = self.to_device(linear_14)
    flatten = torch.ops.aten.flatten.using_ints(to_device, 0, 1)

Golden: `tests/compiler/golden/passes/devices.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch
from torch import fx

from meshplan.dsl import ast
from meshplan.dsl.check import PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.dsl.fmt import action_text
from meshplan.runtime.device_copy import DEVICE, HOST, DeviceCopy

from .. import meta
from ..graph import innermost, is_tensor_node, module_path, value
from ..outline import value_meta
from . import Context, Pass
from .checkpoint import recomputed_nodes


def device_of(rule: PlanRule) -> str | None:
    """Where a device rule puts its modules: "cpu", "cuda:N", or None (`on cuda`: the rank's own)."""
    action = rule.action
    assert isinstance(action, ast.Device), "a device rule"
    if action.kind == "cpu":
        return HOST
    return f"cuda:{action.index}" if action.index is not None else None


def rule_text(rule: PlanRule) -> str:
    """`lm_head: on cpu`, as the plan writes the rule."""
    return f"{rule.pattern}: {action_text(rule.action)}"


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    rules = ctx.plan.rules_of("device")
    if not rules:
        return gm
    problems = _plan_problems(ctx, rules)
    placed = Placed(ctx)
    if not ctx.failed and not problems:  # one problem a rule: the plan's first
        problems += _graph_problems(gm, ctx, placed)
    ctx.diagnostics += problems
    if ctx.failed:
        return gm
    _insert_copies(gm, placed)
    gm.graph.lint()
    gm.recompile()
    return gm


class Placed:
    """Each node's device and the rule that put it there (None: the rank's own device, by no rule)."""

    def __init__(self, ctx: Context) -> None:
        self._rules = {
            path: rule for path, kinds in ctx.resolution.placements.items() if (rule := kinds.get("device"))
        }
        model = ctx.source.model
        self._names: dict[str, list[str]] = {}  # a tensor's name -> every name it has (ties)
        by_id: dict[int, list[str]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            by_id.setdefault(id(t), []).append(name)
        for names in by_id.values():
            for name in names:
                self._names[name] = names
        self.trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        self.device: dict[fx.Node, str | None] = {}
        self.rule: dict[fx.Node, PlanRule | None] = {}

    def rule_for(self, path: str) -> PlanRule | None:
        """The device rule of the innermost placed module enclosing `path` (itself included)."""
        return innermost(path, self._rules)

    def tensor_rules(self, name: str) -> list[PlanRule | None]:
        """The rule placing each name of a model tensor (its owner module's)."""
        return [self.rule_for(n.rpartition(".")[0]) for n in self._names.get(name, [name])]

    def is_model_tensor(self, name: str) -> bool:
        return name in self._names


def _plan_problems(ctx: Context, rules: tuple[PlanRule, ...]) -> list[Diagnostic]:
    out = []
    for rule in rules:
        action = rule.action
        assert isinstance(action, ast.Device)
        if action.kind == "cuda" and action.index is not None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if action.index >= count:
                have = "this machine has no CUDA device" if not count else f"this machine has {count}"
                out.append(
                    Diagnostic(
                        action.span,
                        f"`on cuda:{action.index}` places modules on CUDA device {action.index}, but {have}",
                        hint="compile on the machine that runs the plan, or place the module `on cpu`",
                    )
                )
        data = [a for a in ctx.plan.batch_axes if ctx.layout.size(a) > 1]
        if action.kind == "cuda" and action.index is not None and data:
            out.append(
                Diagnostic(
                    action.span,
                    f"`on cuda:{action.index}` under data parallelism over `{data[0]}` is not lowered yet: "
                    "its gradients would be reduced from another device than the rank's",
                    hint="naive model parallelism is one process's: drop the data axis, or place the module `on cpu`",
                )
            )
        if ctx.plan.pipeline is not None:
            out.append(
                Diagnostic(
                    action.span,
                    "device placement under a pipeline is not lowered yet: a stage's activations "
                    "travel from its device",
                    hint="remove the pipeline block, or the device rule",
                )
            )
    return out


def _graph_problems(gm: fx.GraphModule, ctx: Context, placed: Placed) -> list[Diagnostic]:
    """Each node's device decided (`placed`), and what the placement cannot do."""
    out: list[Diagnostic] = []
    reported: set[int] = set()

    def report(rule: PlanRule, message: str, hint: str, related=()) -> None:
        if rule.order not in reported:
            reported.add(rule.order)
            out.append(Diagnostic(rule.action.span, message, hint=hint, related=related))

    data: dict[fx.Node, bool] = {}  # depends on the program's inputs (not a weight-side value)
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        data[node] = node.op == "placeholder" or any(data[i] for i in inputs)
        where, rule = _decide(node, placed, data[node])
        placed.device[node], placed.rule[node] = where, rule
        info = meta.collective(node)
        if info is not None and where is not None and rule is not None:
            by = info.get("rule")
            report(
                rule,
                f"`{module_path(node)}` is placed on {where} by `{rule_text(rule)}` but communicates "
                f"over `{info['axis']}` ({info['kind']}): collectives off the rank's device are not lowered yet",
                "place only modules no tensor, sequence, context or experts rule splits",
                ((by.span, "the rule that splits it"),) if by is not None else (),
            )
    for node in gm.graph.nodes:  # a trainable weight read across the boundary: copied every step
        if node.op != "get_attr" or str(node.target) not in placed.trainable:
            continue
        rules = placed.tensor_rules(str(node.target))
        devices = {device_of(r) if r is not None else None for r in rules}
        readers = {placed.device[u] for u in _weight_readers(node, data)}
        if len(devices | readers) > 1:
            rule = next((r for r in rules if r is not None), None) or next(
                placed.rule[u] for u in _weight_readers(node, data) if placed.rule[u] is not None
            )
            report(
                rule,
                f"weight `{node.target}` would be read on two devices under `{rule_text(rule)}` "
                "(a weight tied across the boundary, or read outside its module): it would be copied every step",
                "place the modules that share the weight alike",
            )
    host_trainable = any(
        placed.device[n] is not None and str(n.target) in placed.trainable
        for n in gm.graph.nodes
        if n.op == "get_attr"
    )
    data_axes = [a for a in ctx.plan.batch_axes if ctx.layout.size(a) > 1]
    if host_trainable and data_axes and (ctx.experts or ctx.grad_sums):
        rule = next(r for r in placed.rule.values() if r is not None)
        report(
            rule,
            "a placed module's gradients under a gradient sync per set of axes (expert parallelism, "
            "or a sequence or context rule) are not lowered yet",
            "remove the device rule, or the experts / sequence / context rules",
        )
    return out


def _decide(node: fx.Node, placed: Placed, data: bool) -> tuple[str | None, PlanRule | None]:
    """A node's device: a model tensor's owner module's; an op's module's; a value the weights
    alone make (a cast of a weight, before any input is read) where those weights are."""
    if node.op in ("placeholder", "output"):
        return None, None
    if node.op == "get_attr":
        name = str(node.target)
        if not placed.is_model_tensor(name):
            return None, None
        rule = next((r for r in placed.tensor_rules(name) if r is not None), None)
        return (device_of(rule) if rule is not None else None), rule
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        assert isinstance(source, fx.Node)
        return placed.device[source], placed.rule[source]
    rule = placed.rule_for(module_path(node))
    if rule is not None:
        return device_of(rule), rule
    sources = {placed.device[i] for i in node.all_input_nodes if is_tensor_node(i)}
    if not data and len(sources) == 1 and None not in sources:
        source = next(i for i in node.all_input_nodes if is_tensor_node(i))
        return placed.device[source], placed.rule[source]
    return None, None


def _weight_readers(param: fx.Node, data: dict[fx.Node, bool]) -> list[fx.Node]:
    """The ops that read a weight with the program's inputs: through the values the weight alone
    makes (its casts, views), the first op that also reads an activation."""
    out, todo = [], list(param.users)
    while todo:
        user = todo.pop()
        if user.op == "output":
            continue
        if data[user]:
            out.append(user)
        else:
            todo += user.users
    return out


def _insert_copies(gm: fx.GraphModule, placed: Placed) -> None:
    """A `DeviceCopy` before each op that reads a tensor from another device: one per value and
    device, placed before its first reader and tagged with its module (so a checkpointed reader
    recomputes it); each placed node says where it runs."""
    graph = gm.graph
    grad: dict[fx.Node, bool] = {}  # carries a gradient back (made from a trainable weight)
    copies: dict[tuple[fx.Node, str | None], fx.Node] = {}
    for node in list(graph.nodes):
        grad[node] = (node.op == "get_attr" and str(node.target) in placed.trainable) or any(
            grad.get(i, False) for i in node.all_input_nodes
        )
        where = placed.device[node]
        meta.set_device(node, where)
        if node.op == "output":
            where = None
        for source in node.all_input_nodes:
            if placed.device.get(source) == where or not is_tensor_node(source):
                continue
            key = (source, where)
            if key not in copies:
                copies[key] = _copy(gm, source, node, where, placed, grad[source])
                grad[copies[key]] = grad[source]
            node.replace_input_with(source, copies[key])


def _copy(
    gm: fx.GraphModule, source: fx.Node, reader: fx.Node, where: str | None, placed: Placed, grad: bool
) -> fx.Node:
    to = where if where is not None else DEVICE
    base = {HOST: "to_host", DEVICE: "to_device"}.get(to, "to_" + to.replace(":", "_"))
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    gm.add_submodule(name, DeviceCopy(to))
    with gm.graph.inserting_before(reader):
        node = gm.graph.call_module(name, (source,))
    node.meta.update(value_meta(source))
    meta.set_device(node, None)  # where it runs is its module's business, not `place`'s
    meta.set_module_tag(node, module_path(reader) if reader.op != "output" else "")
    # the placed module whose boundary this is: the reader's going in, the source's coming out
    inside = reader if where is not None else source
    rule = placed.rule[inside]
    assert rule is not None, "a copy crosses into or out of a placed module"
    src = placed.device[source]
    meta.set_device_copy(
        node,
        meta.DeviceCopyFact(
            to,
            src if src is not None else DEVICE,
            grad and value_is_floating(source),
            rule_module(inside),
            rule,
        ),
    )
    placed.device[node], placed.rule[node] = where, placed.rule[reader]
    return node


def value_is_floating(node: fx.Node) -> bool:
    val = value(node)
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def rule_module(node: fx.Node) -> str:
    """The module a node ran in, as the copy's note names the boundary."""
    return module_path(node) or "the top level"


PASS = Pass(
    "devices",
    run,
    requires="the collectives of the tensor and experts rules inserted; before checkpointing and ZeRO",
    ensures="each op reads its tensors on its device, through a DeviceCopy node where they cross; "
    "each placed node says its device",
    checks_after_errors=True,
)


def copy_nodes(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, bool]]:
    """Every device copy node of `gm` and of its checkpoint regions, in program order, with
    whether backward's recomputation of its region copies again (`recomputed_nodes`)."""
    for node in gm.graph.nodes:
        region = meta.checkpoint_region(node)
        if region is None:
            if meta.device_copy(node) is not None:
                yield node, False
            continue
        sub = gm.get_submodule(region.target)
        assert isinstance(sub, fx.GraphModule), "a checkpoint region is a graph"
        again = set(recomputed_nodes(sub, lambda n: meta.device_copy(n) is not None))
        for inner in sub.graph.nodes:
            if meta.device_copy(inner) is not None:
                yield inner, inner in again
