"""What a compiled plan does to one model, for `meshplan diff --model`: where each parameter goes,
the collectives a step issues, the worst rank's memory and the step's predicted time.

    changes = effect_changes(effects(compiled_a, hw), effects(compiled_b, hw))

Each is a `dsl.diff.Change`, so the command prints them as it prints the plans' own: a
parameter's placement before and after (parameters that change alike grouped under one
pattern, `layers.*.mlp.up_proj.weight (x4)`), each collective per step by its op, axis and
phase (count and bytes, from the ledger), the peak and the training state of the worst rank and
the step time (from `estimate`). `same_program` says whether two plans compile to one program:
then their rules' text differences do not count.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from meshplan.dsl.diff import Change

from .compile import Compiled
from .estimate import estimate
from .hardware import Hardware
from .print_estimate import seconds, size

_INDEX = re.compile(r"(?<=\.)[0-9]+(?=\.|$)")  # a layer's number in a parameter's name


@dataclass(frozen=True)
class Effects:
    placements: dict[str, str]  # parameter -> `Shard(0) over tp` ("replicated" on every axis)
    collectives: dict[str, str]  # `all_reduce over tp (forward)` -> `8 a step, 0.066 MB`
    peak: int  # the worst rank's most live bytes over a step
    state: int  # the worst rank's training state
    step_time: float | None
    program: str  # the SPMD graph's code
    checkpoint: dict[str, tuple[int, ...]]  # what a run's checkpoint holds: each tensor's whole shape


def effects(compiled: Compiled, hw: Hardware) -> Effects:
    placements = {
        name: ", ".join(f"{p} over {axis}" for axis, p in sorted(by_axis.items())) or "replicated"
        for name, by_axis in compiled.param_placements.items()
    }
    for name, _ in compiled.graph.named_parameters():
        placements.setdefault(name, "replicated")
    per_step: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in compiled.ledger.rows:
        totals = per_step[f"{row.op} over {row.axis} ({row.phase})"]
        totals[0] += row.count
        totals[1] += row.bytes * row.count
    est = estimate(compiled, hw=hw)
    worst = max(est.ranks, key=lambda r: r.peak)
    return Effects(
        placements,
        {k: f"{count} a step, {nbytes / 1e6:.3f} MB" for k, (count, nbytes) in sorted(per_step.items())},
        worst.peak,
        max(r.state for r in est.ranks),
        est.step_time,
        compiled.graph.code,
        {name: tuple(t.shape) for name, t in compiled.graph.state_dict(keep_vars=True).items()},
    )


def same_program(a: Effects, b: Effects) -> bool:
    return a.program == b.program and a.placements == b.placements


def effect_changes(a: Effects, b: Effects) -> list[Change]:
    """The placements that change (grouped), the collectives, memory and time that differ."""
    grouped: dict[tuple[str, str | None, str | None], int] = defaultdict(int)
    for name in dict.fromkeys([*a.placements, *b.placements]):
        before, after = a.placements.get(name), b.placements.get(name)
        if before != after:
            grouped[(_INDEX.sub("*", name), before, after)] += 1
    changes = [
        Change(f"{pattern}" + (f" (x{n})" if n > 1 else ""), before, after)
        for (pattern, before, after), n in grouped.items()
    ]
    for key in dict.fromkeys([*a.collectives, *b.collectives]):
        if a.collectives.get(key) != b.collectives.get(key):
            changes.append(Change(key, a.collectives.get(key), b.collectives.get(key)))
    if a.peak != b.peak:
        changes.append(Change("peak, worst rank", size(a.peak), size(b.peak)))
    if a.state != b.state:
        changes.append(Change("training state, worst rank", size(a.state), size(b.state)))
    if a.step_time is not None and b.step_time is not None and seconds(a.step_time) != seconds(b.step_time):
        changes.append(Change("step time", seconds(a.step_time), seconds(b.step_time)))
    return changes


def resume_problem(a: Effects, b: Effects) -> str | None:
    """Why a checkpoint written under plan A does not resume under plan B, or None when it does.
    Checkpoints hold each tensor whole-shaped under its name, whatever the layout (each rank's
    pieces placed in it), so a plan change that keeps every name and shape resumes; one that
    stacks a list of experts (an `experts` rule), or drops it, renames them."""
    only_a = [k for k in a.checkpoint if k not in b.checkpoint]
    only_b = [k for k in b.checkpoint if k not in a.checkpoint]
    if only_a or only_b:
        stacked = _stacked(only_a, only_b) or _stacked(only_b, only_a)
        if stacked:
            return stacked
        name, side = (
            (only_a[0], "A's holds it, B has none") if only_a else (only_b[0], "B needs it, A's holds none")
        )
        return f"`{name}`: {side}"
    for name, shape in a.checkpoint.items():
        if b.checkpoint[name] != shape:
            return f"`{name}` is {shape} under A, {b.checkpoint[name]} under B"
    return None


def _stacked(listed: list[str], stacked: list[str]) -> str | None:
    """The experts a plan holds as a list (`layers.0.mlp.experts.3.w1`) that the other stacks
    (`layers.0.mlp.experts.w1`), said once."""
    for name in listed:
        parts = re.fullmatch(r"(.+)\.\d+\.(.+)", name)
        if parts and f"{parts[1]}.{parts[2]}" in stacked:
            return f"the experts of `{parts[1]}` are a list under one plan and stacked under the other (an `experts` rule)"
    return None
