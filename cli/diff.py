"""`meshplan diff A.plan B.plan`: what changes between two plans (`dsl/diff.py`), as `diff` says
it: exit 0 and nothing printed when they are equivalent, 1 when they differ, 2 for an error."""

from __future__ import annotations

import argparse
import json

from meshplan.dsl import load_plan
from meshplan.dsl.diff import diff_plans, diff_text

EXIT_SAME, EXIT_DIFFERENT = 0, 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("before", metavar="A.plan")
    p.add_argument("after", metavar="B.plan")
    p.add_argument("--json", action="store_true", help="the changes as JSON (an empty list: equivalent)")


def cmd_diff(args: argparse.Namespace) -> int:
    changes = diff_plans(load_plan(args.before), load_plan(args.after))
    if args.json:
        print(json.dumps({"equivalent": not changes, "changes": [c.to_json() for c in changes]}, indent=2))
    elif changes:
        print(f"--- {args.before}\n+++ {args.after}")
        print(diff_text(changes), end="")
    return EXIT_DIFFERENT if changes else EXIT_SAME
