"""One rank's training session under `meshplan run` (and `meshplan verify`'s partitioned run):
compile the plan for this rank's micro-batch, bind its shards and process groups, wrap the
program in data parallel or ZeRO, and train it with `runtime/train.py`.

    session = open_session(args, rank, world_size)     # inside an initialized process group
    summary = train_session(args, session)
    state = consolidated_state(session)                # the unpartitioned model's state_dict
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshplan.dsl.check import axes_of
from meshplan.run import RunError, injected_fault, run_dir

if TYPE_CHECKING:  # torch stays unimported until a session opens
    import torch
    from torch import fx, nn

    from meshplan.compiler.compile import Compiled
    from meshplan.compiler.executable import Executable
    from meshplan.dsl.check import DataParallelSpec, Plan
    from meshplan.runtime.axes import Axes
    from meshplan.runtime.data import BatchFn
    from meshplan.runtime.data_parallel import DataParallel
    from meshplan.runtime.expert_data_parallel import ExpertDataParallel
    from meshplan.runtime.expert_zero import ExpertZero
    from meshplan.runtime.zero import Zero


def check_supported(plan: Plan) -> None:
    """Plan features the compiler accepts but `meshplan run` does not execute yet: refuse, don't ignore."""
    missing = []
    dp = plan.data_parallel
    if dp is not None and dp.zero == 0 and dp.offload_optimizer:
        missing.append("optimizer offload without ZeRO (use zero = 1 or more)")
    pr = plan.precision
    if (pr.params, pr.grads) != ("fp32", "fp32"):
        missing.append(f"{pr.params} parameters / {pr.grads} gradients (master weights stay fp32)")
    kinds = sorted(
        {r.kind for r in plan.rules} - {"tensor", "sequence", "dtype", "checkpoint", "context", "experts"}
    )
    missing += [f"`{kind}` rules" for kind in kinds]
    if missing:
        raise RunError(
            f"{plan.path}: meshplan run does not execute {', '.join(missing)} yet "
            "(hint: `meshplan check`/`explain` accept the plan; remove these for now to train)"
        )


@dataclass(frozen=True)
class Session:
    """Everything one rank trains with: its program, data, process groups and data-parallel engine."""

    program: fx.GraphModule  # this rank's: its shards bound, its collectives on its groups
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, labels) -> loss
    batches: BatchFn
    axes: Axes  # process groups by axis name, the data axes, each parameter's cuts
    dp: DataParallel | ExpertDataParallel | Zero | ExpertZero | None  # None: no data-parallel axis
    accumulation: int
    loss_scale: str | float | None = None  # the plan's: "dynamic", a fixed scale, or None
    export_names: frozenset[str] = frozenset()  # the unpartitioned model's state_dict keys
    tied: tuple[tuple[str, ...], ...] = ()  # each weight held under several names (GPT-2's wte / lm_head)
    # a pipeline's micro-step: its schedule over `microbatches` (None: one forward, one backward)
    forward_backward: Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor] | None = None
    microbatches: int = 1  # sequences per micro-step = --batch x microbatches
    pipeline_group: torch.distributed.ProcessGroup | None = None  # ranks holding the other stages
    step_metrics: Callable[[], dict[str, Any]] | None = None  # facts the pipeline adds to each step
    after_backward: Callable[[], None] | None = None  # a pipeline's tied weights: sum their gradients
    between_steps: Callable[[], None] | None = None  # --between-steps: the model's update of its buffers
    # lists of experts held stacked (`runtime.expert_list`): path -> the expert's parameter names
    expert_lists: dict[str, tuple[str, ...]] = field(default_factory=dict)


def open_session(args: argparse.Namespace, rank: int, world_size: int) -> Session:
    import torch

    from meshplan.compiler.capture import bind_inputs, load_model, with_token_shape
    from meshplan.compiler.compile import build_rank_program, compile_plan
    from meshplan.dsl import load_plan
    from meshplan.dsl.check import check_text
    from meshplan.examples import CORPUS
    from meshplan.runtime.data import make_batches
    from meshplan.runtime.data_parallel import DataParallel
    from meshplan.runtime.expert_list import stacked_lists
    from meshplan.runtime.mesh import init_mesh

    program_file = getattr(args, "program", None)
    if program_file is None and Path(args.plan).is_dir():  # a compile folder, under the user's torchrun
        compiled_folder(args)
        program_file = str(Path(args.plan) / "program.pt")
    torch.manual_seed(args.seed)
    # token inputs of this rank's micro-batch: the example a compile here captures with
    source = with_token_shape(load_model(args.model), batch=args.batch, seq=args.seq)
    compiled: Compiled | Executable
    if program_file:  # compiled once, by the launcher or `meshplan compile`
        compiled = load_program(Path(program_file), source.model, batch=args.batch, seq=args.seq)
        plan = check_text(compiled.plan_text, compiled.plan_name, world_size=world_size)
    else:
        plan = load_plan(args.plan, world_size=world_size)
        check_supported(plan)
        # for this run's shapes only: a rank that compiles for itself never runs other ones, and
        # symbolic shapes cost a compile about 2.7 times as much
        compiled = compile_plan(plan, source, world_size=world_size, dynamic=False)
    layout = compiled.layout
    mesh = init_mesh(layout, "cuda" if torch.cuda.is_available() else "cpu")
    program = build_rank_program(compiled, source.model, rank, mesh)
    if torch.cuda.is_available():
        program = program.cuda()
    stages = _pipeline(plan, compiled, program, mesh, rank) if plan.pipeline is not None else None
    if stages is not None:
        program = stages.held  # this rank's stages' parameters, under the model's names
    coords = layout.coords(rank)
    dp_spec = plan.data_parallel
    dp_axis = dp_spec.axis if dp_spec is not None and layout.size(dp_spec.axis) > 1 else None
    dp_group = mesh.get_group(dp_axis) if dp_axis else None
    dp: DataParallel | ExpertDataParallel | Zero | ExpertZero | None = None
    experts = tuple(
        a for a in layout.names if a in {x for r in plan.rules_of("experts") for x in axes_of(r.axis)}
    )
    # weight gradients partial over a tensor or context axis, summed by the gradient sync
    grad_sums = getattr(compiled, "grad_sums", {})
    if dp_group is not None and dp_spec is not None and not experts and not grad_sums:
        reduce_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.precision.reduce]
        if dp_spec.zero > 0:
            # a pipeline rank's parameters run in its stage programs, whose ZeRO nodes drive the engine
            programs = [stages.stages[s] for s in sorted(stages.stages)] if stages is not None else []
            tied = sorted(stages.tied) if stages is not None else []
            dp = _shard_for_zero(args, program, dp_group, dp_spec, reduce_dtype, programs, tied)
            if stages is not None:
                stages.zero = dp  # a tied weight's gradient is summed piece by piece
        else:
            dp = DataParallel(
                program,
                dp_group,
                bucket_bytes=dp_spec.bucket_bytes,
                reduce_dtype=reduce_dtype,
                axis=dp_spec.axis,
                late=[program.get_parameter(n) for n in stages.shared_here] if stages is not None else (),
            )
    axes = rank_axes(compiled, mesh, data=(dp_spec.axis,) if dp_spec is not None else ())
    dp_rank = coords[dp_axis] if dp_axis else 0
    if experts or grad_sums:
        # the expert axes split the batch too: data parallel for all but the experts; a weight
        # gradient partial over an axis is summed over it with the data axes' average
        axes = dataclasses.replace(axes, data=plan.batch_axes)
        from meshplan.runtime.expert_zero import ExpertZero

        dp = _expert_data_parallel(args, program, axes, layout, mesh, plan, stages)
        if stages is not None and isinstance(dp, ExpertZero):
            stages.zero = dp  # a tied weight's gradient is summed piece by piece
        dp_rank = axes.data_rank
    dp_size = axes.data_size
    microbatches = pipeline_microbatches(plan, layout)
    batches = make_batches(
        args.data or str(CORPUS),
        batch=args.batch * microbatches,
        seq=args.seq,
        seed=args.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        accumulation=plan.train.gradient_accumulation,
    )
    fault = injected_fault(rank)
    if fault is not None:
        clean_batches = batches

        def batches(step: int, micro: int):  # the same batches, with a fault injected
            if step == fault.step:
                fault.strike()
            return clean_batches(step, micro)

    forward = dp if isinstance(dp, DataParallel) else program  # ZeRO works through hooks on `program`
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, graph, template = source.model, compiled.graph, source

    def inputs_of(input_ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        """The program's inputs (placeholders, in order) for one micro-batch of tokens."""
        call_args, call_kwargs = call_inputs(
            template.args, template.kwargs, input_ids.to(device), labels.to(device)
        )
        return tuple(bind_inputs(model, graph, call_args, call_kwargs))

    def loss_of(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        outputs = forward(*inputs_of(input_ids, labels))
        return outputs[0] if isinstance(outputs, (tuple, list)) else outputs

    forward_backward = pipeline_group = None
    if stages is not None:
        forward_backward = stages.forward_backward(
            inputs_of, microbatches, dp.no_sync if dp is not None else None
        )
        pipeline_group = stages.group
        axes = dataclasses.replace(axes, stages=(stages.axis,), copies=stages.copies)

    return Session(
        program,
        loss_of,
        batches,
        axes,
        dp,
        plan.train.gradient_accumulation,
        plan.precision.loss_scale,
        frozenset(source.model.state_dict()),
        _tied_names(source.model),
        forward_backward,
        microbatches,
        pipeline_group,
        _step_metrics(
            stages.metrics if stages is not None else None,
            _expert_metrics(list(stages.stages.values()) if stages else [program], axes) if experts else None,
        ),
        stages.sum_tied_grads if stages is not None and stages.tied else None,
        between_steps_hook(args.between_steps, program, source.model, axes, stages is not None)
        if args.between_steps
        else None,
        stacked_lists(source.model),
    )


def rank_axes(compiled: Compiled | Executable, mesh, data: tuple[str, ...] = ()) -> Axes:
    """The mesh as a rank of `compiled` trains on it: every axis's group, the data axes, each
    parameter's cuts and the axes its gradient is partial over."""
    from meshplan.compiler.placement import Shard
    from meshplan.runtime.axes import Axes
    from meshplan.runtime.shards import AxisCut, Cut

    layout = compiled.layout
    return Axes(
        groups={name: mesh.get_group(name) for name in layout.names if layout.size(name) > 1},
        data=data,
        sharding={
            name: tuple(
                AxisCut(axis, Cut(p.dim, p.blocks, p.padded))
                for axis, p in placement.items()
                if isinstance(p, Shard)
            )
            for name, placement in compiled.param_placements.items()
            if any(isinstance(p, Shard) for p in placement.values())
        },
        # (a program compiled before gradient sums existed has an all-reduce per weight instead)
        summed=getattr(compiled, "grad_sums", {}),
    )


def partial_grad_sync(
    compiled: Compiled | Executable, program: nn.Module, mesh, data: tuple[str, ...] = ()
) -> ExpertDataParallel:
    """For code that runs a rank program itself (benchmarks, parity tests) rather than through
    `meshplan run`: the gradient sync of the weights whose gradients are partial over an axis
    (`Compiled.grad_sums`), summed over it in buckets; with `data`, every gradient also
    averaged over those axes (an expert's over those that do not hold other experts), as `run`
    does. Call `finish()` after backward."""
    from meshplan.runtime.expert_data_parallel import expert_data_parallel
    from meshplan.runtime.mesh import group_over

    layout = compiled.layout
    return expert_data_parallel(
        program, rank_axes(compiled, mesh, data), lambda over: group_over(layout, over, mesh)
    )


def _expert_data_parallel(
    args: argparse.Namespace,
    program: fx.GraphModule,
    axes: Axes,
    layout,
    mesh,
    plan: Plan,
    stages: _PipelineRank | None,
) -> ExpertDataParallel | ExpertZero:
    """Gradient averaging under expert parallelism (`runtime/experts.py`): each parameter over
    the data axes that do not shard it, in buckets of the plan's size; under ZeRO, each
    parameter's training state sharded over those axes (`runtime/expert_zero.py`). Under a
    pipeline `program` holds the rank's parameters and its stage programs run them (as for
    `_shard_for_zero`)."""
    import torch

    from meshplan.runtime.expert_data_parallel import expert_data_parallel
    from meshplan.runtime.expert_zero import expert_zero
    from meshplan.runtime.mesh import group_over

    dp_spec = plan.data_parallel
    reduce_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.precision.reduce]
    groups = lambda over: group_over(layout, over, mesh)  # noqa: E731
    if dp_spec is not None and dp_spec.zero > 0:
        return expert_zero(
            program,
            axes,
            groups,
            _zero_config(dp_spec, reduce_dtype),
            **_adamw(args),
            programs=[stages.stages[s] for s in sorted(stages.stages)] if stages is not None else [],
            alone=sorted(stages.tied) if stages is not None else [],
        )
    return expert_data_parallel(
        program,
        axes,
        groups,
        bucket_bytes=dp_spec.bucket_bytes if dp_spec is not None else 25_000_000,
        reduce_dtype=reduce_dtype,
        late=[program.get_parameter(n) for n in stages.shared_here] if stages is not None else (),
    )


def _step_metrics(*sources: Callable[[], dict[str, Any]] | None) -> Callable[[], dict[str, Any]] | None:
    """The facts of each source, in one record (None without any)."""
    present = [m for m in sources if m is not None]
    if not present:
        return None
    return lambda: {k: v for m in present for k, v in m().items()}


def _expert_metrics(programs: list[fx.GraphModule], axes: Axes) -> Callable[[], dict[str, Any]]:
    """Each step's expert load: the (token, slot) pairs routed to each expert of each MoE
    layer over the whole job, and its overload factor (the most loaded expert-parallel rank's
    pairs over the balanced share); under a capacity, `dropped`: those of them each expert
    had no room for. One all-reduce of the counts per data axis. Under a pipeline, the layers
    of this rank's stages (`programs`)."""
    import torch

    from meshplan.runtime.experts import ExpertParallel

    units = [m for program in programs for m in program.modules() if isinstance(m, ExpertParallel)]

    def metrics() -> dict[str, Any]:
        if not units:
            return {}
        local = torch.cat([torch.cat([u.take_tokens(), u.take_dropped()]) for u in units])
        # every rank's routed rows: the data ranks', those of experts borrowing a tensor axis, and
        # those of an axis that cuts the tokens by rows (a sequence shard each)
        routing = {a for u in units for a in (*axes_of(u.axis), *getattr(u, "rows_cut", ()))}
        over = (*axes.data, *sorted(routing - set(axes.data)))
        counts = axes.sum_over(local, over, "expert load")
        load = {}
        for unit, both in zip(units, counts.split([2 * u.num_experts for u in units]), strict=True):
            tokens, dropped = both.chunk(2)
            per_rank = tokens.view(math.prod(axes.size(a) for a in axes_of(unit.axis)), -1).sum(1)
            share = float(tokens.sum()) / len(per_rank)
            load[unit.path] = {
                "tokens": tokens.tolist(),
                "overload": float(per_rank.max()) / share if share else 0.0,
            }
            if unit.capacity_factor is not None:
                load[unit.path]["dropped"] = dropped.tolist()
        return {"expert_load": load}

    return metrics


def between_steps_hook(
    spec: str, program: fx.GraphModule, model: nn.Module, axes: Axes, pipeline: bool = False
) -> Callable[[], None]:
    """`--between-steps FILE.py:update`: after each optimizer step, `update(model)` on the
    user's own model object, its buffers this rank's. The buffers the program writes while it
    runs (a router's token counts) are statistics of this rank's tokens: they are summed over
    the data axes first, so every rank calls `update` on the same numbers and the buffers it
    sets (an expert bias) stay identical everywhere, as on one device over the whole batch."""
    import torch

    from meshplan.compiler.capture import describe_error, load_function
    from meshplan.compiler.graph import mutated_buffers

    if pipeline:
        raise RunError(PIPELINE_BETWEEN_STEPS)
    update = load_function(spec, "--between-steps")
    written = mutated_buffers(program)  # a checkpointed layer may not write any (checkpoint pass)
    own = dict(program.named_buffers())
    theirs = dict(model.named_buffers())
    mirrored = [n for n, b in own.items() if n in theirs and theirs[n].shape == b.shape]
    for n in mirrored:  # the model's buffers are the program's: an in-place update needs no copy
        _set_buffer(model, n, own[n])

    def between_steps() -> None:
        with torch.no_grad():
            stats = [own[n] for n in written]
            if stats and axes.data:
                total = axes.sum_over(torch.cat([s.flatten().double() for s in stats]), axes.data, spec)
                for s, part in zip(stats, total.split([s.numel() for s in stats]), strict=True):
                    s.copy_(part.view_as(s))
            cut = {n: b.clone() for n, b in theirs.items() if n not in mirrored}  # usually none
        try:
            update(model)
        except Exception as e:
            raise RunError(
                f"--between-steps {spec} raised {describe_error(e, spec.rpartition(':')[0])}"
            ) from e
        with torch.no_grad():
            for n in mirrored:
                if (value := model.get_buffer(n)) is not own[n]:  # assigned anew, not updated in place
                    own[n].copy_(value)
                    _set_buffer(model, n, own[n])
            changed = [n for n, b in cut.items() if not torch.equal(b, model.get_buffer(n))]
        if changed:
            raise RunError(
                f"--between-steps {spec} changed `{changed[0]}`, a buffer this plan cuts over ranks: "
                "meshplan cannot give it back to the program"
            )

    return between_steps


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Make `value` the tensor of `model`'s buffer `name` (its persistence unchanged)."""
    owner, _, leaf = name.rpartition(".")
    model.get_submodule(owner)._buffers[leaf] = value


PIPELINE_BETWEEN_STEPS = (
    "--between-steps with a pipeline is not supported yet: each stage holds other layers' buffers "
    "(hint: run the plan without its `pipeline` block)"
)


def pipeline_microbatches(plan: Plan, layout) -> int:
    """How many `--batch`-sized microbatches one pipeline micro-step runs (1 without a pipeline):
    the plan's `microbatches`, else one per pipeline rank."""
    p = plan.pipeline
    if p is None:
        return 1
    return p.microbatches or layout.size(p.axis)


@dataclass
class _PipelineRank:
    """This rank's stages: their programs, the module holding their parameters under the
    model's names (what the optimizer, data parallelism, checkpoints and export see), and
    the checked schedule that runs them."""

    held: fx.GraphModule
    stages: dict[int, fx.GraphModule]
    schedule: Any  # runtime.schedules.Schedule
    position: int  # this rank's coordinate on the pipeline axis
    ranks: list[int]  # the global ranks of its pipeline group, by position
    group: torch.distributed.ProcessGroup | None
    axis: str
    # weights tied across pipeline ranks: name -> (shape, the positions holding a copy)
    tied: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # weights several of this rank's stages read (the tied embedding and LM head in a V):
    # complete only after both stages' last backwards
    shared_here: frozenset[str] = frozenset()
    step: Any = None  # the PipelineStep, once `forward_backward` made it
    zero: Zero | ExpertZero | None = None  # the ZeRO engine of this rank's parameters, if any

    @property
    def copies(self) -> frozenset[str]:
        """The tied weights this rank holds but another counts (in the gradient norm)."""
        return frozenset(n for n, (_, holders) in self.tied.items() if self.position in holders[1:])

    def sum_tied_grads(self) -> None:
        """Sum each tied weight's gradient over the pipeline ranks holding a copy (the others
        add zeros), so every copy takes the same optimizer step.

        Under ZeRO the averaged gradient is sharded over the data axis: each holder sums its
        piece. The weight has a flat of its own on every holder (`_shard_for_zero`), so the
        ranks of one pipeline group, which share their data-axis coordinate, hold the same piece.
        """
        import math

        import torch
        import torch.distributed as dist

        for name, (shape, holders) in sorted(self.tied.items()):
            if self.zero is not None:
                piece = self.zero.own_grad_of(name) if self.position in holders else None
                total = (
                    piece.float()
                    if piece is not None
                    else torch.zeros(self.zero.shard_numel(math.prod(shape)))
                )
                total = total.clone()
                dist.all_reduce(total, group=self.group)
                if piece is not None:
                    piece.copy_(total)
                continue
            param = self.held.get_parameter(name) if self.position in holders else None
            grad = param.grad if param is not None and param.grad is not None else None
            total = grad.clone() if grad is not None else torch.zeros(shape)
            dist.all_reduce(total, group=self.group)
            if param is not None:
                param.grad = total

    def metrics(self) -> dict[str, Any]:
        return {"pipeline_idle": self.step.idle if self.step is not None else None}

    def forward_backward(self, inputs_of, microbatches: int, no_sync):
        """The micro-step: split its batch into microbatches, run the schedule (`no_sync`:
        the data-parallel engine's), and return the loss on every pipeline rank."""
        import torch.distributed as dist

        from meshplan.runtime.pipeline import PipelineStep

        step = self.step = PipelineStep(
            self.stages,
            self.schedule,
            rank=self.position,
            ranks=self.ranks,
            group=self.group,
            axis=self.axis,
            no_sync=no_sync,
        )
        group = self.group

        def forward_backward(
            input_ids: torch.Tensor, labels: torch.Tensor, k: int, scale: float
        ) -> torch.Tensor:
            micro = [
                inputs_of(x, y)
                for x, y in zip(input_ids.chunk(microbatches), labels.chunk(microbatches), strict=True)
            ]
            loss = step.run(micro, scale / k)  # on the last stage's rank; 0 on the others
            if group is not None:
                loss = loss.clone()
                dist.all_reduce(loss, group=group)
            return loss / k

        return forward_backward


def _pipeline(plan: Plan, compiled, program: fx.GraphModule, mesh, rank: int) -> _PipelineRank:
    """Cut `program` (this rank's, shards and groups bound) into the compiled stages and keep
    the ones the plan's schedule gives this rank."""
    import torch.distributed as dist
    from torch import fx

    from meshplan.compiler.stages import compiled_cuts, cut_stages
    from meshplan.runtime import schedules
    from meshplan.runtime.collectives import label_collectives

    spec = plan.pipeline
    assert spec is not None
    layout = compiled.layout
    ranks = layout.size(spec.axis)
    microbatches = pipeline_microbatches(plan, layout)
    # checked by simulation: a list that cannot run is a meshplan bug, found before it hangs
    schedule = schedules.build(spec.schedule, ranks, microbatches, spec.virtual_stages)
    cut = cut_stages(compiled.graph, compiled_cuts(compiled.graph, getattr(compiled, "stage_cuts", ())))
    assert cut.count == schedule.stages, f"{cut.count} stages for a schedule of {schedule.stages}"
    position = layout.coords(rank)[spec.axis]
    programs = cut.programs(program)
    mine = {s: programs[s] for s in range(cut.count) if schedule.owner[s] == position}
    for stage in mine.values():
        label_collectives(stage)
    names = {str(n.target) for st in mine.values() for n in st.graph.nodes if n.op == "get_attr"}
    # and every other name of the parameters held (a tied weight read under one name: its
    # checkpoint keys and export names are the model's, whatever layout loads them)
    held_ids = {id(p) for n in names if (p := _parameter(program, n)) is not None}
    names |= {
        str(n.target)
        for n in program.graph.nodes
        if n.op == "get_attr" and id(_parameter(program, str(n.target))) in held_ids
    }
    graph = fx.Graph()
    # in the program's order, so that a tied weight's first name (its optimizer state's key) is
    # the one every layout gives it
    for name in dict.fromkeys(str(n.target) for n in program.graph.nodes if n.op == "get_attr"):
        if name in names:
            graph.get_attr(name)
    graph.output(None)
    held = fx.GraphModule(program, graph, class_name="PipelineRank")
    group = mesh.get_group(spec.axis) if ranks > 1 else None
    members = dist.get_process_group_ranks(group) if group is not None else [rank]
    # a weight by its first name in the program, as every rank and `held` name it
    first = {id(p): n for n, p in reversed(list(program.named_parameters(remove_duplicate=False)))}
    tied = {}
    for name, used in cut.shared.items():
        holders = tuple(sorted({schedule.owner[s] for s in used}))
        if len(holders) > 1:  # on one rank the copies are one parameter: autograd sums them
            param = program.get_parameter(name)
            tied[first[id(param)]] = (tuple(param.shape), holders)
    here = frozenset(
        first[id(program.get_parameter(n))]
        for n, used in cut.shared.items()
        if sum(s in mine for s in used) > 1
    )
    return _PipelineRank(held, mine, schedule, position, members, group, spec.axis, tied, here)


def _parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    try:
        return module.get_parameter(name)
    except AttributeError:  # a buffer, or a constant
        return None


def compiled_folder(args: argparse.Namespace) -> Executable:
    """`meshplan run DIR` of a `meshplan compile -o DIR` folder: its program, and the options it
    was compiled for where the command line does not give them (the model, --batch, --seq)."""
    from meshplan.args import given
    from meshplan.compiler.artifact import ArtifactError, read_artifact
    from meshplan.compiler.executable import PROGRAM, ExecutableError, load_executable

    folder = Path(args.plan)
    try:
        manifest = read_artifact(folder)
        executable = load_executable(folder / PROGRAM)
    except (ArtifactError, ExecutableError) as e:
        raise RunError(str(e)) from None
    if not given(args.model) and manifest.get("model"):
        args.model = manifest["model"]
    if executable.token_shape is not None:
        batch, seq = executable.token_shape
        args.batch = args.batch if given(args.batch) else batch
        args.seq = args.seq if given(args.seq) else seq
    return executable


def load_program(path: Path, model: nn.Module, *, batch: int, seq: int) -> Executable:
    """The compiled program at `path`, checked against the run: the same model structure and a
    (batch, seq) it serves (any its splits divide, for a program with symbolic shapes; else the
    one it was compiled for). A mismatch is the user's to fix (`RunError`)."""
    from meshplan.compiler.executable import ExecutableError, load_executable

    try:
        executable = load_executable(path, model)
    except ExecutableError as e:
        raise RunError(str(e)) from None
    if executable.shapes is None and executable.token_shape not in (None, (batch, seq)):
        b, t = executable.token_shape
        raise RunError(
            f"{path} was compiled for --batch {b} --seq {t}, not --batch {batch} --seq {seq} "
            f"(hint: run with --batch {b} --seq {t}, or compile again with the shapes you want)"
        )
    problems = executable.shape_problems(batch, seq)
    if problems:
        raise RunError(
            f"{path} cannot run --batch {batch} --seq {seq}: {'; '.join(problems)}{_shape_hint(executable)}"
        )
    return executable


def _shape_hint(executable: Executable) -> str:
    """` (hint: ...)` naming the steps of the shapes the program runs."""
    if executable.shapes is None:
        return ""
    b, s = executable.shapes.multiples()
    steps = [f"--seq a multiple of {s}"] * (s > 1) + [f"--batch a multiple of {b}"] * (b > 1)
    return f" (hint: pass {' and '.join(steps)})" if steps else ""


def _tied_names(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The names of each weight the model holds under several: the program holds it under one
    of them, an export writes all."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _shard_for_zero(
    args: argparse.Namespace,
    program: fx.GraphModule,
    dp_group: torch.distributed.ProcessGroup,
    dp_spec: DataParallelSpec,
    reduce_dtype: torch.dtype | None,
    programs: list[fx.GraphModule],
    tied: list[str],
) -> Zero:
    """ZeRO over the dp group, from dp rank 0's initial params, with `train`'s AdamW settings.

    The engine binds itself to the compiled program's ZeRO nodes (`compiler/passes/zero.py`):
    ZeRO-3 gathers layer by layer, ZeRO-1/2 overlap the post-step all-gather with forward.
    Under a pipeline `program` holds the rank's parameters and `programs` (its stages) run them;
    each weight `tied` across pipeline ranks gets a flat of its own, so that every rank holding
    a copy holds the same piece of its gradient (`_PipelineRank.sum_tied_grads` adds them).
    """
    from meshplan.runtime.data_parallel import broadcast_parameters
    from meshplan.runtime.zero import shard_for_zero

    # every rank built the same seeded model, but only each rank's own shard survives sharding
    broadcast_parameters([p for p in program.parameters() if p.requires_grad], dp_group)
    return shard_for_zero(
        program,
        dp_group,
        _zero_config(dp_spec, reduce_dtype),
        **_adamw(args),
        axis=dp_spec.axis,
        programs=programs,
        alone=tied,
    )


def _adamw(args: argparse.Namespace) -> dict[str, Any]:
    """`train`'s AdamW settings, for the ZeRO engines that bring their own optimizer."""
    from meshplan.runtime.buckets import decays
    from meshplan.runtime.train import TrainConfig

    return {"lr": args.lr, "betas": TrainConfig.betas, "weight_decay": args.weight_decay, "decay": decays}


def _zero_config(dp_spec: DataParallelSpec, reduce_dtype: torch.dtype | None):
    """The plan's `data_parallel` block as the ZeRO engine's settings."""
    from meshplan.runtime.zero import ZeroConfig

    return ZeroConfig(
        stage=dp_spec.zero,
        bucket_bytes=dp_spec.bucket_bytes,
        offload_optimizer=dp_spec.offload_optimizer,
        offload_params=dp_spec.offload_params,
        reduce_dtype=reduce_dtype,
    )


def call_inputs(
    args: tuple, kwargs: dict[str, Any], input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[tuple, dict[str, Any]]:
    """A forward call shaped like the model's example inputs, with this micro-batch's tokens.

    Positional (input_ids, labels): labels as given (already shifted, like the built-in
    Llama). Keyword `input_ids`/`labels` (Hugging Face): labels = input_ids, because those
    models shift the labels themselves.
    """
    import torch

    if "input_ids" in kwargs:
        new = dict(kwargs, input_ids=input_ids)
        if "labels" in new:
            new["labels"] = input_ids
        return args, new
    tokens = iter((input_ids, labels))
    out = tuple(
        next(tokens, a) if isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_floating_point() else a
        for a in args
    )
    return out, kwargs


INITIAL_DYNAMIC_SCALE = 2.0**16  # fp16's usual starting point; overflows halve it within a few steps


def export_weights(args: argparse.Namespace, prepared: Session, rank: int) -> None:
    """Consolidate this rank's shards into full tensors; rank 0 writes them, as the
    unpartitioned model's `state_dict()` (a list of experts under the list's names)."""
    from meshplan.runtime.expert_list import as_list_state
    from meshplan.runtime.export import write_state_dict

    state = as_list_state(consolidated_state(prepared), prepared.expert_lists)
    if rank == 0:
        write_state_dict(state, Path(args.export))
        print(f"exported {len(state)} tensors to {args.export}")


def consolidated_state(prepared: Session) -> dict[str, torch.Tensor]:
    """The trained weights as the unpartitioned model's `state_dict()` (every rank gets them):
    shards gathered over their axes, ZeRO's gathered unit by unit, and each tied weight under
    every name it has."""
    from meshplan.runtime.expert_zero import ExpertZero
    from meshplan.runtime.export import consolidate
    from meshplan.runtime.zero import Zero

    dp, program, wanted = prepared.dp, prepared.program, set(prepared.export_names)
    state: dict[str, torch.Tensor] = {}
    if isinstance(dp, Zero | ExpertZero):  # ZeRO-3: one unit gathered at a time, not the model
        ids = {name: id(p) for name, p in program.named_parameters(remove_duplicate=False)}
        for names in dp.gathered_by_unit():
            mine = {ids[n] for n in names if n in ids}
            state |= consolidate(program, prepared.axes, {n for n, i in ids.items() if i in mine} & wanted)
    # the rest: buffers, and parameters no ZeRO engine holds (all of them without ZeRO)
    state |= consolidate(program, prepared.axes, wanted - state.keys())
    if prepared.pipeline_group is not None:  # each pipeline rank holds other stages: put them together
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size(prepared.pipeline_group)
        dist.all_gather_object(parts, state, group=prepared.pipeline_group)
        state = {name: tensor for part in parts for name, tensor in part.items()}
    for group in prepared.tied:
        held = next((state[name] for name in group if name in state), None)
        if held is not None:
            state.update({name: held for name in group if name not in state})
    return state


def train_config(args: argparse.Namespace, prepared: Session):
    """The `TrainConfig` of a run: its command line, with the plan's accumulation and loss scale."""
    from meshplan.runtime.train import TrainConfig

    return TrainConfig(
        steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        accumulation=prepared.accumulation,
        seed=args.seed,
        tokens_per_micro_step=args.batch * prepared.microbatches * args.seq,
        run_dir=run_dir(args),
        save_every=args.save_every,
        resume=args.resume,
        log_every=args.log_every,
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
        loss_scale=None
        if prepared.loss_scale is None
        else (INITIAL_DYNAMIC_SCALE if prepared.loss_scale == "dynamic" else float(prepared.loss_scale)),
        dynamic_loss_scale=prepared.loss_scale == "dynamic",
    )


def train_session(args: argparse.Namespace, prepared: Session, *, show_progress: bool | None = None):
    from meshplan.runtime.train import train

    return train(
        prepared.program,
        prepared.loss_of,
        prepared.batches,
        train_config(args, prepared),
        axes=prepared.axes,
        sync=prepared.dp,
        show_progress=show_progress,
        forward_backward=prepared.forward_backward,
        step_metrics=prepared.step_metrics,
        after_backward=prepared.after_backward,
        between_steps=prepared.between_steps,
    )
