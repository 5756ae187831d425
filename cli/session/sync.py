"""Which gradient-sync engine a rank trains with, from the plan: none, data parallel (DDP-style
buckets), ZeRO 1/2/3, or their per-set-of-axes forms when expert parallelism or a weight whose
gradient is partial over a tensor or context axis makes parameters reduce over different axes.

    sync = gradient_sync(plan, program, rank_program, mesh, pipeline)
    sync.engine, sync.axes      # the `GradSync` (None: no data axis), the process groups by role
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, cast

from meshplan.dsl.axes import axes_of
from meshplan.errors import RunError

if TYPE_CHECKING:
    import torch
    from torch import fx, nn

    from meshplan.compiler.lower import Program
    from meshplan.dsl.check import Plan
    from meshplan.dsl.settings import DataParallelSpec
    from meshplan.runtime.axes import Axes
    from meshplan.runtime.compression import Compression
    from meshplan.runtime.data_parallel import DataParallel
    from meshplan.runtime.expert_data_parallel import ExpertDataParallel
    from meshplan.runtime.expert_zero import ExpertZero
    from meshplan.runtime.mesh import MeshLayout
    from meshplan.runtime.zero import Zero, ZeroOptions
    from meshplan.runtime.zero_grads import Replicas

    from .pipeline import PipelineRank, ZeroShards

    Engine: TypeAlias = DataParallel | ExpertDataParallel | Zero | ExpertZero


@dataclass(frozen=True)
class Sync:
    """A rank's gradient synchronization: its engine (None without a data axis) and its axes."""

    engine: Engine | None
    axes: Axes  # process groups by axis name, the data axes, each parameter's cuts
    experts: tuple[str, ...]  # the mesh axes experts rules split over


def gradient_sync(
    plan: Plan,
    program: Program,
    rank_program: fx.GraphModule,
    mesh,
    pipeline: PipelineRank | None,
    *,
    offload_dir: Path | None = None,
) -> Sync:
    """The engine and the axes of a rank that holds `rank_program`'s parameters (under a
    pipeline, its stages' parameters, which its stage programs run). `offload_dir`: where
    `offload = optimizer:disk` keeps the state and `params:disk` the parameter shards
    (`cli/options.offload_dir`)."""
    layout = program.layout
    dp_spec = plan.data_parallel
    dp_axis = dp_spec.axis if dp_spec is not None and layout.size(dp_spec.axis) > 1 else None
    experts_over = {x for r in plan.rules_of("experts") for x in axes_of(r.axis)}
    experts = tuple(a for a in layout.names if a in experts_over)
    engine: Engine | None = None
    host = _host_names(rank_program)
    on_disk = dp_spec is not None and (dp_spec.optimizer_on_disk or dp_spec.params_on_disk)
    if on_disk and (host or experts or program.grad_sums):
        # these build several ZeRO engines per rank, each of which would need files of its own
        why = (
            "`on cpu` rules"
            if host
            else "`experts` rules"
            if experts
            else "a weight whose gradient is partial"
        )
        assert dp_spec is not None
        target, what = ("optimizer", "the state") if dp_spec.optimizer_on_disk else ("params", "the shards")
        raise RunError(
            f"`offload = {target}:disk` composes with one ZeRO engine per rank only, not yet with {why} "
            f"(hint: use `offload = {target}` to keep {what} in host memory)"
        )
    if dp_axis is not None and dp_spec is not None and not experts and not program.grad_sums:
        from meshplan.runtime.mesh import axis_group

        dp_group = axis_group(mesh, dp_axis)
        if host:
            engine = _host_apart(rank_program, mesh, dp_spec, plan, host, layout)
        elif dp_spec.zero > 0:
            engine = shard_for_zero(rank_program, mesh, dp_spec, plan, pipeline, offload_dir)
        else:
            from meshplan.runtime.data_parallel import DataParallel

            engine = DataParallel(
                rank_program,
                dp_group,
                bucket_bytes=dp_spec.bucket_bytes,
                reduce_dtype=_reduce_dtype(plan),
                axis=dp_spec.axis,
                late=_late(rank_program, pipeline),
                compression=compression(dp_spec),
            )
    axes = rank_axes(program, mesh, data=dp_spec.axes if dp_spec is not None else ())
    if experts or program.grad_sums:
        # the expert axes split the batch too: data parallel for all but the experts; a weight
        # gradient partial over an axis is summed over it with the data axes' average
        axes = dataclasses.replace(axes, data=plan.batch_axes)
        engine = _per_axes(rank_program, axes, mesh, program, plan, pipeline)
    if pipeline is not None and engine is not None and dp_spec is not None and dp_spec.zero > 0:
        pipeline.zero = cast("ZeroShards", engine)  # a tied weight's gradient is summed piece by piece
    return Sync(engine, axes, experts)


def _host_names(rank_program: fx.GraphModule) -> frozenset[str]:
    """The trainable parameters a device rule holds on the host (`on cpu`)."""
    from meshplan.compiler.lower import placed_names

    trainable = {n for n, p in rank_program.named_parameters() if p.requires_grad}
    return frozenset(
        n for n, where in placed_names(rank_program).items() if where == "cpu" and n in trainable
    )


def _host_apart(
    rank_program: fx.GraphModule,
    mesh,
    dp_spec: DataParallelSpec,
    plan: Plan,
    host: frozenset[str],
    layout: MeshLayout,
) -> ExpertDataParallel | ExpertZero:
    """Data parallelism when a device rule holds some parameters on the host (`on cpu`): those
    are reduced apart, by an engine of their own over the same ranks, after the device's (what the
    compiler's ledger lists: `ledger.DataParallelFacts.host`). Without ZeRO, each engine's
    buckets; under ZeRO, the device's flats and units as the plan asks, the host's flats sharded
    at most as ZeRO-2 shards them (the ZeRO pass put no host parameter in a unit), on the host;
    under HSDP both cut over the same axes and copied over the same others.
    On a GPU the host engine reduces over gloo groups of the same ranks (`_host_group`): NCCL
    reduces device tensors only, and backward's hooks run on two threads there, so the two
    engines' collectives could interleave differently on two ranks of one group."""
    from meshplan.runtime.data_parallel import DataParallel, broadcast_parameters
    from meshplan.runtime.expert_data_parallel import ExpertDataParallel
    from meshplan.runtime.expert_zero import ExpertZero
    from meshplan.runtime.mesh import axis_group
    from meshplan.runtime.zero import Zero
    from meshplan.runtime.zero_grads import Replicas

    # in the order the graph reads them, as the ledger buckets them (a module's own order differs)
    by_name = dict(rank_program.named_parameters())
    reads = dict.fromkeys(str(n.target) for n in rank_program.graph.nodes if n.op == "get_attr")
    named = [(n, by_name[n]) for n in [*reads, *by_name] if n in by_name and by_name[n].requires_grad]
    named = list(dict(named).items())
    on_host = all(p.device.type == "cpu" for _, p in named)  # the whole rank on the host: its groups serve
    dp_group = axis_group(mesh, dp_spec.axis)
    if dp_spec.zero == 0:
        halves = [
            ([p for n, p in named if n not in host], dp_group),
            ([p for n, p in named if n in host], _host_group(dp_group, layout, dp_spec.axis, on_host)),
        ]
        return ExpertDataParallel(
            rank_program,
            [
                DataParallel(
                    rank_program,
                    group,
                    bucket_bytes=dp_spec.bucket_bytes,
                    reduce_dtype=_reduce_dtype(plan),
                    axis=dp_spec.axis,
                    params=params,
                )
                for params, group in halves
                if params
            ],
        )
    # ZeRO cuts the state over `sharded_over` (every data axis but HSDP's replicated ones); the
    # host's groups are made on every rank, whether or not it holds host parameters
    cut = dp_spec.sharded_over
    shard_group = _shard_group(mesh, dp_spec)
    copies = replicas(mesh, dp_spec.replicated_over)
    host_copies = copies and Replicas(_host_group(copies.group, layout, copies.axis, on_host), copies.axis)
    sides = [  # (on the host, its parameters, the group they start from, cut over, copied over)
        (False, [p for n, p in named if n not in host], dp_group, shard_group, copies),
        (
            True,
            [p for n, p in named if n in host],
            _host_group(dp_group, layout, dp_spec.axis, on_host),
            _host_group(shard_group, layout, cut, on_host),
            host_copies,
        ),
    ]
    options = _zero_options(dp_spec, plan)
    engines = []
    for host_side, params, every, group, side_replicas in sides:
        if not params:
            continue
        broadcast_parameters(params, every)  # every rank built the same seeded model: make it exact
        engines.append(
            Zero(
                rank_program,
                group,
                dataclasses.replace(options, stage=min(options.stage, 2)) if host_side else options,
                axis=cut,
                only=[n for n, p in named if any(p is q for q in params)],
                node_axis="(host)" if host_side else None,  # the ZeRO pass's nodes are the device's
                replicas=side_replicas,
            )
        )
    return ExpertZero(rank_program, engines)


def _host_group(
    group: torch.distributed.ProcessGroup,
    layout: MeshLayout,
    axis: str,
    on_host: bool,
) -> torch.distributed.ProcessGroup:
    """`group` (the ranks along `axis`) for the host parameters' engine: itself where the rank's
    program is on the host too (a CPU run), else a gloo group of the same ranks, made by every rank."""
    import torch.distributed as dist

    if on_host:
        return group
    groups = sorted({tuple(layout.group_ranks(axis, r)) for r in range(layout.world_size)})
    made, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups], backend="gloo")
    return made


def rank_axes(program: Program, mesh, data: tuple[str, ...] = ()) -> Axes:
    """The mesh as a rank of `program` trains on it: every axis's group, the data axes, each
    parameter's cuts and the axes its gradient is partial over."""
    from meshplan.compiler.placement import Shard
    from meshplan.runtime.axes import Axes
    from meshplan.runtime.shards import AxisCut, Cut

    layout = program.layout
    return Axes(
        groups={name: mesh.get_group(name) for name in layout.names if layout.size(name) > 1},
        data=data,
        sharding={
            name: tuple(
                AxisCut(axis, Cut(p.dim, p.blocks, p.padded))
                for axis, p in placement.items()
                if isinstance(p, Shard)
            )
            for name, placement in program.param_placements.items()
            if any(isinstance(p, Shard) for p in placement.values())
        },
        summed=program.grad_sums,
    )


def partial_grad_sync(
    program: Program, rank_program: nn.Module, mesh, data: tuple[str, ...] = ()
) -> ExpertDataParallel:
    """For code that runs a rank program itself (benchmarks, parity tests) rather than through
    `meshplan run`: the gradient sync of the weights whose gradients are partial over an axis
    (`Program.grad_sums`), summed over it in buckets; with `data`, every gradient also
    averaged over those axes (an expert's over those that do not hold other experts), as `run`
    does. Call `finish()` after backward."""
    from meshplan.runtime.expert_data_parallel import expert_data_parallel
    from meshplan.runtime.mesh import group_over

    layout = program.layout
    return expert_data_parallel(
        rank_program, rank_axes(program, mesh, data), lambda over: group_over(layout, over, mesh)
    )


def _per_axes(
    rank_program: fx.GraphModule,
    axes: Axes,
    mesh,
    program: Program,
    plan: Plan,
    pipeline: PipelineRank | None,
) -> ExpertDataParallel | ExpertZero:
    """Gradient averaging under expert parallelism (`runtime/experts.py`): each parameter over
    the data axes that do not shard it, in buckets of the plan's size; under ZeRO, each
    parameter's training state sharded over those axes (`runtime/expert_zero.py`). Under a
    pipeline `rank_program` holds the rank's parameters and its stage programs run them (as for
    `shard_for_zero`)."""
    from meshplan.runtime.expert_data_parallel import expert_data_parallel
    from meshplan.runtime.expert_zero import expert_zero
    from meshplan.runtime.mesh import group_over

    dp_spec = plan.data_parallel
    layout = program.layout
    groups = lambda over: group_over(layout, over, mesh)  # noqa: E731
    if dp_spec is not None and dp_spec.zero > 0:
        return expert_zero(
            rank_program,
            axes,
            groups,
            _zero_options(dp_spec, plan),
            programs=_stage_programs(pipeline),
            alone=sorted(pipeline.parts.tied) if pipeline is not None else [],
            replicated=dp_spec.replicated_over,
            compressed=dp_spec.axes,
        )
    return expert_data_parallel(
        rank_program,
        axes,
        groups,
        bucket_bytes=dp_spec.bucket_bytes if dp_spec is not None else 25_000_000,
        reduce_dtype=_reduce_dtype(plan),
        late=_late(rank_program, pipeline),
        compression=compression(dp_spec) if dp_spec is not None else None,
        compressed=dp_spec.axes if dp_spec is not None else (),
    )


def shard_for_zero(
    rank_program: fx.GraphModule,
    mesh,
    dp_spec: DataParallelSpec,
    plan: Plan,
    pipeline: PipelineRank | None,
    offload_dir: Path | None = None,
) -> Zero:
    """ZeRO over the data axes, from their first rank's initial params (HSDP, `zero = N over
    dp`: sharded over `dp`, each shard reduced over the other data axes too); `train` builds its AdamW
    (`Zero.optimizer`) with the run's settings, its state in files under `offload_dir` when the
    plan offloads it to disk, and the parameter shards there too under `params:disk`.

    The engine binds itself to the compiled program's ZeRO nodes (`compiler/passes/zero.py`):
    ZeRO-3 gathers layer by layer, ZeRO-1/2 overlap the post-step all-gather with forward.
    Under a pipeline `rank_program` holds the rank's parameters and its stage programs run them;
    each weight tied across pipeline ranks gets a flat of its own, so that every rank holding
    a copy holds the same piece of its gradient (`PipelineRank.sum_tied_grads` adds them).
    """
    from meshplan.runtime.data_parallel import broadcast_parameters
    from meshplan.runtime.mesh import axis_group
    from meshplan.runtime.zero import shard_for_zero

    # every rank built the same seeded model, but only each rank's own shard survives sharding
    broadcast_parameters(
        [p for p in rank_program.parameters() if p.requires_grad], axis_group(mesh, dp_spec.axis)
    )
    return shard_for_zero(
        rank_program,
        _shard_group(mesh, dp_spec),
        dataclasses.replace(
            _zero_options(dp_spec, plan),
            offload_dir=offload_dir if dp_spec.optimizer_on_disk else None,
            params_dir=offload_dir if dp_spec.params_on_disk else None,
        ),
        axis=dp_spec.sharded_over,
        programs=_stage_programs(pipeline),
        alone=sorted(pipeline.parts.tied) if pipeline is not None else [],
        replicas=replicas(mesh, dp_spec.replicated_over),
    )


def _shard_group(mesh, dp_spec: DataParallelSpec) -> torch.distributed.ProcessGroup:
    """The group ZeRO cuts the state over (`sharded_over`); an HSDP group whose cut axes are all
    of one rank is that rank alone, each copy whole."""
    from meshplan.runtime.mesh import axis_group

    cut = dp_spec.sharded_over
    return axis_group(mesh, cut) or mesh.get_group(axes_of(cut)[0])


def replicas(mesh, axes: Sequence[str]) -> Replicas | None:
    """HSDP's replicas of this rank's shards: its peers over `axes` (None: no other rank)."""
    from meshplan.runtime.mesh import GROUP, axis_group
    from meshplan.runtime.zero_grads import Replicas

    names = tuple(mesh.mesh_dim_names or ())
    axes = [a for a in axes if mesh.mesh.shape[names.index(a)] > 1]
    group = axis_group(mesh, GROUP.join(axes)) if axes else None
    return Replicas(group, GROUP.join(axes)) if group is not None else None


def _stage_programs(pipeline: PipelineRank | None) -> list[fx.GraphModule]:
    """A pipeline rank's stage programs, whose ZeRO nodes drive the engine ([] without one)."""
    if pipeline is None:
        return []
    return [pipeline.parts.stages[s] for s in sorted(pipeline.parts.stages)]


def _late(rank_program: fx.GraphModule, pipeline: PipelineRank | None) -> list[nn.Parameter]:
    """The weights several of a pipeline rank's stages read: reduced after its last backward."""
    if pipeline is None:
        return []
    return [rank_program.get_parameter(n) for n in pipeline.parts.shared_here]


def compression(dp_spec: DataParallelSpec) -> Compression | None:
    """The plan's `compress` as the data-parallel and ZeRO engines take it (the per-axes ones on
    the sets of parameters reduced over a data axis; `dsl.check` refuses it beside parameters
    on the host, whose gradients an engine of their own reduces)."""
    from meshplan.runtime.compression import Compression

    c = dp_spec.compress
    return None if c is None else Compression(c.method, c.rank, c.warmup)


def _reduce_dtype(plan: Plan) -> torch.dtype | None:
    import torch

    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.precision.reduce]


def _zero_options(dp_spec: DataParallelSpec, plan: Plan) -> ZeroOptions:
    """The plan's `data_parallel` block as the ZeRO engine's options, with `make_optimizer`'s
    rule of which params get weight decay."""
    from meshplan.runtime.buckets import decays
    from meshplan.runtime.zero import ZeroOptions

    return ZeroOptions(
        stage=dp_spec.zero,
        bucket_bytes=dp_spec.bucket_bytes,
        offload_optimizer=dp_spec.offload_optimizer,
        offload_params=dp_spec.offload_params,
        reduce_dtype=_reduce_dtype(plan),
        decay=decays,
        compression=compression(dp_spec),
    )
