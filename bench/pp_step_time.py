"""Pipeline step time: meshplan's `PipelineStep` vs `torch.distributed.pipelining`, same stages, same schedule.

    python bench/pp_step_time.py [--microbatches 8] [--steps 8] [--warmup 2] [--quick]

Model: the example Llama in fp32, 8 layers, H=256, I=688, V=256, heads 8/4; microbatches of
B=2, T=128; p=2 gloo ranks with 1 intra-op thread each, m=8 microbatches per step. The compiled
graph is cut once, balanced by FLOPs (`compiler/stages.py`), and both runtimes run those same
stage programs (each on its own copy of the weights, same seed), under the same schedule:

    meshplan gpipe / 1f1b   `runtime.pipeline.PipelineStep` with `schedules.build("gpipe" | "1f1b")`
    torch gpipe / 1f1b      `PipelineStage` (static shapes given, so no shape inference at run
                            time) + `ScheduleGPipe` / `Schedule1F1B`, driven by hand: rank 0
                            steps with the token ids, the last rank with `losses`

A stage program takes the microbatch's inputs (token ids, labels) and what it receives; PyTorch
gives a stage only what it receives (the first stage the token ids), so each stage module there
takes its microbatch's inputs from a feeder, in the order the schedule runs forwards (0..m-1 under
both schedules). Both divide each microbatch's loss by m (PyTorch: in `loss_fn`, with
`scale_grads=False`), so gradients and losses are the same arithmetic; the losses printed must
agree. A step is zero_grad, forward and backward over the m microbatches, AdamW (lr 1e-4). Every
variant runs in the same two processes, one step each per round, each started by a barrier; a
step's time is the slower rank's; the median over the measured steps is printed, and the ratios
meshplan / torch at the same schedule (below 1.0: meshplan is faster): of the medians, the
median of each round's ratio (two steps run back to back, so a slow minute of the machine hits
both), and of the fastest steps. "CPU ms" is the CPU time both ranks used for the step
(`time.process_time`, summed; gloo's receives block without spinning): the runtimes' own cost,
whatever the machine's other load does to the wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from pp_common import built_schedules, compile_llama, microbatches, new_step, rank_stages
from torch import fx, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from meshplan.compiler.lower import build_rank_program
from meshplan.compiler.stages import balanced_cuts, cut_stages
from meshplan.examples.models.llama import Llama, build
from meshplan.runtime.launch import spawn
from meshplan.runtime.schedules import Schedule

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
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Fed(nn.Module):
    """A meshplan stage program as a `PipelineStage` calls its module: with only what the stage
    receives. The microbatch's own inputs (token ids, labels), which every meshplan stage is
    given, come from `feed` in the order the forwards run. The last stage returns its loss / m."""

    def __init__(self, program: fx.GraphModule, *, first: bool, last: bool, m: int) -> None:
        super().__init__()
        self.program, self.first, self.last, self.m = program, first, last, m
        self.feed: list[tuple[torch.Tensor, ...]] = []
        self.next = 0

    def forward(self, *received: torch.Tensor):
        inputs = self.feed[self.next % self.m]
        self.next += 1
        if self.first:  # PyTorch hands the first stage the microbatch's token ids
            assert torch.equal(received[0], inputs[0])
            received = ()
        out = self.program(*inputs, *received)
        return out[0] / self.m if self.last else out


def torch_variant(
    compiled, model: Llama, rank: int, schedule: Schedule, name: str, m: int, example: list
) -> tuple[Callable[[list, torch.Tensor, torch.Tensor], float], list[nn.Parameter]]:
    """A step function (microbatches, whole-batch ids, labels) -> loss on the last rank, and
    the parameters it trains."""
    (stage_program,) = rank_stages(compiled, model, rank, schedule, _cuts(compiled, model)).values()
    module = Fed(stage_program, first=rank == 0, last=rank == WORLD - 1, m=m)
    received, sent = example[rank]
    stage = PipelineStage(
        module,
        stage_index=rank,
        num_stages=WORLD,
        device=torch.device("cpu"),
        input_args=received,
        output_args=sent,
    )
    pipe = TORCH_SCHEDULES[name](stage, n_microbatches=m, loss_fn=lambda out, _: out, scale_grads=False)

    def step(micro: list, ids: torch.Tensor, labels: torch.Tensor) -> float:
        module.feed, module.next = micro, 0
        if rank == 0:
            pipe.step(ids)
            return 0.0
        losses: list[torch.Tensor] = []
        pipe.step(target=labels, losses=losses, return_outputs=False)
        return float(sum(loss.detach() for loss in losses))

    return step, list(module.parameters())


def meshplan_variant(
    compiled, model: Llama, rank: int, schedule: Schedule
) -> tuple[Callable[[list, torch.Tensor, torch.Tensor], float], list[nn.Parameter]]:
    stages = rank_stages(compiled, model, rank, schedule, _cuts(compiled, model))
    pipeline = new_step(stages, schedule, rank, WORLD)

    def step(micro: list, ids: torch.Tensor, labels: torch.Tensor) -> float:
        return float(pipeline.run(micro))

    return step, [p for stage in stages.values() for p in stage.parameters()]


def _cuts(compiled, model: Llama):
    return balanced_cuts(compiled.graph, model, WORLD)


def examples(compiled, model: Llama, micro: tuple) -> list[tuple[tuple, tuple]]:
    """Per stage: what it receives and what it returns for one microbatch (the static shapes
    `PipelineStage` is given), from the whole chain run once without gradients."""
    stages = cut_stages(compiled.graph, _cuts(compiled, model))
    programs = stages.programs(build_rank_program(compiled, model, 0))
    out, values = [], ()
    with torch.no_grad():
        for s, program in enumerate(programs):
            received = (micro[0],) if s == 0 else values
            values = program(*micro, *values)
            out.append((received, (values[0],) if s == stages.count - 1 else tuple(values)))
    # made without gradients, but they carry them in training: PipelineStage reads requires_grad
    # from these to decide which gradients cross the stage boundary
    for received, sent in out:
        for t in (*received, *sent):
            if t.is_floating_point():
                t.requires_grad_()
    return out


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict[str, list[tuple[float, float, float]]]:
    """{variant: [(seconds, loss on the last rank, CPU seconds) per measured step]} on this rank."""
    compiled = compile_llama(world, batch=BATCH, seq=SEQ, **MODEL)
    schedules = built_schedules(world, opts.microbatches, tuple(TORCH_SCHEDULES))
    probe = build(**MODEL)
    example = examples(compiled, probe, microbatches(compiled, probe, batch=BATCH, seq=SEQ, m=1, seed=0)[0])
    variants = {}
    for name, schedule in schedules.items():
        for runtime in ("meshplan", "torch"):
            model = build(**MODEL)
            if runtime == "meshplan":
                step, params = meshplan_variant(compiled, model, rank, schedule)
            else:
                step, params = torch_variant(
                    compiled, model, rank, schedule, name, opts.microbatches, example
                )
            variants[f"{runtime} {name}"] = (step, torch.optim.AdamW(params, lr=1e-4), model)
    out: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    for i in range(opts.warmup + opts.steps):
        for name, (step, optimizer, model) in variants.items():
            micro = microbatches(compiled, model, batch=BATCH, seq=SEQ, m=opts.microbatches, seed=i)
            ids, labels = (torch.cat([mb[j] for mb in micro]) for j in range(2))
            dist.barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)
            loss = step(micro, ids, labels)
            optimizer.step()
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            if i >= opts.warmup:
                out[name].append((elapsed, loss, cpu))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="3 steps after 1 warm-up")
    opts = parser.parse_args()
    if opts.quick:
        opts.steps, opts.warmup = 3, 1
    load_before = os.getloadavg()[0]
    results = spawn(worker, WORLD, (opts,), timeout_s=900)
    load_after = os.getloadavg()[0]

    print(
        f"Llama fp32, {MODEL['num_hidden_layers']} layers, H={MODEL['hidden_size']}, V={MODEL['vocab_size']}; "
        f"microbatch B={BATCH} T={SEQ}; p={WORLD} gloo ranks (1 thread each), m={opts.microbatches}; "
        f"zero_grad + pipeline + AdamW; {opts.steps} steps after {opts.warmup} warm-up"
    )
    print(f"{os.cpu_count()} cores, 1-min load average {load_before:.2f} before, {load_after:.2f} after\n")
    print(f"{'variant':<16}{'median ms':>10}{'min ms':>9}{'max ms':>9}{'CPU ms':>9}   last loss")
    medians, fastest, cpu = {}, {}, {}
    for name in results[0]:
        per_step = [max(r[name][k][0] for r in results) for k in range(opts.steps)]  # the slower rank
        medians[name], fastest[name] = statistics.median(per_step), min(per_step)
        cpu[name] = statistics.median(sum(r[name][k][2] for r in results) for k in range(opts.steps))
        losses = [results[-1][name][k][1] for k in range(opts.steps)]
        print(
            f"{name:<16}{medians[name] * 1e3:>10.1f}{fastest[name] * 1e3:>9.1f}"
            f"{max(per_step) * 1e3:>9.1f}{cpu[name] * 1e3:>9.1f}   {losses[-1]:.6f}"
        )
    print()
    for schedule in TORCH_SCHEDULES:
        ours, theirs = f"meshplan {schedule}", f"torch {schedule}"
        if ours not in medians:
            continue
        gap = max(abs(a[1] - b[1]) for a, b in zip(results[-1][ours], results[-1][theirs], strict=True))
        paired = statistics.median(
            max(r[ours][k][0] for r in results) / max(r[theirs][k][0] for r in results)
            for k in range(opts.steps)
        )
        print(
            f"{schedule}: meshplan / torch.distributed.pipelining {medians[ours] / medians[theirs]:.3f} "
            f"(medians), {paired:.3f} (median of each round's ratio), "
            f"{fastest[ours] / fastest[theirs]:.3f} (fastest steps); CPU time {cpu[ours] / cpu[theirs]:.3f}; "
            f"largest loss difference {gap:.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
