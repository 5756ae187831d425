"""What a plan's tensor rules mean for each parameter: its placement over the tensor axis.

`tensor_specs` reads the winning `column`/`row`/`vocab`/`replicate` rule of every module and
turns it into a `Shard` or `Replicate()` per parameter, with the model's facts checked on
the way: heads divisible by the axis (GQA's key/value heads replicated when fewer than the
ranks), weights tied across modules placed alike, fused projections left to the pass. It
also collects the `sequence` rules, and returns one `TensorParallelSpec` per tensor axis,
which the tensor-parallel pass walks the graph with, axis after axis.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import torch
from torch import nn

from meshplan.dsl import ast
from meshplan.dsl.axes import axes_of
from meshplan.dsl.check import Plan, PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.expert_list import ExpertList
from meshplan.runtime.mesh import MeshLayout

from ...match import Resolution
from ...placement import REPLICATE, Placement, Shard
from .expert_tensor_rules import expert_split
from .spec import ParamPlacement, TensorParallelSpec
from .weights import Weights

_EMBEDDING_LIKE = (nn.Embedding,)


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, or Hugging Face's Conv1D (GPT-2), a linear layer whose weight is stored (in, out)."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def tensor_specs(
    plan: Plan, resolution: Resolution, model: nn.Module, layout: MeshLayout, weights: Weights
) -> tuple[list[TensorParallelSpec], list[Diagnostic]]:
    """One spec per mesh axis that tensor or context rules name, the context axes first, then
    the tensor axes in mesh order: each parameter's placement over that axis, from the winning
    tensor rules. A module has one winning tensor rule, so a parameter is split over at most
    one of them; the walk gives every tensor a placement on each.
    `weights` says which parameters the graph multiplies as weights, and how (`weights.py`):
    a `column`/`row` rule on a module other than a linear layer splits those of its own."""
    tensor_rules = [r for r in plan.rules if isinstance(r.action, ast.TensorParallel)]
    named = {r.axis for r in tensor_rules if r.axis}
    context = {r.axis for r in plan.rules_of("context") if r.axis and layout.size(r.axis) > 1}
    specs, diagnostics = [], []
    experts = {path: rule for path, kinds in resolution.placements.items() if (rule := kinds.get("experts"))}
    # the context axes first: they cut the token inputs, so a tensor axis's sequence shard is
    # always a cut inside theirs (`nested`), whatever order the mesh names them in
    inside = {a: layout.size(a) for a in layout.names if a in context}
    for axis in sorted(
        (a for a in layout.names if a in named or a in context), key=lambda a: a not in context
    ):
        if axis in context:
            specs.append(dataclasses.replace(_context_spec(plan, resolution, layout, axis), experts=experts))
            continue
        spec, found = _axis_spec(plan, resolution, model, layout, axis, weights)
        specs.append(dataclasses.replace(spec, experts=experts, nested=inside))
        diagnostics += found
    return specs, diagnostics


def _heads_split_by_tensor_axes(
    resolution: Resolution, layout: MeshLayout, modules: dict[str, PlanRule]
) -> dict[str, tuple[int, PlanRule]]:
    """The Ulysses modules among `modules` whose projections tensor rules of other axes split:
    module path -> the product of those axes' sizes (how many times fewer heads each of their
    ranks holds, Ulysses' to cut again) and the first such rule."""
    out = {}
    for path, rule in modules.items():
        if rule.action.mode != "ulysses":  # type: ignore[union-attr]
            continue
        inner: dict[str, PlanRule] = {}  # axis -> its first rule under the module (q_proj's)
        for p, kinds in resolution.placements.items():
            tensor = kinds.get("tensor")
            if (
                tensor is None
                or not p.startswith(f"{path}.")
                or not isinstance(tensor.action, ast.TensorParallel)
            ):
                continue
            if tensor.axis is not None and tensor.axis != rule.axis:
                inner.setdefault(tensor.axis, tensor)
        if inner:
            out[path] = (math.prod(layout.size(a) for a in inner), next(iter(inner.values())))
    return out


def _context_spec(plan: Plan, resolution: Resolution, layout: MeshLayout, axis: str) -> TensorParallelSpec:
    """Context parallelism over `axis`: every parameter whole, every activation cut by sequence
    from the token inputs on, and the attention modules the `context` rules name; the
    load-balanced layout unless a module uses Ulysses (or no attention is causal: the walk)."""
    modules = {
        path: kinds["context"]
        for path, kinds in resolution.placements.items()
        if "context" in kinds and kinds["context"].axis == axis
    }
    # Ulysses attends to the whole sequence on every rank (its heads only): nothing to balance,
    # and its all-to-alls move heads, so the axis keeps contiguous chunks with it
    # (and `layout=contiguous` asks for contiguous chunks; `check` refuses mixed layouts on an axis)
    balanced = all(
        rule.action.mode in ("ring", "all_gather") and rule.action.layout != "contiguous"  # type: ignore[union-attr]
        for rule in modules.values()
    )
    return TensorParallelSpec(
        axis,
        layout.size(axis),
        {},
        sequence_parallel=True,
        sequence_modules=modules,  # what a message about a sequence-cut tensor points at
        fallback_span=next(iter(modules.values())).span if modules else plan.mesh.span,
        context_modules=modules,
        balanced=balanced,
        heads_split=_heads_split_by_tensor_axes(resolution, layout, modules),
    )


def _axis_spec(
    plan: Plan, resolution: Resolution, model: nn.Module, layout: MeshLayout, axis: str, weights: Weights
) -> tuple[TensorParallelSpec, list[Diagnostic]]:
    diagnostics: list[Diagnostic] = []
    tensor_rules = [r for r in plan.rules if isinstance(r.action, ast.TensorParallel) and r.axis == axis]
    n = layout.size(axis)
    modules = dict(model.named_modules())
    params: dict[str, ParamPlacement] = {}
    replicated: dict[str, ParamPlacement] = {}  # kept whole by an explicit `replicate` rule
    in_experts: dict[str, dict[str, PlanRule]] = {}  # experts module -> its parameter -> rule
    row_biases: set[str] = set()  # experts' biases added after their row matrices
    for path, kinds in resolution.placements.items():
        rule = kinds.get("tensor")
        if path not in modules:  # a parameter of an experts module (`expert_tensor_rules`)
            owner = _owner(path, modules, resolution)
            if rule is not None:
                in_experts.setdefault(owner, {})[path.removeprefix(f"{owner}.")] = rule
            continue
        holder = _list_of_experts(path, modules)
        if holder is not None:  # `experts.gate_proj` of a stacked list: its experts' gate_proj
            if rule is not None:
                for pname, _ in modules[path].named_parameters():
                    in_experts.setdefault(holder, {})[f"{path}.{pname}".removeprefix(f"{holder}.")] = rule
            continue
        if rule is not None and isinstance(rule.action, ast.Replicate):
            for pname, _ in modules[path].named_parameters(recurse=False):
                replicated[f"{path}.{pname}"] = ParamPlacement(REPLICATE, rule)
        if rule is None or not isinstance(rule.action, ast.TensorParallel) or rule.axis != axis:
            continue
        module = modules[path]
        style = rule.action.style
        if style in ("column", "row") and not is_linear(module):
            placement = _weights_placements(style, module, path, rule, n, weights, diagnostics)
        else:
            placement = _module_placements(style, module, path, rule, n, diagnostics)
        for pname, p in placement.items():
            params[f"{path}.{pname}"] = ParamPlacement(p, rule)
    for owner, named in in_experts.items():
        split = [r for r in named.values() if isinstance(r.action, ast.TensorParallel) and r.axis == axis]
        if not split:
            continue
        experts = resolution.rule_for(owner, "experts")
        if (
            experts is not None and experts.axis is not None and axis in axes_of(experts.axis)
        ):  # not both ways
            first = min(split, key=lambda r: r.order)
            clash = Diagnostic(
                first.pattern_span,
                f"the experts of `{owner}` are split over `{axis}` and so are their matrices: "
                "one axis holds other experts or slices of the same ones, not both",
                hint="split the matrices over another tensor axis, or the experts over another axis",
                related=((experts.span, f"the experts are split over `{axis}` here"),),
            )
            diagnostics.append(_once_per_rule(clash, owner, in_experts))
            continue
        placed, biases, found = expert_split(owner, modules[owner], named, axis, n)
        diagnostics += [_once_per_rule(d, owner, in_experts) for d in found]
        params.update({f"{owner}.{name}": ParamPlacement(p, named[name]) for name, p in placed.items()})
        row_biases |= {f"{owner}.{name}" for name in biases}
    diagnostics = list(dict.fromkeys(diagnostics))  # an experts problem, once per rule
    diagnostics = _collapse_repeats(diagnostics)
    heads = _check_heads(plan, model, axis, n, tensor_rules)
    diagnostics = _behind_root_cause(heads, diagnostics, model) + heads
    diagnostics += _check_ties(model, {**replicated, **params})
    _share_tied_placements(model, params)
    kv_replicas = _replicate_kv_heads(model, n, params, modules)
    seq_rules = [r for r in plan.rules if isinstance(r.action, ast.SequenceParallel) and r.axis == axis]
    sequence_modules = {
        p: k["sequence"]
        for p, k in resolution.placements.items()
        if "sequence" in k and k["sequence"].axis == axis
    }
    spec = TensorParallelSpec(
        axis,
        n,
        params,
        sequence_parallel=bool(seq_rules),
        sequence_modules=sequence_modules,
        fallback_span=plan.mesh.span,
        kv_replicas=kv_replicas,
        row_biases=row_biases,
    )
    return spec, diagnostics


def _once_per_rule(
    diagnostic: Diagnostic, owner: str, in_experts: Mapping[str, Mapping[str, PlanRule]]
) -> Diagnostic:
    """An experts module's problem, said for every module its rules match alike: the first one
    named, "and N more like it" (equal diagnostics then fold into one)."""
    rules = set(map(id, in_experts[owner].values()))
    alike = [o for o, named in in_experts.items() if set(map(id, named.values())) == rules]
    if len(alike) < 2:
        return diagnostic
    message = diagnostic.message.replace(f"`{owner}`", f"`{alike[0]}` and {len(alike) - 1} more like it")
    return dataclasses.replace(diagnostic, message=message)


def _list_of_experts(path: str, modules: Mapping[str, nn.Module]) -> str | None:
    """The stacked list of experts (`ExpertList`) a module inside it belongs to, by path: its
    submodules hold each expert's parameters stacked (`experts.gate_proj` holds `weight`
    (E, out, in)), so a rule naming one names that module of every expert."""
    ancestor = path.rpartition(".")[0]
    while ancestor:
        if isinstance(modules.get(ancestor), ExpertList):
            return ancestor
        ancestor = ancestor.rpartition(".")[0]
    return None


def _owner(parameter: str, modules: Mapping[str, nn.Module], resolution: Resolution) -> str:
    """The experts module holding a parameter, by path (a stacked list of experts holds
    `gate_proj.weight` in a submodule of its own), else the module holding it."""
    owner = parameter.rpartition(".")[0]
    while owner not in modules:
        owner = owner.rpartition(".")[0]
    ancestor = owner
    while ancestor:
        if resolution.rule_for(ancestor, "experts") is not None:
            return ancestor
        ancestor = ancestor.rpartition(".")[0]
    return owner


def _module_placements(
    style: str, module: nn.Module, path: str, rule: PlanRule, n: int, diagnostics: list[Diagnostic]
) -> Mapping[str, Placement]:
    """Which parameters of the module are split, and along which dim, for a tensor rule."""
    kind = type(module).__name__
    if style == "vocab" and not (is_linear(module) or isinstance(module, _EMBEDDING_LIKE)):
        diagnostics.append(
            Diagnostic(
                rule.pattern_span, f"`vocab` needs an embedding or an LM head, but `{path}` is a {kind}"
            )
        )
        return {}
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # a linear layer's or an embedding's (checked above)
    dim = 1 if style == "row" else 0
    if _is_conv1d(module):
        dim = 1 - dim  # the weight is stored transposed: (in, out)
    if style == "vocab" and weight.shape[dim] % n:  # the last ranks' chunks are zero-padded
        padded = Shard(dim, padded=weight.shape[dim])
        bias = getattr(module, "bias", None)
        return {"weight": padded} | ({"bias": Shard(0, padded=bias.shape[0])} if bias is not None else {})
    if not _divides(style, path, weight.shape[dim], n, rule, diagnostics):
        return {}
    out: dict[str, Placement] = {"weight": Shard(dim)}
    if getattr(module, "bias", None) is not None:
        out["bias"] = REPLICATE if style == "row" else Shard(0)
    return out


def _weights_placements(
    style: str,
    module: nn.Module,
    path: str,
    rule: PlanRule,
    n: int,
    weights: Weights,
    diagnostics: list[Diagnostic],
) -> Mapping[str, Placement]:
    """A `column`/`row` rule on a module that is not a linear layer: the parameters of its own
    that its forward multiplies its input by (`weights.py`: `F.linear` on
    nn.MultiheadAttention's packed `in_proj_weight`, `x @ self.weight.T`) are split as a linear
    layer's would be, and the biases added to their products with them; nothing else of it."""
    own = dict(module.named_parameters(recurse=False))
    uses = {name: use for name in own if (use := weights.uses.get(f"{path}.{name}")) is not None}
    if not uses:
        linears = [name for name, m in module.named_modules() if name and is_linear(m)]
        hint = (
            f"linear layers inside it: {', '.join(linears[:8])}"
            if linears
            else "column and row splits apply to linear layers: nn.Linear, or a module whose "
            "forward multiplies its input by a weight of its own (F.linear, @, matmul)"
        )
        diagnostics.append(
            Diagnostic(
                rule.pattern_span,
                f"`{style}` needs a linear layer, but `{path}` is a {type(module).__name__} "
                "that multiplies by no weight of its own",
                hint=hint,
            )
        )
        return {}
    out: dict[str, Placement] = {}
    blocks: dict[str, tuple[int, ...]] = {}  # a packed weight's pieces, cut alike by its bias
    for name, use in uses.items():
        dim = use.out_dim if style == "column" else use.in_dim
        size = own[name].shape[dim]
        if not _divides(style, f"{path}.{name}", size, n, rule, diagnostics):
            return {}
        if style == "column" and use.pieces > 1 and dim == 0:  # each piece split by its heads
            blocks[name] = (size // use.pieces,) * use.pieces
        out[name] = Shard(dim, blocks.get(name, ()))
    for name in own:
        weight = weights.biases.get(f"{path}.{name}", "").removeprefix(f"{path}.")
        packed = weights.bias_pieces.get(f"{path}.{name}", 1)
        if weight in uses:
            size = own[name].shape[0]
            pieces = blocks.get(weight, ()) or ((size // packed,) * packed if packed > 1 else ())
            out[name] = REPLICATE if style == "row" else Shard(0, pieces)
    return out


def _divides(style: str, what: str, size: int, n: int, rule: PlanRule, diagnostics: list[Diagnostic]) -> bool:
    if size % n == 0:
        return True
    features = {"column": "output features", "row": "input features"}[style]
    diagnostics.append(
        Diagnostic(
            rule.span,
            f"`{what}` has {size} {features}, not divisible by {n} ranks over `{rule.axis}`",
            hint="pick a tensor-parallel size that divides it",
        )
    )
    return False


_NOT_DIVISIBLE = re.compile(
    r"^`(?P<path>[^`]+)`(?: and (?P<more>\d+) more like it)? ha(?:s|ve) (?P<size>\d+) (?P<rest>.*not divisible by .*)$"
)


def _collapse_repeats(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """One error per rule for the same size problem in every layer it matches:
    "`layers.0.mlp.up_proj` and 7 more like it have 128 output features, not divisible by 3"."""
    groups: dict[tuple, list[Diagnostic]] = {}
    out: list[Diagnostic] = []
    for d in diagnostics:
        m = _NOT_DIVISIBLE.match(d.message)
        if m is None:
            out.append(d)
            continue
        key = (d.span, m["size"], m["rest"])
        if key not in groups:
            groups[key] = []
            out.append(d)
        groups[key].append(d)
    for (_, size, rest), group in groups.items():
        if len(group) > 1:
            first = _NOT_DIVISIBLE.match(group[0].message)
            assert first is not None
            message = f"`{first['path']}` and {len(group) - 1} more like it have {size} {rest}"
            out[out.index(group[0])] = dataclasses.replace(group[0], message=message)
    return out


def _behind_root_cause(
    heads: list[Diagnostic], diagnostics: list[Diagnostic], model: nn.Module
) -> list[Diagnostic]:
    """When the head count does not divide, every projection sized in heads fails to divide as
    a consequence: leave those out, and count them on the root cause."""
    config = getattr(model, "config", None)
    hidden, num_heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not heads or not isinstance(hidden, int) or not isinstance(num_heads, int):
        return diagnostics
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    kept, hidden_away = [], 0
    for d in diagnostics:
        m = _NOT_DIVISIBLE.match(d.message)
        if m is not None and int(m["size"]) % head_dim == 0 and "attn" in m["path"]:
            hidden_away += 1 + int(m["more"] or 0)
        else:
            kept.append(d)
    if hidden_away:
        root = heads[0]
        heads[0] = dataclasses.replace(
            root, message=f"{root.message} (so {hidden_away} attention projections do not split either)"
        )
    return kept


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of each parameter that has more than one (tied weights), in named_parameters order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _check_ties(model: nn.Module, params: dict[str, ParamPlacement]) -> list[Diagnostic]:
    """Tied weights are one tensor: a rule on any owner places it (BERT's MLM decoder bias is
    `cls.predictions.bias` too), and rules on two owners must agree."""
    out = []
    for group in _tied_groups(model):
        placed = {name: params[name] for name in group if name in params}
        kinds = {str(pp.placement) for pp in placed.values()}
        if len(kinds) > 1:
            (first_name, first), *rest = placed.items()
            other_name, other = next((n, pp) for n, pp in rest if pp.placement != first.placement)
            out.append(
                Diagnostic(
                    other.rule.span,
                    f"`{other_name}` is tied to `{first_name}`, which another rule places differently "
                    f"({other.placement} vs {first.placement})",
                    hint="tied weights are one tensor: give both owners the same rule, or a rule to one of them",
                    related=((first.rule.span, f"`{first_name}` is placed here"),),
                )
            )
    return out


def _share_tied_placements(model: nn.Module, params: dict[str, ParamPlacement]) -> None:
    """Export names a tied weight by one of its names; make every name carry the placement."""
    for group in _tied_groups(model):
        placed = next((params[n] for n in group if n in params), None)
        if placed is not None:
            for name in group:
                params.setdefault(name, placed)


def _replicate_kv_heads(
    model: nn.Module, n: int, params: dict[str, ParamPlacement], modules: dict[str, nn.Module]
) -> dict[str, int]:
    """GQA with fewer key/value heads than ranks (Qwen2's 2 at tp=4): the key and value
    projections stay whole and each rank keeps the head its query heads use, n / kv ranks per
    head, as Megatron and vLLM replicate them. Returns weight name -> ranks per head; the
    projections' placements become Replicate() (the pass slices their outputs)."""
    config = getattr(model, "config", None)
    kv, heads = getattr(config, "num_key_value_heads", None), getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if (
        not (isinstance(kv, int) and isinstance(heads, int) and isinstance(hidden, int))
        or kv >= n
        or n % kv
        or kv == heads
    ):
        return {}
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    out = {}
    for name, pp in list(params.items()):
        path = name.rpartition(".")[0]
        module = modules.get(path)
        if (
            name.endswith(".weight")
            and isinstance(module, nn.Linear)
            and pp.placement == Shard(0)
            and module.out_features == kv * head_dim
        ):
            out[name] = n // kv
            params[name] = ParamPlacement(REPLICATE, pp.rule)
            if f"{path}.bias" in params:
                params[f"{path}.bias"] = ParamPlacement(REPLICATE, params[f"{path}.bias"].rule)
    return out


def _check_heads(plan: Plan, model: nn.Module, axis: str, n: int, rules: list[PlanRule]) -> list[Diagnostic]:
    """Attention heads and kv heads must divide by the tensor-parallel size (config-based models)."""
    config = getattr(model, "config", None)
    out = []
    for attr, what in (
        ("num_attention_heads", "attention heads"),
        ("num_key_value_heads", "key/value heads"),
    ):
        count = getattr(config, attr, None)
        replicated = attr == "num_key_value_heads" and isinstance(count, int) and n % count == 0
        if isinstance(count, int) and count % n and not replicated:
            rule = next((r for r in rules if "attn" in r.pattern), rules[0])
            out.append(
                Diagnostic(
                    rule.span,
                    f"the model has {count} {what}, not divisible by {n} ranks over `{axis}`",
                    hint=f"use a tensor-parallel size that divides {count}"
                    + (
                        " (or a multiple of it: kv heads are replicated)"
                        if attr == "num_key_value_heads"
                        else ""
                    ),
                )
            )
    return out
