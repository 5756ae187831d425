"""What the tensor-parallel walk of one axis is told: the axis, its size, each parameter's placement."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshplan.dsl.check import PlanRule
from meshplan.dsl.errors import Diagnostic, Span

from ...placement import Placement

aten = torch.ops.aten


@dataclass(frozen=True)
class ParamPlacement:
    """A parameter's layout over the tensor axis and the rule that set it."""

    placement: Placement
    rule: PlanRule


@dataclass
class TensorParallelSpec:
    """What the pass needs to know: the axis, its size, and each parameter's placement."""

    axis: str
    size: int
    params: dict[str, ParamPlacement]  # "layers.0.mlp.up_proj.weight" -> placement
    sequence_parallel: bool = False
    seq_dim: int = 1
    sequence_modules: dict[str, PlanRule] = field(default_factory=dict)  # module path -> `sequence` rule
    # key/value projection weight -> ranks sharing each of its heads (GQA with fewer kv heads
    # than ranks): the weight stays whole and each rank keeps its head after the projection
    kv_replicas: dict[str, int] = field(default_factory=dict)
    # experts' biases added after their row matrices (GPT-OSS's `down_proj_bias`): whole on
    # every rank, each rank's experts adding 1/n of them to their partial sums
    row_biases: set[str] = field(default_factory=set)
    fallback_span: Span | None = None  # where to point when no rule is near the problem
    # sizes that depend on the token shape and that this axis cuts: (size, pieces) -> the rule
    # behind the cut; a run's --batch/--seq must make each divide (`capture.TokenShapes`)
    cuts: dict[tuple[object, int], PlanRule | None] = field(default_factory=dict)
    # context parallelism over this axis: the token inputs are cut by sequence, so every
    # activation is, and the attention of each module here gathers what it needs (its rule's mode)
    context_modules: dict[str, PlanRule] = field(default_factory=dict)
    # the load-balanced causal layout over this (context) axis: the sequence in 2n chunks, rank r
    # holding chunks r and 2n-1-r, in every collective of the axis. The context rules allow it
    # (ring and all_gather, no Ulysses); the walk keeps it only if some attention is causal.
    balanced: bool = False
    # experts modules (module path -> their `experts` rule): a unit whose tokens come in cut by
    # rows over this axis runs on them as they are, unless its capacity needs every token
    experts: dict[str, PlanRule] = field(default_factory=dict)
    # the context axes (axis -> size) whose cut of the sequence this tensor axis may cut again:
    # Megatron's sequence parallelism on each rank's slice of the sequence. They are walked
    # first and cut the token inputs, so theirs is always the outer cut: the global dim is cut
    # into the product of the sizes, and their gathers of it gather ours first.
    nested: dict[str, int] = field(default_factory=dict)
    # the Ulysses modules of this (context) axis whose heads tensor axes split first (module path
    # -> the product of their sizes and the first such rule): each rank of theirs holds that many
    # times fewer heads, which Ulysses cuts again over this axis
    heads_split: dict[str, tuple[int, PlanRule]] = field(default_factory=dict)

    @property
    def fallback_rule(self) -> PlanRule | None:
        """The first context rule: why the token inputs are cut by sequence."""
        return next(iter(self.context_modules.values()), None)


class TensorParallelError(Exception):
    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic
