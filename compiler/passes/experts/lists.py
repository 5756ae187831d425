"""Lists of experts (`nn.ModuleList`) an `experts` rule splits, held stacked from the start of
`compile_plan` (`runtime.expert_list.ExpertList`: the experts' parameters stacked on dim 0), and
the rules written against the list as the model's code names it (`experts.*.gate_proj`) moved
to the modules holding its experts stacked.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from meshplan.dsl.check import Plan, PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.expert_list import ExpertList, problem, stack_lists

from ...match import Resolution
from .units import expert_modules


def stack_expert_lists(plan: Plan, model: nn.Module) -> tuple[str, ...]:
    """Every list of experts an `experts` rule splits, replaced in `model` by its `ExpertList`
    (the experts' parameters stacked on dim 0, under the names `experts.gate_proj.weight`); a
    list that cannot be stacked stays, and the pass says why. The paths, in model order: a
    program records them, and a rank stacks its model alike before it binds it."""
    lists = tuple(
        path
        for path, rule in expert_modules(plan, model).items()
        if rule.axis is not None
        and (isinstance(module := model.get_submodule(path), ExpertList) or problem(module) is None)
    )
    stack_lists(model, lists)
    return lists


def list_members(model: nn.Module) -> dict[str, str]:
    """Each stacked list's modules as the model's code names them (`experts.3.gate_proj`, the
    expert itself `experts.3`) -> the module holding them stacked (`experts.gate_proj`; the
    list for the expert itself): what a rule written against the list may name."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, ExpertList):
            for e in range(module.num_experts):
                for sub, _ in module.template.named_modules():
                    out[f"{path}.{e}" + (f".{sub}" if sub else "")] = f"{path}.{sub}" if sub else path
    return out


def fold_list_members(
    resolution: Resolution, members: dict[str, str], modules: dict[str, nn.Module]
) -> tuple[Resolution, list[Diagnostic]]:
    """Rules matched on a stacked list's members (`layers.*.mlp.experts.*.gate_proj: column over
    tp`) moved to the modules holding them stacked (`experts.gate_proj`): a tensor rule splits
    every expert's module alike, so all experts must get the same one; other kinds of rule
    cannot cut a stacked list's experts apart (located errors)."""
    placements = {p: dict(k) for p, k in resolution.placements.items() if p not in members}
    diagnostics: list[Diagnostic] = []
    reported: set[int] = set()
    experts_of = Counter(members.values())  # holder -> its experts (E member paths)
    named: Counter[tuple[str, int]] = Counter()  # (holder, rule) -> the experts it matched
    for path, kinds in resolution.placements.items():
        holder = members.get(path)
        if holder is None:
            continue
        for kind, rule in kinds.items():
            if rule.order in reported:
                continue
            if kind != "tensor" or isinstance(modules.get(holder), ExpertList):  # not an expert's module
                reported.add(rule.order)
                diagnostics.append(_member_error(rule, path, holder))
                continue
            named[(holder, rule.order)] += 1
            other = placements.setdefault(holder, {}).setdefault(kind, rule)
            if other is not rule:
                reported.update((rule.order, other.order))
                diagnostics.append(
                    Diagnostic(
                        rule.pattern_span,
                        f"`{path}` is one of the experts of a stacked list: its module `{holder}` takes one "
                        f"rule for every expert, and `{other.pattern}` gives it another",
                        hint=f"write one rule for all the experts: `{holder}: ...`",
                        related=((other.span, "the other rule"),),
                    )
                )
    rules = {r.order: r for kinds in resolution.placements.values() for r in kinds.values()}
    for (holder, order), count in named.items():
        if order in reported:  # conflicting: said above
            placements[holder].pop("tensor", None)
        elif count < experts_of[holder]:
            reported.add(order)
            placements[holder].pop("tensor", None)  # no expert's module split: one error, not its echoes
            rule = rules[order]
            diagnostics.append(
                Diagnostic(
                    rule.pattern_span,
                    f"`{rule.pattern}` names {count} of the {experts_of[holder]} experts held stacked in "
                    f"`{holder.rpartition('.')[0]}`: a tensor rule splits every expert's module alike",
                    hint=f"name them all: `{holder}` (or `*` in place of the expert's index)",
                )
            )
    matched = {
        order: tuple(dict.fromkeys(members.get(p, p) for p in paths))
        for order, paths in resolution.matched.items()
    }
    return Resolution(placements, matched, resolution.overridden), diagnostics


def _member_error(rule: PlanRule, path: str, holder: str) -> Diagnostic:
    return Diagnostic(
        rule.pattern_span,
        f"`{path}` is one of the experts of a list held stacked (`{holder}`): a `{rule.kind}` rule cannot "
        "name one expert or cut the experts apart",
        hint="name the experts' modules without the index (`experts.gate_proj: column over tp`), "
        "or put the rule on the module holding the experts",
    )
