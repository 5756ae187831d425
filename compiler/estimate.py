"""`meshplan estimate`: what each rank will hold, before anything runs, from the compiled program.

    est = estimate(compiled, model, args, kwargs, limit=80 * 2**30)
    est.ranks[r].peak, est.fits, est.classes()       # bytes per rank; ranks that hold the same

Two halves, both read off the program every rank runs rather than a formula per model:

- **Training state** (`engine_state.state_of`): each rank's parameters at their local shapes (the placements
  `build_rank_program` cuts by; under a pipeline only the stages the schedule gives the rank),
  then the engine the plan asks for (`cli/session/sync.py`'s choice) laid out as it lays them
  out: whole parameters, gradients and the plan's optimizer's state (`optimizer_state.py`) without
  ZeRO; under ZeRO the flats of `runtime/buckets.py` (stages 1/2: gradient buckets; stage 3:
  the program's gather units), padded to the data group, each rank holding its shard of what
  the stage shards, fp32 masters where the shard is not fp32 or the optimizer is offloaded.
  Offloaded state is counted on the host (`host`), not in the device's total; offloaded to disk
  (`optimizer:disk`, `params:disk`), in files (`disk`), the host holding the few flats (and
  units' parameter shards) a step has in memory.
- **A step** (`walk`): the rank program run forward and backward on the meta device under a
  fake process group (no weights, no data), a dispatch mode adding up the storages the ops
  create while they live: the activations kept for backward (live when the forward ends),
  and the peak, with the op where it occurs. Under a pipeline every stage is run in turn on a
  microbatch, its received values fed from the stage before, and a rank's activations are its
  stages' times the microbatches its schedule keeps in flight.

Communication buffers are what neither half holds: ZeRO-3's gathered units (the current one
and the prefetched next, in the dtype they are gathered in) and a pipeline stage's receive
buffers (one microbatch of what each of its stages receives). Under ZeRO-3 the walk counts the
engine's buffers itself, when the engine makes and frees them (`liveness.ZeroWalk`): the peak
is where the activations still held meet the units gathered and the gradient flats in flight.
The peak is at least the whole training state (the optimizer step); on a CPU, "offloaded"
state is in the same memory and counts in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from meshplan.dsl.axes import axes_of
from meshplan.runtime.buckets import bucket_params, by_program, decays, read_by_several
from meshplan.runtime.experts import meta_routing
from meshplan.runtime.mesh import MeshLayout
from meshplan.runtime.zero_nodes import graph_units

from .engine_state import nbytes, state_of
from .errors import CompileError
from .hardware import Hardware
from .liveness import ZeroSteps
from .optimizer_state import describe
from .passes.experts.capacity import capacity_factor
from .placement import Placement, Shard
from .step_time import (
    OpCosts,
    PhaseCost,
    StepTime,
    collective_time,
    engine_cost,
    optimizer_state_bytes,
    pipeline_timeline,
    rank_time,
    woken,
)


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes: device-resident unless said. `peak` includes everything else."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int  # kept for backward at the schedule's most microbatches in flight
    buffers: int  # communication: ZeRO-3 gathered units, pipeline receives
    peak: int  # most live tensor bytes over a step (state + buffers + the walk's peak)
    peak_op: str  # where the peak occurs
    host: int = 0  # offloaded to CPU memory (optimizer state, ZeRO-3 parameter shards)
    disk: int = 0  # `offload = optimizer:disk`, `params:disk`: the state and shards in this rank's files
    model_buffers: int = 0  # the model's own buffers (rotary tables, masks)
    stages: tuple[int, ...] = ()  # under a pipeline, the stages this rank runs
    time: StepTime | None = None  # the step, priced against `Estimate.hardware`

    @property
    def state(self) -> int:
        """Training state, device and host: what `meshplan run` reports as `state_bytes`."""
        return self.params + self.grads + self.optimizer + self.host

    def key(self) -> tuple:
        """What makes two ranks the same class (all but the rank)."""
        return (self.params, self.grads, self.optimizer, self.activations, self.buffers, self.peak)

    def parts(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
        }


@dataclass(frozen=True)
class Estimate:
    ranks: list[RankMemory]
    assumptions: dict[str, Any]
    limit: int | None = None  # --memory, bytes
    hardware: Hardware | None = None

    @property
    def step_time(self) -> float | None:
        """The job's step: its slowest rank's (every rank waits for the others at the step's end)."""
        times = [r.time.total for r in self.ranks if r.time is not None]
        return max(times) if times else None

    def fits_rank(self, r: RankMemory) -> bool | None:
        return None if self.limit is None else r.peak <= self.limit

    @property
    def fits(self) -> bool:
        return all(self.fits_rank(r) is not False for r in self.ranks)

    def classes(self) -> list[tuple[list[int], RankMemory]]:
        """Ranks that hold the same bytes, once each, with their ranks, in rank order."""
        by_key: dict[tuple, tuple[list[int], RankMemory]] = {}
        for r in self.ranks:
            by_key.setdefault(r.key(), ([], r))[0].append(r.rank)
        return list(by_key.values())

    def to_json(self) -> dict[str, Any]:
        ranks = []
        for r in self.ranks:
            entry: dict[str, Any] = {"rank": r.rank, **r.parts(), "peak": r.peak, "peak_op": r.peak_op}
            entry.update({"host": r.host, "disk": r.disk, "state": r.state, "model_buffers": r.model_buffers})
            entry["stages"] = list(r.stages)
            entry["fits"] = self.fits_rank(r)
            entry["time"] = r.time.to_json() if r.time is not None else None
            ranks.append(entry)
        out = {"ranks": ranks, "fits": self.fits, "limit": self.limit, "step_time_s": self.step_time}
        out["hardware"] = self.hardware.to_json() if self.hardware is not None else None
        return {**out, "assumptions": self.assumptions}


# ------------------------------------------------------------------------------------ state


def local_params(
    program: fx.GraphModule,
    model: nn.Module,
    placements: dict[str, dict[str, Placement]],
    layout: MeshLayout,
    held: Iterable[str] | None = None,
) -> dict[str, Tensor]:
    """This rank's parameters (a tied one once, by its first name in the program) as meta
    tensors of their local shapes; `held`: only those names (a pipeline rank's)."""
    full = dict(model.named_parameters(remove_duplicate=False))
    keep = set(held) if held is not None else None
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for node in program.graph.nodes:
        name = str(node.target)
        if node.op != "get_attr" or name not in full or id(full[name]) in seen:
            continue
        if keep is not None and name not in keep:
            continue
        seen.add(id(full[name]))
        shape = list(full[name].shape)
        for axis, p in placements.get(name, {}).items():
            if isinstance(p, Shard):
                shape[p.dim] = p.chunk(shape[p.dim], layout.size(axis))
        t = torch.empty(shape, dtype=full[name].dtype, device="meta")
        out[name] = nn.Parameter(t, requires_grad=full[name].requires_grad)
    return out


def zero_units(program: fx.GraphModule, axis: str | None = None):
    """ZeRO-3's units of `program` in order: (unit, its parameters, the dtype each is gathered in)."""
    out = []
    for gather, _ in graph_units(program, axis):
        out.append((gather.unit, gather.params, gather.dtypes))
    return out


# ------------------------------------------------------------------------------------ driver


def estimate(
    compiled, *, limit: int | None = None, hw: Hardware | None = None, routing: str = "balanced"
) -> Estimate:
    """Every rank's bytes for `compiled` (a `compile.Compiled` whose model was built on the meta
    device or not: nothing is initialized), at the shape it was compiled for, and with `hw`
    each rank's step time on that hardware. `routing`: how dropless experts route the walk's
    tokens ("balanced", or "worst": the most rows on one rank; `runtime.experts.meta_routing`).

    Builds rank programs on a fake process group of the plan's world size, so it must run in a
    process with no process group of its own."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplan.runtime.mesh import init_mesh

    from .capture import bind_inputs
    from .liveness import in_flight, kept_around_first_backward, walk_stages
    from .lower import build_rank_program, place, placed_names, shared_cast_stages, stage_names
    from .stages import compiled_cuts, cut_stages

    plan, layout, source = compiled.plan, compiled.layout, compiled.source
    assert source is not None, "a fresh compile keeps its model and inputs"
    model = source.model
    if dist.is_initialized():
        raise RuntimeError("estimate builds rank programs on a fake process group of its own")
    if hw is not None and hw.cores:  # a CPU entry prices a run on this one machine
        hw = dataclasses.replace(hw, devices_per_node=layout.world_size)
    costs = OpCosts(hw, layout.world_size) if hw is not None else None
    group_of = functools.lru_cache(maxsize=None)(functools.partial(_group, layout))
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:" to every traceback
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        mesh = init_mesh(layout) if layout.names else None
        program = place(build_rank_program(compiled, model, 0, mesh, keep=frozenset()), "meta")
        inputs = [
            x.to("meta") if isinstance(x, Tensor) else x
            for x in bind_inputs(model, compiled.graph, source.args, source.kwargs)
        ]
        spec = plan.pipeline
        schedule = None
        if spec is not None:
            from meshplan.runtime.schedules import build

            micro = spec.microbatches or layout.size(spec.axis)
            schedule = build(spec.schedule, layout.size(spec.axis), micro, spec.virtual_stages)
            cut = cut_stages(compiled.graph, compiled_cuts(compiled.graph, compiled.stage_cuts))
            stages = cut.programs(program, share_casts=shared_cast_stages(schedule))
        else:
            stages = [program]
        engine, zero, group_size = _engine(plan, layout, compiled)
        # ZeRO's gathers and gradient flats are counted in the walk, as the engine makes them
        steps = _zero_steps(program, stages, plan, layout, engine, zero)
        free = (zero == 2 and steps is None) or engine in ("data parallel", "per-axes data parallel")
        backwards = plan.train.gradient_accumulation * (schedule.microbatches if schedule is not None else 1)
        # without a data-parallel engine, each parameter's gradient is whole in `.grad` from the
        # step's first backward to its optimizer step
        grads_held = engine == "none" and backwards > 1
        # under ZeRO too: a pipeline's earlier microbatches run backward under `no_sync`
        accumulated = (zero >= 1 and backwards > 1) or grads_held
        if accumulated:  # the walk is a later backward: gradients add into the whole ones held
            for p in program.parameters():  # (`State.accumulating`, `grads_held`): not counted
                p.grad = torch.zeros_like(p) if p.requires_grad else None
        with meta_routing(routing), _reads_no_data():  # experts route meta tokens as a step does
            walks = walk_stages(stages, inputs, _free_grad if free else None, costs, zero=steps)
        for p in program.parameters():
            p.grad = None
        if costs is not None and hw is not None and hw.selective_op:
            _price_selective(costs, stages, hw)
        timeline = None
        if costs is not None and schedule is not None:
            link = costs.link(group_of(spec.axis))
            received = [w.received for w in walks]
            timeline = pipeline_timeline(
                schedule, costs, received, link, _replicas_apart(plan, layout, spec.axis)
            )
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook

    dp = plan.data_parallel
    units = zero_units(compiled.graph) if zero == 3 else []
    on_host = hw is not None and hw.cores is not None  # the ranks run on CPUs
    by_position: dict[int, RankMemory] = {}
    ranks = []
    whole = {n: p.shape for n, p in model.named_parameters()}
    for rank in range(layout.world_size):
        position = layout.coords(rank)[spec.axis] if spec is not None else 0
        if position not in by_position:
            mine = [s for s in range(len(stages)) if schedule is None or schedule.owner[s] == position]
            held = (
                stage_names(compiled, rank, axis=spec.axis, schedule=schedule) if spec and schedule else None
            )
            params = local_params(compiled.graph, model, compiled.param_placements, layout, held)
            # a device rule's (`on cpu`): their state is on the host, ZeRO-2 at most (`session.sync`)
            on_cpu = {
                n: params.pop(n)
                for n, d in placed_names(compiled.graph).items()
                if d == "cpu" and n in params
            }
            st = state_of(
                params,
                zero=zero,
                group_size=group_size,
                engine=engine,
                bucket_bytes=dp.bucket_bytes if dp is not None else 25_000_000,
                offload_optimizer=bool(dp and dp.offload_optimizer and zero > 0),
                offload_params=bool(dp and dp.offload_params and zero == 3),
                on_disk=bool(dp and dp.optimizer_on_disk and zero > 0),
                params_on_disk=bool(dp and dp.params_on_disk and zero == 3),
                on_host=on_host,
                accumulation=backwards,
                bucketed=lambda n: group_size(n) > 1 or _summed(compiled.grad_sums.get(n, ()), layout),
                units=[u for u in units if held is None or set(u[1]) <= held],
                optimizer=plan.train.optimizer,
                compress=(dp.compress.method, dp.compress.rank) if dp is not None and dp.compress else None,
                compressed=_compressed(plan, layout, compiled, engine, group_size),
                replicated=bool(dp and zero and any(layout.size(a) > 1 for a in dp.replicated_over)),
                whole=whole,
                programs=_programs(program, [stages[s] for s in mine]) if len(mine) > 1 else None,
            )
            if on_cpu:
                kept = state_of(
                    on_cpu,
                    zero=min(zero, 2),
                    group_size=group_size,
                    engine=engine,
                    bucket_bytes=dp.bucket_bytes if dp is not None else 25_000_000,
                    optimizer=plan.train.optimizer,
                    whole=whole,
                )
                st.host += kept.params + kept.grads + kept.optimizer
            flight = {s: in_flight(schedule, s) if schedule is not None else 1 for s in mine}
            if schedule is None:
                activations = sum(walks[s].saved for s in mine)
                with_grads, first_backward = activations, 0
            else:  # the most the rank's actions keep at once, its stages' microbatches together
                saved = {s: walks[s].saved for s in mine}
                # a split backward's gradients kept from I to W (none where the stage's inputs
                # need none: the first stage's I is nothing, its W the whole backward)
                joins = {s: walks[s].joins if s > 0 else 0 for s in mine}
                casts = {s: walks[s].shared for s in mine}  # the weights' casts, once a step
                before, after = kept_around_first_backward(schedule, position, saved, joins, casts)
                activations = max(before, after)
                # with `grads_held`, the step's gradients are whole from its first backward on:
                # kept beside what is kept after it, and made in it (GPipe's peak: every
                # microbatch kept, no gradient yet)
                with_grads, first_backward = (after, before) if grads_held else (activations, 0)
                if grads_held:
                    first_backward += max(walks[s].first_backward_peak - walks[s].saved for s in mine)
            receive = sum(walks[s].received * flight[s] for s in mine) if schedule is not None else 0
            # the engine's buffers of the rank's other stages: in `State.accumulating` already
            # where the gradients are held whole between microbatches (a flat or a shard of
            # them replaces them, no larger)
            others = () if accumulated else mine
            extra = max(mine, key=lambda s: _beyond_saved(walks, s, others))
            transient = _beyond_saved(walks, extra, others)
            buffers = st.gathered + st.reducing + st.accumulating + receive
            walked = (st.gathered + st.reducing) if steps is not None else 0  # in the walk's peak already
            model_buffers = _buffer_bytes(stages, mine)
            time = None
            if costs is not None:
                share = _share(params, model) if held is not None else 1.0
                opt_bytes, tensors = optimizer_state_bytes(
                    params, zero=zero, group_size=group_size, spec=compiled.plan.train.optimizer
                )
                offload = bool(dp and dp.offload_optimizer and zero > 0)
                price = engine_cost(
                    [r for r in compiled.ledger.rows if _engine_row(r)],
                    hw=costs.hw,
                    link_of=lambda axis: costs.link(group_of(*axis.split(" x "))),
                    held=share,
                    optimizer_bytes=opt_bytes,
                    optimizer_tensors=st.flats if zero else tensors,
                    host_bandwidth=HOST_BANDWIDTH if offload else None,
                    world=layout.world_size,
                )
                waits = sum(
                    collective_time("all_reduce", 8, layout.size(axis), costs.link(group_of(axis)))
                    * woken(costs.hw, layout.world_size, layout.size(axis))
                    for axis in _loop_reductions(compiled, params)
                )
                price = dataclasses.replace(price, step=price.step + waits)
                time = rank_time(
                    costs,
                    mine,
                    engine=price,
                    accumulation=plan.train.gradient_accumulation,
                    timeline=timeline,
                    position=position,
                )
            start = st.params + st.optimizer + st.grads_between_steps + model_buffers
            shared = st.host if on_host else 0  # a CPU's "offloaded" state shares its memory
            by_position[position] = RankMemory(
                rank,
                st.params,
                st.grads,
                st.optimizer,
                activations,
                buffers,
                # the step's peak: in forward or backward, or at the optimizer step (every
                # gradient reduced, ZeRO's shards included: the training state whole)
                max(
                    start
                    + buffers
                    - walked
                    + with_grads
                    + max(transient, 0)
                    + (st.grads if grads_held else 0),
                    start + buffers - walked + first_backward,
                    st.params + st.grads + st.optimizer + model_buffers,
                )
                + shared,
                walks[extra].peak_at,
                host=st.host,
                disk=st.disk,
                model_buffers=model_buffers,
                stages=tuple(mine) if schedule is not None else (),
                time=time,
            )
        ranks.append(_with_rank(by_position[position], rank))
    assumptions = {
        "batch": _batch_shape(inputs),
        "world_size": layout.world_size,
        "mesh": {a: layout.size(a) for a in layout.names},
        "engine": engine,
        "zero": zero,
        "optimizer": describe(plan.train.optimizer),
        "microbatches": schedule.microbatches if schedule is not None else 1,
        "schedule": spec.schedule if spec is not None else None,
        "activations": "measured by running each rank's program forward and backward on meta tensors",
        "zero3_gathered": "reported: the two largest consecutive units (current and prefetched); in the "
        "peak: the engine's gathers, prefetches, frees and gradient flats counted in the walk, in its order",
        "zero_reduction": "one flat's whole gradient in flight (ZeRO-3: a unit's gradients and their flat); "
        "under gradient accumulation, ZeRO-2/3 keep every flat's whole gradient between micro-steps",
        "not_counted": "allocator fragmentation and caching, kernel workspaces, the CUDA context",
    }
    if experts := plan.rules_of("experts"):
        capped = [r for r in experts if capacity_factor(r) is not None]
        said = []
        if len(capped) < len(experts):
            said.append(
                "dropless routing priced balanced: N k / E pairs per expert, as many received as sent"
                if routing == "balanced"
                else "dropless routing at its worst: every pair a rank sends lands on this rank's experts"
            )
        if capped:
            said.append(
                "capacity_factor: E C rows per rank dispatched and combined whatever the routing, "
                "the kept pairs assumed to fill them in order (experts sharing tokens: each rank its share of C)"
            )
        assumptions["experts"] = "; ".join(said)
    if costs is not None:
        priced = dict(STEP_TIME_ASSUMPTIONS, hardware=costs.hw.source)
        if dp and dp.offload_optimizer and dp.zero:
            priced["offload"] = f"the optimizer steps in host memory at {HOST_BANDWIDTH / 1e9:.0f} GB/s"
        assumptions["step_time"] = priced
    return Estimate(ranks, assumptions, limit, hw)


HOST_BANDWIDTH = 20e9  # bytes/s: an offloaded optimizer steps in host memory

STEP_TIME_ASSUMPTIONS = {
    "ops": "op overhead + max(FLOPs / matmul rate of the dtype, bytes read and written / memory bandwidth)",
    "inline_collectives": "tensor, sequence, context and expert collectives waited for where issued",
    "zero3_gathers": "prefetched: all but the first hidden behind the phase's compute",
    "gradient_reductions": "overlap the last backward, all but the last bucket or flat",
    "pipeline": "the schedule simulated at each stage's priced forward and backward, each message "
    "between ranks a send's time late to its receiver (the sender goes on: sends are asynchronous; "
    "`--calibrate` measures a CPU's through the pipeline)",
    "attention": "attention kernels at the hardware's `attention` share of the matmul rate "
    "(datasheet entries: all of it; `--calibrate` measures a CPU's)",
    "loop": "the training loop's own cost per step and per parameter, and its all-reduces of the "
    "loss over the batch axes and of the gradient norm over the axes that cut parameters",
    "shared_cores": "a CPU's ranks beyond its cores take turns: every op, and every collective "
    "other ranks compute beside, that much longer (a collective of every rank: not); a pipeline's "
    "stages only while they compute (in the schedule's bubble, fewer ranks share the cores); a "
    "pipeline's data-parallel replicas sharing them wait the hand-off `--calibrate` measures for "
    "two pipelines on two cores",
}


def _price_selective(costs: OpCosts, stages: list, hw: Hardware) -> None:
    """Selective checkpointing's own cost: its policy sees each op of a selective region in
    the forward and again in backward's recomputation (`Hardware.selective_op` a time)."""
    from .passes.checkpoint import selective_ops

    for s, stage in enumerate(stages):
        spent = selective_ops(stage) * hw.selective_op * costs.slowdown
        for phase in ("forward", "backward"):
            cost = costs.phases.setdefault((s, phase), PhaseCost())
            cost.compute += spent


def _engine_row(row) -> bool:
    """A ledger row the data-parallel engine issues (ZeRO-3's gathers and reductions included:
    the walk's program runs without them)."""
    return row.kind in ("dp_bucket", "zero_bucket", "zero_norm", "zero_gather")


def _loop_reductions(compiled, params: Mapping[str, Tensor]) -> list[str]:
    """The axes of the float64 scalars the training loop all-reduces each step, beside the
    engine's (`runtime.train`): the loss's mean over the batch axes, and the gradient norm's
    squares summed over each axis that cuts some of this rank's parameters and over the
    pipeline's (each stage's parameters are other ranks')."""
    layout = compiled.layout
    plan = compiled.plan
    axes = [a for a in plan.batch_axes if layout.size(a) > 1]
    cut_by = {
        tuple(a for a, p in compiled.param_placements.get(name, {}).items() if isinstance(p, Shard))
        for name in params
    }
    for over in sorted(cut_by):
        axes += [a for a in over if layout.size(a) > 1]
    if plan.pipeline is not None and layout.size(plan.pipeline.axis) > 1:
        axes.append(plan.pipeline.axis)
    return axes


def _summed(axes: Sequence[str], layout: MeshLayout) -> bool:
    """A gradient summed over `axes` (`Compiled.grad_sums`) is reduced: some axis has ranks."""
    return any(layout.size(a) > 1 for a in axes)


def _group(layout: MeshLayout, *axes: str) -> list[int]:
    """Rank 0's group over `axes` (an empty or unknown axis: rank 0 alone)."""
    axes = tuple(a for a in axes if a in layout.names)
    home = layout.coords(0)
    return [
        r
        for r in range(layout.world_size)
        if all(c == home[a] for a, c in layout.coords(r).items() if a not in axes)
    ]


def _share(params: dict[str, Tensor], model: nn.Module) -> float:
    """The share of the model's parameter bytes `params` holds (a pipeline rank's stages)."""
    total = sum(nbytes(p) for p in model.parameters())
    return sum(nbytes(p) for p in params.values()) / total if total else 1.0


def _free_grad(p: nn.Parameter) -> None:
    """The engine takes a gradient into its bucket or shard as soon as backward makes it."""
    p.grad = None


def _with_rank(r: RankMemory, rank: int) -> RankMemory:
    import dataclasses

    return r if r.rank == rank else dataclasses.replace(r, rank=rank)


def _buffer_bytes(stages: Sequence[fx.GraphModule], mine: Sequence[int]) -> int:
    seen: set[int] = set()
    total = 0
    for s in mine:
        for b in stages[s].buffers():
            if id(b) not in seen:
                seen.add(id(b))
                total += nbytes(b)
    return total


def _batch_shape(inputs: Sequence[Any]) -> list[list[int]]:
    return [list(x.shape) for x in inputs if isinstance(x, Tensor)]


@contextlib.contextmanager
def _reads_no_data() -> Iterator[None]:
    """The walk runs on the meta device: model code that reads a tensor's values (`.item()`,
    `.tolist()`, a branch on one) outside an `experts` rule cannot run there. Said as the
    user's mistake it is, at the model's line."""
    try:
        yield
    except RuntimeError as e:
        if "meta tensor" not in str(e) and "data-dependent" not in str(e):
            raise
        # the model's line: the last frame of the failing node's own traceback, which fx adds to
        # the error (the model's code as it was captured)
        mine = [(f, int(n), code) for f, n, code in _ORIGINAL.findall(str(e))]
        where = f"{mine[-1][0]}:{mine[-1][1]}: " if mine else ""
        code = mine[-1][2].split("  #")[0].strip() if mine else ""  # without its comment
        line = f" (`{code}`)" if code else ""
        raise CompileError(
            f"{where}the model reads a tensor's values{line}, which the estimate of memory and step "
            "time cannot: it runs the program on shapes alone (hint: a routing step belongs under "
            "an `experts` rule, whose routing meshplan prices itself)"
        ) from None


_ORIGINAL = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def _programs(program: nn.Module, stages: Sequence[nn.Module]) -> dict[str, int | None]:
    """Each parameter's program among a pipeline rank's `stages` (the first that reads it), None
    for one several read: as `runtime.zero` splits its flats."""
    aliases = dict(program.named_parameters(remove_duplicate=False))
    named = list(aliases.items())
    several = read_by_several(named, stages, aliases)
    return {
        n: None if n in several else k
        for k, part in enumerate(by_program(named, stages, aliases))
        for n, _ in part
    }


def _beyond_saved(walks, s: int, mine: Sequence[int]) -> int:
    """Stage `s`'s peak over its activations: in backward, with the engine's buffers for the
    rank's other stages in `mine` (their gradients, made before), which the walk counts with
    their own stages only."""
    others = sum(b for t, b in enumerate(walks[s].engine_held) if t in mine and t != s)
    return max(walks[s].forward_peak, walks[s].backward_peak + others) - walks[s].saved


def _zero_steps(
    program: nn.Module, stages: Sequence[nn.Module], plan, layout: MeshLayout, engine: str, zero: int
) -> ZeroSteps | None:
    """What the walk emulates of the ZeRO engine: stage 3's units (any engine), or the flats of
    stages 1/2 as the single-axis engine buckets them (per stage program: `runtime.zero`'s);
    None where the walk adds no engine."""

    copies = plan.data_parallel.replicated_over if plan.data_parallel is not None else ()

    def group(axis: str) -> int:  # under HSDP a group's state is cut over its axes but the copies'
        return math.prod(layout.size(a) for a in axes_of(axis) if a not in copies)

    dp = plan.data_parallel
    # `compress = bf16`'s buffers beside each reduction (HSDP's across the copies too)
    bf16 = dp is not None and dp.compress is not None and dp.compress.method == "bf16"
    across = bf16 and any(layout.size(a) > 1 for a in copies)
    if zero == 3:
        return ZeroSteps(3, group, bf16=bf16, across=across)
    if zero not in (1, 2) or engine != "zero":
        return None
    named = [(n, p) for n, p in program.named_parameters() if p.requires_grad]
    aliases = dict(program.named_parameters(remove_duplicate=False))
    decayed = {id(p): decays(n, p) for n, p in named}
    parts = by_program(named, stages, aliases)  # per stage, then what none reads (no gradient)
    flats = [
        (min(k, len(stages) - 1), names)
        for k, part in enumerate(parts)
        for names, _ in bucket_params(part, dp.bucket_bytes, decayed)
    ]
    return ZeroSteps(zero, group, dp.axis, flats, bf16=bf16, across=across)


def _replicas_apart(plan, layout: MeshLayout, pipeline_axis: str) -> int:
    """How many copies of the pipeline run apart until the step's end: the ranks over the axes
    no rule's collectives tie together within a step (data parallelism's; a tensor, sequence,
    context or expert rule's axis exchanges every layer and keeps its ranks together)."""
    tied = {a for r in plan.rules if r.axis for a in axes_of(r.axis)} | {pipeline_axis}
    return axis_size(layout, (a for a in plan.mesh.names if a not in tied))


def _compressed(
    plan, layout: MeshLayout, compiled, engine: str, group_size: Callable[[str], int]
) -> Callable[[str], bool]:
    """Which parameters' reductions `compress` makes lossy: every one in the data-parallel and
    ZeRO engines; in the per-axes ones, those reduced over a data axis that does not shard them,
    by more than this rank (`runtime.expert_data_parallel`, `runtime.expert_zero`)."""
    dp = plan.data_parallel
    if dp is None or not engine.startswith("per-axes"):
        return lambda name: True

    def over_data(name: str) -> bool:
        cut = {a for a, p in compiled.param_placements.get(name, {}).items() if isinstance(p, Shard)}
        zero_alone = engine == "per-axes zero" and group_size(name) <= 1
        return not zero_alone and any(layout.size(a) > 1 and a not in cut for a in dp.axes)

    return over_data


def _engine(plan, layout: MeshLayout, compiled) -> tuple[str, int, Callable[[str], int]]:
    """The engine `cli/session/sync.py` picks (its name), its ZeRO stage and, per parameter, the
    ranks its ZeRO state is cut over."""
    dp = plan.data_parallel
    dp_axis = dp.axis if dp is not None and layout.size(dp.axis) > 1 else None
    experts = {x for r in plan.rules_of("experts") for x in axes_of(r.axis)}
    zero = dp.zero if dp is not None else 0
    copies = dp.replicated_over if dp is not None and zero else ()  # HSDP: the state copied over these
    if experts or compiled.grad_sums:
        data = tuple(a for a in plan.batch_axes if a not in copies)

        def per_axes(name: str) -> int:
            cut = {a for a, p in compiled.param_placements.get(name, {}).items() if isinstance(p, Shard)}
            return axis_size(layout, (a for a in data if a not in cut))

        return ("per-axes zero" if zero else "per-axes data parallel"), zero, per_axes
    if dp_axis is None:
        return "none", 0, lambda name: 1
    size = layout.size(dp.sharded_over if zero else dp_axis)
    return ("zero" if zero else "data parallel"), zero, lambda name: size


def axis_size(layout: MeshLayout, axes: Iterable[str]) -> int:
    out = 1
    for a in axes:
        out *= layout.size(a)
    return out
