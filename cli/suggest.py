"""`meshplan suggest --model SPEC --world-size N --memory SIZE`: the plan for a model on N
devices, written out (`compiler/suggest.py` finds it). The plan goes to stdout (or `-o FILE`)
and the report to stderr, so `meshplan suggest ... > my.plan` keeps the plan alone; exit 3
when no layout fits the memory, with the closest miss."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.args import memory_size, positive_int, share
from meshplan.compiler.headroom import HEADROOM
from meshplan.errors import UsageError

if TYPE_CHECKING:
    from meshplan.suggest_measure import Trial

EXIT_OK, EXIT_DOES_NOT_FIT = 0, 3
AXES = ("dp", "tp", "pp", "ep", "cp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="SPEC", help="the model: path/to/file.py:factory")
    p.add_argument("--world-size", required=True, type=positive_int, metavar="N", help="ranks to plan for")
    p.add_argument("--memory", type=memory_size, metavar="SIZE", help="each rank's device memory (80GiB)")
    p.add_argument(
        "--batch",
        type=positive_int,
        metavar="B",
        help="sequences per step (default: one per rank, N)",
    )
    p.add_argument(
        "--seq", type=positive_int, metavar="T", help="sequence length (default: the model's example)"
    )
    p.add_argument(
        "--hardware",
        metavar="NAME",
        help="h100, h200, a100, cpu or a .json entry, as `estimate` takes it (default: this machine's kind)",
    )
    p.add_argument(
        "--axes",
        metavar="LIST",
        help=f"only these parallel axes, comma-separated, from {','.join(AXES)} (default: all)",
    )
    p.add_argument(
        "--top", type=positive_int, default=3, metavar="K", help="plans to estimate and show (default 3)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds the command may take once a plan fits: no further candidate is estimated "
        "past them (default 60; the first plan that fits is always found)",
    )
    p.add_argument(
        "--headroom",
        type=share,
        default=HEADROOM,
        metavar="F",
        help=f"the share of --memory a plan leaves free for what `estimate` does not count (the CUDA "
        f"context, kernel and NCCL workspaces, fragmentation; default {HEADROOM:g})",
    )
    p.add_argument(
        "--measure",
        type=positive_int,
        metavar="K",
        help="train the K fastest plans by the estimate, each of another mesh, for a few steps on "
        "this machine (`meshplan run`) and write the fastest measured that fits --memory",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan here (default: stdout)")
    p.add_argument("--json", action="store_true", help="the plan and the ranking as one JSON object")


def cmd_suggest(args: argparse.Namespace) -> int:
    from meshplan.compiler.hardware import hardware
    from meshplan.compiler.load import load_model
    from meshplan.compiler.print_suggest import suggest_json, suggest_text
    from meshplan.compiler.suggest import suggest
    from meshplan.compiler.suggest_plan import gib, seconds
    from meshplan.for_model import this_machine

    axes = _axes(args.axes)
    if args.output and Path(args.output).is_dir():
        raise UsageError(f"-o {args.output}: is a folder; name the plan file to write")
    if args.measure:
        _runs_here(args.world_size)
    hw = hardware(args.hardware or this_machine())
    batch = args.batch or args.world_size
    found = suggest(
        load_model(args.model, shapes_only=True),
        world=args.world_size,
        hw=hw,
        limit=args.memory,
        batch=batch,
        seq=args.seq,
        axes=axes,
        top=args.top,
        budget=args.budget,
        headroom=args.headroom,
        shapes=max((args.measure or 0) - 1, 0),
    )
    report = sys.stderr if args.output is None or args.json else sys.stdout
    trials = _measure(found, args, report) if args.measure and found.best is not None else None
    if args.json:
        out = suggest_json(found)
        if trials is not None:
            out["measured"] = [
                {
                    "mesh": t.candidate.layout.mesh(),
                    "step_time_s": t.step_time,
                    "peak": t.peak,
                    "error": t.error or None,
                }
                for t in trials
            ]
        print(json.dumps(out, indent=2))
        return EXIT_OK if found.best is not None else EXIT_DOES_NOT_FIT
    where = f"{args.model} on {args.world_size} ranks of {hw.name}"
    memory = ""
    if args.memory:
        memory = f", {gib(args.memory)} each"
        if found.limit != args.memory:
            memory += f" ({gib(found.limit)} planned, {args.headroom:.0%} left free)"
    print(
        f"meshplan suggest: {where}{memory}, batch {batch}"
        + ("" if args.batch else " (one sequence per rank)"),
        file=report,
    )
    print(suggest_text(found, top=args.top), file=report)
    from meshplan.suggest_measure import pick, table

    chosen = pick(trials, args.memory) if trials is not None else None
    if trials is not None:
        print("\n" + table(trials, chosen, args.memory), file=report)
        if chosen is None:
            print("no plan measured ran under --memory: the estimate's fastest is written", file=report)
        print(file=report)
    best = found.best
    if best is None and found.refusals and not any(c.estimate is not None for c in found.ranked):
        print(
            f"meshplan: error: the compiler refused every layout of {args.world_size} ranks the screen kept "
            f"(above: what it refused, and why); none could be estimated",
            file=sys.stderr,
        )
        print("hint: let other axes or sizes in (--axes), or change what the refusal names", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if best is None:
        closest = min(found.ranked, key=lambda c: c.estimated_peak or c.peak)
        need = closest.estimated_peak or closest.peak
        how = "by `meshplan estimate`" if closest.estimate is not None else "by the screen's arithmetic"
        print(
            f"meshplan: error: no layout of {args.world_size} ranks fits {gib(found.limit)} a rank "
            f"({gib(args.memory)} less {args.headroom:.0%} headroom); the closest, "
            f"`mesh {closest.layout.mesh()}` (zero {closest.layout.zero}"
            f"{', offload' if closest.layout.offload else ''}{f', checkpoint {closest.layout.checkpoint}' if closest.layout.checkpoint else ''}),"
            f" needs {gib(need)} ({how})",
            file=sys.stderr,
        )
        print("hint: more ranks, a smaller --batch or --seq, or devices with more memory", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if args.output:
        Path(args.output).write_text(best.text)
        print(
            f"wrote {args.output}: `mesh {best.layout.mesh()}`, {gib(best.estimated_peak)} per rank at most, "
            f"a step in {seconds(best.estimated_time)} (by `meshplan estimate`)"
            + (
                f", {seconds(chosen.step_time)} measured here"
                if chosen is not None and chosen.step_time
                else ""
            ),
            file=report,
        )
    else:
        sys.stdout.write(best.text)
    return EXIT_OK


def _runs_here(world: int) -> None:
    """`--measure` trains the plans on this machine: its GPUs, one a rank; or its CPU cores,
    which ranks share (up to `meshplan run`'s most a node)."""
    import torch

    from meshplan.launcher import most_processes_per_node

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and world > gpus:
        raise UsageError(
            f"--measure trains each plan here, one rank a GPU: {world} ranks, and this machine has {gpus} "
            "(hint: drop --measure, the estimate alone ranks the plans; or time a plan on its nodes with `meshplan run`)"
        )
    if not gpus and world > most_processes_per_node():
        raise UsageError(
            f"--measure trains each plan here: {world} ranks are more than `meshplan run` starts on one "
            f"machine ({most_processes_per_node()}) (hint: drop --measure, the estimate alone ranks the plans)"
        )


def _measure(found, args: argparse.Namespace, report) -> list[Trial]:
    """`--measure`: the shortlist trained here; the fastest measured that fits becomes the
    suggestion (its text noting what was measured)."""
    from meshplan.suggest_measure import annotated, measure, pick

    trials = measure(found, args.measure, args.model, args.memory, report)
    chosen = pick(trials, args.memory)
    if chosen is not None:
        chosen.candidate.text = annotated(chosen)
        found.best = chosen.candidate
    return trials


def _axes(text: str | None) -> frozenset[str] | None:
    if text is None:
        return None
    names = frozenset(a.strip() for a in text.split(",") if a.strip())
    unknown = sorted(names - set(AXES))
    if unknown:
        raise UsageError(f"--axes: unknown axis {', '.join(unknown)} (known: {', '.join(AXES)})")
    return names
