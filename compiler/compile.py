"""The compiler pipeline: checked plan + captured model -> the SPMD program and its facts.

    plan = load_plan("examples/llama_tp.plan", world_size=2)
    source = load_model("examples/models/llama.py:build")
    compiled = compile_plan(plan, source)
    program = build_rank_program(compiled, source.model, rank=0, mesh=device_mesh)  # lower.py

Capture and resolution come first; then the passes of `PASSES`, in this order, each for a
reason, each linted after it runs (`lint.py`):

1. capture   torch.export, then `normalize` (flat inputs/outputs, no guard nodes).
2. resolve   rules -> modules; unmatched and conflicting rules are reported with the
             model's problems in one error.
3. precision casts from fp32 parameters to the compute dtype; before tensor
             parallelism, so the collectives it inserts carry the compute dtype.
4. tensor-parallel (and sequence parallel): needs resolved parameter placements;
             it must run before any pass that reads local shapes.
5. experts   (`experts over ep`): each experts module, captured as one unit
             (`experts_as_units`), becomes an all-to-all dispatch / local experts / combine
             call with its parameters split over the axis; after tensor parallelism, whose
             walk sees the unit's inputs whole, and before checkpoint, which must outline
             the call with its layer.
6. devices   (`lm_head: on cpu`, `on cuda:N`): each node's device, a `DeviceCopy` node where
             an activation crosses into or out of a placed module; after the passes that
             insert collectives (a placed module must issue none), before checkpoint (a copy
             is outlined, and recomputed, with the module that reads it) and ZeRO (which
             leaves placed parameters out of its units).
7. checkpoint outlines each region into a submodule called through
             torch.utils.checkpoint; after tensor parallelism so its collectives are
             recomputed too. The ledger is built at the end and counts recomputed collectives.
8. unsupported: a check, not a rewrite: rules accepted by the language that the compiler
             cannot lower yet are located errors.
9. pipeline  (`pipeline over pp`): the stage cuts, explicit or balanced, and each
             activation's stage; the graph is not changed (each pipeline rank builds its
             stage programs from it). After checkpoint, so a checkpointed layer is never split.
10. zero     (`data_parallel { zero = N }`): gather/release nodes around each layer's
             parameter uses; last, because a checkpointed layer must be one call node
             (its recomputation then runs between the release's backward gather and the
             layer's backward, never re-gathering or freeing).
11. overlap  the linears reading an entry collective (f, SP's all-gather) grouped into one
             node whose backward issues the entry's reduction before the weight gradients;
             last, on the final graph and its regions (it only regroups nodes).

A plan with errors still goes through the passes marked `checks_after_errors` (precision,
the tensor rules, experts, devices, unsupported), so one compile reports every problem; the others are skipped.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from meshplan.dsl.check import Plan, PlanRule
from meshplan.dsl.errors import Diagnostic, PlanValidationError
from meshplan.runtime.mesh import MeshLayout, axes_of

from . import meta
from .capture import BATCH, SEQ, Captured, Divisibility, TokenShapes, capture, token_tensors
from .graph import ShapeGuardError, keep_loss_output, no_new_guards, normalize
from .ledger import Ledger, build_ledger, data_parallel_facts, expert_data_facts
from .lint import lint
from .load import ModelSource
from .match import Resolution, resolve
from .mha import heads_first
from .passes import (
    Context,
    Pass,
    checkpoint,
    devices,
    experts,
    overlap,
    pipeline,
    precision,
    tensor_parallel,
    unsupported,
    zero,
)
from .passes.experts import rows as expert_rows
from .passes.experts.lists import fold_list_members, list_members, stack_expert_lists
from .passes.experts.units import expert_parameters, experts_as_units
from .passes.precision import DTYPES, cast_floating
from .placement import Placement, Shard


@dataclass
class Compiled:
    """The result of compiling a plan for a model: one SPMD program plus what explains it."""

    plan: Plan
    layout: MeshLayout
    captured: Captured
    resolution: Resolution
    graph: fx.GraphModule  # shared by every rank; parameters are materialized per rank
    param_placements: dict[str, dict[str, Placement]]  # param/buffer name -> {axis: placement}
    param_rules: dict[str, PlanRule]
    tensor_axes: tuple[str, ...]  # the axes tensor rules split over, in mesh order
    ledger: Ledger
    warnings: list[Diagnostic] = field(default_factory=list)
    kv_replicas: dict[str, int] = field(default_factory=dict)  # GQA: kv weight -> ranks per head
    source: ModelSource | None = None  # the model (fp32, unpartitioned) and the inputs compiled for
    shapes: TokenShapes | None = None  # the (batch, seq) it serves; None: only the example's
    # parameter -> the axes its gradient is summed over by the gradient sync (`grad_sums.py`)
    grad_sums: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # lists of experts the program holds stacked (`runtime.expert_list.ExpertList`), by path
    expert_lists: tuple[str, ...] = ()

    @property
    def stage_cuts(self) -> tuple[tuple[str, str], ...]:
        """The pipeline's cuts the pipeline pass chose: (side, module path); () without a pipeline."""
        return meta.stage_cuts(self.graph) or ()


# Sees the graph after capture ("capture") and after each pass that ran (the pass's name),
# before the next pass changes it in place: the golden tests render each step's effect.
Observer = Callable[[str, fx.GraphModule], None]

# The passes, in order (see the module docstring for why this order). Each is one module or
# package under `passes/` with the same signature: (graph, Context) -> graph.
PASSES: tuple[Pass, ...] = (
    expert_rows.PASS,
    precision.PASS,
    tensor_parallel.PASS,
    experts.PASS,
    devices.PASS,
    checkpoint.PASS,
    unsupported.PASS,
    pipeline.PASS,
    zero.PASS,
    overlap.PASS,
)


def compile_plan(
    plan: Plan,
    source: ModelSource,
    *,
    world_size: int | None = None,
    dynamic: bool = True,
    observe: Observer | None = None,
    captured: Captured | None = None,
) -> Compiled:
    """Compile `plan` for the model in `source`. Raises `PlanError` listing every problem found.

    With `dynamic` (the default) the batch and sequence length of the token inputs stay
    symbols, so the program serves every (batch, seq) its splits divide (`Compiled.shapes`).
    Where the model or a pass needs them concrete, the plan is compiled for the example
    shape instead, with a warning saying why: never a program that is right only for the
    example and accepts others.

    `observe` sees the graph after capture and after each pass that ran (`Observer`); when
    the dynamic compile falls back to the example's shapes, it sees the second run from
    its capture again.

    `captured`: the model as `capture_for` captured it for a plan of the same compute dtype
    and experts rules (`meshplan suggest` compiles many plans from one capture).
    """
    layout = _layout(plan, world_size)
    # lists of experts an experts rule splits are held stacked from here on (`ExpertList`)
    expert_lists = stack_expert_lists(plan, source.model)
    traced = _traced(plan, source)
    if captured is None:
        with experts_as_units(plan, traced), heads_first(traced):
            captured = capture(traced, source.args, source.kwargs, dynamic=dynamic)
    static_because = captured.static_reason
    if captured.dims is not None:
        try:
            gm, ctx = _run_passes(plan, layout, source, captured, observe)
        except (ShapeGuardError, PlanValidationError) as e:
            # The passes needed a size of the example shape (`ShapeGuardError`), or found a
            # problem that only the static compile can tell real from symbolic: compile for
            # the example's shapes, whose errors are the plan's own.
            static_because = str(e) if isinstance(e, ShapeGuardError) else e.errors[0].message
            with experts_as_units(plan, traced), heads_first(traced):
                captured = capture(traced, source.args, source.kwargs)
    if captured.dims is None:
        gm, ctx = _run_passes(plan, layout, source, captured, observe)
        if dynamic and static_because:
            ctx.diagnostics.append(_static_warning(plan, source, static_because))
    warnings = [d for d in ctx.diagnostics if d.severity == "warning"]
    placements: dict[str, dict[str, Placement]] = {}
    rules: dict[str, PlanRule] = {}
    kv: dict[str, int] = {}
    for spec in ctx.tensor:
        for name, pp in spec.params.items():
            placements.setdefault(name, {})[spec.axis] = pp.placement
            if pp.rule is not None:
                rules.setdefault(name, pp.rule)
        kv.update(spec.kv_replicas)
    for name, split in ctx.experts.items():  # the experts of each rank: Shard(0) over their axis
        for axis in axes_of(split.axis):  # a group's axes in mesh order: rank (d, t) holds chunk d T + t
            placements.setdefault(name, {})[axis] = Shard(0)
        rules.setdefault(name, split.rule)
    grad_sums = _every_name(ctx.grad_sums, source.model)
    experts_data = expert_data_facts(plan, gm, source.model, placements, layout, grad_sums)
    ledger = build_ledger(
        gm,
        layout,
        accumulation=plan.train.gradient_accumulation,
        data=None if experts_data else data_parallel_facts(plan, gm, source.model, placements, layout),
        experts_data=experts_data,
    )
    return Compiled(
        plan,
        layout,
        captured,
        ctx.resolution,
        gm,
        placements,
        rules,
        tuple(spec.axis for spec in ctx.tensor),
        ledger,
        warnings,
        kv,
        source,
        _token_shapes(captured, ctx),
        grad_sums,
        expert_lists,
    )


def capture_for(plan: Plan, source: ModelSource, *, dynamic: bool = False) -> Captured:
    """The model captured as `compile_plan` captures it for `plan`: what every plan with the
    same compute dtype and experts rules can be compiled from (`compile_plan(captured=...)`)."""
    stack_expert_lists(plan, source.model)
    traced = _traced(plan, source)
    with experts_as_units(plan, traced), heads_first(traced):
        return capture(traced, source.args, source.kwargs, dynamic=dynamic)


def _traced(plan: Plan, source: ModelSource) -> nn.Module:
    """Capture in the compute dtype, so the model's own casts (a norm's `.to(input_dtype)`) are
    recorded in it; the rank program still gets the fp32 parameters (master weights)."""
    compute = DTYPES[plan.precision.compute]
    return source.model if compute == torch.float32 else cast_floating(copy.deepcopy(source.model), compute)


def _every_name(by_name: dict[str, tuple[str, ...]], model: nn.Module) -> dict[str, tuple[str, ...]]:
    """`by_name` under every name its parameter has (a tied weight is read by one of them)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    return {alias: axes for name, axes in by_name.items() for alias in names[id(params[name])]}


def _run_passes(
    plan: Plan, layout: MeshLayout, source: ModelSource, captured: Captured, observe: Observer | None = None
) -> tuple[fx.GraphModule, Context]:
    """Resolve the rules and run `PASSES` on the captured graph, linting after each. Raises
    `PlanValidationError` with every problem found, `ShapeGuardError` when a pass decides on
    a size that follows from the token shape by its example value."""
    gm = keep_loss_output(normalize(captured.program.module()), captured.program.call_spec.out_spec)
    lint(gm, layout, after="capture")
    if observe is not None:
        observe("capture", gm)
    # a stacked list's experts may be named as the model's code names them (`experts.*.gate_proj`)
    members = list_members(source.model)
    paths = [*captured.modules, *members]
    resolution, diagnostics = resolve(plan, paths, expert_parameters(plan, source.model))
    resolution, folded = fold_list_members(resolution, members, dict(source.model.named_modules()))
    diagnostics += folded
    ctx = Context(plan, layout, source, resolution, diagnostics)
    with no_new_guards(gm):
        for step in PASSES:
            if ctx.failed and not step.checks_after_errors:
                continue
            gm = step.run(gm, ctx)
            if not ctx.failed:
                lint(gm, layout, after=step.name)
            if observe is not None:
                observe(step.name, gm)
    if ctx.failed:
        raise PlanValidationError(ctx.diagnostics, {plan.path: plan.source})
    return gm, ctx


def _token_shapes(captured: Captured, ctx: Context) -> TokenShapes | None:
    """The shapes a dynamic program serves: what the tensor-parallel walks cut must divide."""
    dims = captured.dims
    if dims is None:
        return None
    divisible = []
    for spec in ctx.tensor:
        for (size, by), rule in spec.cuts.items():
            where = f"{rule.span.path}:{rule.span.line}" if rule is not None else ""
            named = dims.named(size)
            what = "sequence" if named == SEQ else "batch" if named == BATCH else f"`{named}`"
            why = f"{_rule_text(rule)}cuts each {what} into {by} shards over `{spec.axis}`"
            divisible.append(Divisibility(named, by, why, where))
    return TokenShapes(dims.example, dims.max_seq, tuple(divisible))


def _rule_text(rule: PlanRule | None) -> str:
    """`sequence over tp` , `column over tp` : the rule's action as the plan writes it."""
    if rule is None:
        return ""
    style = getattr(rule.action, "style", rule.kind)
    return f"`{rule.pattern}: {style} over {rule.axis}` "


def _static_warning(plan: Plan, source: ModelSource, because: str) -> Diagnostic:
    shape = next(iter(token_tensors(source.args, source.kwargs)), None)
    example = f" --batch {shape.shape[0]} --seq {shape.shape[1]}" if shape is not None else ""
    return Diagnostic(
        plan.mesh.span,
        f"the program is compiled for{example} only: the batch and sequence length could not "
        f"stay symbolic ({because})",
        hint="compile again for other shapes (--batch/--seq)",
        severity="warning",
    )


def _layout(plan: Plan, world_size: int | None) -> MeshLayout:
    sizes = []
    for axis in plan.mesh.axes:
        if axis.size is None:
            raise PlanValidationError(
                [
                    Diagnostic(
                        axis.span,
                        f"axis `{axis.name}` is `*` but no world size was given",
                        hint="pass --world-size N (or launch with torchrun, which sets it)",
                    )
                ],
                {plan.path: plan.source},
            )
        sizes.append(axis.size)
    if world_size is not None and math.prod(sizes) != world_size:
        raise AssertionError("the checker resolves the mesh against the world size")
    return MeshLayout(plan.mesh.names, tuple(sizes))
