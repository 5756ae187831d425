"""Pipeline bubble: each rank's measured idle fraction vs the simulation of the same action lists.

    python bench/pp_idle.py [--microbatches 8] [--steps 5] [--warmup 2] [--quick]

Model: the example Llama in fp32, 8 layers, H=256, I=688, V=256, heads 8/4; microbatches of
B=2, T=128; p=2 gloo ranks with 1 intra-op thread each, m=8 microbatches per step. Every
schedule `runtime.schedules.build` knows (`pp_common.SCHEDULES`: gpipe, 1f1b, interleaved with
2 virtual stages per rank, zero_bubble, zbv) runs in the same two processes, one step each per
round (a barrier before each), so a change in the machine's load hits all of them alike. Stages
are balanced by FLOPs (`compiler/stages.py`) into as many stages as the schedule has (2, or 4
for interleaved and zbv). A step is `PipelineStep.run` over the m microbatches (forward and
backward, gradients accumulated; no optimizer).

Columns, per schedule and rank (fractions of that rank's step):

    measured   `PipelineStep.idle`: the time spent waiting in receives and for its sends to
               complete (what `meshplan run` reports as `pipeline_idle`)
    simulated  `runtime.schedules.simulate` of the same action lists at the costs measured in
               the same step. Each action is timed as the step runs it (`pp_common.ActionClock`),
               less the time it waited in receives; an action's cost is the mean of that over
               the step's microbatches, per kind and stage (F, B, or I and W, of stage s). A
               rank's simulated idle is 1 - (its busy time) / (the end of its last action);
               averaged over the measured steps
    msgs       of the measured idle, the waits for data already sent: in a receive after the
               sending action had ended on the other rank (same clock: `time.perf_counter`),
               and the final wait for this rank's sends. The simulation sends in no time, so
               this is idle it cannot predict (not all of it is excess: a late message can
               stand in for a wait the simulation puts elsewhere)
    unit       the simulated idle at unit costs (F=1, B=2, I=W=1), as `meshplan explain` prints
    ratio/pts  measured / simulated, and the difference in percentage points of the step; a
               ratio over a small idle (a few percent) is noisy: read the points there

On a 2-core machine two ranks have one core each; any other load on it delays the process a
message wakes up, and shows as msgs. Read the numbers from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pp_common import (
    SCHEDULES,
    ActionClock,
    Timed,
    built_schedules,
    compile_llama,
    microbatches,
    new_step,
    rank_stages,
    zero_grads,
)

from meshplan.compiler.stages import balanced_cuts
from meshplan.examples.models.llama import build
from meshplan.runtime.launch import spawn
from meshplan.runtime.schedules import Action, Schedule, Timeline, simulate

WORLD = 2
MODEL = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=128,
)
BATCH, SEQ = 2, 128


@dataclass(frozen=True)
class StepRecord:
    """One rank's measured step: its actions, timed, and `PipelineStep`'s own measures."""

    actions: list[Timed]
    idle: float  # PipelineStep.idle
    waited: float  # seconds in receives and in the final wait for sends
    wall: float  # seconds of `run`, from outside


def one_way(rank: int, shape: tuple[int, ...], trips: int = 20) -> float:
    """Seconds for one activation to go from rank 0 to rank 1, receive posted first (half a
    round trip's median): the transfer itself, without waiting for a busy peer."""
    x = torch.randn(shape)
    times = []
    for _ in range(trips):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def worker(rank: int, world: int, opts: argparse.Namespace) -> tuple[float, dict[str, list[StepRecord]]]:
    model_config = {**MODEL, "num_hidden_layers": opts.layers}
    compiled = compile_llama(world, batch=BATCH, seq=SEQ, **model_config)
    runs = {}
    for name, schedule in built_schedules(world, opts.microbatches, opts.schedules).items():
        model = build(**model_config)
        stages = rank_stages(
            compiled, model, rank, schedule, balanced_cuts(compiled.graph, model, schedule.stages)
        )
        step = new_step(stages, schedule, rank, world)
        runs[name] = (stages, step, ActionClock(step), model)
    latency = one_way(rank, (BATCH, SEQ, MODEL["hidden_size"]))
    out: dict[str, list[StepRecord]] = {name: [] for name in runs}
    # Round-robin, one step of each per round: every schedule sees the same load.
    for i in range(opts.warmup + opts.steps):
        for name, (stages, step, clock, model) in runs.items():
            micro = microbatches(compiled, model, batch=BATCH, seq=SEQ, m=opts.microbatches, seed=i)
            zero_grads(stages)
            dist.barrier()
            t0 = time.perf_counter()
            step.run(micro)
            wall = time.perf_counter() - t0
            if i >= opts.warmup:
                out[name].append(StepRecord(list(clock.records), step.idle, step._waited, wall))
    return latency, out


def rank_idle(schedule: Schedule, timeline: Timeline) -> list[float]:
    """Each rank's idle share of its own span: from the step's start to its last action's end
    (what `PipelineStep.idle` measures; a rank that finishes early is not idle after)."""
    out = []
    for r, actions in enumerate(schedule.actions):
        end = max(timeline.end[a] for a in actions)
        out.append(1.0 - timeline.busy[r] / end if end else 0.0)
    return out


def producer(schedule: Schedule, a: Action, split: bool) -> Action | None:
    """The action on another rank whose message `a` waits for (None: nothing crosses ranks)."""
    owner, last = schedule.owner, schedule.stages - 1
    if a.kind == "F" and a.stage > 0:
        before = Action("F", a.stage - 1, a.microbatch)
    elif a.kind in ("B", "I") and a.stage < last:
        before = Action("I" if split else "B", a.stage + 1, a.microbatch)
    else:
        return None
    return before if owner[before.stage] != owner[a.stage] else None


def message_wait(schedule: Schedule, step: list[StepRecord]) -> list[float]:
    """Per rank, the share of its step spent waiting for data already sent: in a receive after
    the sending action had ended (the rendezvous of the two processes and the copy), and in the
    final wait for its own sends. The simulation sends in no time, so this is idle it cannot see."""
    split = any(t.action.kind == "I" for record in step for t in record.actions)
    ended = {t.action: t.start + t.seconds for record in step for t in record.actions}
    out = []
    for record in step:
        spent = record.waited - sum(t.waited for t in record.actions)  # the final wait for sends
        for t in record.actions:
            before = producer(schedule, t.action, split)
            if before is not None and t.waited > 0:
                ready = max(t.start, ended[before])
                spent += min(t.waited, max(0.0, t.start + t.waited - ready))
        out.append(spent / (record.waited / record.idle) if record.idle else 0.0)
    return out


@dataclass
class Result:
    measured: list[float]  # per rank, PipelineStep.idle, mean over steps
    simulated: list[float]  # each step simulated at its mean cost per (kind, stage); mean over steps
    messages: list[float]  # of the measured idle, the waits for data already sent
    unit: list[float]  # at unit costs
    step: float  # median over steps of the slower rank's `run`
    predicted_step: float  # median over steps of the simulated makespan
    cost: dict[tuple[str, int], float]  # mean busy seconds per (kind, stage) over every step


def analyse(schedule: Schedule, by_rank: list[list[StepRecord]]) -> Result:
    steps = len(by_rank[0])
    everything: dict[tuple[str, int], list[float]] = defaultdict(list)
    simulated, messages, makespans = [0.0] * schedule.ranks, [0.0] * schedule.ranks, []
    for k in range(steps):
        step = [records[k] for records in by_rank]
        spent: dict[tuple[str, int], list[float]] = defaultdict(list)
        for record in step:
            for t in record.actions:
                spent[(t.action.kind, t.action.stage)].append(t.busy)
                everything[(t.action.kind, t.action.stage)].append(t.busy)
        cost = {key: statistics.fmean(v) for key, v in spent.items()}
        timeline = simulate(schedule, lambda a, cost=cost: cost[(a.kind, a.stage)])
        makespans.append(timeline.makespan)
        for r, (idle, msg) in enumerate(
            zip(rank_idle(schedule, timeline), message_wait(schedule, step), strict=True)
        ):
            simulated[r] += idle / steps
            messages[r] += msg / steps
    return Result(
        measured=[statistics.fmean(record.idle for record in records) for records in by_rank],
        simulated=simulated,
        messages=messages,
        unit=rank_idle(schedule, simulate(schedule)),
        step=statistics.median(max(r[k].wall for r in by_rank) for k in range(steps)),
        predicted_step=statistics.median(makespans),
        cost={key: statistics.fmean(v) for key, v in everything.items()},
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", nargs="*", default=[], help="a subset of the schedules")
    parser.add_argument("--quick", action="store_true", help="2 steps after 1 warm-up")
    opts = parser.parse_args()
    if opts.quick:
        opts.steps, opts.warmup = 2, 1
    schedules = built_schedules(WORLD, opts.microbatches, opts.schedules)
    asked = [n for n, _ in SCHEDULES if not opts.schedules or n in opts.schedules]
    skipped = [n for n in asked if n not in schedules]
    load_before = os.getloadavg()[0]
    results = spawn(worker, WORLD, (opts,), timeout_s=900)
    load_after = os.getloadavg()[0]
    latency = results[0][0]

    print(
        f"Llama fp32, {opts.layers} layers, H={MODEL['hidden_size']}, V={MODEL['vocab_size']}; "
        f"microbatch B={BATCH} T={SEQ}; p={WORLD} gloo ranks, m={opts.microbatches}; "
        f"{opts.steps} steps after {opts.warmup} warm-up"
        + (f"; not built yet: {', '.join(skipped)}" if skipped else "")
    )
    print(
        f"{os.cpu_count()} cores, 1-min load average {load_before:.2f} before, {load_after:.2f} after; "
        f"one (B, T, H) activation to a waiting rank: {latency * 1e3:.2f} ms\n"
    )
    print(
        f"{'idle':<14}{'rank':>5}{'measured':>10}{'simulated':>11}{'ratio':>7}{'pts':>7}"
        f"{'msgs':>7}{'unit':>7}"
    )
    got = {name: analyse(schedule, [r[1][name] for r in results]) for name, schedule in schedules.items()}
    for name, res in got.items():
        for r in range(WORLD):
            m, s, msg = res.measured[r], res.simulated[r], res.messages[r]
            print(
                f"{name:<14}{r:>5}{m:>10.3f}{s:>11.3f}{m / s:>7.2f}{100 * (m - s):>+7.1f}"
                f"{msg:>7.3f}{res.unit[r]:>7.3f}"
            )
    print()
    for name, res in got.items():
        order = sorted(res.cost, key=lambda key: (key[1], "FBIW".index(key[0])))
        costs = ", ".join(f"{k}{s} {res.cost[(k, s)] * 1e3:.0f}" for k, s in order)
        print(
            f"{name:<12}step {res.step * 1e3:5.0f} ms measured, {res.predicted_step * 1e3:5.0f} simulated "
            f"(medians); costs in ms: {costs}"
        )
    if "1f1b" in got and "zero_bubble" in got:
        one, zb = got["1f1b"].cost, got["zero_bubble"].cost
        split = ", ".join(
            f"stage {s} {(zb[('I', s)] + zb[('W', s)]) / one[('B', s)]:.2f}" for s in range(WORLD)
        )
        print(f"\nsplit backward, (I + W) / B of the same stage (zero_bubble's vs 1f1b's): {split}")
    if "zbv" in got and "1f1b" in got:
        z, o = got["zbv"], got["1f1b"]

        def share(a: list[float], b: list[float]) -> float:
            return statistics.fmean(a) / statistics.fmean(b)

        print(
            f"zbv idle / 1f1b idle (mean over ranks, p={WORLD}, m={opts.microbatches}; goal below 0.5): "
            f"measured {share(z.measured, o.measured):.2f}, simulated at the measured costs "
            f"{share(z.simulated, o.simulated):.2f}, at unit costs {share(z.unit, o.unit):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
