"""Syntax tree -> checked `Plan`: defaults filled in, every model-free rule of the language enforced.

Everything that can be known without the model is checked here: axis names and sizes,
mesh product vs world size, setting ranges, schedule needs, axes used for two
incompatible purposes, contradictory precision, malformed patterns, duplicate rules.
Checks that need the model (a rule matches nothing, heads divisible by the axis size)
belong to the compiler, which reports them against the same spans.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from . import ast
from .errors import (
    Collector,
    Diagnostic,
    PlanSyntaxError,
    PlanValidationError,
    Span,
    did_you_mean,
    one_of,
)
from .limits import MAX_INT, read_plan_text
from .parser import parse_recovering
from .patterns import Glob, PatternSyntaxError

DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")
DEFAULT_BUCKET_BYTES = 25 * 10**6  # DDP's default bucket size
RuleKind = Literal["tensor", "sequence", "context", "experts", "checkpoint", "device", "dtype"]


# ---------------------------------------------------------------------------- the checked plan


@dataclass(frozen=True)
class Axis:
    name: str
    size: int | None  # None until a world size resolves `*`
    span: Span


@dataclass(frozen=True)
class MeshSpec:
    """Named axes in rank-layout order: the last axis varies fastest."""

    axes: tuple[Axis, ...]
    span: Span

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def size(self, name: str) -> int | None:
        """An axis's size; of a group of axes (`dp x tp`, as an experts rule names it) their product."""
        sizes = [next(a.size for a in self.axes if a.name == part) for part in axes_of(name)]
        return None if None in sizes else math.prod(sizes)  # type: ignore[arg-type]

    def axis(self, name: str) -> Axis:
        return next(a for a in self.axes if a.name == name)

    @property
    def world_size(self) -> int | None:
        sizes = [a.size for a in self.axes]
        return None if None in sizes else math.prod(s for s in sizes if s is not None)


# how an experts rule names a group of axes (`experts over dp x tp`): the rule's `axis` is that
# text, which `runtime.mesh.MeshLayout` reads alike (the two layers share no code)
GROUP = " x "


def axes_of(axis: str) -> tuple[str, ...]:
    """The mesh axes an axis name stands for: itself, or a group's (`dp x tp` -> dp, tp)."""
    return tuple(axis.split(GROUP))


@dataclass(frozen=True)
class PlanRule:
    """One `modules` rule, compiled. `order` is its position in the file."""

    glob: Glob
    action: ast.Action
    kind: RuleKind
    axis: str | None
    span: Span
    pattern_span: Span
    order: int

    @property
    def pattern(self) -> str:
        return self.glob.text


@dataclass(frozen=True)
class PipelineSpec:
    axis: str
    schedule: str
    microbatches: int | None  # None: one per stage, decided once the axis size is known
    virtual_stages: int
    cuts: tuple[ast.Cut, ...]
    span: Span
    spans: Mapping[str, Span] = field(default_factory=dict)


@dataclass(frozen=True)
class DataParallelSpec:
    axis: str
    zero: int
    bucket_bytes: int
    offload_optimizer: bool
    offload_params: bool
    span: Span
    spans: Mapping[str, Span] = field(default_factory=dict)


@dataclass(frozen=True)
class PrecisionSpec:
    compute: str = "fp32"
    params: str = "fp32"
    grads: str = "fp32"
    reduce: str = "fp32"
    loss_scale: str | float | None = None  # "dynamic", a fixed scale, or None
    spans: Mapping[str, Span] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainSpec:
    gradient_accumulation: int = 1
    spans: Mapping[str, Span] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """A checked plan: what the compiler consumes. Spans point back into `source`."""

    path: str
    source: str
    mesh: MeshSpec
    rules: tuple[PlanRule, ...]
    pipeline: PipelineSpec | None
    data_parallel: DataParallelSpec | None
    precision: PrecisionSpec
    train: TrainSpec
    warnings: tuple[Diagnostic, ...] = ()
    more_warnings: int = 0  # found beyond the `MAX_KEPT` first in `warnings`

    def rules_of(self, kind: RuleKind) -> tuple[PlanRule, ...]:
        return tuple(r for r in self.rules if r.kind == kind)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over, in mesh order: the data-parallel axis and every
        expert axis that no tensor or sequence rule uses. An expert axis splits the batch too
        (torchtitan's layout: data parallel for all but the experts); experts borrowing a tensor
        axis see the tokens its ranks share, and each rank routes its own rows of them."""
        tensor = {r.axis for r in self.rules if r.kind in ("tensor", "sequence")}
        experts = {a for r in self.rules_of("experts") if r.axis for a in axes_of(r.axis)} - tensor
        data = {self.data_parallel.axis} if self.data_parallel is not None else set()
        return tuple(a for a in self.mesh.names if a in experts | data)


# ---------------------------------------------------------------------------- entry points


def load_plan(path: str | Path, *, world_size: int | None = None) -> Plan:
    """Read, parse and check a plan file. Raises `PlanError` with every problem found."""
    return check_text(read_plan_text(path), str(path), world_size=world_size)


def check_text(text: str, path: str = "<plan>", *, world_size: int | None = None) -> Plan:
    """Parse and check plan text, reporting syntax and validation errors of the whole file together."""
    tree, syntax_errors = parse_recovering(text, path)
    if not syntax_errors:
        return check(tree, text, world_size=world_size)
    diagnostics = list(syntax_errors)
    more_errors = 0
    mesh_broken = not any(isinstance(s, ast.Mesh) for s in tree.statements)
    if not mesh_broken:
        # Report what else is wrong with the statements that did parse; warnings would be
        # noise about the broken parts (an axis "unused" by a block that failed to parse).
        broken_lines = frozenset(d.span.line for d in syntax_errors)
        checker = _Checker(path, world_size, broken_lines=broken_lines)
        checker.run(tree, text)
        diagnostics += checker.found.of("error")
        more_errors = checker.found.more["error"]
    raise PlanSyntaxError(diagnostics, {path: text}, more_errors=more_errors)


def check(tree: ast.PlanFile, source: str, *, world_size: int | None = None) -> Plan:
    """Check a parsed plan; with `world_size`, also resolve `*` and check the mesh product."""
    checker = _Checker(tree.path, world_size)
    plan = checker.run(tree, source)
    errors = checker.found.of("error")
    if errors or plan is None:
        raise PlanValidationError(
            errors + checker.found.of("warning"),
            {tree.path: source},
            more_errors=checker.found.more["error"],
            more_warnings=checker.found.more["warning"],
        )
    return plan


# ---------------------------------------------------------------------------- the checker

_KIND_OF: dict[type, RuleKind] = {
    ast.TensorParallel: "tensor",
    ast.Replicate: "tensor",
    ast.SequenceParallel: "sequence",
    ast.ContextParallel: "context",
    ast.ExpertParallel: "experts",
    ast.Checkpoint: "checkpoint",
    ast.Device: "device",
    ast.DtypeOverride: "dtype",
}

# What an axis is used for; an axis may serve several purposes only within one group.
_ROLE_WORDS = {
    "tensor": "tensor parallelism",
    "sequence": "sequence parallelism",
    "context": "context parallelism",
    "experts": "expert parallelism",
    "pipeline": "pipeline stages",
    "data": "data parallelism",
}
# experts may borrow a data axis (its ranks hold other experts, the batch split as before) or a
# tensor axis (its ranks hold other experts; each routes its own rows of the tokens)
_COMPATIBLE_ROLES = ({"tensor", "sequence", "experts"}, {"data", "experts"})


def _compatible(roles: set[str]) -> bool:
    """Whether one axis may serve all of `roles`."""
    return len(roles) == 1 or any(roles <= group for group in _COMPATIBLE_ROLES)


_EXPERT_ARGS = {"top_k": "int", "capacity_factor": "float", "z_loss": "float"}


class _Checker:
    def __init__(self, path: str, world_size: int | None, *, broken_lines: frozenset[int] = frozenset()):
        self.path = path
        self.world_size = world_size
        # Lines with syntax errors. A block holding one lost an entry to recovery, so checks
        # that relate its entries (offload needs zero = 3) would report the loss, not the plan.
        self.broken_lines = broken_lines
        self.found = Collector()
        self.roles: dict[str, list[tuple[str, Span]]] = {}
        self.unknown_axis_used = False

    def complete(self, node: ast.Statement | None) -> bool:
        """Whether the statement parsed without losing anything to error recovery."""
        if node is None:
            return True
        return not any(node.span.line <= line <= node.span.end_line for line in self.broken_lines)

    def error(self, span: Span, message: str, hint: str | None = None, related=()) -> None:
        self.found.add(Diagnostic(span, message, hint, "error", tuple(related)))

    def warn(self, span: Span, message: str, hint: str | None = None) -> None:
        self.found.add(Diagnostic(span, message, hint, "warning"))

    # -- driver
    def run(self, tree: ast.PlanFile, source: str) -> Plan | None:
        by_kind: dict[type, list[ast.Statement]] = {}
        for stmt in tree.statements:
            by_kind.setdefault(type(stmt), []).append(stmt)
        for stmts in by_kind.values():
            for dup in stmts[1:]:
                word = _statement_word(dup)
                self.error(
                    _head_span(dup),
                    f"`{word}` appears twice",
                    hint=f"merge it into the first `{word}`",
                    related=[(_head_span(stmts[0]), "first here")],
                )

        meshes = by_kind.get(ast.Mesh, [])
        if not meshes:
            self.error(
                Span(self.path, 1, 1, 1, 2),
                "plan has no `mesh`",
                hint="start the plan with the device mesh, e.g. `mesh dp=*, tp=2`",
            )
            return None
        mesh = self.mesh(meshes[0])  # type: ignore[arg-type]

        first = lambda kind: by_kind.get(kind, [None])[0]  # noqa: E731
        modules: ast.ModulesBlock | None = first(ast.ModulesBlock)  # type: ignore[assignment]
        rules = self.rules(modules.rules if modules else (), mesh)
        pipeline = self.pipeline(first(ast.PipelineBlock), mesh)  # type: ignore[arg-type]
        data_parallel = self.data_parallel(first(ast.DataParallelBlock), mesh)  # type: ignore[arg-type]
        precision = self.precision(first(ast.PrecisionBlock))  # type: ignore[arg-type]
        train = self.train(first(ast.TrainBlock))  # type: ignore[arg-type]
        self.check_roles()
        self.check_rule_consistency(rules, precision, complete=self.complete(modules))
        self.check_unused_axes(mesh)
        warnings = tuple(self.found.of("warning"))
        return Plan(
            self.path,
            source,
            mesh,
            rules,
            pipeline,
            data_parallel,
            precision,
            train,
            warnings,
            self.found.more["warning"],
        )

    # -- mesh
    def mesh(self, node: ast.Mesh) -> MeshSpec:
        seen: dict[str, ast.MeshAxis] = {}
        axes = []
        for ax in node.axes:
            if ax.name.text in seen:
                self.error(
                    ax.name.span,
                    f"axis `{ax.name.text}` is declared twice",
                    hint="give each mesh axis its own name",
                    related=[(seen[ax.name.text].span, "first declared here")],
                )
                continue
            seen[ax.name.text] = ax
            if ax.size is not None and ax.size < 1:
                self.error(ax.span, f"axis `{ax.name.text}` has size {ax.size}; sizes are at least 1")
            axes.append(Axis(ax.name.text, ax.size, ax.span))
        autos = [a for a in axes if a.size is None]
        for extra in autos[1:]:
            self.error(
                extra.span,
                "only one axis can take its size from the world size (`*`)",
                hint=f"`{autos[0].name}` already does; give `{extra.name}` a number",
            )
        known = _product_up_to(MAX_INT + 1, [a.size for a in axes if a.size and a.size > 0])
        if known > MAX_INT:  # each size has at most 12 digits, but thousands of axes multiply
            self.error(
                node.span,
                f"the mesh axes multiply to more than {MAX_INT:,} ranks",
                hint=f"a mesh has 1 to {MAX_INT:,} ranks: the product of its axis sizes",
            )
        elif self.world_size is not None:
            if autos:
                if self.world_size % known:
                    self.error(
                        node.span,
                        f"world size {self.world_size} is not divisible by the fixed axes' product {known}",
                        hint="change the axis sizes or the number of processes",
                    )
                else:
                    axes = [
                        Axis(a.name, self.world_size // known, a.span) if a is autos[0] else a for a in axes
                    ]
            elif known != self.world_size:
                self.error(
                    node.span,
                    f"mesh has {known} ranks but the world size is {self.world_size}",
                    hint=f"make the axis sizes multiply to {self.world_size}, or use `*` for one axis",
                )
        return MeshSpec(tuple(axes), node.span)

    def axis_ref(self, name: ast.Name, mesh: MeshSpec, role: str) -> str | None:
        if name.text not in mesh.names:
            guess = did_you_mean(name.text, mesh.names)
            hint = f"did you mean `{guess}`?" if guess else "the mesh axes are: " + ", ".join(mesh.names)
            self.error(name.span, f"unknown mesh axis `{name.text}`", hint=hint)
            self.unknown_axis_used = True
            return None
        self.roles.setdefault(name.text, []).append((role, name.span))
        return name.text

    def check_roles(self) -> None:
        """An axis serves several purposes only within one compatible group, all its uses at once
        (experts borrow a data axis or a tensor axis, never one that is both)."""
        for axis, uses in self.roles.items():
            seen: dict[str, Span] = {}
            for role, span in uses:
                if _compatible({*seen, role}):
                    seen.setdefault(role, span)
                    continue
                # the use it clashes with: one it shares no group with (else the first: tensor
                # and data are each fine with experts, not with each other through them)
                clash = [(r, s) for r, s in seen.items() if not _compatible({r, role})]
                other, other_span = (clash or list(seen.items()))[0]
                self.error(
                    span,
                    f"axis `{axis}` is used for {_ROLE_WORDS[role]} here but for "
                    f"{_ROLE_WORDS[other]} elsewhere",
                    hint="give each kind of parallelism its own mesh axis",
                    related=[(other_span, f"`{axis}` used for {_ROLE_WORDS[other]} here")],
                )
                break

    def check_unused_axes(self, mesh: MeshSpec) -> None:
        if self.unknown_axis_used:
            return  # the misspelt name was most likely meant to be one of the "unused" axes
        for ax in mesh.axes:
            if ax.name not in self.roles and ax.size != 1:
                self.warn(
                    ax.span,
                    f"axis `{ax.name}` is not used by any rule or block",
                    hint=f"its ranks would all compute the same thing; add `data_parallel over {ax.name}` "
                    "or set its size to 1",
                )

    # -- modules
    def rules(self, nodes: tuple[ast.Rule, ...], mesh: MeshSpec) -> tuple[PlanRule, ...]:
        out = []
        for order, rule in enumerate(nodes):
            glob = self.glob(rule.pattern)
            action = rule.action
            kind = _KIND_OF[type(action)]
            axis = None
            if isinstance(action, (ast.TensorParallel, ast.SequenceParallel, ast.ContextParallel)):
                axis = self.axis_ref(action.axis, mesh, kind)
            if isinstance(action, ast.ExpertParallel):
                axis = self.expert_axes(action, mesh)
                self.expert_args(action)
            if isinstance(action, ast.Checkpoint) and action.every is not None and action.every < 1:
                self.error(
                    action.span,
                    "`every` must be at least 1",
                    hint="`checkpoint every 2` checkpoints every second matched module",
                )
            if (
                isinstance(action, ast.ContextParallel)
                and action.mode == "ulysses"
                and action.layout == "balanced"
            ):
                self.error(
                    rule.span,
                    "`context ulysses` keeps contiguous chunks: each rank attends over the whole "
                    "sequence with its heads, so there is no causal work to balance",
                    hint="drop `(layout=balanced)`, or use `context ring` or `context all_gather`",
                )
            if glob is not None:
                out.append(PlanRule(glob, action, kind, axis, rule.span, rule.pattern.span, order))
        self.duplicate_rules(out)
        self.context_layouts(out)
        return tuple(out)

    def context_layouts(self, rules: list[PlanRule]) -> None:
        """The sequence is cut one way over a context axis: every collective of the axis uses it."""
        first: dict[str, PlanRule] = {}
        for rule in rules:
            action = rule.action
            if not isinstance(action, ast.ContextParallel) or rule.axis is None:
                continue
            chunks = "contiguous" if action.mode == "ulysses" else action.layout or "balanced"
            seen = first.setdefault(rule.axis, rule)
            seen_action = seen.action
            assert isinstance(seen_action, ast.ContextParallel)
            seen_chunks = "contiguous" if seen_action.mode == "ulysses" else seen_action.layout or "balanced"
            if chunks != seen_chunks and (action.layout or seen_action.layout):
                self.error(
                    rule.span,
                    f"this rule cuts the sequence over `{rule.axis}` in {chunks} chunks, but line "
                    f"{seen.span.line} cuts it in {seen_chunks} ones: an axis has one layout",
                    hint=f"write the same `(layout=...)` on every context rule over `{rule.axis}`",
                )

    def glob(self, pattern: ast.Pattern) -> Glob | None:
        try:
            return Glob.compile(pattern.text)
        except PatternSyntaxError as e:
            s = pattern.span
            col = s.col + e.offset
            self.error(Span(s.path, s.line, col, s.line, col + e.length), str(e), hint=e.hint)
            return None

    def expert_axes(self, action: ast.ExpertParallel, mesh: MeshSpec) -> str | None:
        """The rule's expert group: one axis, or several named `dp x tp` (its ranks in mesh order)."""
        names = [self.axis_ref(name, mesh, "experts") for name in action.axes]
        for i, name in enumerate(action.axes):
            if name.text in (a.text for a in action.axes[:i]):
                once = GROUP.join(dict.fromkeys(a.text for a in action.axes))
                self.error(
                    name.span,
                    f"axis `{name.text}` is named twice in one expert group",
                    hint=f"name each axis once: `experts over {once}`",
                )
                return None
        if None in names:
            return None
        ordered = [a for a in mesh.names if a in names]
        if ordered != names:
            self.error(
                action.axes[0].span,
                f"the axes of an expert group are written in mesh order: `{GROUP.join(ordered)}`",
                hint="a group's ranks are numbered as the mesh numbers them",
            )
            return None
        return GROUP.join(names)  # type: ignore[arg-type]

    def expert_args(self, action: ast.ExpertParallel) -> None:
        seen: set[str] = set()
        for arg in action.args:
            key = arg.name.text
            if key not in _EXPERT_ARGS:
                guess = did_you_mean(key, _EXPERT_ARGS)
                self.error(
                    arg.name.span,
                    f"unknown expert setting `{key}`",
                    hint=f"did you mean `{guess}`?" if guess else f"expected {one_of(_EXPERT_ARGS)}",
                )
            elif key in seen:
                self.error(arg.span, f"`{key}` is given twice")
            elif _EXPERT_ARGS[key] == "int" and (arg.value != int(arg.value) or arg.value < 1):
                self.error(arg.span, f"`{key}` must be a whole number of at least 1, not {arg.text}")
            elif arg.value <= 0:
                self.error(arg.span, f"`{key}` must be positive, not {arg.text}")
            seen.add(key)

    def duplicate_rules(self, rules: list[PlanRule]) -> None:
        first: dict[tuple[str, str], PlanRule] = {}
        for rule in rules:
            key = (rule.kind, rule.pattern)
            prev = first.setdefault(key, rule)
            if prev is rule:
                continue
            if prev.action == rule.action:
                self.warn(
                    rule.span, f"rule repeats the rule at line {prev.span.line}", hint="delete one of them"
                )
            else:
                self.error(
                    rule.pattern_span,
                    f"conflicting rules for `{rule.pattern}`",
                    hint="a module gets one placement of each kind; keep one rule",
                    related=[(prev.span, "the other rule")],
                )

    def check_rule_consistency(
        self, rules: tuple[PlanRule, ...], precision: PrecisionSpec, *, complete: bool
    ) -> None:
        tensor_axes = {r.axis for r in rules if isinstance(r.action, ast.TensorParallel)}
        for rule in rules:
            if (
                complete
                and rule.kind == "sequence"
                and rule.axis is not None
                and rule.axis not in tensor_axes
            ):
                self.error(
                    rule.span,
                    f"sequence parallelism over `{rule.axis}` needs tensor-parallel rules over `{rule.axis}`",
                    hint="sequence parallelism shards the regions between column and row splits; "
                    f"add `column over {rule.axis}` / `row over {rule.axis}` rules",
                )
            if isinstance(rule.action, ast.DtypeOverride) and rule.action.dtype == precision.compute:
                self.warn(
                    rule.span,
                    f"`precision {rule.action.dtype}` has no effect: compute is already {precision.compute}",
                )

    # -- settings blocks
    def settings(self, items, allowed: tuple[str, ...]) -> dict[str, ast.Setting]:
        out: dict[str, ast.Setting] = {}
        for item in items:
            if not isinstance(item, ast.Setting):
                continue
            if item.key in out:
                self.error(
                    item.span,
                    f"`{item.key}` is set twice",
                    hint="keep one",
                    related=[(out[item.key].span, "first set here")],
                )
                continue
            assert item.key in allowed, item.key  # the grammar only admits these
            out[item.key] = item
        return out

    def pipeline(self, node: ast.PipelineBlock | None, mesh: MeshSpec) -> PipelineSpec | None:
        if node is None:
            return None
        axis = self.axis_ref(node.axis, mesh, "pipeline")
        s = self.settings(node.items, ("schedule", "microbatches", "virtual_stages"))
        spans = {k: v.span for k, v in s.items()}
        schedule = s["schedule"].value if "schedule" in s else "1f1b"
        assert isinstance(schedule, str)
        num_stages = mesh.size(axis) if axis else None

        virtual = s["virtual_stages"].value if "virtual_stages" in s else None
        complete = self.complete(node)
        if complete and virtual is not None and schedule not in ("interleaved", "zbv"):
            self.error(
                s["virtual_stages"].span,
                f"`virtual_stages` needs `schedule = interleaved` or `zbv`, not {schedule}",
                hint="virtual stages are the chunks each rank holds in the interleaved and V schedules",
            )
        if schedule == "interleaved" and virtual is not None and isinstance(virtual, int) and virtual < 2:
            self.error(
                s["virtual_stages"].value_span,
                "interleaved 1F1B needs at least 2 virtual stages per rank",
                hint="use `schedule = 1f1b` for one stage per rank",
            )
        if schedule == "zbv" and isinstance(virtual, int) and (virtual < 2 or virtual % 2):
            self.error(
                s["virtual_stages"].value_span,
                f"zbv places its chunks in Vs: it needs an even number of virtual stages per rank, not {virtual}",
                hint=f"use `virtual_stages = {max(2, virtual + virtual % 2)}`",
            )
        if virtual is None:
            virtual = 2 if schedule in ("interleaved", "zbv") else 1
        assert isinstance(virtual, int)

        micro = s["microbatches"].value if "microbatches" in s else None
        if isinstance(micro, int):
            if micro < 1:
                self.error(s["microbatches"].value_span, "`microbatches` must be at least 1")
            elif complete and num_stages and schedule != "gpipe" and micro < num_stages:
                self.error(
                    s["microbatches"].value_span,
                    f"{schedule} needs at least as many microbatches as stages: {micro} < {num_stages}",
                    hint=f"set `microbatches = {num_stages}` or more (more microbatches, smaller bubble)",
                )
            elif complete and num_stages and schedule == "interleaved" and micro % num_stages:
                self.error(
                    s["microbatches"].value_span,
                    f"interleaved 1F1B needs microbatches divisible by the {num_stages} pipeline ranks",
                    hint=f"use {micro + (-micro) % num_stages}",
                )

        cuts = tuple(i for i in node.items if isinstance(i, ast.Cut))
        seen_cuts: dict[tuple[str, str], ast.Cut] = {}
        for cut in cuts:
            self.glob(cut.pattern)
            prev = seen_cuts.setdefault((cut.side, cut.pattern.text), cut)
            if prev is not cut:
                self.error(
                    cut.span,
                    "the same cut is given twice",
                    hint="delete one of them",
                    related=[(prev.span, "first here")],
                )
        if complete and cuts and num_stages:
            want = num_stages * virtual - 1
            num_cuts = len(seen_cuts)  # a repeated cut is reported above, not counted twice
            if num_cuts != want:
                self.error(
                    cuts[0].span,
                    f"{num_cuts} cut(s) make {num_cuts + 1} stages, but `{axis}` has "
                    f"{num_stages} rank(s)" + (f" x {virtual} virtual stages" if virtual > 1 else ""),
                    hint=f"give {want} cut(s), or none to balance the stages automatically",
                )
        if axis and num_stages == 1:
            self.warn(node.span, f"pipeline over `{axis}` of size 1 has a single stage")
        return PipelineSpec(
            axis or node.axis.text,
            schedule,
            micro if isinstance(micro, int) else None,
            virtual,
            cuts,
            node.span,
            MappingProxyType(spans),
        )

    def data_parallel(self, node: ast.DataParallelBlock | None, mesh: MeshSpec) -> DataParallelSpec | None:
        if node is None:
            return None
        axis = self.axis_ref(node.axis, mesh, "data")
        s = self.settings(node.items, ("zero", "bucket", "offload"))
        zero = s["zero"].value if "zero" in s else 0
        assert isinstance(zero, int)
        if not 0 <= zero <= 3:
            self.error(
                s["zero"].value_span,
                f"ZeRO stage {zero} does not exist",
                hint="0: plain data parallel, 1: shard optimizer state, 2: + gradients, 3: + parameters",
            )
        bucket = s["bucket"].value if "bucket" in s else DEFAULT_BUCKET_BYTES
        assert isinstance(bucket, int)
        if bucket <= 0:
            self.error(s["bucket"].value_span, "bucket size must be positive")
        offload = s["offload"].value if "offload" in s else ()
        assert isinstance(offload, tuple)
        if len(set(offload)) != len(offload):
            self.error(s["offload"].value_span, "an offload target is listed twice")
        if self.complete(node) and "params" in offload and zero != 3:
            self.error(
                s["offload"].value_span,
                "offloading parameters needs `zero = 3`",
                hint="only ZeRO-3 gathers parameters on use, so only it can keep them on the CPU",
            )
        return DataParallelSpec(
            axis or node.axis.text,
            zero,
            bucket,
            "optimizer" in offload,
            "params" in offload,
            node.span,
            MappingProxyType({k: v.span for k, v in s.items()}),
        )

    def precision(self, node: ast.PrecisionBlock | None) -> PrecisionSpec:
        if node is None:
            return PrecisionSpec()
        s = self.settings(node.items, ("compute", "params", "grads", "reduce", "loss_scale"))

        def get(key: str, default: str) -> str:
            value = s[key].value if key in s else default
            assert isinstance(value, str), value  # the grammar admits only dtype names here
            return value

        compute = get("compute", "fp32")
        params = get("params", "fp32")
        grads = get("grads", params)
        reduce = get("reduce", grads)
        complete = self.complete(node)
        if complete and DTYPE_BITS[params] < DTYPE_BITS[compute]:
            self.error(
                s["params"].value_span,
                f"master weights in {params} are less precise than compute in {compute}",
                hint="keep `params = fp32` (the usual choice), or lower `compute`",
            )
        if complete and "params" in s and "compute" in s and {params, compute} == {"bf16", "fp16"}:
            self.error(
                s["params"].value_span,
                f"params in {params} cannot be cast losslessly to compute in {compute}",
                hint="keep `params = fp32` (the usual choice)",
            )
        loss_scale = (
            s["loss_scale"].value if "loss_scale" in s else ("dynamic" if compute == "fp16" else "none")
        )
        assert isinstance(loss_scale, (str, float)), loss_scale
        if complete and loss_scale != "none" and compute != "fp16" and "loss_scale" in s:
            self.error(
                s["loss_scale"].value_span,
                f"loss scaling is for fp16 compute, but compute is {compute}",
                hint="bf16 and fp32 have fp32's exponent range; remove `loss_scale`",
            )
        if isinstance(loss_scale, float) and loss_scale <= 0:
            self.error(s["loss_scale"].value_span, "a fixed loss scale must be positive")
        if compute == "fp16" and loss_scale == "none":
            self.warn(
                s["loss_scale"].span,
                "fp16 without loss scaling: small gradients will underflow to zero",
                hint="use `loss_scale = dynamic`",
            )
        spans = MappingProxyType({k: v.span for k, v in s.items()} | {"block": node.span})
        return PrecisionSpec(
            compute, params, grads, reduce, None if loss_scale == "none" else loss_scale, spans
        )

    def train(self, node: ast.TrainBlock | None) -> TrainSpec:
        if node is None:
            return TrainSpec()
        s = self.settings(node.items, ("gradient_accumulation",))
        steps = s["gradient_accumulation"].value if "gradient_accumulation" in s else 1
        assert isinstance(steps, int)
        if steps < 1:
            self.error(s["gradient_accumulation"].value_span, "`gradient_accumulation` must be at least 1")
        return TrainSpec(steps, MappingProxyType({k: v.span for k, v in s.items()}))


def _product_up_to(cap: int, values: list[int]) -> int:
    """The product of `values`, or `cap` once it reaches `cap`: thousands of 12-digit sizes
    would otherwise make a number too long to print."""
    out = 1
    for v in values:
        out *= v
        if out >= cap:
            return cap
    return out


def _statement_word(stmt: ast.Statement) -> str:
    return {
        ast.Mesh: "mesh",
        ast.ModulesBlock: "modules",
        ast.PipelineBlock: "pipeline",
        ast.DataParallelBlock: "data_parallel",
        ast.PrecisionBlock: "precision",
        ast.TrainBlock: "train",
    }[type(stmt)]


def _head_span(stmt: ast.Statement) -> Span:
    """The statement's keyword: what to underline when the whole statement is the problem."""
    s = stmt.span
    return Span(s.path, s.line, s.col, s.line, s.col + len(_statement_word(stmt)))
