"""The syntax tree of a plan file: what the user wrote, in order, with a span on every node.

Nodes compare equal when they say the same thing: spans are excluded from equality,
so `parse(format(parse(text))) == parse(text)` is the formatter's contract.
Defaults are not filled in here; `dsl.check` does that when it builds a `Plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from .errors import Span

_NOSPAN = Span("<none>", 0, 0, 0, 0)


def _span() -> Span:
    return field(default=_NOSPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Name:
    """An identifier with its location: an axis name, a setting's argument."""

    text: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class MeshAxis:
    name: Name
    size: int | None  # None is `*`: the world size decides
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Mesh:
    axes: tuple[MeshAxis, ...]
    span: Span = _span()


# ------------------------------------------------------------------ modules block


@dataclass(frozen=True, slots=True)
class Pattern:
    """A module-path glob as written, e.g. `layers.*.self_attn.{q,k,v}_proj`."""

    text: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """`column`, `row` or `vocab` over an axis (Megatron-style linear/embedding splits)."""

    style: Literal["column", "row", "vocab"]
    axis: Name
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Replicate:
    """Keep the module whole on every rank; overrides a broader tensor rule."""

    span: Span = _span()


@dataclass(frozen=True, slots=True)
class SequenceParallel:
    """Run the module (a norm, dropout) on a sequence shard over the tensor axis."""

    axis: Name
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ContextParallel:
    """Split attention over the sequence: `ring` (K/V around a ring), `ulysses` (all-to-all to
    heads and back) or `all_gather` (each rank gathers K/V once and attends with its queries)."""

    mode: Literal["ring", "ulysses", "all_gather"]
    axis: Name
    span: Span = _span()
    # how the sequence is cut over the axis: `balanced` (chunks r and 2n-1-r of 2n, the same
    # causal attention work on every rank) or `contiguous`; None: the compiler's default
    layout: Literal["balanced", "contiguous"] | None = None


@dataclass(frozen=True, slots=True)
class ExpertArg:
    name: Name
    value: float
    text: str  # as written, so the formatter keeps `1.25` and `2` apart
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """Place an MoE expert container's experts over an axis, or over several as one group
    (`experts over dp x tp`: `axis` the first, `more` the rest)."""

    axis: Name
    args: tuple[ExpertArg, ...]
    span: Span = _span()
    more: tuple[Name, ...] = ()

    @property
    def axes(self) -> tuple[Name, ...]:
        return (self.axis, *self.more)

    def arg(self, name: str) -> ExpertArg | None:
        """The argument called `name` (`capacity_factor`, `z_loss`), or None where the rule has none."""
        return next((a for a in self.args if a.name.text == name), None)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Activation checkpointing of the matched modules; `every` k-th match; `selective` keeps matmuls."""

    mode: Literal["full", "selective"] | None
    every: int | None
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Device:
    """Pin the matched modules to a device, e.g. `cpu`."""

    kind: Literal["cpu", "cuda"]
    index: int | None
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class DtypeOverride:
    """Compute the matched modules in this dtype (e.g. norms in fp32 under bf16)."""

    dtype: Dtype
    span: Span = _span()


Action: TypeAlias = (
    TensorParallel
    | Replicate
    | SequenceParallel
    | ContextParallel
    | ExpertParallel
    | Checkpoint
    | Device
    | DtypeOverride
)


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: Pattern
    action: Action
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ModulesBlock:
    rules: tuple[Rule, ...]
    span: Span = _span()


# ------------------------------------------------------------------ settings blocks

Dtype: TypeAlias = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True, slots=True)
class CompressArg:
    """`rank=4` in `compress = powersgd(rank=4)`."""

    name: Name
    value: int
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ZeroStage:
    """The value of `zero = N`, or `zero = N over AXIS` (HSDP: the state sharded over those of
    the data axes only, replicated over the others)."""

    stage: int
    over: tuple[Name, ...] = ()


@dataclass(frozen=True, slots=True)
class Compression:
    """The value of `compress = METHOD(ARG=N, ...)`: the method and its arguments as written,
    each with its span, so the checker can point at the one that is wrong."""

    method: Name
    args: tuple[CompressArg, ...] = ()


@dataclass(frozen=True, slots=True)
class OptimizerArg:
    """`momentum=0.9` in `optimizer = sgd(momentum=0.9)`; `text` as written, for the formatter."""

    name: Name
    value: float
    text: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class OptimizerChoice:
    """The value of `optimizer = NAME(KEY=NUMBER, ...)`: the optimizer and its hyperparameters as
    written, each with its span, so the checker can point at the one that is wrong."""

    name: Name
    args: tuple[OptimizerArg, ...] = ()


SettingValue: TypeAlias = (
    int | float | str | tuple[str, ...] | ZeroStage | Compression | OptimizerChoice | None
)


@dataclass(frozen=True, slots=True)
class Setting:
    """`key = value` inside a block. `text` is the value as the formatter prints it."""

    key: str
    value: SettingValue
    text: str
    span: Span = _span()
    value_span: Span = _span()


@dataclass(frozen=True, slots=True)
class Cut:
    """`cut before PATTERN` / `cut after PATTERN`: a pipeline stage boundary."""

    side: Literal["before", "after"]
    pattern: Pattern
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class PipelineBlock:
    axis: Name
    items: tuple[Setting | Cut, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class DataParallelBlock:
    """`data_parallel over AXIS { ... }`, or over several axes as one group (`over node x dp`:
    `axis` the first, `more` the rest)."""

    axis: Name
    items: tuple[Setting, ...]
    span: Span = _span()
    more: tuple[Name, ...] = ()

    @property
    def axes(self) -> tuple[Name, ...]:
        return (self.axis, *self.more)


@dataclass(frozen=True, slots=True)
class PrecisionBlock:
    items: tuple[Setting, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class TrainBlock:
    items: tuple[Setting, ...]
    span: Span = _span()


Statement: TypeAlias = Mesh | ModulesBlock | PipelineBlock | DataParallelBlock | PrecisionBlock | TrainBlock


@dataclass(frozen=True, slots=True)
class PlanFile:
    """A parsed file: its statements in source order."""

    path: str
    statements: tuple[Statement, ...]
    span: Span = _span()
