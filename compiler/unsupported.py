"""Constructs the language has and the compiler does not lower yet: refused, never ignored.

`experts` rules and device placement (`on cpu`) parse and pass `meshplan check`, but no
pass lowers them yet: a program compiled from such a plan would simply lack them and train
as if they were not there. So every command that compiles against a model refuses them, one
located error per rule, and so are the axes a `pipeline` does not compose with yet (ZeRO-3):

    p.plan:5:11: error: device placement (`on cuda:1`) is not lowered yet: this plan would train without it
            norm: on cuda:1
                  ^~~~~~~~~
    hint: remove the rule to compile this plan; `meshplan check PLAN` without --model checks the language only

Before that, the sizes these constructs need are checked against the model, because a
size that can never work is the more useful message (and stays true once they are
lowered): experts divisible by the expert-parallel size, no more pipeline stages than
layers. A size error and the refusal of the same construct
are two problems and are both reported; the size error comes first in the file.
Model-free sizes (microbatches vs stages) are `dsl.check`'s.

When a pass lowers one of these constructs, its refusal goes from `not_lowered` and its
size checks move to that pass (the sequence a context axis cuts: the tensor-parallel pass).
"""

from __future__ import annotations

from torch import fx, nn

from meshplan.dsl import ast
from meshplan.dsl.check import Plan
from meshplan.dsl.errors import Diagnostic, Span

from .capture import ModelSource
from .match import Resolution
from .passes import Context, Pass
from .stages import layer_list

_REMOVE_RULE = (
    "remove the rule to compile this plan; `meshplan check PLAN` without --model checks the language only"
)
_CONFIG_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_CONFIG_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")


def check_unsupported(plan: Plan, source: ModelSource, resolution: Resolution) -> list[Diagnostic]:
    """Size errors of the constructs that are not lowered yet, then their refusal."""
    model = source.model
    return [
        *_expert_sizes(plan, model, resolution),
        *_pipeline_sizes(plan, model),
        *not_lowered(plan),
    ]


def not_lowered(plan: Plan) -> list[Diagnostic]:
    """One error per `experts` and `on DEVICE` rule (no pass lowers them), and per
    axis a `pipeline` does not compose with yet."""
    out = _pipeline_compositions(plan)
    for rule in plan.rules:
        action = rule.action
        if isinstance(action, ast.ExpertParallel):
            what = "expert parallelism"
        elif isinstance(action, ast.Device):
            device = action.kind if action.index is None else f"{action.kind}:{action.index}"
            what = f"device placement (`on {device}`)"
        else:
            continue
        out.append(
            Diagnostic(
                action.span, f"{what} is not lowered yet: this plan would train without it", hint=_REMOVE_RULE
            )
        )
    return out


# ---------------------------------------------------------------------------- experts


def _expert_sizes(plan: Plan, model: nn.Module, resolution: Resolution) -> list[Diagnostic]:
    """Experts split evenly over the expert-parallel ranks; top_k picks among them."""
    modules = dict(model.named_modules())
    out = []
    for rule in plan.rules_of("experts"):
        assert isinstance(rule.action, ast.ExpertParallel) and rule.axis is not None
        n = plan.mesh.size(rule.axis)
        counts: dict[int, list[str]] = {}  # number of experts -> modules with that many
        for path in resolution.matched.get(rule.order, ()):
            if resolution.rule_for(path, "experts") is not rule:
                continue  # a more specific experts rule governs it
            count = _num_experts(modules[path], model)
            if count is not None:
                counts.setdefault(count, []).append(path)
        for count, paths in counts.items():
            who = _modules_phrase(paths)
            if n is not None and count % n:
                out.append(
                    Diagnostic(
                        rule.span,
                        f"{who} {'have' if len(paths) > 1 else 'has'} {count} experts, "
                        f"not divisible by {n} ranks over `{rule.axis}`",
                        hint=f"use an `{rule.axis}` size that divides {count} ({_divisors(count)})",
                    )
                )
            for arg in rule.action.args:
                if arg.name.text == "top_k" and arg.value > count:
                    out.append(
                        Diagnostic(
                            arg.span,
                            f"top_k={arg.text} routes each token to more experts than the {count} of {who}",
                            hint=f"use top_k of at most {count}",
                        )
                    )
    return out


def _num_experts(module: nn.Module, model: nn.Module) -> int | None:
    """A list of expert modules, or one module holding them (3-D weights, Mixtral's
    `num_experts`), or the model config's count."""
    if isinstance(module, nn.ModuleList):
        return len(module)
    for owner in (module, getattr(model, "config", None)):
        for attr in _CONFIG_EXPERTS:
            count = getattr(owner, attr, None)
            if isinstance(count, int) and count > 0:
                return count
    return None


# ---------------------------------------------------------------------------- pipeline


def _pipeline_compositions(plan: Plan) -> list[Diagnostic]:
    """A pipeline composes with tensor and sequence rules, data parallelism and ZeRO-1/2,
    checkpointing, precision and accumulation, under every schedule; not yet with ZeRO-3 (its
    gather and release nodes would be cut apart by the stages)."""
    p, dp = plan.pipeline, plan.data_parallel
    if p is None:
        return []
    out = []
    if dp is not None and dp.zero == 3:
        out.append(
            Diagnostic(
                dp.spans.get("zero", _keyword_span(dp.span, "data_parallel")),
                "a pipeline with ZeRO-3 is not lowered yet",
                hint="use `zero = 1` or `zero = 2` with a pipeline",
            )
        )
    return out


def _pipeline_sizes(plan: Plan, model: nn.Module) -> list[Diagnostic]:
    """Stages balanced automatically are cut between layers: each needs at least one."""
    p = plan.pipeline
    if p is None or p.cuts:
        return []  # explicit cuts are counted against the stages by dsl.check
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


# ---------------------------------------------------------------------------- helpers


def _keyword_span(span: Span, word: str) -> Span:
    return Span(span.path, span.line, span.col, span.line, span.col + len(word))


def _modules_phrase(paths: list[str]) -> str:
    return f"`{paths[0]}`" + (f" and {len(paths) - 1} more like it" if len(paths) > 1 else "")


def _divisors(count: int) -> str:
    found = [str(d) for d in range(1, count + 1) if count % d == 0]
    return ", ".join(found[:-1]) + " or " + found[-1] if len(found) > 1 else found[0]


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
