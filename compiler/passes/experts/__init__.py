"""Expert parallelism: each MoE experts module an `experts over AXIS` rule names runs split over
that axis, its tokens dispatched to the ranks holding their experts and combined back.

The experts module is treated as a unit. Capture (`units.experts_as_units`) calls, in place of its
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
An experts module called on rows the model permuted by expert itself, `experts(x,
num_tokens_per_expert)` (torchtitan's `GroupedExperts`), is captured as the same operator on
those rows, each with its expert (read from the counts) and weight 1 (`units.py`): the unit is
`ExpertParallel(..., grouped=True)`, which calls the model's module with rows and counts; its
routing (for `top_k` and `z_loss`) is the top-k the counts come from. A capacity is refused:
which (token, slot) pair a row is, the permutation knows, and it is the model's.

A `capacity_factor` goes to the unit (`ExpertParallel(..., capacity_factor=1.25)`): each
expert then takes at most ceil(N k factor / E) pairs of a rank's N tokens and the rest are
dropped (`runtime/experts.py` states the policy); `capacity.capacity_applied` makes the
unpartitioned model drop the same pairs, for `meshplan verify`'s reference (a list of
experts queues its rows in the policy's order: `rows.py`). Experts borrowing a tensor
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

The package, one idea a module: `units.py` (an experts module captured as one operator, and
what can be one), `lists.py` (lists of experts held stacked, and the rules naming their
members), `rows.py` (the pass joining a list's per-expert calls into one unit), this pass,
`capacity.py` (the capacity factor, and the reference that drops as the unit does),
`router_loss.py` (the router z-loss, in the graph and in the reference).

Golden: `tests/compiler/golden/passes/experts.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx, nn

from meshplan.dsl import ast
from meshplan.dsl.check import Plan, PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.expert_list import ExpertList
from meshplan.runtime.experts import ExpertParallel, grouped_rows, takes_counts
from meshplan.runtime.mesh import axes_of

from ... import meta
from ...graph import arg_node, shape
from ...meta import Collective
from ...placement import Shard
from .. import Context, Pass
from .capacity import capacity_factor
from .router_loss import add_z_loss, router_logits, router_path, z_loss_of, z_loss_problem
from .rows import find_routing
from .units import MARKER, ROWS_MARKER, argument_error, expert_modules, not_a_unit, num_experts


@dataclass(frozen=True)
class ExpertParams:
    """A parameter split over an expert axis, and the rule that split it."""

    axis: str
    rule: PlanRule


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
    modules = dict(model.named_modules())
    for path, node in markers.items():  # rows the model grouped by expert: the routing they come from
        if grouped_rows(modules[path]) and (routing := find_routing([arg_node(node, 1)], True)) is not None:
            meta.set_routing(node, routing)
    ctx.diagnostics += _sizes(plan, model, governed, markers)
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
                "top_k_weights) (Hugging Face's MoE layout), experts(x, num_tokens_per_expert) on rows "
                "grouped by expert (torchtitan's) or experts(x) on equal shares of them (Llama 4's), whose "
                "parameters stack the experts on dim 0",
            )
        )
    grouped_capacity: dict[int, tuple[PlanRule, list[str]]] = {}  # per rule: its grouped modules
    for path in markers:
        if grouped_rows(modules[path]) and capacity_factor(governed[path]) is not None:
            grouped_capacity.setdefault(id(governed[path]), (governed[path], []))[1].append(path)
    ctx.diagnostics += [
        argument_error(
            rule,
            "capacity_factor",
            f"expert capacity (`capacity_factor`) for {_modules_phrase(paths)} is not lowered: it is called "
            "on rows the model grouped by expert itself, so which (token, slot) pair each row is, and so "
            "which to drop, is the model's",
            hint="remove `capacity_factor` to train dropless, or drop tokens in the model's own routing",
        )
        for rule, paths in grouped_capacity.values()
    ]
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
            z_loss: Collective = {"z_loss": coefficient, "router": router_path(logits), "path": path}
            meta.set_collective(call, {**meta.collective_of(call), **z_loss})
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
    rows_cut = meta.rows_cut(node)
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
        token_chunks=meta.token_chunks(node),
        shared=shared,
        rows_cut=rows_cut,
        # a group of axes: the mean over those of its axes that split the batch
        batch_ranks=math.prod(ctx.layout.size(a) for a in group if a in ctx.plan.batch_axes)
        if len(group) > 1
        else None,
        grouped=grouped_rows(module),
        counted=takes_counts(module),
    )
    gm.add_submodule(target, unit)
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(target, (tokens, top_k_index, top_k_weights, *params))
    call.meta.update(node.meta)
    info: Collective = {
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
        info["routed_pairs"] = routing.pairs if (routing := meta.routing(node)) is not None else None
    meta.set_collective(call, info)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    for get_attr in gm.graph.nodes:
        if get_attr.op == "get_attr" and get_attr.target in names:
            for axis in group:
                meta.set_axis_placement(get_attr, axis, Shard(0))
    for name in names:
        ctx.experts[name] = ExpertParams(rule.axis, rule)
    return call


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
    list's joined calls (or rows the model grouped by expert) the top-k found in the graph (or
    why there is none)."""
    if not isinstance(module, ExpertList) and not grouped_rows(module):
        return arg_node(marker, 1)
    routing = meta.routing(marker)
    if routing is None or routing.index is None:
        return "its parent routes its tokens with no top-k the graph shows"
    return routing.index


def _routed_k(marker: fx.Node, module: nn.Module) -> int | torch.SymInt | None:
    """How many experts the model routes each token to: top_k_index's (N, k), or for a list's
    joined calls or rows grouped by expert (rows one per pair) its routing's k, if found."""
    if isinstance(module, ExpertList) or grouped_rows(module):
        return routing.k if (routing := meta.routing(marker)) is not None else None
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
