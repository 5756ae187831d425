"""Constructs the language has and the compiler does not lower yet: refused, never ignored.

`pipeline` blocks, `context` and `experts` rules and device placement (`on cpu`) parse
and pass `meshplan check`, but no pass lowers them yet: a program compiled from such a
plan would simply lack them and train as if they were not there. So every command that
compiles against a model refuses them, one located error per block or rule:

    examples/long_context.plan:8:25: error: context parallelism (`context ring`) is not lowered yet: this plan would train without it
            layers.*.self_attn: context ring over cp
                                ^~~~~~~~~~~~~~~~~~~~
    hint: remove the rule to compile this plan; `meshplan check PLAN` without --model checks the language only

When a pass lowers one of these constructs, its refusal goes from `not_lowered`.
"""

from __future__ import annotations

from meshplan.dsl import ast
from meshplan.dsl.check import Plan
from meshplan.dsl.errors import Diagnostic, Span

from .capture import ModelSource
from .match import Resolution

_REMOVE_RULE = (
    "remove the rule to compile this plan; `meshplan check PLAN` without --model checks the language only"
)
_REMOVE_BLOCK = (
    "remove the `pipeline` block to compile this plan; "
    "`meshplan check PLAN` without --model checks the language only"
)


def check_unsupported(plan: Plan, source: ModelSource, resolution: Resolution) -> list[Diagnostic]:
    """The problems of the constructs that are not lowered yet, for `compile_plan` to report
    with the others: for now, that they are not lowered."""
    return not_lowered(plan)


def not_lowered(plan: Plan) -> list[Diagnostic]:
    """One error per `pipeline` block, `context`, `experts` and `on DEVICE` rule: no pass lowers them."""
    out = []
    if plan.pipeline is not None:
        out.append(
            Diagnostic(
                _keyword_span(plan.pipeline.span, "pipeline"),
                "pipeline parallelism is not lowered yet: this plan would train without it",
                hint=_REMOVE_BLOCK,
            )
        )
    for rule in plan.rules:
        action = rule.action
        if isinstance(action, ast.ContextParallel):
            what = f"context parallelism (`context {action.mode}`)"
        elif isinstance(action, ast.ExpertParallel):
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


# ---------------------------------------------------------------------------- helpers


def _keyword_span(span: Span, word: str) -> Span:
    return Span(span.path, span.line, span.col, span.line, span.col + len(word))
