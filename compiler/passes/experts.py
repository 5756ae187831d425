"""Expert parallelism: each MoE experts module an `experts over AXIS` rule names runs split over
that axis, its tokens dispatched to the ranks holding their experts and combined back.

The experts module is treated as a unit. Capture (`experts_as_units`) calls, in place of its
forward, one opaque operator that takes what the module takes and its parameters:

    experts = meshplan.experts(tokens, top_k_index, top_k_weights, [gate_up_proj, down_proj], path)

so the captured graph holds the module's interface, not its internals (a loop over
per-expert token counts whose sizes depend on the data). This pass replaces each such node
with a call of `runtime.experts.ExpertParallel` over the axis, and places each of the
module's parameters `Shard(0)` over it: rank r holds experts [r E/n, (r+1) E/n). At run
time that module sends each token to the ranks of its experts (all-to-all), runs the model's
own experts module on them as its E/n local experts, and sends the outputs back.

Why a unit and not a rewrite of the captured region: routing is the model's (top-k, the
weights' normalization, a router bias) and stays in the graph untouched; the experts'
arithmetic is the model's own code, run unchanged on fewer experts, whatever it is (a loop,
a grouped matmul); and the region of a data-dependent loop has no fixed shape to rewrite.
The interface is what Hugging Face's transformers 5 gives every MoE model
(`experts(hidden_states, top_k_index, top_k_weights)`, 3-D parameters with the experts on
dim 0) and what `examples/models/moe.py` copies: out[t] = sum_j w[t, j] expert_{i[t, j]}(x[t]).

A `capacity_factor` goes to the unit (`ExpertParallel(..., capacity_factor=1.25)`): each
expert then takes at most ceil(N k factor / E) pairs of a rank's N tokens and the rest are
dropped (`runtime/experts.py` states the policy); `capacity_applied` makes the
unpartitioned model drop the same pairs, for `meshplan verify`'s reference (a list of
experts queues its rows in the policy's order: `expert_rows.py`). Experts borrowing a tensor
axis, alone or in a group of axes (`dp x tp`), queue the tokens that axis's ranks share (the
unit gathers their routing over it, `shared`: `token_chunks` says how each rank's rows lie
among them); so do the ranks of an axis that cuts the tokens by rows (`ROWS_CUT`: a sequence
shard, or whole tokens split at the unit, `tensor_parallel/experts.py`); under the
load-balanced context layout a unit with a capacity gets every token of its call, gathered.
A `z_loss` adds the router z-loss of each unit to the graph's loss (`router_loss.py`).

Requires: a graph captured under `experts_as_units`; tensor parallelism decided (the unit's
inputs are whole over every tensor axis: the operator has no sharding rule).
Ensures: no `meshplan.experts` node is left; each became a call_module node
(`meta["meshplan.collective"]["kind"] == "experts"`) whose parameters are `Shard(0)` over its
axis (`Context.experts`); the plan's sizes fit the model (experts divisible by the axis,
`top_k` the model's own) or are located errors.

Before (`layers.*.mlp.experts: experts over ep`, E = 4):

    experts = torch.ops.meshplan.experts.default(reshape_1, getitem_5, div,
        [layers_0_mlp_experts_gate_up_proj, layers_0_mlp_experts_down_proj], 'layers.0.mlp.experts')

After (ep=2; each rank holds 2 experts: gate_up_proj (2, 2I, H), down_proj (2, H, I)):

    experts_ep = self.experts_ep(reshape_1, getitem_5, div,
        layers_0_mlp_experts_gate_up_proj, layers_0_mlp_experts_down_proj)

where `self.experts_ep` is `ExpertParallel(axis='ep', path='layers.0.mlp.experts',
num_experts=4)`, or with `capacity_factor=1.25` in the rule `ExpertParallel(...,
capacity_factor=1.25)`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn

from meshplan.dsl import ast
from meshplan.dsl.check import Plan, PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.expert_list import ExpertList, problem, stack_lists
from meshplan.runtime.experts import EXPERT_COUNTS, ExpertParallel
from meshplan.runtime.mesh import axes_of

from ..graph import COLLECTIVE, PLACEMENT, arg_node, shape
from ..match import Resolution
from ..meta import ROUTING, ROWS_CUT, TOKEN_CHUNKS
from ..placement import Shard
from . import Context, Pass
from .router_loss import add_z_loss, router_logits, router_path, z_loss_of, z_loss_problem

_OP = "meshplan::experts"


@torch.library.custom_op(_OP, mutates_args=())
def _experts(
    tokens: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    params: list[torch.Tensor],
    path: str,
) -> torch.Tensor:
    raise AssertionError(f"{_OP} marks an experts module in a captured graph; the experts pass replaces it")


@_experts.register_fake
def _(tokens, top_k_index, top_k_weights, params, path):
    return torch.empty_like(tokens)  # (N, H): each token's weighted sum of its experts' outputs


MARKER = torch.ops.meshplan.experts.default


@torch.library.custom_op("meshplan::expert_rows", mutates_args=())
def _expert_rows(rows: torch.Tensor, params: list[torch.Tensor], path: str, expert: int) -> torch.Tensor:
    raise AssertionError("meshplan::expert_rows marks one expert of a list in a captured graph")


@_expert_rows.register_fake
def _(rows, params, path, expert):
    return torch.empty_like(rows)  # (R, H): an expert maps each row to a row of its width


# one expert of a list of experts (`ExpertList`) called on its rows by the parent's loop:
# expert_rows(rows, [stacked params], path, e); `expert_rows.py` joins a list's calls into one MARKER
ROWS_MARKER = torch.ops.meshplan.expert_rows.default


@dataclass(frozen=True)
class ExpertParams:
    """A parameter split over an expert axis, and the rule that split it."""

    axis: str
    rule: PlanRule


# ---------------------------------------------------------------------------- capture


def expert_modules(plan: Plan, model: nn.Module) -> dict[str, PlanRule]:
    """Module path -> the `experts` rule that governs it (the most specific one matching)."""
    from ..match import resolve

    resolution, _ = resolve(plan, [p for p, _ in model.named_modules()])
    return {
        path: rule
        for path, kinds in resolution.placements.items()
        if (rule := kinds.get("experts")) is not None
    }


def expert_parameters(plan: Plan, model: nn.Module) -> list[str]:
    """The parameters of every experts module an `experts` rule splits, by path: what a `column`
    or `row` rule may name (each expert's matrix split over a tensor axis: `expert_tensor_rules`)."""
    modules = dict(model.named_modules())
    return [
        f"{path}.{name}"
        for path, rule in expert_modules(plan, model).items()
        if rule.axis is not None and not_a_unit(modules[path], model) is None
        for name, _ in modules[path].named_parameters()
    ]


def stack_expert_lists(plan: Plan, model: nn.Module) -> tuple[str, ...]:
    """Every list of experts an `experts` rule splits, replaced in `model` by its `ExpertList`
    (the experts' parameters stacked on dim 0, under the names `experts.gate_proj.weight`); a
    list that cannot be stacked stays, and the pass says why. The paths, in model order: a
    program records them, and a rank stacks its model alike before it binds it."""
    lists = tuple(
        path
        for path, rule in expert_modules(plan, model).items()
        if rule.axis is not None
        and (isinstance(module := model.get_submodule(path), ExpertList) or problem(module) is None)
    )
    stack_lists(model, lists)
    return lists


def list_members(model: nn.Module) -> dict[str, str]:
    """Each stacked list's modules as the model's code names them (`experts.3.gate_proj`, the
    expert itself `experts.3`) -> the module holding them stacked (`experts.gate_proj`; the
    list for the expert itself): what a rule written against the list may name."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, ExpertList):
            for e in range(module.num_experts):
                for sub, _ in module.template.named_modules():
                    out[f"{path}.{e}" + (f".{sub}" if sub else "")] = f"{path}.{sub}" if sub else path
    return out


def fold_list_members(
    resolution: Resolution, members: dict[str, str], modules: dict[str, nn.Module]
) -> tuple[Resolution, list[Diagnostic]]:
    """Rules matched on a stacked list's members (`layers.*.mlp.experts.*.gate_proj: column over
    tp`) moved to the modules holding them stacked (`experts.gate_proj`): a tensor rule splits
    every expert's module alike, so all experts must get the same one; other kinds of rule
    cannot cut a stacked list's experts apart (located errors)."""
    placements = {p: dict(k) for p, k in resolution.placements.items() if p not in members}
    diagnostics: list[Diagnostic] = []
    reported: set[int] = set()
    experts_of = Counter(members.values())  # holder -> its experts (E member paths)
    named: Counter[tuple[str, int]] = Counter()  # (holder, rule) -> the experts it matched
    for path, kinds in resolution.placements.items():
        holder = members.get(path)
        if holder is None:
            continue
        for kind, rule in kinds.items():
            if rule.order in reported:
                continue
            if kind != "tensor" or isinstance(modules.get(holder), ExpertList):  # not an expert's module
                reported.add(rule.order)
                diagnostics.append(_member_error(rule, path, holder))
                continue
            named[(holder, rule.order)] += 1
            other = placements.setdefault(holder, {}).setdefault(kind, rule)
            if other is not rule:
                reported.update((rule.order, other.order))
                diagnostics.append(
                    Diagnostic(
                        rule.pattern_span,
                        f"`{path}` is one of the experts of a stacked list: its module `{holder}` takes one "
                        f"rule for every expert, and `{other.pattern}` gives it another",
                        hint=f"write one rule for all the experts: `{holder}: ...`",
                        related=((other.span, "the other rule"),),
                    )
                )
    rules = {r.order: r for kinds in resolution.placements.values() for r in kinds.values()}
    for (holder, order), count in named.items():
        if order in reported:  # conflicting: said above
            placements[holder].pop("tensor", None)
        elif count < experts_of[holder]:
            reported.add(order)
            placements[holder].pop("tensor", None)  # no expert's module split: one error, not its echoes
            rule = rules[order]
            diagnostics.append(
                Diagnostic(
                    rule.pattern_span,
                    f"`{rule.pattern}` names {count} of the {experts_of[holder]} experts held stacked in "
                    f"`{holder.rpartition('.')[0]}`: a tensor rule splits every expert's module alike",
                    hint=f"name them all: `{holder}` (or `*` in place of the expert's index)",
                )
            )
    matched = {
        order: tuple(dict.fromkeys(members.get(p, p) for p in paths))
        for order, paths in resolution.matched.items()
    }
    return Resolution(placements, matched, resolution.overridden), diagnostics


def _member_error(rule: PlanRule, path: str, holder: str) -> Diagnostic:
    return Diagnostic(
        rule.pattern_span,
        f"`{path}` is one of the experts of a list held stacked (`{holder}`): a `{rule.kind}` rule cannot "
        "name one expert or cut the experts apart",
        hint="name the experts' modules without the index (`experts.gate_proj: column over tp`), "
        "or put the rule on the module holding the experts",
    )


@contextlib.contextmanager
def experts_as_units(plan: Plan, model: nn.Module) -> Iterator[None]:
    """While capturing: every experts module an `experts` rule names calls the `meshplan.experts`
    operator instead of its forward (one that cannot be a unit keeps its forward; the pass says
    why). Over an axis of one rank too: the unit then runs the model's experts module whole,
    which also serves experts whose own code export cannot capture (Mixtral's eager loop)."""
    modules = dict(model.named_modules())
    patched = []
    for path, rule in expert_modules(plan, model).items():
        module = modules[path]
        if rule.axis is None or not_a_unit(module, model) is not None:
            continue
        if isinstance(module, ExpertList):  # the parent's loop calls each expert on its rows
            module.__dict__["call_expert"] = _rows_call(module, path)
        else:
            module.forward = _unit_forward(module, path)  # an instance attribute: shadows the class's
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("call_expert", None) if isinstance(module, ExpertList) else delattr(
                module, "forward"
            )


def _unit_forward(module: nn.Module, path: str):
    signature = inspect.signature(module.forward)
    names = [name for name, _ in module.named_parameters()]

    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        tokens, top_k_index, top_k_weights = bound.args[:3]
        # read through the module at call time: export swaps its parameters for graph inputs
        return MARKER(tokens, top_k_index, top_k_weights, [module.get_parameter(n) for n in names], path)

    return forward


def _rows_call(module: ExpertList, path: str):
    def call(e: int, rows: torch.Tensor, *rest, **kwargs):
        if rest or kwargs:
            raise TypeError(f"meshplan calls each expert of `{path}` with its rows only")
        return ROWS_MARKER(rows, [module.stacked(n) for n in module.names], path, e)

    return call


def num_experts(module: nn.Module, model: nn.Module) -> int | None:
    """A list of expert modules, or one module holding them (3-D weights, Mixtral's
    `num_experts`), or the model config's count."""
    if isinstance(module, nn.ModuleList):
        return len(module)
    for owner in (module, getattr(model, "config", None)):
        for attr in EXPERT_COUNTS:
            count = getattr(owner, attr, None)
            if isinstance(count, int) and count > 0:
                return count
    return None


def not_a_unit(module: nn.Module, model: nn.Module) -> str | None:
    """Why `module` cannot run split over experts, or None: it must take (tokens, top_k_index,
    top_k_weights) and hold its experts stacked on dim 0 of every parameter."""
    if isinstance(module, nn.ModuleList):
        return f"its experts are a list of modules that cannot be stacked: {problem(module)}"
    count = num_experts(module, model)
    if count is None:
        return "it says nowhere how many experts it has (`num_experts`, or the model config's)"
    params = list(module.named_parameters())
    if not params:
        return "it has no parameters"
    for name, p in params:
        if p.dim() < 2 or p.shape[0] != count:
            return f"its parameter `{name}` {tuple(p.shape)} does not stack the {count} experts on dim 0"
    try:
        signature = inspect.signature(module.forward)
        signature.bind(0, 0, 0)
    except (TypeError, ValueError):
        return "its forward does not take (tokens, top_k_index, top_k_weights)"
    return None


def _call_problem(marker: fx.Node) -> str | None:
    """Why the captured call cannot be split, or None: its tokens must be (N, H) rows and its
    top_k_index and top_k_weights (N, k), one row per token."""
    tokens, index, weights = (shape(arg_node(marker, i)) for i in range(3))
    if len(tokens) != 2 or len(index) != 2 or len(weights) != 2:
        sizes = ", ".join(str(len(s)) for s in (tokens, index, weights))
        return f"it is called with {sizes}-D tensors, not tokens (N, H) and top_k_index, top_k_weights (N, k)"
    return None


# ---------------------------------------------------------------------------- the pass


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Check every experts rule against the model; on a plan without errors, lower each unit."""
    plan, model = ctx.plan, ctx.source.model
    if not plan.rules_of("experts"):
        return gm
    governed = {p: r for p, r in expert_modules(plan, model).items() if r.axis is not None}
    markers = {str(node.args[4]): node for node in gm.graph.nodes if node.target is MARKER}
    ctx.diagnostics += _sizes(plan, model, governed, markers)
    modules = dict(model.named_modules())
    unjoined = {str(node.args[2]) for node in gm.graph.nodes if node.target is ROWS_MARKER}  # said why
    for path, rule in governed.items():
        assert rule.axis is not None
        why = _call_problem(markers[path]) if path in markers else None
        if (path in markers and why is None) or path in unjoined:
            continue
        why = why or not_a_unit(modules[path], model) or "the model never calls it"
        ctx.diagnostics.append(
            Diagnostic(
                rule.pattern_span,
                f"`{path}` cannot be split over `{rule.axis}`: {why}",
                hint="expert parallelism splits a module called as experts(tokens, top_k_index, "
                "top_k_weights) whose parameters stack the experts on dim 0 (Hugging Face's MoE layout)",
            )
        )
    no_logits: dict[int, tuple[PlanRule, list[str], str]] = {}  # per rule: its paths, the first why
    for path, node in markers.items():
        rule = governed.get(path)
        index = _routing_index(node, modules[path])
        if rule is None or z_loss_of(rule) is None:
            continue
        found = router_logits(index) if isinstance(index, fx.Node) else index
        if rule is not None and isinstance(found, str):
            no_logits.setdefault(id(rule), (rule, [], found))[1].append(path)
    ctx.diagnostics += [z_loss_problem(r, _modules_phrase(p), why) for r, p, why in no_logits.values()]
    if ctx.failed:
        return gm
    z_losses = []
    for path, node in markers.items():
        call = _lower(gm, node, governed[path], modules[path], model, ctx)
        coefficient = z_loss_of(governed[path])
        if coefficient is not None:
            index = _routing_index(call, modules[path])
            assert isinstance(index, fx.Node)
            z_losses.append((index, coefficient, governed[path]))
            logits = router_logits(index)
            assert isinstance(logits, fx.Node)
            call.meta[COLLECTIVE].update(z_loss=coefficient, router=router_path(logits), path=path)
    add_z_loss(gm, z_losses, ctx.layout) if z_losses else None
    gm.graph.lint()
    gm.recompile()
    return gm


def _lower(
    gm: fx.GraphModule, node: fx.Node, rule: PlanRule, module: nn.Module, model: nn.Module, ctx: Context
) -> fx.Node:
    """Replace one marker node by the axis's ExpertParallel call; place its parameters."""
    assert rule.axis is not None
    tokens, top_k_index, top_k_weights, params, path = node.args
    assert isinstance(params, (list, tuple))
    names = tuple(f"{path}.{name}" for name, _ in module.named_parameters())
    count = num_experts(module, model)
    assert count is not None
    index = 0
    label = "_".join(axes_of(rule.axis))  # `experts_dp_tp_0` for a group of axes
    while hasattr(gm, f"experts_{label}_{index}"):
        index += 1
    target = f"experts_{label}_{index}"
    relative = tuple(name.removeprefix(f"{path}.") for name in names)
    factor = capacity_factor(rule)
    group = axes_of(rule.axis)
    # the axes that cut its tokens by rows, each rank routing its own (`ROWS_CUT`); the axis whose
    # ranks queue their tokens together under a capacity (a tensor axis the experts borrow, or
    # that one), or ""
    rows_cut = tuple(node.meta.get(ROWS_CUT, ()))
    shared = " x ".join(a for a in group if a not in ctx.plan.batch_axes) or (
        rows_cut[0] if factor is not None and rows_cut else ""
    )
    unit = ExpertParallel(
        None,
        rule.axis,
        path=str(path),
        num_experts=count,
        param_names=relative,
        capacity_factor=factor,
        splits_batch=all(a in ctx.plan.batch_axes for a in group),
        token_chunks=node.meta.get(TOKEN_CHUNKS, 1),
        shared=shared,
        rows_cut=rows_cut,
        # a group of axes: the mean over those of its axes that split the batch
        batch_ranks=math.prod(ctx.layout.size(a) for a in group if a in ctx.plan.batch_axes)
        if len(group) > 1
        else None,
    )
    gm.add_submodule(target, unit)
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(target, (tokens, top_k_index, top_k_weights, *params))
    call.meta.update(node.meta)
    call.meta[COLLECTIVE] = {
        "kind": "experts",
        "axis": rule.axis,
        "dim": 0,
        "rule": rule,
        "experts": count,
        "capacity_factor": factor,
        # the axis whose ranks share the tokens (a tensor axis it borrows): a capacity gathers
        # their routing
        "shared": shared,
    }
    if isinstance(module, ExpertList):  # its rows are pairs: as many as its routing makes
        call.meta[COLLECTIVE]["routed_pairs"] = node.meta[ROUTING]["pairs"] if ROUTING in node.meta else None
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    for get_attr in gm.graph.nodes:
        if get_attr.op == "get_attr" and get_attr.target in names:
            for axis in group:
                get_attr.meta.setdefault(PLACEMENT, {})[axis] = Shard(0)
    for name in names:
        ctx.experts[name] = ExpertParams(rule.axis, rule)
    return call


def capacity_factor(rule: PlanRule) -> float | None:
    """The rule's `capacity_factor`, or None: dropless."""
    assert isinstance(rule.action, ast.ExpertParallel)
    return next((float(a.value) for a in rule.action.args if a.name.text == "capacity_factor"), None)


def capacity_lists(plan: Plan, model: nn.Module) -> list[str]:
    """The lists of experts (`ExpertList`) a rule with a `capacity_factor` governs, by path."""
    modules = dict(model.named_modules())
    return [
        path
        for path, rule in expert_modules(plan, model).items()
        if isinstance(modules[path], ExpertList) and capacity_factor(rule) is not None
    ]


@contextlib.contextmanager
def capacity_applied(plan: Plan, model: nn.Module) -> Iterator[None]:
    """While it lasts, every experts module a rule with a `capacity_factor` governs drops the
    pairs the compiled unit drops (`runtime.experts.expert_positions`, over the tokens of each
    call): their routing weights multiplied by 0, its own code computing the rest. So the
    unpartitioned model (`meshplan verify`'s float64 reference) follows the plan's capacity
    rule without the unit's buffers and all-to-alls: a dropped pair adds 0 to its token's
    output, and its weight gets no gradient from it, as in the unit."""
    from meshplan.runtime.experts import expert_capacity, expert_positions

    modules = dict(model.named_modules())
    patched = []
    for path, rule in expert_modules(plan, model).items():
        factor, module = capacity_factor(rule), modules[path]
        count = num_experts(module, model)
        if factor is None or count is None or isinstance(module, ExpertList):
            continue  # (a list's parent hands each expert its rows: verify's reference is its unit)
        signature, forward = inspect.signature(module.forward), module.forward

        def dropping(*args, _signature=signature, _forward=forward, _factor=factor, _count=count, **kwargs):
            bound = _signature.bind(*args, **kwargs)
            tokens, index, weights = bound.args[:3]
            capacity = expert_capacity(index.shape[0], index.shape[1], _count, _factor)
            kept = expert_positions(index, _count) < capacity  # (N, k)
            return _forward(tokens, index, weights * kept, *bound.args[3:], **bound.kwargs)

        module.forward = dropping
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _sizes(
    plan: Plan, model: nn.Module, governed: dict[str, PlanRule], markers: dict[str, fx.Node]
) -> list[Diagnostic]:
    """Experts split evenly over the expert-parallel ranks; `top_k` picks among them, as many
    as the model routes each token to (routing is the model's: the plan states it, never
    changes it)."""
    modules = dict(model.named_modules())
    out = []
    for rule in plan.rules_of("experts"):
        assert isinstance(rule.action, ast.ExpertParallel) and rule.axis is not None
        n = plan.mesh.size(rule.axis)
        # (number of experts, the model's k or None) -> the modules this rule governs with those
        groups: dict[tuple[int, int | None], list[str]] = {}
        for path, winner in governed.items():
            count = num_experts(modules[path], model)
            if winner is not rule or count is None:
                continue  # a more specific experts rule governs it, or no count to check
            k = _routed_k(markers[path], modules[path]) if path in markers else None
            groups.setdefault((count, k if isinstance(k, int) else None), []).append(path)
        by_count: dict[int, list[str]] = {}
        for (count, _), paths in groups.items():
            by_count.setdefault(count, []).extend(paths)
        for count, paths in by_count.items():
            if n is not None and count % n:
                out.append(
                    Diagnostic(
                        rule.span,
                        f"{_modules_phrase(paths)} {'have' if len(paths) > 1 else 'has'} {count} experts, "
                        f"not divisible by {n} ranks over `{rule.axis}`",
                        hint=f"use an `{rule.axis}` size that divides {count} ({_divisors(count)})",
                    )
                )
        for arg in rule.action.args:
            if arg.name.text == "capacity_factor":
                shared = [a for a in axes_of(rule.axis) if a not in plan.batch_axes]
                if len(shared) > 1:
                    out.append(
                        Diagnostic(
                            arg.span,
                            f"expert capacity (`capacity_factor`) with a group of axes that borrows "
                            f"two tensor axes (`{shared[0]}`, `{shared[1]}`) is not lowered yet: the "
                            "tokens they share are cut over both",
                            hint="remove `capacity_factor` to train dropless, or borrow one tensor axis",
                        )
                    )
                continue
            if arg.name.text != "top_k":
                continue
            for (count, k), paths in groups.items():
                if arg.value > count:
                    out.append(
                        Diagnostic(
                            arg.span,
                            f"top_k={arg.text} routes each token to more experts than the {count} "
                            f"of {_modules_phrase(paths)}",
                            hint=f"use top_k of at most {count}",
                        )
                    )
                elif k is not None and k != arg.value:
                    out.append(
                        Diagnostic(
                            arg.span,
                            f"top_k={arg.text}, but the model routes each token of "
                            f"{_modules_phrase(paths)} to {k} experts",
                            hint=f"routing is the model's: write top_k={k}, or leave top_k out",
                        )
                    )
                elif k is None and any(p in markers for p in paths):  # a list whose routing has no topk
                    out.append(
                        Diagnostic(
                            arg.span,
                            f"top_k={arg.text} is not checked: the block calling {_modules_phrase(paths)} "
                            "routes its tokens with no top-k the graph shows",
                            hint="leave top_k out, or route with torch.topk",
                            severity="warning",
                        )
                    )
    return out


def _routing_index(marker: fx.Node, module: nn.Module) -> fx.Node | str:
    """The node of the top-k indices the model routed with: the unit's top_k_index, or for a
    list's joined calls the top-k `expert_rows` found (or why there is none)."""
    if not isinstance(module, ExpertList):
        return arg_node(marker, 1)
    routing = marker.meta.get(ROUTING)
    if routing is None or routing["index"] is None:
        return "its parent routes its tokens with no top-k the graph shows"
    return routing["index"]


def _routed_k(marker: fx.Node, module: nn.Module) -> int | torch.SymInt | None:
    """How many experts the model routes each token to: top_k_index's (N, k), or for a list's
    joined calls (rows one per pair) its routing's k, if `expert_rows` found it."""
    if isinstance(module, ExpertList):
        return marker.meta[ROUTING]["k"] if ROUTING in marker.meta else None
    return shape(arg_node(marker, 1))[-1]


def _modules_phrase(paths: list[str]) -> str:
    return f"`{paths[0]}`" + (f" and {len(paths) - 1} more like it" if len(paths) > 1 else "")


def _divisors(count: int) -> str:
    found = [str(d) for d in range(1, count + 1) if count % d == 0]
    return ", ".join(found[:-1]) + " or " + found[-1] if len(found) > 1 else found[0]


PASS = Pass(
    "experts",
    run,
    requires="a graph captured under `experts_as_units`; tensor parallelism decided",
    ensures="each experts unit is an ExpertParallel call over its axis; its parameters Shard(0) over it",
    checks_after_errors=True,
)
