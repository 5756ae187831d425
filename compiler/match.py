"""Resolve a plan's `modules` rules against a real model's module paths.

For every module and every rule kind (tensor, sequence, checkpoint, ...) the most specific
matching rule wins; equally specific rules that disagree are a conflict. A rule that
matches no module is an error that lists what does exist where the pattern went wrong:

    llama.plan:7:5: error: rule `layers.*.mlp.w4` matches no module
        layers.*.mlp.w4: column over tp
        ^~~~~~~~~~~~~~~
    hint: modules under `layers.0.mlp` are: gate_proj, up_proj, down_proj
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshplan.dsl.check import Plan, PlanRule, RuleKind
from meshplan.dsl.errors import Diagnostic, Span, did_you_mean
from meshplan.dsl.patterns import Glob


@dataclass(frozen=True)
class Resolution:
    """Which rule governs which module.

    `placements[path][kind]` is the winning rule of that kind for the module at `path`
    (only modules some rule matched appear). `matched[rule.order]` lists every module a
    rule matched, winning or not; `overridden[rule.order]` the (module, winner) pairs
    where a more specific rule took precedence.
    """

    placements: Mapping[str, Mapping[RuleKind, PlanRule]]
    matched: Mapping[int, tuple[str, ...]]
    overridden: Mapping[int, tuple[tuple[str, PlanRule], ...]]

    def rule_for(self, path: str, kind: RuleKind) -> PlanRule | None:
        return self.placements.get(path, {}).get(kind)


def resolve(
    plan: Plan, module_paths: Iterable[str], parameter_paths: Iterable[str] = ()
) -> tuple[Resolution, list[Diagnostic]]:
    """Match every rule of `plan` against `module_paths` (as `named_modules()` spells them);
    tensor rules also against `parameter_paths` (an experts module's stacked matrices, which
    `column`/`row` split as its linear layers: `expert_tensor_rules`).

    Returns the resolution and the diagnostics (unmatched rules, conflicts); the caller
    decides whether to raise, so one compile reports model problems and plan problems together.
    """
    paths = [p for p in module_paths if p]  # the root module has no name to match
    with_parameters = paths + list(parameter_paths)
    diagnostics: list[Diagnostic] = []
    matched: dict[int, tuple[str, ...]] = {}
    candidates: dict[tuple[str, RuleKind], list[PlanRule]] = defaultdict(list)

    for rule in plan.rules:
        among = with_parameters if rule.kind == "tensor" else paths
        hits = tuple(p for p in among if rule.glob.matches(p))
        matched[rule.order] = hits
        if not hits:
            diagnostics.append(_unmatched(rule.glob, rule.pattern_span, among, what="rule"))
        for path in hits:
            candidates[(path, rule.kind)].append(rule)

    placements: dict[str, dict[RuleKind, PlanRule]] = defaultdict(dict)
    overridden: dict[int, list[tuple[str, PlanRule]]] = defaultdict(list)
    reported: set[tuple[int, int]] = set()
    for (path, kind), rules in candidates.items():
        ranked = sorted(rules, key=lambda r: r.glob.specificity, reverse=True)
        winner = ranked[0]
        for other in ranked[1:]:
            if other.glob.specificity == winner.glob.specificity and other.action != winner.action:
                first, second = sorted((winner, other), key=lambda r: r.order)
                if (first.order, second.order) not in reported:
                    reported.add((first.order, second.order))
                    diagnostics.append(
                        Diagnostic(
                            second.pattern_span,
                            f"rules conflict on `{path}`: `{second.pattern}` and `{first.pattern}` are "
                            "equally specific",
                            hint="make one pattern more specific (name the module), or remove one rule",
                            related=((first.span, "the other rule"),),
                        )
                    )
            else:
                overridden[other.order].append((path, winner))
        placements[path][kind] = winner

    resolution = Resolution(
        placements={p: dict(k) for p, k in placements.items()},
        matched=matched,
        overridden={k: tuple(v) for k, v in overridden.items()},
    )
    return resolution, diagnostics


def check_pattern_matches(glob: Glob, span: Span, paths: list[str], *, what: str) -> Diagnostic | None:
    """An error if `glob` matches none of `paths` (used for pipeline cuts)."""
    if any(glob.matches(p) for p in paths if p):
        return None
    return _unmatched(glob, span, [p for p in paths if p], what=what)


def _unmatched(glob: Glob, span: Span, paths: list[str], *, what: str) -> Diagnostic:
    return Diagnostic(span, f"{what} `{glob.text}` matches no module", hint=_nearest_hint(glob.text, paths))


def _nearest_hint(pattern: str, paths: list[str]) -> str:
    """Find the longest prefix of the pattern that matches something and list what is below it."""
    segments = _segments(pattern)
    for cut in range(len(segments) - 1, 0, -1):
        prefix = Glob.compile(".".join(segments[:cut]))
        parents = [p for p in paths if prefix.matches(p)]
        if not parents:
            continue
        parent = parents[0]
        children = _children(parent, paths)
        if not children:
            return f"`{parent}` has no submodules"
        missing = segments[cut]
        guess = did_you_mean(missing, children)
        listed = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "")
        hint = f"modules under `{parent}` are: {listed}"
        return f"did you mean `{guess}`? " + hint if guess else hint
    roots = _children("", paths)
    guess = did_you_mean(segments[0], roots)
    listed = ", ".join(roots[:12]) + (", ..." if len(roots) > 12 else "")
    hint = f"the model's top-level modules are: {listed}"
    return f"did you mean `{guess}`? " + hint if guess else hint


def _segments(pattern: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, ch in enumerate(pattern):
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "." and not depth:
            out.append(pattern[start:i])
            start = i + 1
    out.append(pattern[start:])
    return out


def _children(parent: str, paths: list[str]) -> list[str]:
    prefix = parent + "." if parent else ""
    seen: dict[str, None] = {}
    for p in paths:
        if p.startswith(prefix) and p != parent:
            seen.setdefault(p[len(prefix) :].split(".", 1)[0], None)
    return list(seen)
