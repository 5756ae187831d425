"""Syntax tree -> checked `Plan`: defaults filled in, every model-free rule of the language enforced.

Everything that can be known without the model is checked here and in `dsl.settings`
(the mesh and the settings blocks): axis names and sizes, mesh product vs world size,
setting ranges, schedule needs, axes used for two incompatible purposes, contradictory
precision, malformed patterns, duplicate rules.
Checks that need the model (a rule matches nothing, heads divisible by the axis size)
belong to the compiler, which reports them against the same spans.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import ast
from .axes import MeshSpec, axes_of
from .errors import (
    Diagnostic,
    PlanSyntaxError,
    PlanValidationError,
    Span,
    did_you_mean,
    one_of,
)
from .limits import read_plan_text
from .parser import parse_recovering
from .patterns import Glob
from .settings import DataParallelSpec, PipelineSpec, PrecisionSpec, SettingsChecker, TrainSpec

RuleKind = Literal["tensor", "sequence", "context", "experts", "checkpoint", "device", "dtype"]


# ---------------------------------------------------------------------------- the checked plan


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
        """The axes the batch is split over, in mesh order: the data-parallel axes and every
        expert axis that no tensor or sequence rule uses. An expert axis splits the batch too
        (torchtitan's layout: data parallel for all but the experts); experts borrowing a tensor
        axis see the tokens its ranks share, and each rank routes its own rows of them."""
        tensor = {r.axis for r in self.rules if r.kind in ("tensor", "sequence")}
        experts = {a for r in self.rules_of("experts") if r.axis for a in axes_of(r.axis)} - tensor
        data = set(self.data_parallel.axes) if self.data_parallel is not None else set()
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
_EXPERT_ARGS = {"top_k": "int", "capacity_factor": "float", "z_loss": "float"}


class _Checker(SettingsChecker):
    """The whole plan: its statements in order, then its module rules."""

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
        if data_parallel is not None and data_parallel.compress is not None and self.complete(modules):
            self.compression_composes(data_parallel, rules, precision)
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

    def expert_axes(self, action: ast.ExpertParallel, mesh: MeshSpec) -> str | None:
        """The rule's expert group: one axis, or several named `dp x tp` (its ranks in mesh order)."""
        return self.axis_group(action.axes, mesh, "experts", "experts over", "expert group")

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

    def compression_composes(
        self,
        dp: DataParallelSpec,
        rules: tuple[PlanRule, ...],
        precision: PrecisionSpec,
    ) -> None:
        """`compress` runs in the data-parallel and ZeRO engines (the per-axes ones too: under
        experts, and where sequence or context rules leave weight gradients partial), over
        gradients in fp32, under pipelines too (a weight tied across stages is summed after
        each copy's reduction): what hands the gradients to another engine (the host's), or
        rounds them first, is refused at it."""
        assert dp.compress is not None and dp.compress.span is not None
        at = dp.compress.span
        host = next((r for r in rules if isinstance(r.action, ast.Device) and r.action.kind == "cpu"), None)
        if host is not None:
            self.error(
                at,
                "`compress` cannot compose with this plan yet: parameters on the host (`on cpu`) are "
                "reduced by an engine of their own",
                hint="remove `compress`, or the construct it cannot compose with",
                related=[(host.span, "here")],
            )
            return
        if precision.reduce != "fp32":
            # the reduce dtype defaults to the gradients', which default to the parameters'
            key = next(k for k in ("reduce", "grads", "params") if k in precision.spans)
            self.error(
                at,
                f"`compress` needs fp32 gradients to compress, but they are reduced in {precision.reduce}",
                hint="`compress` sets how gradients travel: keep them fp32 in `precision` with it",
                related=[(precision.spans[key], f"`{key} = {precision.reduce}` here")],
            )


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
