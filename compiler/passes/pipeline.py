"""Pipeline stages: where the plan's `pipeline` block cuts the program.

Requires: the final forward graph (tensor-parallel collectives inserted, checkpoint
regions outlined, so a checkpointed layer is one call node and never split); export's `val`
on the nodes (the balancing cost); the plan's `pipeline` block.
A weight several stages read (an embedding tied to the LM head) is held by each pipeline
rank running one of them (`Stages.shared`); the ZeRO pass puts it in a unit of each stage.
Ensures: `gm.meta["meshplan.stages"]` holds the cuts as module paths (`("before",
"layers.2")`, ...), explicit or balanced, that make `size(axis) x virtual_stages` stages,
each with at least one operation; every op node that runs in one stage has
`meta["meshplan.stage"]`. The graph itself is not changed: every rank compiles the same
program, and a pipeline rank builds its stage programs from it (`compiler/stages.py`).

Golden: `tests/compiler/golden/passes/pipeline.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

from torch import fx

from meshplan.dsl.errors import Diagnostic, Span

from .. import meta
from ..stages import StageError, cut_stages, cuts_from
from . import Context, Pass


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    spec = ctx.plan.pipeline
    if spec is None:
        return gm
    try:
        cuts = cuts_from(ctx.plan, ctx.source.model, gm, ranks=ctx.layout.size(spec.axis))
        stages = cut_stages(gm, cuts)
    except StageError as e:
        ctx.diagnostics.append(Diagnostic(e.span or _keyword(spec.span), str(e), e.hint))
        return gm
    for node, s in stages.stage_of.items():
        meta.set_stage(node, s)
    meta.set_stage_cuts(gm, tuple((c.side, c.path) for c in cuts))
    return gm


def _keyword(span: Span) -> Span:
    """The `pipeline` keyword of the block: the whole block would underline a dozen lines."""
    return Span(span.path, span.line, span.col, span.line, span.col + len("pipeline"))


PASS = Pass(
    "pipeline",
    run,
    requires="the final forward graph (collectives inserted, checkpoint regions outlined)",
    ensures="the stage cuts in gm.meta, explicit or balanced; each activation's stage in its meta",
)
