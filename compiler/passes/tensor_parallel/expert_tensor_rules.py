"""Tensor parallelism inside experts: what `column` and `row` rules on an experts module's
stacked matrices mean.

An experts module (Hugging Face's MoE layout, `examples/models/moe.py`) holds every expert's
matrices stacked on dim 0 of 3-D parameters, so its linear layers are not modules a rule could
name; the rules name its parameters instead, each expert's matrix split as a linear layer's
weight would be:

    layers.*.mlp.experts:              experts over ep
    layers.*.mlp.experts.gate_up_proj: column over tp     # (E, 2I, H): each expert's outputs split
    layers.*.mlp.experts.down_proj:    row over tp        # (E, H, I):  each expert's inputs split

Each rank of `tp` then runs the model's own experts code on its slice of every expert (the
intermediate features I/tp) and the unit's output is a partial sum over `tp`, reduced once
after the experts combine their tokens (the tensor-parallel walk's rule for the unit,
`experts.py`). Which dim is an expert's output comes from the shapes:
the token width H is the input of every column matrix and the output of every row matrix,
weights stored (E, out, in) as `F.linear` reads them or transposed (E, in, out) as a grouped
matmul reads them (a module's own `is_transposed` says which when I = H). A column matrix
wider than the row's input by a factor k (Mixtral's gate and up projections fused: 2I) is k
blocks, each split alike, so every rank keeps its slice of the gate and of the up projection.
A bias added after the row matrix (GPT-OSS's `down_proj_bias`, (E, H)) takes a `row` rule too:
it stays whole on every rank, and each rank's experts add 1/n of it to their partial sum
(`TensorParallelSpec.row_biases`), so the sum over the axis adds it once; its gradient, 1/n
of the whole on each rank, is summed over the axis by the gradient sync.

The experts' code is the model's, so the split is checked on it before it is used: one expert
with random float64 weights and a few tokens, run whole and as the sum of its `tp` slices
(`_probe`). A layout the slices do not add up to (gate and up interleaved rather than in two
halves, a bias added after the row matrix) is a located error, never a silently wrong model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from meshplan.dsl import ast
from meshplan.dsl.check import PlanRule
from meshplan.dsl.errors import Diagnostic, Span
from meshplan.runtime.experts import local_experts, takes_counts, takes_rows
from meshplan.runtime.shards import Cut, shard_of

from ...placement import REPLICATE, Placement, Shard

_PROBE_TOKENS = 5


def expert_split(
    path: str, module: nn.Module, rules: Mapping[str, PlanRule], axis: str, n: int
) -> tuple[dict[str, Placement], set[str], list[Diagnostic]]:
    """The placement over `axis` of each parameter of the experts module at `path`, from the
    tensor rules that name them (`rules`: parameter name -> rule), the biases added after the
    row matrices (whole, each rank adding 1/n of them), or the located errors."""
    params = dict(module.named_parameters())
    first = min(rules.values(), key=lambda r: r.order)
    split = {name: r for name, r in rules.items() if _style(r) != "replicate"}
    if not split:
        return {}, set(), []
    problem = _rules_problem(path, params, rules, split, axis)
    if problem is not None:
        return _refused(first.pattern_span, *problem)
    columns = [name for name, r in split.items() if _style(r) == "column"]
    rows = [name for name, r in split.items() if _style(r) == "row"]
    unfit: list[str] = []  # why the shapes do not fit an orientation
    failed: list[str] = []  # why an orientation that fits does not add up
    for transposed in _orientations(module):
        shaped = _layout(params, columns, rows, transposed)
        if isinstance(shaped, str):
            unfit.append(shaped)
            continue
        layout, width, biases = shaped
        uneven = next((f for f in _chunks(params, layout) if f % n), None)
        if uneven is not None:
            return _refused(
                split[rows[0]].span,
                f"the experts of `{path}` have {uneven} intermediate features, not divisible by "
                f"{n} ranks over `{axis}`",
                "pick a tensor-parallel size that divides it",
            )
        for tried in (layout, _interleaved(layout)):
            why = _probe(module, params, tried, biases, width, n)
            if why is None:
                return {**tried, **dict.fromkeys(biases, REPLICATE)}, biases, []
            failed.append(why)
    return _refused(
        first.pattern_span,
        f"the experts of `{path}` cannot be split over `{axis}` as the rules say: {(failed or unfit)[0]}",
        "each expert's first matrices `column`, its last `row`, as for an MLP's linear layers "
        "(a bias after the row matrix `row` too)",
    )


def _refused(span: Span, message: str, hint: str) -> tuple[dict[str, Placement], set[str], list[Diagnostic]]:
    return {}, set(), [Diagnostic(span, message, hint=hint)]


def _style(rule: PlanRule) -> str:
    assert isinstance(rule.action, (ast.TensorParallel, ast.Replicate))
    return rule.action.style if isinstance(rule.action, ast.TensorParallel) else "replicate"


def _rules_problem(
    path: str,
    params: Mapping[str, torch.Tensor],
    rules: Mapping[str, PlanRule],
    split: Mapping[str, PlanRule],
    axis: str,
) -> tuple[str, str] | None:
    """(message, hint) when the rules cannot describe an expert's MLP split over `axis`."""
    vocab = next((name for name, r in split.items() if _style(r) == "vocab"), None)
    if vocab is not None:
        return (
            f"`vocab` splits an embedding or an LM head, not the experts' `{vocab}`",
            "use `column` or `row`",
        )
    others = {r.axis for r in split.values()} - {axis}
    if others:
        return (
            f"the matrices of `{path}` are split over `{axis}` and `{others.pop()}`",
            "split every matrix of an experts module over one tensor axis",
        )
    missing = [name for name in params if name not in split]
    if missing:
        named = ", ".join(f"`{m}`" for m in missing)
        return (
            f"the experts of `{path}` have matrices split over `{axis}` and {named} whole: every rank "
            f"of `{axis}` would add the whole of what {'they compute' if len(missing) > 1 else 'it computes'}",
            f"give {named} a `column` or `row` rule too (a bias is split with its column matrix; "
            "one added after the row matrix takes `row`)",
        )
    styles = {_style(r) for r in split.values()}
    if styles != {"column", "row"}:
        return (
            f"the experts of `{path}` are split by {styles.pop()} only: their outputs must come out as "
            "partial sums, from a column split followed by a row split",
            "split the first matrices `column` and the last `row`",
        )
    return None


def _orientations(module: nn.Module) -> tuple[bool, ...]:
    """Whether the weights are stored (E, in, out): both, unless the module says."""
    said = getattr(module, "is_transposed", None)
    return (said,) if isinstance(said, bool) else (False, True)


def _layout(
    params: Mapping[str, torch.Tensor], columns: list[str], rows: list[str], transposed: bool
) -> tuple[dict[str, Shard], int, set[str]] | str:
    """Each split parameter's `Shard`, the token width H and the biases added after the row
    matrices (`row` rules on (E, H) parameters), if the shapes fit this orientation; else why not."""
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    shapes = {name: tuple(params[name].shape) for name in (*columns, *rows)}
    bad = next((name for name in rows if len(shapes[name]) not in (2, 3)), None)
    if bad is not None:
        return (
            f"`{bad}` {shapes[bad]} is split `row`: neither a stacked matrix (E, out, in) nor a bias (E, out)"
        )
    biases = {name for name in rows if len(shapes[name]) == 2}
    rows = [name for name in rows if name not in biases]
    if not rows:
        return "no `row` parameter is a stacked matrix (E, out, in)"
    inner = {shapes[name][in_dim] for name in rows}
    width = {shapes[name][out_dim] for name in rows}
    width |= {shapes[name][in_dim] for name in columns if len(shapes[name]) == 3}
    if not any(len(shapes[name]) == 3 for name in columns):
        return "no `column` parameter is a stacked matrix (E, out, in)"
    width |= {shapes[name][1] for name in biases}
    if len(inner) > 1 or len(width) > 1:
        return f"the matrices' shapes {', '.join(f'{n} {s}' for n, s in shapes.items())} do not chain"
    (features,) = inner
    layout: dict[str, Shard] = {name: Shard(in_dim) for name in rows}
    for name in columns:
        dim = out_dim if len(shapes[name]) == 3 else 1  # a bias (E, out)
        size = shapes[name][dim]
        if len(shapes[name]) not in (2, 3) or size % features:
            return f"`{name}` {shapes[name]} does not feed the row matrices' {features} input features"
        blocks = size // features
        layout[name] = Shard(dim, (features,) * blocks if blocks > 1 else ())
    return layout, width.pop(), biases


def _interleaved(layout: dict[str, Shard]) -> dict[str, Shard]:
    """The layout with fused column matrices cut as one block: gate and up projections
    interleaved feature by feature (GPT-OSS's `gate_up[..., ::2]`, `[..., 1::2]`), whose
    contiguous slices hold pairs of both. The probe decides which of the two the code reads."""
    return {name: Shard(p.dim) for name, p in layout.items()}


def _chunks(params: Mapping[str, torch.Tensor], layout: Mapping[str, Shard]) -> list[int]:
    """The global size of every block each split cuts."""
    out = []
    for name, p in layout.items():
        out += list(p.blocks) or [params[name].shape[p.dim]]
    return out


def _probe(
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    layout: Mapping[str, Shard],
    biases: set[str],
    width: int,
    n: int,
) -> str | None:
    """Why the model's experts code, on one expert's slices (and 1/n of each bias added after
    the row matrices), does not add up to the whole expert, or None. Random float64 values: a
    wrong split is off by O(1), rounding by 1e-15."""
    one = local_experts(module, 1)
    gen = torch.Generator().manual_seed(0)
    whole = {
        name: torch.randn((1, *p.shape[1:]), generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5
        for name, p in params.items()
    }
    tokens = torch.randn((_PROBE_TOKENS, width), generator=gen, dtype=torch.float64)
    index = torch.zeros((_PROBE_TOKENS, 1), dtype=torch.int64)
    weights = torch.ones((_PROBE_TOKENS, 1), dtype=torch.float64)
    # rows grouped by expert and their counts (torchtitan's layout), or tokens and their routing
    args = (
        (tokens, torch.tensor([_PROBE_TOKENS]))
        if takes_counts(one)
        else (tokens,)
        if takes_rows(one)
        else (tokens, index, weights)
    )
    try:
        with torch.no_grad():
            full = torch.func.functional_call(one, whole, args)
            parts = sum(
                torch.func.functional_call(
                    one,
                    {
                        name: t / n
                        if name in biases
                        else shard_of(t, Cut(layout[name].dim, layout[name].blocks), r, n)
                        for name, t in whole.items()
                    },
                    args,
                )
                for r in range(n)
            )
    except Exception as e:  # the model's code: anything may fail on sliced weights
        return f"its code fails on one rank's slices ({type(e).__name__}: {e})"
    assert isinstance(parts, torch.Tensor)
    error = (parts - full).abs().max().item()
    scale = full.abs().max().item() or 1.0
    if error > 1e-9 * scale:
        return (
            f"the sum of the {n} ranks' slices differs from the whole expert by {error / scale:.2g} "
            "(relative), tried on random values"
        )
    return None
