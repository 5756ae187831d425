"""What the commands that take a model share: the plan compiled for it (`check --model`, `explain`,
`compile`, `estimate`, `diff --model`), a plan's warnings printed, the hardware entry of this
machine."""

from __future__ import annotations

import argparse
import sys

from meshplan.dsl import load_plan
from meshplan.dsl.check import Plan
from meshplan.dsl.errors import render_diagnostics
from meshplan.errors import use_color


def print_warnings(plan: Plan) -> None:
    if plan.warnings:
        print(
            render_diagnostics(
                plan.warnings,
                {plan.path: plan.source},
                color=use_color(sys.stderr),
                more_warnings=plan.more_warnings,
            ),
            file=sys.stderr,
        )


def compiled_for_model(args: argparse.Namespace, *, dynamic: bool = True):
    """Plan + model -> Compiled, for the commands that need the model. `*` axes default to 1.
    `dynamic=False`: for the --batch/--seq given only (what `estimate` prices)."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model, on_meta_inputs

    world_size = args.world_size
    if world_size is None:
        probe = load_plan(args.plan)
        print_warnings(probe)
        autos = [a.name for a in probe.mesh.axes if a.size is None]
        if autos:
            world_size = probe.mesh.world_size or _product(a.size for a in probe.mesh.axes if a.size)
            print(f"note: `{autos[0]}=*` taken as 1; pass --world-size N for the real size", file=sys.stderr)
    plan = load_plan(args.plan, world_size=world_size)
    # compiling needs shapes, not weights: a factory's model is built on the meta device where it can be
    source = with_token_shape(load_model(args.model, shapes_only=True), batch=args.batch, seq=args.seq)
    compiled = compile_plan(plan, on_meta_inputs(source), world_size=world_size, dynamic=dynamic)
    if compiled.warnings:
        print(
            render_diagnostics(compiled.warnings, {plan.path: plan.source}, color=use_color(sys.stderr)),
            file=sys.stderr,
        )
    return compiled


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def this_machine() -> str:
    """The hardware entry for where this runs: the GPU's kind, else `cpu`."""
    import torch

    if torch.cuda.is_available():
        from meshplan.compiler.hardware import gpu_name

        return gpu_name(torch.device("cuda"))
    return "cpu"
