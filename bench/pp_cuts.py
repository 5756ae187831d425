"""Pipeline cuts: stages balanced by FLOPs (`compiler/stages.py`) vs equal layer counts, step time.

    python bench/pp_cuts.py [--ranks 4] [--microbatches 8] [--seq 128] [--steps 3] [--warmup 1] [--quick]

Model: the example Llama in fp32 with a 32k vocabulary, which makes the ends heavy (the
embedding on the first stage, the LM head and the loss on the last): 8 layers, H=1024,
I=2752, heads 16/8, V=32000 (158M parameters); microbatches of B=1, T=128; p=4 gloo ranks
with 1 intra-op thread each, 1F1B over m=8 microbatches. Two cuts of the same compiled graph:

    equal   2 layers per stage: `cut before layers.2`, `layers.4`, `layers.6`
    auto    `balanced_cuts`: the cuts `meshplan run` makes when the plan gives none (the
            linear-partition DP over each layer's FLOPs, the embedding and the LM head counted)

Each variant has its own copy of the weights (same seed). A step is zero_grad, the pipeline
(`PipelineStep.run` over the m microbatches) and AdamW (lr 1e-4) on each rank's stages. Both
variants run in the same processes, one step each per round, each started by a barrier; a
step's time is the slowest rank's; the median over the measured steps is printed, with each
stage's share of the FLOPs (what the balance sees), each rank's share of the CPU time the step
used (`time.process_time`: gloo's receives block without spinning, so this is the rank's
compute and optimizer step), and each rank's `PipelineStep.idle`.

Timing caveat: this machine has 2 cores, so p=4 is 4 processes on 2 cores. Wherever more than
two stages have work at once they share the cores, and a step cannot take less than its CPU
time over 2 cores (printed as "CPU floor"), the same for both cuts, which pulls the ratio
here towards 1. `--ranks 2` runs p=2 on one core each instead. Any
other load on the machine slows the ranks unevenly: read the numbers from one run.

So the script also prints what p dedicated cores would take, as a model, not a measurement:
each action's CPU time (`pp_common.ActionClock`; the core's time, whoever else wanted it),
averaged per kind and stage within the step, run through `runtime.schedules.simulate` of the
same 1F1B lists (sends free), plus the slowest rank's zero_grad and AdamW. In 1F1B the
fill and drain cost about the sum of one microbatch's work over all stages, which balancing
does not shorten, and the steady state m - 1 times the costliest stage, which it does: the
ratio falls towards the costliest stages' ratio as m grows (`--microbatches 4` shows less gain).
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
    ActionClock,
    built_schedules,
    compile_llama,
    equal_cuts,
    microbatches,
    new_step,
    rank_stages,
)

from meshplan.compiler.stages import balanced_cuts, cut_stages
from meshplan.examples.models.llama import build
from meshplan.runtime.launch import spawn
from meshplan.runtime.schedules import Schedule, simulate

MODEL = dict(
    hidden_size=1024,
    intermediate_size=2752,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=512,
)
BATCH = 1
VARIANTS = ("equal", "auto")


def cuts_for(variant: str, compiled, model, stages: int):
    if variant == "auto":
        return balanced_cuts(compiled.graph, model, stages)
    return equal_cuts(MODEL["num_hidden_layers"], stages)


@dataclass(frozen=True)
class Step:
    """One rank's measured step."""

    seconds: float  # zero_grad + pipeline + AdamW, wall time
    cpu: float  # the CPU time this process used for it
    idle: float  # PipelineStep.idle
    optimizer_cpu: float  # of `cpu`, zero_grad and AdamW
    action_cpu: dict[tuple[str, int], float]  # (kind, stage) -> mean CPU seconds of one action


Stages = dict[str, tuple[list[float], str]]  # variant -> (each stage's share of the FLOPs, the cuts)


def worker(rank: int, world: int, opts: argparse.Namespace) -> tuple[dict[str, list[Step]], Stages]:
    """This rank's measured steps per variant, and the stages of each variant (the same on
    every rank)."""
    compiled = compile_llama(world, batch=BATCH, seq=opts.seq, **MODEL)
    schedule = built_schedules(world, opts.microbatches, [opts.schedule])[opts.schedule]
    probe = build(**{**MODEL, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 172})
    runs = {}
    shares: Stages = {}
    for variant in VARIANTS:
        model = build(**MODEL)
        cuts = cuts_for(variant, compiled, model, schedule.stages)
        cost = cut_stages(compiled.graph, cuts).cost
        shares[variant] = ([c / sum(cost) for c in cost], ", ".join(c.path for c in cuts))
        stages = rank_stages(compiled, model, rank, schedule, cuts)
        del model  # the stages hold this rank's parameters; the rest is freed
        step = new_step(stages, schedule, rank, world)
        params = [p for stage in stages.values() for p in stage.parameters()]
        runs[variant] = (step, ActionClock(step), torch.optim.AdamW(params, lr=1e-4))
    out: dict[str, list[Step]] = {v: [] for v in VARIANTS}
    for i in range(opts.warmup + opts.steps):
        micro = microbatches(compiled, probe, batch=BATCH, seq=opts.seq, m=opts.microbatches, seed=i)
        for variant, (step, clock, optimizer) in runs.items():
            dist.barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)
            step.run(micro)
            optimizer.step()
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            spent: dict[tuple[str, int], list[float]] = defaultdict(list)
            for t in clock.records:
                spent[(t.action.kind, t.action.stage)].append(t.cpu)
            if i >= opts.warmup:
                action_cpu = {key: statistics.fmean(v) for key, v in spent.items()}
                pipeline_cpu = sum(t.cpu for t in clock.records)
                out[variant].append(Step(elapsed, cpu, step.idle, cpu - pipeline_cpu, action_cpu))
    return out, shares


def dedicated(schedule: Schedule, step: list[Step]) -> float:
    """The step's time on one core per rank, nothing else running: the schedule simulated at
    each action's CPU time (per kind and stage, this step's mean), then the slowest optimizer."""
    cost = {key: c for s in step for key, c in s.action_cpu.items()}
    timeline = simulate(schedule, lambda a: cost[(a.kind, a.stage)])
    return timeline.makespan + max(s.optimizer_cpu for s in step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 steps after 1 warm-up, T=64")
    opts = parser.parse_args()
    if opts.quick:
        opts.steps, opts.warmup, opts.seq = 2, 1, 64
    world = opts.ranks
    load_before = os.getloadavg()[0]
    returned = spawn(worker, world, (opts,), timeout_s=1800)
    load_after = os.getloadavg()[0]
    results = [measured for measured, _ in returned]
    shares = returned[0][1]
    schedule = built_schedules(world, opts.microbatches, [opts.schedule])[opts.schedule]
    cores = os.cpu_count() or 1

    params = sum(p.numel() for p in build(**MODEL).parameters())
    print(
        f"Llama fp32, {MODEL['num_hidden_layers']} layers, H={MODEL['hidden_size']}, "
        f"V={MODEL['vocab_size']} ({params / 1e6:.0f}M params); microbatch B={BATCH} T={opts.seq}; "
        f"p={world} gloo ranks on {cores} cores, {opts.schedule}, m={opts.microbatches}; "
        f"zero_grad + pipeline + AdamW; {opts.steps} steps after {opts.warmup} warm-up"
    )
    print(f"1-min load average {load_before:.2f} before, {load_after:.2f} after\n")
    steps = range(opts.steps)
    wall = {v: [max(r[v][k].seconds for r in results) for k in steps] for v in VARIANTS}  # the slowest rank
    alone = {v: [dedicated(schedule, [r[v][k] for r in results]) for k in steps] for v in VARIANTS}
    for v in VARIANTS:
        cpu = [statistics.fmean(s.cpu for s in r[v]) for r in results]
        idle = [statistics.fmean(s.idle for s in r[v]) for r in results]
        floor = statistics.median(sum(r[v][k].cpu for r in results) / cores for k in steps)
        print(
            f"{v:<6} cuts before {shares[v][1]}: step median {statistics.median(wall[v]):.2f} s, "
            f"fastest {min(wall[v]):.2f} s; CPU floor {floor:.2f} s; "
            f"on {world} dedicated cores (simulated) {statistics.median(alone[v]):.2f} s"
        )
        print(f"       FLOPs per stage     {'  '.join(f'{x:5.1%}' for x in shares[v][0])}")
        print(f"       CPU time per rank   {'  '.join(f'{x / sum(cpu):5.1%}' for x in cpu)}")
        print(f"       idle per rank       {'  '.join(f'{x:5.1%}' for x in idle)}")

    def ratios(t: dict[str, list[float]]) -> str:
        paired = statistics.median(a / e for a, e in zip(t["auto"], t["equal"], strict=True))
        return (
            f"{statistics.median(t['auto']) / statistics.median(t['equal']):.3f} (medians), "
            f"{paired:.3f} (median of each round's ratio), {min(t['auto']) / min(t['equal']):.3f} (fastest)"
        )

    print(f"\nauto / equal step time, measured: {ratios(wall)}; goal: at most 0.85")
    print(f"auto / equal on {world} dedicated cores, simulated from each action's CPU time: {ratios(alone)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
