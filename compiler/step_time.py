"""`meshplan estimate`'s step time: the compiled program's ops and collectives priced against a
hardware entry (`compiler/hardware.py`), the data-parallel engine's collectives from the
ledger, the pipeline's bubble from its schedule simulated at those costs.

    costs = OpCosts(hw)                         # an observer of the liveness walk
    walk_stages(stages, inputs, observer=costs) # prices every op each stage runs
    t = rank_time(costs, ...)                   # one rank's step: compute, exposed comm, idle

What is assumed (and said in the report):

- An op costs `op_overhead` plus the larger of its FLOPs at its dtype's matmul rate (attention
  kernels at `attention` of it) and the bytes it reads and writes at the memory bandwidth (a
  roofline; FLOPs from PyTorch's own formulas, `torch.utils.flop_counter`, for matmuls,
  convolutions and attention). On a CPU, the bandwidth of ops within cache is what a
  transformer block's norms, activations and softmaxes reach (`fit_block`), not a copy's.
- A collective costs a ring's steps at its op's latency and its bytes at the link's bandwidth
  (`collective_time`); sends issued back to back are one batch (`batch_isend_irecv`, a ring
  attention step's keys and values) and pay one latency. A collective the program issues
  inline (tensor, sequence, context, expert parallelism) is waited for where it is issued.
  ZeRO-3's gathers (the ledger's) are prefetched: they can hide behind the phase's compute,
  all but the first. The engine's gradient reductions
  (buckets, flats) can overlap the last microbatch's backward, all but the last; ZeRO-1/2's
  parameter all-gathers after the step can overlap the next forward. How much of what can
  hide does is the hardware's `overlap` (a GPU's collectives run beside its compute: 1; gloo
  on a CPU whose cores the ranks already use: what `--calibrate` measures).
- The optimizer step reads and writes each local parameter's state once: the parameter, its
  gradient, an fp32 master under mixed precision, and the plan's optimizer's own state (AdamW's
  two moments, one for Lion and SGD with momentum; Adafactor a few passes over the parameter's
  size), plus a cost per tensor.
- A pipeline's forward and backward actions cost their stage's priced forward and backward
  (a split backward half each, but its checkpointed regions' recomputation, which runs in both
  halves), plus the send of what the next stage receives.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.flop_counter as flop_counter
from torch import Tensor
from torch.utils._pytree import tree_leaves

from meshplan.dsl.optimizer import OptimizerSpec

from .hardware import Hardware, Link

# c10d's ops as the dispatcher sees them (`dist.all_reduce` and friends), by what goes on the wire
_WIRE = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "send": "send",
    "recv_": "recv",
    "broadcast_": "broadcast",
    "barrier": "barrier",
}


def collective_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """A ring algorithm's time for `op` over `n` ranks moving `nbytes` (the full tensor: what an
    all-reduce reduces, what an all-gather gathers)."""
    if n <= 1 and op not in ("send",):
        return 0.0
    if op == "all_reduce":
        steps, moved = 2 * (n - 1), 2 * (n - 1) / n * nbytes
    elif op in ("all_gather", "reduce_scatter", "all_to_all"):
        steps, moved = n - 1, (n - 1) / n * nbytes
    elif op == "broadcast":
        steps, moved = n - 1, nbytes
    elif op == "barrier":
        steps, moved = n - 1, 0.0
    else:  # a point-to-point send
        return (link.latency if link.send_latency is None else link.send_latency) + nbytes / link.bandwidth
    return steps * link.step_latency(op) + moved / link.bandwidth


def _sdpa_cpu(query, key, value, *args, out_val=None, **kwargs) -> float:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> float:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _grouped_mm(a, b, *args, out_val=None, **kwargs) -> float:
    """`torch._grouped_mm(x (M, K), w (G, K, N), offs)`: every row through one expert's matrix."""
    return 2.0 * a.shape[0] * a.shape[-1] * b.shape[-1] if a.dim() == 2 and b.dim() == 3 else 0.0


# formulas PyTorch's flop counter does not carry: its CPU attention kernels, grouped GEMMs
_EXTRA_FLOPS: dict[str, Callable[..., float]] = {
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_cpu,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_cpu_backward,
    "_grouped_mm": _grouped_mm,
}


@dataclass
class PhaseCost:
    """One stage's forward or backward on one microbatch, priced."""

    compute: float = 0.0  # s of ops
    ops: int = 0
    flops: float = 0.0
    ideal: float = 0.0  # s the FLOPs take at the matmul peak of their dtype
    bytes: float = 0.0
    inline: float = 0.0  # s of collectives waited for where they are issued
    prefetched: float = 0.0  # s of ZeRO-3 gathers issued ahead of their unit
    gathers: int = 0
    issued: dict[str, float] = field(default_factory=dict)  # s of collectives per op, for the report
    recomputed: float = 0.0  # s of `compute`: a backward's recomputation of checkpointed forwards

    def half(self, overlap: float) -> float:
        """One half of a backward split into input and weight gradients: half the rest each,
        and the recomputation whole in both (torch's checkpoint recomputes once per backward
        pass, and the halves are two)."""
        return (self.time(overlap) - self.recomputed) / 2 + self.recomputed

    def exposed(self, overlap: float) -> float:
        """The collectives' time this phase waits for: inline ones whole; prefetched gathers
        all but the first hidden behind the phase's compute (as far as `overlap` lets them)."""
        if not self.gathers:
            return self.inline
        return self.inline + exposed(self.prefetched, self.prefetched / self.gathers, self.compute, overlap)

    def time(self, overlap: float) -> float:
        return self.compute + self.exposed(overlap)


def exposed(total: float, first: float, compute: float, overlap: float) -> float:
    """What a rank waits for of `total` seconds of collectives issued ahead of `compute` seconds
    of work: all but `first` can hide behind the work, the `overlap` fraction of it does."""
    return total - overlap * min(max(total - first, 0.0), compute)


class OpCosts:
    """An observer of the liveness walk (`LiveBytes`): prices each op of the stage and phase
    `begin` named last."""

    def __init__(self, hw: Hardware, world: int = 1) -> None:
        self.hw = hw
        self.world = world  # ranks on the machine: a CPU's cores may be shared
        self.slowdown = shared_cores(hw, world)  # every op takes this much longer
        self.phases: dict[tuple[int, str], PhaseCost] = {}
        self._current = PhaseCost()
        self._kinds: dict[Any, tuple[str, Any]] = {}  # per op: ("view" | "op" | a wire op, flop formula)
        self._attention: set[Any] = set()  # attention kernels: at `hw.attention` of the matmul rate
        self.record: list[tuple[float, float]] | None = None  # a list: each op's FLOP seconds and bytes
        self._sending = False  # the last thing seen was a send: the next one joins its batch
        self._backward = False  # the phase `begin` named last is a backward

    def begin(self, stage: int, phase: str) -> None:
        self._current = self.phases.setdefault((stage, phase), PhaseCost())
        self._backward = phase == "backward"

    def phase(self, stage: int, phase: str) -> PhaseCost:
        return self.phases.get((stage, phase), PhaseCost())

    def __call__(self, func, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any, where: str) -> None:
        kind, formula = self._kind(func)
        cost = self._current
        # autograd runs a backward's formulas without grad mode: an op with it, inside the engine
        # (not the loss's seed gradient, made before it starts), is a checkpoint's recomputation
        recomputing = self._backward and torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
        if kind == "view":
            cost.ops += 1
            cost.compute += self.hw.op_overhead * self.slowdown
            cost.recomputed += self.hw.op_overhead * self.slowdown if recomputing else 0.0
            return
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if kind != "op":
            self._collective(kind, args, tensors, where)
            return
        self._sending = False
        nbytes = sum(_nbytes(t) for t in tensors)
        nbytes += sum(_nbytes(t) for t in tree_leaves(out) if isinstance(t, Tensor))
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        rate = self.hw.flops_of(dtype)
        cost.ops += 1
        cost.flops += flops
        cost.ideal += flops / rate
        cost.bytes += nbytes
        if func in self._attention:
            rate *= self.hw.attention
        if self.record is not None:
            self.record.append((flops / rate, nbytes))
        spent = self.hw.op_overhead + max(flops / rate, nbytes / self.hw.bandwidth(nbytes))
        cost.compute += spent * self.slowdown
        cost.recomputed += spent * self.slowdown if recomputing else 0.0

    def _kind(self, func) -> tuple[str, Any]:
        known = self._kinds.get(func)
        if known is None:
            name = func._schema.name.split("::")[-1]
            if func.namespace == "c10d":
                known = (_WIRE.get(name, "view"), None)  # waits and such: no time of their own
            elif all(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
                known = ("view", None)
            else:
                formula = flop_counter.flop_registry.get(func._overloadpacket) or _EXTRA_FLOPS.get(name)
                known = ("op", formula)
                if "attention" in name:
                    self._attention.add(func)
            self._kinds[func] = known
        return known

    def _collective(self, op: str, args: Sequence[Any], tensors: list[Tensor], where: str) -> None:
        if op == "recv":  # the other half of a send issued beside it (a ring's exchange): priced there
            return
        group = _group_ranks(args)
        n = len(group) if group else 1
        nbytes = max(
            (sum(_nbytes(t) for t in tree_leaves(a) if isinstance(t, Tensor)) for a in args), default=0
        )
        link = self.link(group)
        if op == "send" and self._sending:  # one batch (`batch_isend_irecv`): its latency paid once
            link = dataclasses.replace(link, send_latency=0.0)
        self._sending = op == "send"
        spent = collective_time(op, nbytes, n, link) * woken(self.hw, self.world, n)
        cost = self._current
        cost.issued[op] = cost.issued.get(op, 0.0) + spent
        if "zero" in where.lower() and op == "all_gather":
            cost.prefetched += spent
            cost.gathers += 1
        else:
            cost.inline += spent

    def link(self, ranks: Sequence[int]) -> Link:
        per_node = self.hw.devices_per_node
        return self.hw.intra if len({r // per_node for r in ranks}) <= 1 else self.hw.inter


def shared_cores(hw: Hardware, world: int) -> float:
    """How much longer each op takes on a CPU whose cores the ranks share: more ranks than
    cores take turns; up to one a core, they crowd each other (`Hardware.crowding`, measured
    with every core busy) in proportion to how many cores they fill."""
    if not hw.cores or world <= 1:
        return 1.0
    busy = min(world, hw.cores)
    crowd = 1.0 + (hw.crowding - 1.0) * (busy - 1) / max(hw.cores - 1, 1)
    return crowd * max(1.0, world / hw.cores)


def crowding(hw: Hardware, world: int, pipeline_ranks: int) -> Callable[[int], float]:
    """How much longer a pipeline's action takes while `n` of its ranks compute at once
    (`schedules.simulate(crowded=)`): each with its replicas over the other axes, sharing the
    cores as `shared_cores` says."""
    replicas = max(world // pipeline_ranks, 1)
    return lambda running: shared_cores(hw, running * replicas)


def woken(hw: Hardware, world: int, group: int) -> float:
    """How much longer a collective over `group` of `world` ranks takes on a CPU whose cores
    the ranks share. Its ranks wait in it, their cores free; when it spans every rank, its
    data wakes them onto idle cores (a data-parallel all-reduce of all ranks: its measured
    time, `bench/step_time_accuracy.py`'s 4-rank cells). When ranks outside it compute
    meanwhile (a tensor-parallel pair beside another stage's, a data-parallel pair beside the
    other pipeline stage's), a woken rank takes its turn on the cores as their ops do."""
    return 1.0 if group >= world else shared_cores(hw, world)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _group_ranks(args: Sequence[Any]) -> list[int]:
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return list(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
    return []


# ------------------------------------------------------------------------------------ a rank


@dataclass(frozen=True)
class StepTime:
    """One rank's optimizer step, in seconds."""

    total: float
    compute: float  # forward and backward ops, every microbatch
    communication: float  # collectives waited for (exposed), every kind
    optimizer: float
    idle: float  # a pipeline rank waiting for its neighbours
    issued: dict[str, float]  # s of every collective issued, by op, exposed or not
    flops: float  # this rank's FLOPs a step, recomputation included
    ideal: float = 0.0  # s those FLOPs take at the matmul peak of their dtype

    @property
    def utilization(self) -> float:
        """The share of the step the device would need at its peak: FLOP utilization."""
        return self.ideal / self.total if self.total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "compute": self.compute,
            "communication": self.communication,
            "optimizer": self.optimizer,
            "idle": self.idle,
            "issued": dict(self.issued),
            "flops": self.flops,
            "flop_utilization": self.utilization,
        }


@dataclass(frozen=True)
class EngineCost:
    """The data-parallel engine's part of a step, for one rank."""

    backward: float  # gradient reductions issued during the last backward
    last: float  # the last of them (nothing left to hide behind)
    after_step: float  # parameter all-gathers after the step (ZeRO-1/2), hidden by the next forward
    step: float  # small all-reduces the step waits for (gradient norm, loss)
    optimizer: float
    gathers: dict[str, tuple[float, int]] = field(default_factory=dict)  # ZeRO-3, per phase: s, how many


def engine_cost(
    rows: Sequence[Any],
    *,
    hw: Hardware,
    link_of: Callable[[str], Link],
    held: float,
    optimizer_bytes: float,
    optimizer_tensors: int,
    host_bandwidth: float | None,
    world: int = 1,
) -> EngineCost:
    """Prices the ledger's data-parallel rows (`rows`: dp_bucket, zero_bucket, zero_norm and
    ZeRO-3's reduce-scatters; `held`: the share of them this rank issues, under a pipeline its
    stages' share) and the optimizer step over `optimizer_bytes` of state."""
    backward = last = after = step = 0.0
    gathers: dict[str, tuple[float, int]] = {}
    for r in rows:
        t = collective_time(r.op, r.bytes, r.group_size, link_of(r.axis)) * woken(hw, world, r.group_size)
        if r.kind == "zero_gather" and r.op == "all_gather":
            spent, count = gathers.get(r.phase, (0.0, 0))
            gathers[r.phase] = (spent + t * r.count * held, count + r.count)
        elif r.phase == "backward":
            backward += t * r.count * held
            last = max(last, t)
        elif r.kind == "zero_norm":
            step += t * r.count
        else:
            after += t * r.count * held
    bandwidth = host_bandwidth or hw.memory_bandwidth
    optimizer = (
        optimizer_bytes / bandwidth + optimizer_tensors * hw.optimizer_tensor + hw.step_overhead
    ) * shared_cores(hw, world)
    return EngineCost(backward, min(last, backward), after, step, optimizer, gathers)


def rank_time(
    costs: OpCosts,
    stages: Sequence[int],
    *,
    engine: EngineCost,
    accumulation: int,
    timeline: Any = None,
    position: int = 0,
    data_link: Link | None = None,
) -> StepTime:
    """One rank's step: its stages' forward and backward (under a pipeline, the schedule's
    simulated makespan at these costs, `timeline`), then the engine's exposed collectives and
    the optimizer step."""
    forward = [costs.phase(s, "forward") for s in stages]
    backward = [costs.phase(s, "backward") for s in stages]
    overlap = costs.hw.overlap
    compute_once = sum(p.compute for p in forward + backward)
    exposed_once = sum(p.exposed(overlap) for p in forward + backward)
    flops = sum(p.flops for p in forward + backward)
    ideal = sum(p.ideal for p in forward + backward)
    issued: dict[str, float] = {}
    for p in forward + backward:
        for op, t in p.issued.items():
            issued[op] = issued.get(op, 0.0) + t
    if timeline is not None:
        micro = timeline.schedule.microbatches
        busy = timeline.busy[position]
        idle = timeline.makespan - busy
        # its actions' time, in the share of compute and waited-for collectives they were priced at
        compute = busy * compute_once / max(compute_once + exposed_once, 1e-30)
        inline = busy - compute
        flops *= micro
        ideal *= micro
        issued = {op: t * micro for op, t in issued.items()}
        last_backward = sum(p.compute for p in backward)
        forward_compute = sum(p.compute for p in forward) * micro
    else:
        idle = 0.0
        compute = compute_once * accumulation
        inline = exposed_once * accumulation
        flops *= accumulation
        ideal *= accumulation
        issued = {op: t * accumulation for op, t in issued.items()}
        last_backward = sum(p.compute for p in backward)
        forward_compute = sum(p.compute for p in forward)
    reductions = exposed(engine.backward, engine.last, last_backward, overlap)
    after = exposed(engine.after_step, 0.0, forward_compute, overlap)
    gathered = 0.0  # ZeRO-3's prefetched gathers: the first of each phase waited for
    for phase, (spent, count) in engine.gathers.items():
        compute_phase = sum(p.compute for p in (forward if phase == "forward" else backward))
        rounds = timeline.schedule.microbatches if timeline is not None else accumulation
        gathered += exposed(spent, spent / max(count, 1), compute_phase * rounds, overlap)
    communication = inline + reductions + after + engine.step + gathered
    dp = engine.backward + engine.after_step + engine.step + sum(t for t, _ in engine.gathers.values())
    if dp:
        issued["data parallel"] = issued.get("data parallel", 0.0) + dp
    total = compute + communication + engine.optimizer + idle
    return StepTime(total, compute, communication, engine.optimizer, idle, issued, flops, ideal)


def pipeline_timeline(
    schedule: Any, costs: OpCosts, received: Sequence[int], link: Link, replicas: int = 1
) -> Any:
    """The schedule simulated with each action at its stage's priced time (a split backward's
    halves half each, a checkpoint's recomputation in both: `PhaseCost.half`) and each message between ranks a send's time in flight: a forward's
    outputs reach the next stage's forward, a backward's input gradients the previous
    stage's backward (`received[s]`: the bytes stage s receives). A message waits the link's
    hand-off (`Link.for_pipelines`): the measured hand-off is a wake of the receiving process
    already, and one pipeline's 4 ranks on 2 cores measure no slower a message than 2
    (`bench/step_time_accuracy.py`'s pp4). `replicas` pipelines that run apart until the
    step's end (data-parallel replicas) on more ranks than cores wait the shared hand-off
    instead (`pipelines_share_cores`): a woken rank waits for a core another pipeline holds.

    Ranks that share a CPU's cores crowd each other only while they compute: a stage waiting in
    the schedule's bubble leaves its core to the others. The actions are simulated at their
    time alone, each slowed by the ranks computing beside it (`shared_cores` of them: the
    pipeline ranks running an action, each with its replicas over the other axes)."""
    from meshplan.runtime.schedules import simulate

    hw = costs.hw
    link = link.for_pipelines(shared=pipelines_share_cores(hw, costs.world, replicas))
    alone = costs.slowdown  # the phases' prices assume every rank computing at once

    def cost(action) -> float:
        phase = costs.phase(action.stage, "forward" if action.kind == "F" else "backward")
        return (phase.time(hw.overlap) if action.kind in ("F", "B") else phase.half(hw.overlap)) / alone

    def handoff(action) -> float:
        nbytes = received[action.stage + 1] if action.kind == "F" else received[action.stage]
        return collective_time("send", nbytes, 2, link)

    return simulate(schedule, cost, handoff, crowding(hw, costs.world, schedule.ranks))


def pipelines_share_cores(hw: Hardware, world: int, replicas: int) -> bool:
    """Whether `replicas` pipelines that run apart (data-parallel replicas) share a CPU's cores
    with each other: more ranks than cores. Their messages then wait the measured shared
    hand-off (`Link.shared_handoff`)."""
    return bool(hw.cores) and replicas > 1 and world > (hw.cores or 0)


# passes over a parameter-sized tensor an Adafactor step makes beyond reading the gradient and
# reading and writing the parameter: the squared gradient, the update written and read back, the
# parameter's and the update's RMS (its factored moments are rows + cols: nothing beside these)
ADAFACTOR_PASSES = 4


def optimizer_state_bytes(
    params: Mapping[str, Tensor],
    *,
    zero: int,
    group_size: Callable[[str], int],
    spec: OptimizerSpec | None = None,
) -> tuple[float, int]:
    """Bytes the optimizer step reads and writes on this rank and the tensors it steps: it reads
    the gradient and reads and writes the parameter (or fp32 master: a 16-bit parameter is also
    written back from it), and reads and writes each fp32 moment an elementwise optimizer keeps
    (AdamW two, Lion and SGD with momentum one; `spec` None: AdamW); Adafactor makes
    `ADAFACTOR_PASSES` more passes instead."""
    from .optimizer_state import moments

    spec = spec or OptimizerSpec()
    total, tensors = 0.0, 0
    for name, p in params.items():
        if not p.requires_grad:
            continue
        numel = math.ceil(p.numel() / (group_size(name) if zero else 1))
        size = p.element_size()
        master = 4 * numel * 2 if p.dtype != torch.float32 else 0  # read and write the fp32 copy
        state = ADAFACTOR_PASSES * size * numel if spec.kind == "adafactor" else moments(spec) * 2 * 4 * numel
        total += numel * size * 3 + master + state  # grad r, param r/w; the optimizer's own
        tensors += 1
    return total, tensors


# ------------------------------------------------------------------------------ calibration


def fit_block(hw: Hardware, device: torch.device, rounds: int = 3) -> tuple[Hardware, dict[str, str]]:
    """`hw` (as `hardware.calibrate` measured it) with two rates a transformer block's ops reach
    on this device, one thread: attention's share of the matmul rate (a causal attention forward
    and backward, timed), and the bandwidth of the ops within cache, solved so that the block's
    forward and backward priced as `OpCosts` prices them take as long as they do. A copy's
    bandwidth flatters norms, softmaxes and activations: they compute per element. Each rate
    the median of `rounds` fits (a shared machine has slow seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fits = [_fit_block(hw, device) for _ in range(rounds)]
    finally:
        torch.set_num_threads(threads)
    attention = statistics.median(f.attention for f in fits)
    hw = dataclasses.replace(
        hw, attention=attention, cache_bandwidth=statistics.median(f.cache_bandwidth for f in fits)
    )
    said = {
        "attention": f"{attention:.0%} of the matmul rate",
        "block ops": f"{hw.cache_bandwidth / 1e9:.1f} GB/s within cache (a transformer block's, fitted)",
    }
    return hw, said


def _fit_block(hw: Hardware, device: torch.device) -> Hardware:
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from .hardware import _Block, _timed

    q, k, v = (torch.randn(4, 4, 64, 16, device=device, requires_grad=True) for _ in range(3))

    def attend() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    class Priced(TorchDispatchMode):
        def __init__(self, costs: OpCosts) -> None:
            super().__init__()
            self.costs = costs

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.costs(func, args, kwargs or {}, out, "")
            return out

    def priced(fn, at: Hardware) -> tuple[OpCosts, list[tuple[float, float]]]:
        costs = OpCosts(at)
        record: list[tuple[float, float]] = []
        costs.record = record
        with Priced(costs):
            fn()
        return costs, record

    # attention: what its kernels' FLOPs take beyond the other ops of the step (at the matmul rate)
    costs, record = priced(attend, dataclasses.replace(hw, attention=1.0))
    kernels = sum(t for t, _ in record if t > 0)
    rest = costs._current.compute - kernels
    attention = min(max(kernels / max(_timed(attend, device=device) - rest, 1e-9), 0.05), 1.0)
    hw = dataclasses.replace(hw, attention=attention)

    model = torch.nn.Sequential(*[_Block(64) for _ in range(4)]).to(device)
    x = torch.randn(4, 64, 64, device=device)

    def step() -> None:
        model(x).sum().backward()

    costs, record = priced(step, hw)
    real = _timed(step, device=device)
    ops = costs._current.ops

    def predicted(bandwidth: float) -> float:  # `OpCosts`'s sum, at this bandwidth within cache
        within = dataclasses.replace(hw, cache_bandwidth=bandwidth)
        return ops * hw.op_overhead + sum(max(t, b / within.bandwidth(b)) for t, b in record)

    low, high = 1e8, max(hw.cache_bandwidth, hw.memory_bandwidth)  # bytes/s: slow, a copy's
    if predicted(high) < real:
        for _ in range(60):  # the predicted time falls as the bandwidth grows
            mid = (low * high) ** 0.5
            low, high = (mid, high) if predicted(mid) > real else (low, mid)
        hw = dataclasses.replace(hw, cache_bandwidth=high)
    return hw
