"""Constructs the language has and the compiler does not lower yet: refused, never ignored.

Selective checkpointing under a schedule that splits the backward (`zero_bubble`, `zbv`)
parses and passes `meshplan check`, but a region computed under selective checkpointing can be
backwarded once only. So every command that compiles against a model refuses it, one located
error per rule:

    p.plan:4:15: error: selective checkpointing under `schedule = zero_bubble` is not lowered yet: ...
            layers.0: checkpoint selective
                      ^~~~~~~~~~~~~~~~~~~~
    hint: use `checkpoint full` here, or `schedule = 1f1b` / `interleaved`

Before that, the sizes the constructs need are checked against the model, because a size
that can never work is the more useful message (and stays true once they are lowered): no
more pipeline stages than layers. A size error and the refusal of the same construct are
two problems and are both reported; the size error comes first in the file. Model-free
sizes (microbatches vs stages) are `dsl.settings`'s.

When a pass lowers one of these constructs, its refusal goes from `not_lowered` and its
size checks move to that pass (the sequence a context axis cuts: the tensor-parallel pass;
the experts an expert axis splits: the experts pass; device placement, `on cpu`: the
devices pass, which keeps its own refusals).

Golden: `tests/compiler/golden/passes/unsupported.diff`, this pass's before/after (empty: a check changes nothing),
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

from torch import fx, nn

from meshplan.dsl import ast
from meshplan.dsl.check import Plan
from meshplan.dsl.errors import Diagnostic

from ..load import ModelSource
from ..match import Resolution
from ..stages import layer_list
from . import Context, Pass

_CONFIG_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")


def check_unsupported(plan: Plan, source: ModelSource, resolution: Resolution) -> list[Diagnostic]:
    """Size errors of the constructs that are not lowered yet, then their refusal."""
    model = source.model
    return [
        *_pipeline_sizes(plan, model),
        *not_lowered(plan),
    ]


def not_lowered(plan: Plan) -> list[Diagnostic]:
    """One error per selective checkpoint rule under a schedule that splits the backward (a
    region computed under selective checkpointing can be backwarded once only; the split runs
    it in two halves)."""
    out: list[Diagnostic] = []
    split = plan.pipeline is not None and plan.pipeline.schedule in ("zero_bubble", "zbv")
    for rule in plan.rules_of("checkpoint"):
        action = rule.action
        if split and isinstance(action, ast.Checkpoint) and action.mode == "selective":
            assert plan.pipeline is not None
            out.append(
                Diagnostic(
                    action.span,
                    f"selective checkpointing under `schedule = {plan.pipeline.schedule}` is not lowered yet: "
                    "its backward runs in two halves, and a selective region can be backwarded once",
                    hint="use `checkpoint full` here, or `schedule = 1f1b` / `interleaved`",
                )
            )
    return out


# ---------------------------------------------------------------------------- pipeline


def _pipeline_sizes(plan: Plan, model: nn.Module) -> list[Diagnostic]:
    """Stages balanced automatically are cut between layers: each needs at least one."""
    p = plan.pipeline
    if p is None or p.cuts:
        return []  # explicit cuts are counted against the stages by dsl.settings
    ranks = plan.mesh.size(p.axis)
    layers = _num_layers(model)
    if ranks is None or layers is None:
        return []
    stages = ranks * p.virtual_stages
    if stages <= layers:
        return []
    if p.virtual_stages == 1:
        made, hint = f"{stages} stages", f"use a `{p.axis}` size of at most {layers}"
    else:
        made = f"{ranks} x {p.virtual_stages} virtual = {stages} stages"
        hint = f"make `{p.axis}` x `virtual_stages` at most {layers}"
    return [
        Diagnostic(
            plan.mesh.axis(p.axis).span,
            f"`pipeline over {p.axis}` makes {made}, but the model has {layers} layers: "
            "a stage would hold no layer",
            hint=hint,
        )
    ]


def _num_layers(model: nn.Module) -> int | None:
    """The config's layer count, else the length of the outermost list of modules
    (`layers`, `h`): the numbered blocks a pipeline is cut between."""
    config = getattr(model, "config", None)
    for attr in _CONFIG_LAYERS:
        count = getattr(config, attr, None)
        if isinstance(count, int) and count > 0:
            return count
    layers = layer_list(model)
    return layers[1] if layers is not None else None


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    ctx.diagnostics += check_unsupported(ctx.plan, ctx.source, ctx.resolution)
    return gm


PASS = Pass(
    "unsupported",
    run,
    requires="rules resolved",
    ensures="nothing changes: rules the compiler cannot lower yet are located errors, never ignored",
    checks_after_errors=True,
)
