"""What a pipeline's message from one rank to the next costs as `meshplan run` sends it: the
time between the sender's action ending and the receiver's action that needs it starting,
beyond the schedule's own waits. `meshplan estimate --calibrate` measures it here, through
the pipeline itself (`pipeline.PipelineStep`, gloo, two processes), so the estimate's
simulated schedule (`schedules.simulate(handoff=)`) carries what a run meets: the message's
header and tags, gloo's rendezvous between the two processes' threads, the waking of a rank
blocked in its receive.

    latency = measure()                                  # seconds a hand-off adds
    shared = measure(pipelines=2, crowded=slower)        # ... with another pipeline on its cores

Two ranks run an interleaved schedule (two chunks a rank, four microbatches: six hand-offs on
the way of each microbatch) over stages of a few matmuls. Each rank first times its stages'
forward and backward alone, then the pipeline's steps; the latency is the one at which the
schedule simulated at those action times takes as long as the measured step (the median of
rounds; 0 when the step is as fast as the simulation without it).

With `pipelines` > 1, that many such pipelines run at once, all their processes on two cores
(two ranks a core, as data-parallel replicas of a pipeline share a CPU that has fewer cores
than ranks): a woken rank then waits for a core another pipeline's rank holds, which one
pipeline's own ranks, whose turns the schedule orders, do not make it do. The simulation the
latency is fitted to slows the actions running at once by `crowded(n)` (n of one pipeline's
ranks computing, each beside its replicas), as the estimate's does.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

STEPS = 12
WIDTH, ROWS, DEPTH = 256, 16, 4  # an action of about a millisecond on one core
MICROBATCHES, CHUNKS = 4, 2


class _Stage(nn.Module):
    """A chunk of the pipeline: `DEPTH` square matmuls; the last stage's output is a loss."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5) for _ in range(DEPTH)
        )
        self.last = last

    def forward(self, x: Tensor, *received: Tensor):
        h = received[0] if received else x
        for w in self.weights:
            h = torch.tanh(h @ w)
        return h.square().mean() if self.last else (h,)


CORES = 2  # the cores `pipelines` > 1 share


def measure(rounds: int = 3, *, pipelines: int = 1, crowded: Callable[[int], float] | None = None) -> float:
    """Seconds a hand-off between two ranks adds to a pipeline's step on this machine; with
    `pipelines` > 1, while that many pipelines share two cores (see the module docstring: a
    machine that cannot pin processes to cores, or has one, cannot say; `can_share_cores`)."""
    import tempfile

    import torch.multiprocessing as mp

    if pipelines > 1 and not can_share_cores():
        raise RuntimeError("pipelines sharing two cores need two cores and a way to pin processes to them")
    cores = sorted(os.sched_getaffinity(0))[:CORES] if pipelines > 1 else None
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="meshplan-handoff-") as folder:
        store = f"file://{folder}/store"  # a rendezvous through a file: no port to race for
        procs = [
            ctx.Process(target=_worker, args=(r, 2 * pipelines, cores, store, queue, rounds))
            for r in range(2 * pipelines)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        for p in procs:
            p.kill()
        raise RuntimeError(
            f"the pipeline's hand-off was not measured (exit codes {[p.exitcode for p in procs]})"
        )
    costs, steps = queue.get()
    return fit(costs, steps, crowded)


def can_share_cores() -> bool:
    """Whether `measure(pipelines=2)` can put its processes on two cores here."""
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= CORES


def fit(
    costs: dict[tuple[str, int], float],
    steps: list[float],
    crowded: Callable[[int], float] | None = None,
) -> float:
    """The hand-off latency at which the schedule simulated at `costs` (seconds per action kind
    and stage; the actions running at once slowed by `crowded(n)`) takes the median of `steps`."""
    from .schedules import build, simulate

    schedule = build("interleaved", 2, MICROBATCHES, CHUNKS)
    step = statistics.median(steps)

    def makespan(latency: float) -> float:
        cost = lambda a: costs[(a.kind, a.stage)]  # noqa: E731
        return simulate(schedule, cost, lambda a: latency, crowded=crowded).makespan

    low, high = 0.0, step
    if makespan(low) >= step:
        return 0.0
    for _ in range(40):  # the makespan grows with the latency: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if makespan(mid) < step else (low, mid)
    return (low + high) / 2


def _worker(rank: int, world: int, cores: list[int] | None, store: str, queue, rounds: int) -> None:
    """Rank `rank` of `world` // 2 two-rank pipelines (ranks 2i and 2i + 1 the i-th), on
    `cores` if given."""
    import torch.distributed as dist

    from .pipeline import PipelineStep
    from .schedules import build

    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        # every rank makes every pipeline's group (`new_group` is collective); one pipeline alone: the world's
        groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)] if world > 2 else [None]
        position, first = rank % 2, rank - rank % 2
        schedule = build("interleaved", 2, MICROBATCHES, CHUNKS)
        last = schedule.stages - 1
        stages = {s: _Stage(s == last) for s in range(schedule.stages) if schedule.owner[s] == position}
        micro = [(torch.randn(ROWS, WIDTH),) for _ in range(MICROBATCHES)]
        costs = {
            key: value for s, stage in stages.items() for key, value in _alone(s, stage, micro[0]).items()
        }
        ranks = [first, first + 1]
        step = PipelineStep(stages, schedule, rank=position, ranks=ranks, group=groups[rank // 2])
        for _ in range(3):
            step.run(micro)
        times = []
        for _ in range(rounds * STEPS):
            dist.barrier()
            start = time.perf_counter()
            step.run(micro)
            times.append(time.perf_counter() - start)
            for stage in stages.values():
                stage.zero_grad(set_to_none=True)
        every: list[tuple] = [() for _ in range(world)]
        dist.all_gather_object(every, (costs, times))
        if rank == 0:  # the first pipeline's action times (each pipeline's alike), the slowest rank's steps
            merged = {**every[0][0], **every[1][0]}
            slowest = [max(column) for column in zip(*(times for _, times in every), strict=True)]
            queue.put((merged, slowest))
    finally:
        dist.destroy_process_group()


def _alone(s: int, stage: _Stage, inputs: tuple[Tensor, ...]) -> dict[tuple[str, int], float]:
    """A stage's forward and its backward, each timed alone (the median of a few)."""
    received = () if s == 0 else (torch.randn(ROWS, WIDTH, requires_grad=True),)
    forward, backward = [], []
    for _ in range(15):
        start = time.perf_counter()
        out = stage(*inputs, *received)
        middle = time.perf_counter()
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.ones_like(o) for o in outs]
        torch.autograd.backward(list(outs), grads)
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
        stage.zero_grad(set_to_none=True)
    return {("F", s): statistics.median(forward[5:]), ("B", s): statistics.median(backward[5:])}
