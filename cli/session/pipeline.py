"""A pipeline rank at run time: its stages (lowered by `compiler.lower.rank_stages`), run by its
schedule's action list, with the gradients of weights tied across pipeline ranks summed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import fx

    from meshplan.compiler.lower import Program, RankStages
    from meshplan.dsl.check import Plan
    from meshplan.runtime.mesh import MeshLayout


def pipeline_microbatches(plan: Plan, layout: MeshLayout) -> int:
    """How many `--batch`-sized microbatches one pipeline micro-step runs (1 without a pipeline):
    the plan's `microbatches`, else one per pipeline rank."""
    p = plan.pipeline
    if p is None:
        return 1
    return p.microbatches or layout.size(p.axis)


def pipeline_rank(
    plan: Plan, program: Program, rank_program: fx.GraphModule, mesh, rank: int
) -> PipelineRank:
    """This rank's stages of `rank_program` (its shards and groups bound), as the plan's
    schedule gives them; the schedule is checked by simulation first: a list that cannot run
    is a meshplan bug, found before it hangs."""
    from meshplan.compiler.lower import rank_stages

    spec = plan.pipeline
    assert spec is not None
    schedule = pipeline_schedule(plan, program.layout)
    return PipelineRank(rank_stages(program, rank_program, rank, mesh, axis=spec.axis, schedule=schedule))


def pipeline_schedule(plan: Plan, layout: MeshLayout):
    """The plan's schedule: which stages each pipeline rank runs, and in which order."""
    from meshplan.runtime import schedules

    spec = plan.pipeline
    assert spec is not None
    return schedules.build(
        spec.schedule, layout.size(spec.axis), pipeline_microbatches(plan, layout), spec.virtual_stages
    )


def held_names(plan: Plan, program: Program, rank: int) -> frozenset[str] | None:
    """The tensors this rank's stages read (None without a pipeline: every tensor)."""
    from meshplan.compiler.lower import stage_names

    if plan.pipeline is None:
        return None
    return stage_names(
        program, rank, axis=plan.pipeline.axis, schedule=pipeline_schedule(plan, program.layout)
    )


class ZeroShards(Protocol):
    """What summing a tied weight's gradient needs of a ZeRO engine (`Zero`, `ExpertZero`)."""

    def own_grad_of(self, name: str) -> torch.Tensor | None: ...

    def shard_numel(self, numel: int) -> int: ...


@dataclass
class PipelineRank:
    """This rank's stages (`parts`), the ZeRO engine of their parameters if any, and the
    `PipelineStep` that runs them once `forward_backward` made it."""

    parts: RankStages
    step: Any = None  # runtime.pipeline.PipelineStep
    zero: ZeroShards | None = None  # the engine, when it shards gradients (ZeRO)

    @property
    def copies(self) -> frozenset[str]:
        """The tied weights this rank holds but another counts (in the gradient norm)."""
        position = self.parts.position
        return frozenset(n for n, (_, holders) in self.parts.tied.items() if position in holders[1:])

    def sum_tied_grads(self) -> None:
        """Sum each tied weight's gradient over the pipeline ranks holding a copy (the others
        add zeros), so every copy takes the same optimizer step.

        Under ZeRO the averaged gradient is sharded over the data axis: each holder sums its
        piece. The weight has a flat of its own on every holder (`sync.shard_for_zero`), so the
        ranks of one pipeline group, which share their data-axis coordinate, hold the same piece.
        """
        import torch
        import torch.distributed as dist

        parts = self.parts
        device = next(parts.held.parameters()).device  # NCCL reduces device memory only
        for name, (shape, holders) in sorted(parts.tied.items()):
            if self.zero is not None:
                piece = self.zero.own_grad_of(name) if parts.position in holders else None
                total = (
                    piece.float()
                    if piece is not None
                    else torch.zeros(self.zero.shard_numel(math.prod(shape)), device=device)
                )
                total = total.clone()
                dist.all_reduce(total, group=parts.group)
                if piece is not None:
                    piece.copy_(total)
                continue
            param = parts.held.get_parameter(name) if parts.position in holders else None
            grad = param.grad if param is not None and param.grad is not None else None
            total = grad.clone() if grad is not None else torch.zeros(shape, device=device)
            dist.all_reduce(total, group=parts.group)
            if param is not None:
                param.grad = total

    def metrics(self) -> dict[str, Any]:
        return {"pipeline_idle": self.step.idle if self.step is not None else None}

    def forward_backward(self, inputs_of, microbatches: int, no_sync):
        """The micro-step: split its batch into microbatches, run the schedule (`no_sync`:
        the data-parallel engine's), and return the loss on every pipeline rank."""
        import torch.distributed as dist

        from meshplan.runtime.pipeline import PipelineStep

        parts = self.parts
        step = self.step = PipelineStep(
            parts.stages,
            parts.schedule,
            rank=parts.position,
            ranks=parts.ranks,
            group=parts.group,
            axis=parts.axis,
            no_sync=no_sync,
        )
        group = parts.group

        def forward_backward(input_ids: Any, labels: Any, k: int, scale: float) -> torch.Tensor:
            # (input_ids, labels), or (CallBatch, None): the call's own inputs
            chunks = labels.chunk(microbatches) if labels is not None else [None] * microbatches
            micro = [inputs_of(x, y) for x, y in zip(input_ids.chunk(microbatches), chunks, strict=True)]
            loss = step.run(micro, scale / k)  # on the last stage's rank; 0 on the others
            if group is not None:
                loss = loss.clone()
                dist.all_reduce(loss, group=group)
            return loss / k

        return forward_backward
