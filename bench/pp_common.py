"""Shared pieces of the pipeline benchmarks (`bench/pp_*.py`): the example Llama compiled for a
pipeline, one rank's stages under a schedule, and a clock on a `PipelineStep`'s actions.

Not a benchmark itself; the `pp_*` scripts import it (run as `python bench/NAME.py`, so this
folder is on `sys.path`). Stages are made as `meshplan run` makes them
(`compiler/lower.py`, `rank_stages`): the compiled graph cut by `compiler/stages.py`, the cuts
applied to this rank's program, and the stages the schedule gives this rank kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import torch
from torch import fx

from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.compiler.stages import Cut, cut_stages
from meshplan.dsl import check_text
from meshplan.examples.models.llama import Llama, build, example_inputs
from meshplan.runtime import schedules
from meshplan.runtime.pipeline import PipelineStep, split_microbatches
from meshplan.runtime.schedules import Action, Schedule, ScheduleError

# Every schedule `schedules.build` may know, with its chunks (virtual stages) per rank. Names it
# refuses ("no schedule called ...") are skipped, so the benches run before and after one lands.
SCHEDULES: tuple[tuple[str, int], ...] = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("zero_bubble", 1),
    ("zbv", 2),
)


def built_schedules(ranks: int, microbatches: int, names: Sequence[str] = ()) -> dict[str, Schedule]:
    """The schedules of `SCHEDULES` (or only `names`) that `schedules.build` makes, by name."""
    out = {}
    for name, chunks in SCHEDULES:
        if names and name not in names:
            continue
        try:
            out[name] = schedules.build(name, ranks, microbatches, chunks)
        except ScheduleError as e:
            if "no schedule called" not in str(e):
                raise
    return out


def compile_llama(ranks: int, *, batch: int, seq: int, **overrides: object):
    """The example Llama compiled for `mesh pp=ranks` at a microbatch of (batch, seq). The
    compiled graph is cut later, per schedule (the pipeline pass is not asked to choose)."""
    model = build(**overrides)
    ids, labels = example_inputs(batch, seq, vocab_size=model.config.vocab_size)
    source = ModelSource(spec=f"llama{overrides}", model=model, args=(ids, labels))
    return compile_plan(check_text(f"mesh pp={ranks}\n", path="pp.plan"), source, world_size=ranks)


def equal_cuts(layers: int, stages: int) -> list[Cut]:
    """Cuts giving each stage the same number of layers (the embedding on the first stage, the
    norm and LM head on the last), whatever they cost."""
    return [Cut("before", f"layers.{layers * k // stages}") for k in range(1, stages)]


def rank_stages(
    compiled, model: torch.nn.Module, rank: int, schedule: Schedule, cuts: Sequence[Cut]
) -> dict[int, fx.GraphModule]:
    """This rank's stage programs (parameters from `model`) under `schedule`, cut at `cuts`."""
    stages = cut_stages(compiled.graph, cuts)
    assert stages.count == schedule.stages, f"{stages.count} stages for a schedule of {schedule.stages}"
    programs = stages.programs(build_rank_program(compiled, model, rank))
    return {s: programs[s] for s in range(stages.count) if schedule.owner[s] == rank}


def microbatches(
    compiled, model: Llama, *, batch: int, seq: int, m: int, seed: int
) -> list[tuple[torch.Tensor, ...]]:
    """m microbatches of (batch, seq) tokens, as the stage programs take them (every rank makes
    the same ones from the seed)."""
    ids, labels = example_inputs(batch * m, seq, seed=seed, vocab_size=model.config.vocab_size)
    return split_microbatches(bind_inputs(model, compiled.graph, (ids, labels), {}), m)


def new_step(stages: dict[int, fx.GraphModule], schedule: Schedule, rank: int, world: int) -> PipelineStep:
    return PipelineStep(stages, schedule, rank=rank, ranks=list(range(world)), group=None)


def zero_grads(stages: dict[int, fx.GraphModule]) -> None:
    for stage in stages.values():
        for p in stage.parameters():
            p.grad = None


# ---------------------------------------------------------------------------- timing each action


@dataclass(frozen=True)
class Timed:
    """One action of one `PipelineStep.run`: when it started (`time.perf_counter`, one clock for
    every process on a Linux machine), its wall time, the part of that spent waiting in
    receives, which an action does first (busy = seconds - waited: compute, sends issued,
    Python), and the CPU time this process used meanwhile (gloo's receives block without
    spinning, so this is the busy part, less any time another process had the core)."""

    action: Action
    start: float
    seconds: float
    waited: float
    cpu: float

    @property
    def busy(self) -> float:
        return self.seconds - self.waited


class ActionClock(Sequence[Action]):
    """Stands in for a `PipelineStep`'s action list and times each action as `run` iterates it:
    an action runs between two steps of the iteration. The time it waited in receives is read
    from the step's own wait counter (`PipelineStep._waited`, what `idle` is made of), so the
    two measures cannot disagree about what counts as waiting.

        clock = ActionClock(step); step.run(micro); clock.records   # [Timed, ...] in run order

    `after(action)`, if given, is called as each action ends (to sample memory, say); its own
    time counts in the next action's.
    """

    def __init__(self, step: PipelineStep, after: Callable[[Action], None] | None = None) -> None:
        self.step = step
        self.after = after
        self.actions: tuple[Action, ...] = tuple(step.actions)
        self.records: list[Timed] = []
        step.actions = self  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self.actions)

    @overload
    def __getitem__(self, i: int) -> Action: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Action]: ...
    def __getitem__(self, i):
        return self.actions[i]

    def __iter__(self) -> Iterator[Action]:
        self.records = []
        t, w, c = time.perf_counter(), self.step._waited, time.process_time()
        for action in self.actions:
            yield action
            now, waited, cpu = time.perf_counter(), self.step._waited, time.process_time()
            self.records.append(Timed(action, t, now - t, waited - w, cpu - c))
            if self.after is not None:
                self.after(action)
            t, w, c = now, waited, cpu
