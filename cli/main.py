"""The `meshplan` command line.

    meshplan check examples/llama_tp.plan --world-size 4
    meshplan fmt --check examples/*.plan

Exit codes: 0 success, 1 internal error (a bug in meshplan), 2 a problem with the
user's input (plan, model, arguments), reported with its location.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from meshplan.dsl import Plan, PlanError, load_plan, parse, read_plan_text
from meshplan.dsl.errors import render_diagnostics
from meshplan.dsl.fmt import format_plan

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2
EXIT_NOT_CANONICAL = 1  # `fmt --check`, like other formatters' check modes


class UsageError(Exception):
    """A user mistake outside any plan file (a bad flag value, a missing output folder)."""


def _use_color(stream) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    return os.environ.get("FORCE_COLOR") is not None or (hasattr(stream, "isatty") and stream.isatty())


def _report(error: PlanError) -> None:
    print(error.render(color=_use_color(sys.stderr)), file=sys.stderr)
    n_err = len(error.errors)
    n_warn = len(error.diagnostics) - n_err
    paths = sorted({d.span.path for d in error.diagnostics})
    counts = f"{n_err} error{'s' * (n_err != 1)}" + (
        f", {n_warn} warning{'s' * (n_warn != 1)}" if n_warn else ""
    )
    print(f"{', '.join(paths)}: {counts}", file=sys.stderr)


def _print_warnings(plan: Plan) -> None:
    if plan.warnings:
        print(
            render_diagnostics(plan.warnings, {plan.path: plan.source}, color=_use_color(sys.stderr)),
            file=sys.stderr,
        )


# ---------------------------------------------------------------------------- commands


def cmd_check(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.plans:
        try:
            plan = load_plan(path, world_size=args.world_size)
        except PlanError as e:
            _report(e)
            status = EXIT_USER
            continue
        _print_warnings(plan)
        print(summarize(plan))
    return status


def cmd_fmt(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.plans:
        try:
            text = read_plan_text(path)
            formatted = format_plan(parse(text, str(path)), text)
        except PlanError as e:
            _report(e)
            status = EXIT_USER
            continue
        if args.check:
            if formatted != text:
                print(f"{path}: not canonical (run `meshplan fmt --write {path}`)", file=sys.stderr)
                status = status or EXIT_NOT_CANONICAL
        elif args.write:
            if formatted != text:
                Path(path).write_text(formatted, encoding="utf-8")
                print(f"formatted {path}")
        else:
            sys.stdout.write(formatted)
    return status


def summarize(plan: Plan) -> str:
    """A few lines saying what a checked plan does, for `meshplan check`."""
    mesh = " x ".join(f"{a.name}={'*' if a.size is None else a.size}" for a in plan.mesh.axes)
    world = plan.mesh.world_size
    lines = [f"{plan.path}: ok", f"  mesh       {mesh}" + (f"  ({world} ranks)" if world else "")]
    kinds: dict[str, int] = {}
    for rule in plan.rules:
        kinds[rule.kind] = kinds.get(rule.kind, 0) + 1
    if kinds:
        lines.append("  rules      " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
    if p := plan.pipeline:
        stages = plan.mesh.size(p.axis)
        micro = p.microbatches if p.microbatches is not None else "one per stage"
        detail = f"{p.schedule} over {p.axis}"
        if stages:
            detail += f", {stages * p.virtual_stages} stages"
        detail += f", microbatches {micro}"
        detail += f", {len(p.cuts)} cuts" if p.cuts else ", balanced automatically"
        lines.append(f"  pipeline   {detail}")
    if d := plan.data_parallel:
        offload = [
            name for name, on in (("optimizer", d.offload_optimizer), ("params", d.offload_params)) if on
        ]
        detail = f"over {d.axis}, ZeRO-{d.zero}, bucket {d.bucket_bytes / 1e6:g}MB"
        detail += f", offload {' + '.join(offload)}" if offload else ""
        lines.append(f"  data       {detail}")
    pr = plan.precision
    scale = "" if pr.loss_scale is None else f", loss scale {pr.loss_scale}"
    lines.append(
        f"  precision  compute {pr.compute}, params {pr.params}, grads {pr.grads}, reduce {pr.reduce}{scale}"
    )
    if plan.train.gradient_accumulation > 1:
        lines.append(f"  train      gradient accumulation {plan.train.gradient_accumulation}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add(sub, name: str, func: Callable[[argparse.Namespace], int], help: str, example: str):
    p = sub.add_parser(
        name,
        help=help,
        description=help,
        epilog="example:\n" + textwrap.indent(textwrap.dedent(example).strip(), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan",
        description="A declarative model-partitioning compiler for PyTorch.",
        epilog="example:\n  meshplan check examples/llama_tp.plan --world-size 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from meshplan import __version__

    parser.add_argument("--version", action="version", version=f"meshplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = _add(
        sub,
        "check",
        cmd_check,
        "parse and check plans, reporting every problem with its location",
        """
             meshplan check examples/llama_tp.plan
             meshplan check examples/*.plan --world-size 8
             """,
    )
    p.add_argument("plans", nargs="+", metavar="PLAN", help="plan files")
    p.add_argument(
        "--world-size",
        type=_positive_int,
        metavar="N",
        help="number of processes; resolves a `*` axis and checks the mesh product",
    )

    p = _add(
        sub,
        "fmt",
        cmd_fmt,
        "print plans in canonical form, keeping comments",
        """
             meshplan fmt examples/llama_tp.plan
             meshplan fmt --check examples/*.plan      # exit 1 if any is not canonical
             meshplan fmt --write my.plan              # rewrite in place
             """,
    )
    p.add_argument("plans", nargs="+", metavar="PLAN", help="plan files")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report files that are not canonical")
    mode.add_argument("--write", action="store_true", help="rewrite files in place")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PlanError as e:
        _report(e)
        return EXIT_USER
    except UsageError as e:
        print(f"meshplan: error: {e}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        print("meshplan: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in meshplan, not a user mistake
        if os.environ.get("MESHPLAN_DEBUG"):
            raise
        print(
            f"meshplan: internal error: {type(e).__name__}: {e}\n"
            "this is a bug in meshplan; rerun with MESHPLAN_DEBUG=1 for the traceback and report it",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
