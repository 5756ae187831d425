"""An experts rule's `capacity_factor`: each expert takes at most C = ceil(N k factor / E) of a
call's (token, slot) pairs (`runtime/experts.py` states the policy; the unit applies it), and
`capacity_applied` makes the unpartitioned model drop the same pairs, for `meshplan verify`'s
reference.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

from torch import nn

from meshplan.dsl import ast
from meshplan.dsl.check import Plan, PlanRule
from meshplan.runtime.expert_list import ExpertList

from .units import expert_modules, num_experts


def capacity_factor(rule: PlanRule) -> float | None:
    """The rule's `capacity_factor`, or None: dropless."""
    assert isinstance(rule.action, ast.ExpertParallel)
    arg = rule.action.arg("capacity_factor")
    return None if arg is None else float(arg.value)


def capacity_lists(plan: Plan, model: nn.Module) -> list[str]:
    """The lists of experts (`ExpertList`) a rule with a `capacity_factor` governs, by path."""
    modules = dict(model.named_modules())
    return [
        path
        for path, rule in expert_modules(plan, model).items()
        if isinstance(modules[path], ExpertList) and capacity_factor(rule) is not None
    ]


@contextlib.contextmanager
def capacity_applied(plan: Plan, model: nn.Module) -> Iterator[None]:
    """While it lasts, every experts module a rule with a `capacity_factor` governs drops the
    pairs the compiled unit drops (`runtime.experts.expert_positions`, over the tokens of each
    call): their routing weights multiplied by 0, its own code computing the rest. So the
    unpartitioned model (`meshplan verify`'s float64 reference) follows the plan's capacity
    rule without the unit's buffers and all-to-alls: a dropped pair adds 0 to its token's
    output, and its weight gets no gradient from it, as in the unit."""
    from meshplan.runtime.experts import expert_capacity, expert_positions

    modules = dict(model.named_modules())
    patched = []
    for path, rule in expert_modules(plan, model).items():
        factor, module = capacity_factor(rule), modules[path]
        count = num_experts(module, model)
        if factor is None or count is None or isinstance(module, ExpertList):
            continue  # (a list's parent hands each expert its rows: verify's reference is its unit)
        signature, forward = inspect.signature(module.forward), module.forward

        def dropping(*args, _signature=signature, _forward=forward, _factor=factor, _count=count, **kwargs):
            bound = _signature.bind(*args, **kwargs)
            tokens, index, weights = bound.args[:3]
            capacity = expert_capacity(index.shape[0], index.shape[1], _count, _factor)
            kept = expert_positions(index, _count) < capacity  # (N, k)
            return _forward(tokens, index, weights * kept, *bound.args[3:], **bound.kwargs)

        module.forward = dropping
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
