"""Pipeline cuts: stages balanced by FLOPs (`compiler/stages.py`) vs equal layer counts, step time.

    python bench/pp_cuts.py [--ranks 4] [--microbatches 4] [--seq 128] [--steps 4] [--warmup 1] [--quick]

Model: the example Llama in fp32 with a 32k vocabulary, which makes the ends heavy (the
embedding on the first stage, the LM head and the loss on the last): 8 layers, H=1024,
I=2752, heads 16/8, V=32000 (157M parameters); microbatches of B=1, T=128; p=4 gloo ranks
with 1 intra-op thread each, 1F1B over m=4 microbatches. Two cuts of the same compiled graph:

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
time over 2 cores (printed as "CPU floor"), the same for both cuts; so the ratio here
understates what 4 devices would show, more so with more microbatches (the 1F1B steady state
keeps every stage busy, and the step nears the floor). Hence m=4 by default, the least 1F1B
runs p=4 with; `--microbatches 8` shows the floor taking over. `--ranks 2` runs p=2 on one
core each instead. Any other load on the machine slows the ranks unevenly: read the numbers
from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from pp_common import (
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


Measured = dict[str, list[tuple[float, float, float]]]  # variant -> per step: (seconds, CPU seconds, idle)
Stages = dict[str, tuple[list[float], str]]  # variant -> (each stage's share of the FLOPs, the cuts)


def worker(rank: int, world: int, opts: argparse.Namespace) -> tuple[Measured, Stages]:
    """This rank's measured steps, and the stages of each variant (the same on every rank)."""
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
        runs[variant] = (step, torch.optim.AdamW(params, lr=1e-4))
    out: Measured = {v: [] for v in VARIANTS}
    for i in range(opts.warmup + opts.steps):
        micro = microbatches(compiled, probe, batch=BATCH, seq=opts.seq, m=opts.microbatches, seed=i)
        for variant, (step, optimizer) in runs.items():
            dist.barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)
            step.run(micro)
            optimizer.step()
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            if i >= opts.warmup:
                out[variant].append((elapsed, cpu, step.idle))
    return out, shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=4)
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

    params = sum(p.numel() for p in build(**MODEL).parameters())
    print(
        f"Llama fp32, {MODEL['num_hidden_layers']} layers, H={MODEL['hidden_size']}, "
        f"V={MODEL['vocab_size']} ({params / 1e6:.0f}M params); microbatch B={BATCH} T={opts.seq}; "
        f"p={world} gloo ranks on {os.cpu_count()} cores, {opts.schedule}, m={opts.microbatches}; "
        f"zero_grad + pipeline + AdamW; {opts.steps} steps after {opts.warmup} warm-up"
    )
    print(f"1-min load average {load_before:.2f} before, {load_after:.2f} after\n")
    medians, fastest = {}, {}
    cores = os.cpu_count() or 1
    for variant in VARIANTS:
        per_step = [max(r[variant][k][0] for r in results) for k in range(opts.steps)]  # the slowest rank
        medians[variant], fastest[variant] = statistics.median(per_step), min(per_step)
        cpu = [statistics.fmean(s[1] for s in results[r][variant]) for r in range(world)]
        idle = [statistics.fmean(s[2] for s in results[r][variant]) for r in range(world)]
        floor = statistics.median(sum(r[variant][k][1] for r in results) for k in range(opts.steps))
        print(
            f"{variant:<6} cuts before {shares[variant][1]}: step median {medians[variant]:.2f} s, "
            f"fastest {fastest[variant]:.2f} s; CPU floor {floor / cores:.2f} s"
        )
        print(f"       FLOPs per stage     {'  '.join(f'{x:5.1%}' for x in shares[variant][0])}")
        print(f"       CPU time per rank   {'  '.join(f'{x / sum(cpu):5.1%}' for x in cpu)}")
        print(f"       idle per rank       {'  '.join(f'{x:5.1%}' for x in idle)}")
    print(
        f"\nauto / equal step time: {medians['auto'] / medians['equal']:.3f} (medians), "
        f"{fastest['auto'] / fastest['equal']:.3f} (fastest steps); goal: at most 0.85"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
