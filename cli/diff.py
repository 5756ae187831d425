"""`meshplan diff A.plan B.plan [--model SPEC]`: what changes between two plans (`dsl/diff.py`), and
with a model what they do differently to it (`compiler/plan_effects.py`), as `diff` says it: exit
0 and nothing printed when they are equivalent, 1 when they differ, 2 for an error."""

from __future__ import annotations

import argparse
import json

from meshplan.dsl import load_plan
from meshplan.dsl.diff import Change, diff_plans, diff_text

EXIT_SAME, EXIT_DIFFERENT = 0, 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("before", metavar="A.plan")
    p.add_argument("after", metavar="B.plan")
    p.add_argument(
        "--model",
        metavar="SPEC",
        help="also compare what each plan does to this model: placements, collectives, memory, step time",
    )
    p.add_argument("--world-size", type=int, metavar="N", help="size a `*` mesh axis")
    p.add_argument("--batch", type=int, metavar="B", help="compile for this many sequences per step")
    p.add_argument("--seq", type=int, metavar="T", help="compile for this sequence length")
    p.add_argument("--hardware", metavar="NAME", help="price the step on this entry (as `estimate`)")
    p.add_argument("--json", action="store_true", help="the changes as JSON (an empty list: equivalent)")


def cmd_diff(args: argparse.Namespace) -> int:
    changes = diff_plans(
        *(load_plan(path, world_size=_sizing(path, args.world_size)) for path in _paths(args))
    )
    effects: list[Change] = []
    resumes: str | None = None  # with a model: whether a checkpoint of A resumes under B, said
    if args.model is not None:
        changes, effects, resumes = _with_model(args, changes)
    if args.json:
        report = {
            "equivalent": not changes,
            "changes": [c.to_json() for c in changes],
            "effects": [c.to_json() for c in effects],
        }
        if resumes is not None:
            report["checkpoint_resumes"] = resumes == RESUMES
            report["checkpoint"] = resumes
        print(json.dumps(report, indent=2))
    elif changes:
        print(f"--- {args.before}\n+++ {args.after}")
        print(diff_text(changes), end="")
        if effects:
            print(f"\non {args.model}:")
            print(diff_text(effects), end="")
        if resumes is not None:
            print(f"\ncheckpoints: {resumes}")
    return EXIT_DIFFERENT if changes else EXIT_SAME


RESUMES = "a checkpoint of A resumes under B (the same tensors, whole-shaped: checkpoints do not depend on the layout)"


def _with_model(
    args: argparse.Namespace, changes: list[Change]
) -> tuple[list[Change], list[Change], str | None]:
    """The plans' changes, less their rules' when both compile to one program, the effects, and
    whether a checkpoint of A resumes under B (None when the plans are equivalent)."""
    from meshplan.compiler.hardware import hardware
    from meshplan.compiler.plan_effects import effect_changes, effects, resume_problem, same_program
    from meshplan.for_model import compiled_for_model, this_machine

    hw = hardware(args.hardware or this_machine())
    a, b = (effects(compiled_for_model(_for_plan(args, path), dynamic=False), hw) for path in _paths(args))
    if same_program(a, b):
        changes = [c for c in changes if not c.rule]
    if not changes:
        return changes, [], None
    problem = resume_problem(a, b)
    resumes = RESUMES if problem is None else f"a checkpoint of A does not resume under B: {problem}"
    return changes, effect_changes(a, b), resumes


def _paths(args: argparse.Namespace) -> tuple[str, str]:
    return args.before, args.after


def _sizing(path: str, world_size: int | None) -> int | None:
    """--world-size for a plan whose mesh has a `*` axis; None for one whose axes are all sized
    (two plans may span different numbers of ranks)."""
    return world_size if any(a.size is None for a in load_plan(path).mesh.axes) else None


def _for_plan(args: argparse.Namespace, path: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "plan": path, "world_size": _sizing(path, args.world_size)})
