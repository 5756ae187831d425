"""What a pipeline's message from one rank to the next costs as `meshplan run` sends it: the
time between the sender's action ending and the receiver's action that needs it starting,
beyond the schedule's own waits. `meshplan estimate --calibrate` measures it here, through
the pipeline itself (`pipeline.PipelineStep`, gloo, two processes), so the estimate's
simulated schedule (`schedules.simulate(handoff=)`) carries what a run meets: the message's
header and tags, gloo's rendezvous between the two processes' threads, the waking of a rank
blocked in its receive.

    latency = measure()          # seconds a hand-off adds

Two ranks run an interleaved schedule (two chunks a rank, four microbatches: six hand-offs on
the way of each microbatch) over stages of a few matmuls. Each rank first times its stages'
forward and backward alone, then the pipeline's steps; the latency is the one at which the
schedule simulated at those action times takes as long as the measured step (the median of
rounds; 0 when the step is as fast as the simulation without it).
"""

from __future__ import annotations

import statistics
import time

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


def measure(rounds: int = 3) -> float:
    """Seconds a hand-off between two ranks adds to a pipeline's step on this machine."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="meshplan-handoff-") as folder:
        store = f"file://{folder}/store"  # a rendezvous through a file: no port to race for
        procs = [ctx.Process(target=_worker, args=(r, store, queue, rounds)) for r in range(2)]
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
    return fit(costs, steps)


def fit(costs: dict[tuple[str, int], float], steps: list[float]) -> float:
    """The hand-off latency at which the schedule simulated at `costs` (seconds per action kind
    and stage) takes the median of `steps`."""
    from .schedules import build, simulate

    schedule = build("interleaved", 2, MICROBATCHES, CHUNKS)
    step = statistics.median(steps)

    def makespan(latency: float) -> float:
        return simulate(schedule, lambda a: costs[(a.kind, a.stage)], lambda a: latency).makespan

    low, high = 0.0, step
    if makespan(low) >= step:
        return 0.0
    for _ in range(40):  # the makespan grows with the latency: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if makespan(mid) < step else (low, mid)
    return (low + high) / 2


def _worker(rank: int, store: str, queue, rounds: int) -> None:
    import torch.distributed as dist

    from .pipeline import PipelineStep
    from .schedules import build

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    try:
        schedule = build("interleaved", 2, MICROBATCHES, CHUNKS)
        last = schedule.stages - 1
        stages = {s: _Stage(s == last) for s in range(schedule.stages) if schedule.owner[s] == rank}
        micro = [(torch.randn(ROWS, WIDTH),) for _ in range(MICROBATCHES)]
        costs = {
            key: value for s, stage in stages.items() for key, value in _alone(s, stage, micro[0]).items()
        }
        step = PipelineStep(stages, schedule, rank=rank, ranks=[0, 1], group=None)
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
        every: list[dict] = [{}, {}]
        dist.all_gather_object(every, (costs, times))
        if rank == 0:
            merged = {**every[0][0], **every[1][0]}
            slowest = [max(a, b) for a, b in zip(every[0][1], every[1][1], strict=True)]
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
