"""Each experts module an `experts` rule names, captured as one unit: while capture runs
(`experts_as_units`), the module's forward is one opaque operator that takes what the module
takes and its parameters,

    experts = meshplan.experts(tokens, top_k_index, top_k_weights, [gate_up_proj, down_proj], path)

and a list of experts (`ExpertList`) has its parent's loop call `meshplan.expert_rows` on each
expert's rows (`rows.py` joins those calls into one unit). An experts module called on rows the
model has permuted by expert itself, `experts(x, num_tokens_per_expert)` (torchtitan's
`GroupedExperts`, Megatron's grouped MLP: `runtime.experts.takes_counts`), is the same operator
with each row's expert as its (R, 1) index, read from the counts, and weight 1 (the model weighs
and un-permutes the rows after); one called on such rows alone, `experts(x)`, an equal share
each (Llama 4's: every token through every expert, `takes_rows`), the same with index i // (R / E):

    index = searchsorted(cumsum(num_tokens_per_expert), arange(R), right=True)   # (R,)
    experts = meshplan.experts(x, index[:, None], ones((R, 1)), [w1, w2, w3], path)

(rows past the counts' sum, a model's padding, get index E: no expert, output zero). What can
be a unit (`not_a_unit`: the experts stacked on dim 0 of every parameter, a forward taking
(tokens, top_k_index, top_k_weights) or (x, num_tokens_per_expert)), which modules the rules
govern, and the parameters a tensor rule may name.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator

import torch
from torch import nn

from meshplan.dsl import ast
from meshplan.dsl.check import Plan, PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.expert_list import ExpertList, problem
from meshplan.runtime.experts import EXPERT_COUNTS, takes_counts, takes_rows

_OP = "meshplan::experts"


@torch.library.custom_op(_OP, mutates_args=())
def _experts(
    tokens: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    params: list[torch.Tensor],
    path: str,
) -> torch.Tensor:
    raise AssertionError(f"{_OP} marks an experts module in a captured graph; the experts pass replaces it")


@_experts.register_fake
def _(tokens, top_k_index, top_k_weights, params, path):
    return torch.empty_like(tokens)  # (N, H): each token's weighted sum of its experts' outputs


MARKER = torch.ops.meshplan.experts.default


@torch.library.custom_op("meshplan::expert_rows", mutates_args=())
def _expert_rows(rows: torch.Tensor, params: list[torch.Tensor], path: str, expert: int) -> torch.Tensor:
    raise AssertionError("meshplan::expert_rows marks one expert of a list in a captured graph")


@_expert_rows.register_fake
def _(rows, params, path, expert):
    return torch.empty_like(rows)  # (R, H): an expert maps each row to a row of its width


# one expert of a list of experts (`ExpertList`) called on its rows by the parent's loop:
# expert_rows(rows, [stacked params], path, e); `rows.py` joins a list's calls into one MARKER
ROWS_MARKER = torch.ops.meshplan.expert_rows.default


def expert_modules(plan: Plan, model: nn.Module) -> dict[str, PlanRule]:
    """Module path -> the `experts` rule that governs it (the most specific one matching)."""
    from ...match import resolve

    resolution, _ = resolve(plan, [p for p, _ in model.named_modules()])
    return {
        path: rule
        for path, kinds in resolution.placements.items()
        if (rule := kinds.get("experts")) is not None
    }


def expert_parameters(plan: Plan, model: nn.Module) -> list[str]:
    """The parameters of every experts module an `experts` rule splits, by path: what a `column`
    or `row` rule may name (each expert's matrix split over a tensor axis: `expert_tensor_rules`)."""
    modules = dict(model.named_modules())
    return [
        f"{path}.{name}"
        for path, rule in expert_modules(plan, model).items()
        if rule.axis is not None and not_a_unit(modules[path], model) is None
        for name, _ in modules[path].named_parameters()
    ]


def argument_error(rule: PlanRule, name: str, message: str, hint: str) -> Diagnostic:
    """An error located at the experts rule's argument `name` (`capacity_factor=1.25`)."""
    assert isinstance(rule.action, ast.ExpertParallel)
    arg = rule.action.arg(name)
    assert arg is not None
    return Diagnostic(arg.span, message, hint=hint)


@contextlib.contextmanager
def experts_as_units(plan: Plan, model: nn.Module) -> Iterator[None]:
    """While capturing: every experts module an `experts` rule names calls the `meshplan.experts`
    operator instead of its forward (one that cannot be a unit keeps its forward; the pass says
    why). Over an axis of one rank too: the unit then runs the model's experts module whole,
    which also serves experts whose own code export cannot capture (Mixtral's eager loop)."""
    modules = dict(model.named_modules())
    patched = []
    for path, rule in expert_modules(plan, model).items():
        module = modules[path]
        if rule.axis is None or not_a_unit(module, model) is not None:
            continue
        if isinstance(module, ExpertList):  # the parent's loop calls each expert on its rows
            module.__dict__["call_expert"] = _rows_call(module, path)
        elif takes_counts(module):  # rows the model grouped by expert, and their counts
            module.forward = _grouped_forward(module, path)
        elif takes_rows(module):  # rows the model grouped by expert, an equal share each
            module.forward = _shares_forward(module, path, num_experts(module, model))
        else:
            module.forward = _unit_forward(module, path)  # an instance attribute: shadows the class's
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("call_expert", None) if isinstance(module, ExpertList) else delattr(
                module, "forward"
            )


def _unit_forward(module: nn.Module, path: str):
    signature = inspect.signature(module.forward)
    names = [name for name, _ in module.named_parameters()]

    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        tokens, top_k_index, top_k_weights = bound.args[:3]
        # read through the module at call time: export swaps its parameters for graph inputs
        return MARKER(tokens, top_k_index, top_k_weights, [module.get_parameter(n) for n in names], path)

    return forward


def _grouped_forward(module: nn.Module, path: str):
    signature = inspect.signature(module.forward)
    names = [name for name, _ in module.named_parameters()]

    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        x, counts = bound.args[:2]
        if not isinstance(counts, torch.Tensor) or counts.dim() != 1:
            raise TypeError(
                f"meshplan calls `{path}` as experts(x, num_tokens_per_expert): a 1-D tensor of counts"
            )
        rows = x.shape[0]  # (R, H) grouped by expert, maybe padded past the counts' sum
        ends = counts.to(torch.int64).cumsum(0)  # (E,) where each expert's rows end
        index = torch.searchsorted(ends, torch.arange(rows, device=x.device), right=True)  # (R,)
        params = [module.get_parameter(n) for n in names]  # at call time: export swaps them
        return MARKER(x, index[:, None], x.new_ones((rows, 1)), params, path)

    return forward


def _shares_forward(module: nn.Module, path: str, count: int | None):
    """`experts(x)` on rows grouped by expert, an equal share each (Llama 4's), as the operator:
    row i through expert i // (R / E), weight 1 (the model scaled the rows by their scores)."""
    names = [name for name, _ in module.named_parameters()]

    def forward(x):
        rows = x.shape[0]
        if count is None or rows % count:
            raise TypeError(
                f"meshplan calls `{path}` as experts(x) on {count} equal shares of rows: got {rows}"
            )
        index = torch.arange(rows, device=x.device) // (rows // count)  # (R,) each row's expert
        params = [module.get_parameter(n) for n in names]  # at call time: export swaps them
        return MARKER(x, index[:, None], x.new_ones((rows, 1)), params, path)

    return forward


def _rows_call(module: ExpertList, path: str):
    def call(e: int, rows: torch.Tensor, *rest, **kwargs):
        if rest or kwargs:
            raise TypeError(f"meshplan calls each expert of `{path}` with its rows only")
        return ROWS_MARKER(rows, [module.stacked(n) for n in module.names], path, e)

    return call


def num_experts(module: nn.Module, model: nn.Module) -> int | None:
    """A list of expert modules, or one module holding them (3-D weights, Mixtral's
    `num_experts`), or the model config's count."""
    if isinstance(module, nn.ModuleList):
        return len(module)
    for owner in (module, getattr(model, "config", None)):
        for attr in EXPERT_COUNTS:
            count = getattr(owner, attr, None)
            if isinstance(count, int) and count > 0:
                return count
    return None


def not_a_unit(module: nn.Module, model: nn.Module) -> str | None:
    """Why `module` cannot run split over experts, or None: it must take (tokens, top_k_index,
    top_k_weights) or rows grouped by expert and their counts (x, num_tokens_per_expert), and
    hold its experts stacked on dim 0 of every parameter."""
    if isinstance(module, nn.ModuleList):
        return f"its experts are a list of modules that cannot be stacked: {problem(module)}"
    if isinstance(module, nn.ModuleDict):
        return (
            "its experts are a dict of modules (Switch Transformers' layout), which meshplan does not "
            "stack: keep them in an nn.ModuleList the block indexes, or stacked on dim 0 of 3-D parameters"
        )
    count = num_experts(module, model)
    if count is None:
        return "it says nowhere how many experts it has (`num_experts`, or the model config's)"
    params = list(module.named_parameters())
    if not params:
        return "it has no parameters"
    for name, p in params:
        if p.dim() < 2 or p.shape[0] != count:
            return f"its parameter `{name}` {tuple(p.shape)} does not stack the {count} experts on dim 0"
    if takes_counts(module) or takes_rows(module):
        return None
    try:
        signature = inspect.signature(module.forward)
        signature.bind(0, 0, 0)
    except (TypeError, ValueError):
        return (
            "its forward takes neither (tokens, top_k_index, top_k_weights), (x, num_tokens_per_expert) "
            "nor (x) on rows grouped by expert"
        )
    return None


def experts_pattern(model: nn.Module) -> str:
    """The path pattern of the modules that hold experts stacked on dim 0 of every parameter
    (`model.layers.*.mlp.experts`), the first such; '' if none: what a rule making them units
    would name (capture's hint when the model's own experts loop cannot be captured)."""
    for path, module in model.named_modules():
        count = next((c for a in EXPERT_COUNTS if isinstance(c := getattr(module, a, None), int)), None)
        params = list(module.parameters(recurse=False))
        if count and count > 1 and params and all(p.dim() >= 2 and p.shape[0] == count for p in params):
            return re.sub(r"\.\d+(?=\.|$)", ".*", path)
    return ""
