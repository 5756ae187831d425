"""One rank's session: everything it trains with, put together from the program, the plan and
the mesh by `open_session`."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshplan.faults import injected_fault

from .hooks import between_steps_hook, expert_metrics, step_metrics
from .pipeline import held_names, pipeline_microbatches, pipeline_rank
from .program import program_for, with_folder
from .sync import gradient_sync

if TYPE_CHECKING:
    import torch
    from torch import fx, nn

    from meshplan.compiler.load import ModelSource
    from meshplan.dsl.check import Plan
    from meshplan.options import RunOptions
    from meshplan.runtime.axes import Axes
    from meshplan.runtime.data import BatchFn
    from meshplan.runtime.optimizers import OptimizerChoice

    from .sync import Engine


@dataclass(frozen=True)
class Session:
    """Everything one rank trains with: its program, data, process groups and data-parallel engine."""

    options: RunOptions  # the run's, with a compile folder's model and shapes filled in
    program: fx.GraphModule  # this rank's: its shards bound, its collectives on its groups
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, labels) -> loss
    batches: BatchFn
    axes: Axes  # process groups by axis name, the data axes, each parameter's cuts
    dp: Engine | None  # None: no data-parallel axis
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
    optimizer: OptimizerChoice | None = None  # the plan's `train { optimizer = ... }` (None: AdamW)
    plan_text: str = ""  # the plan as written (`--tensorboard` shows it)


def open_session(options: RunOptions, rank: int, world_size: int) -> Session:
    """Rank `rank`'s session, inside an initialized process group: the model built from its
    factory (seeded: every rank builds the same weights), the program loaded or compiled,
    lowered to this rank, its gradient sync, its batches."""
    import torch

    from meshplan.batches import example_batch
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.load import load_model
    from meshplan.compiler.lower import build_rank_program, place
    from meshplan.options import offload_dir
    from meshplan.pretrained import open_init
    from meshplan.runtime.expert_list import stacked_lists
    from meshplan.runtime.hollow import fill
    from meshplan.runtime.mesh import init_mesh
    from meshplan.runtime.optimizers import OptimizerChoice

    options = with_folder(options)
    torch.manual_seed(options.seed)
    # token inputs of this rank's micro-batch: the example a compile here captures with (the
    # launcher refused a --seq the model has no sequence for)
    source = with_token_shape(
        load_model(options.model), batch=options.batch, seq=options.seq, seq_asked=False
    )
    if example_batch(source) is not None:  # no sequence: a sample counts as one token
        options = options.replace(seq=1)
    program, plan = program_for(options, source, world_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_mesh(program.layout, device)
    pretrained = open_init(options.init, verify=False) if options.init else None  # checked by the launcher
    keep = held_names(plan, program, rank)  # a pipeline rank builds only its stages' tensors
    # under ZeRO-3 each parameter is made as the engine lays it out, and only its shard kept
    zero3 = plan.data_parallel is not None and plan.data_parallel.zero == 3
    rank_program = build_rank_program(
        program, source.model, rank, mesh, seed=options.seed, pretrained=pretrained, keep=keep, defer=zero3
    )
    rank_program = place(rank_program, device)
    pipeline = pipeline_rank(plan, program, rank_program, mesh, rank) if plan.pipeline is not None else None
    held = pipeline.parts.held if pipeline is not None else rank_program  # its stages' parameters
    sync = gradient_sync(plan, program, held, mesh, pipeline, offload_dir=offload_dir(options))
    fill(held)  # what no engine shards (a frozen parameter) is made whole
    axes, microbatches = sync.axes, pipeline_microbatches(plan, program.layout)
    batches = _batches(options, source, plan, axes, microbatches, rank)
    inputs_of = _inputs(source, program.graph, device)
    forward_backward = None
    if pipeline is not None:
        no_sync = sync.engine.no_sync if sync.engine is not None else None
        forward_backward = pipeline.forward_backward(inputs_of, microbatches, no_sync)
        axes = dataclasses.replace(axes, stages=(pipeline.parts.axis,), copies=pipeline.copies)
    units = list(pipeline.parts.stages.values()) if pipeline is not None else [held]
    _give_back_freed_memory()
    return Session(
        options,
        held,
        _loss(held, inputs_of),
        batches,
        axes,
        sync.engine,
        plan.train.gradient_accumulation,
        plan.precision.loss_scale,
        frozenset(source.model.state_dict()),
        _tied_names(source.model),
        forward_backward,
        microbatches,
        pipeline.parts.group if pipeline is not None else None,
        step_metrics(
            pipeline.metrics if pipeline is not None else None,
            expert_metrics(units, axes) if sync.experts else None,
        ),
        pipeline.sum_tied_grads if pipeline is not None and pipeline.parts.tied else None,
        between_steps_hook(
            options.between_steps, held, units, source.model, axes, pipeline=pipeline is not None
        )
        if options.between_steps
        else None,
        stacked_lists(source.model),
        OptimizerChoice(plan.train.optimizer.kind, dict(plan.train.optimizer.args)),
        plan.source,
    )


def _inputs(source: ModelSource, graph: fx.GraphModule, device: str) -> Callable[..., tuple]:
    """`(input_ids, labels) -> the program's inputs` (placeholders, in order) for one micro-batch
    of tokens, the other inputs as in the example the program was captured with; or
    `(CallBatch, None)`: the call's own inputs."""
    from meshplan.compiler.capture import bind_inputs

    from .training import call_inputs

    def inputs_of(input_ids: Any, labels: Any) -> tuple:
        call_args, call_kwargs = call_inputs(
            source.args,
            source.kwargs,
            input_ids.to(device),
            labels.to(device) if labels is not None else None,
        )
        return tuple(bind_inputs(source.model, graph, call_args, call_kwargs))

    return inputs_of


def _loss(program: fx.GraphModule, inputs_of: Callable[..., tuple]) -> Callable[..., torch.Tensor]:
    """`(input_ids, labels) -> the loss` of one forward of `program`."""

    def loss_of(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        outputs = program(*inputs_of(input_ids, labels))
        return outputs[0] if isinstance(outputs, (tuple, list)) else outputs

    return loss_of


def _batches(
    options: RunOptions, source: ModelSource, plan: Plan, axes: Axes, microbatches: int, rank: int
) -> BatchFn:
    """This data rank's batches of the run's data (a pipeline's micro-step: `microbatches`
    batches of --batch sequences), with this rank's injected fault (`MESHPLAN_FAULT`) struck at
    its step."""
    from meshplan.batches import run_batches
    from meshplan.examples import CORPUS

    batches = run_batches(
        source,
        options.data,
        batch=options.batch * microbatches,
        seq=options.seq,
        seed=options.seed,
        dp_rank=axes.data_rank,
        dp_size=axes.data_size,
        accumulation=plan.train.gradient_accumulation,
        corpus=str(CORPUS),
    )
    fault = injected_fault(rank)
    if fault is None:
        return batches

    def faulty(step: int, micro: int):
        if step == fault.step:
            fault.strike()
        return batches(step, micro)

    return faulty


def _tied_names(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The names of each weight the model holds under several: the program holds it under one
    of them, an export writes all."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _give_back_freed_memory() -> None:
    """Return the host memory freed while the session was built (whole modules of a meta-built
    model, the parameters ZeRO does not keep) to the system. glibc keeps freed blocks for reuse,
    but the run's later allocations (optimizer state, activations) rarely fit them, so the process
    would hold both: 0.16-0.26 of a rank's training state for a 0.38B Llama (bench/start_memory.py)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # another C library: nothing to ask
            ctypes.CDLL("libc.so.6").malloc_trim(0)
