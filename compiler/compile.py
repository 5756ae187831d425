"""The compiler pipeline: checked plan + captured model -> the SPMD program and its facts.

    plan = load_plan("examples/llama_tp.plan", world_size=2)
    source = load_model("examples/models/llama.py:build")
    compiled = compile_plan(plan, source)
    program = build_rank_program(compiled, source.model.state_dict(), rank=0, mesh=device_mesh)

The passes run in this order, each for a reason:

1. capture   torch.export, then `normalize` (flat inputs/outputs, no guard nodes).
2. resolve   rules -> modules; unmatched and conflicting rules are reported with the
             model's problems in one error.
3. mixed precision: casts from fp32 parameters to the compute dtype; before tensor
             parallelism, so the collectives it inserts carry the compute dtype.
4. tensor parallel (and sequence parallel): needs resolved parameter placements;
             it must run before any pass that reads local shapes.
5. activation checkpointing: outlines each region into a submodule called through
             torch.utils.checkpoint; last, because later passes would not look inside
             regions, and after tensor parallelism so its collectives are recomputed too.
             The ledger is built after it and counts recomputed collectives.
6. ZeRO (`data_parallel { zero = N }`): gather/release nodes around each layer's
             parameter uses; last, because a checkpointed layer must be one call node
             (its recomputation then runs between the release's backward gather and the
             layer's backward, never re-gathering or freeing).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from meshplan.dsl import ast
from meshplan.dsl.check import Plan, PlanRule
from meshplan.dsl.errors import Diagnostic, PlanValidationError
from meshplan.runtime.mesh import MeshLayout
from meshplan.runtime.shards import Cut, shard_of

from .capture import Captured, ModelSource, capture
from .executable import Executable
from .graph import for_rank, keep_loss_output, normalize
from .ledger import DataParallelFacts, Ledger, build_ledger
from .lint import lint
from .match import Resolution, resolve
from .passes.checkpoint import CheckpointError, bind_regions, checkpoint_regions, regions_from
from .passes.precision import DTYPES, PrecisionSpec, cast_floating, mixed_precision
from .passes.tensor_parallel import ParamPlacement, TensorParallelError, TensorParallelSpec, tensor_parallel
from .passes.zero import ZeroSpec, shard_parameters
from .placement import REPLICATE, Placement, Shard
from .unsupported import check_unsupported


@dataclass
class Compiled:
    """The result of compiling a plan for a model: one SPMD program plus what explains it."""

    plan: Plan
    layout: MeshLayout
    captured: Captured
    resolution: Resolution
    graph: fx.GraphModule  # shared by every rank; parameters are materialized per rank
    param_placements: dict[str, dict[str, Placement]]  # param/buffer name -> {axis: placement}
    param_rules: dict[str, PlanRule]
    tensor_axis: str | None
    ledger: Ledger
    warnings: list[Diagnostic] = field(default_factory=list)
    kv_replicas: dict[str, int] = field(default_factory=dict)  # GQA: kv weight -> ranks per head
    source: ModelSource | None = None  # the model (fp32, unpartitioned) and the inputs compiled for


def compile_plan(plan: Plan, source: ModelSource, *, world_size: int | None = None) -> Compiled:
    """Compile `plan` for the model in `source`. Raises `PlanError` listing every problem found."""
    layout = _layout(plan, world_size)
    compute = DTYPES[plan.precision.compute]
    # Capture in the compute dtype, so the model's own casts (a norm's `.to(input_dtype)`)
    # are recorded in it; the rank program still gets the fp32 parameters (master weights).
    traced = source.model if compute == torch.float32 else cast_floating(copy.deepcopy(source.model), compute)
    captured = capture(traced, source.args, source.kwargs)
    gm = keep_loss_output(normalize(captured.program.module()))
    lint(gm, layout, after="capture")
    resolution, diagnostics = resolve(plan, captured.modules)
    gm = mixed_precision(gm, _precision_spec(plan, resolution))
    lint(gm, layout, after="precision")
    tensor_axis, spec, more = _tensor_spec(plan, resolution, source.model, layout)
    diagnostics += more
    warnings: list[Diagnostic] = []
    if not any(d.severity == "error" for d in diagnostics) and spec is not None:
        try:
            gm, found = tensor_parallel(gm, spec)
            diagnostics += found
            lint(gm, layout, after="tensor-parallel")
        except TensorParallelError as e:
            diagnostics.append(e.diagnostic)
    if not any(d.severity == "error" for d in diagnostics):
        try:
            gm = checkpoint_regions(gm, regions_from(plan, resolution))
            lint(gm, layout, after="checkpoint")
        except CheckpointError as e:
            diagnostics.append(e.diagnostic)
    diagnostics += check_unsupported(plan, source, resolution)
    errors = [d for d in diagnostics if d.severity == "error"]
    if errors:
        raise PlanValidationError(diagnostics, {plan.path: plan.source})
    dp = plan.data_parallel
    if dp is not None and dp.zero > 0 and layout.size(dp.axis) > 1:
        gm = shard_parameters(gm, ZeroSpec(dp.axis, dp.zero, f"{dp.span.path}:{dp.span.line}"))
        lint(gm, layout, after="zero")
    warnings = [d for d in diagnostics if d.severity == "warning"]
    placements = {name: {tensor_axis: pp.placement} for name, pp in (spec.params if spec else {}).items()}
    rules = {name: pp.rule for name, pp in (spec.params if spec else {}).items() if pp.rule is not None}
    ledger = build_ledger(
        gm,
        layout,
        accumulation=plan.train.gradient_accumulation,
        data=_data_parallel_facts(plan, gm, source.model, placements, layout),
    )
    kv = spec.kv_replicas if spec else {}
    return Compiled(
        plan, layout, captured, resolution, gm, placements, rules, tensor_axis, ledger, warnings, kv, source
    )


def _data_parallel_facts(
    plan: Plan,
    gm: fx.GraphModule,
    model: nn.Module,
    placements: dict[str, dict[str, Placement]],
    layout: MeshLayout,
) -> DataParallelFacts | None:
    """The plan's data-parallel setting and one rank's trainable params, as meta tensors of
    their local shapes in the order the rank program holds them."""
    dp = plan.data_parallel
    if dp is None:
        return None
    from meshplan.runtime.buckets import decays

    full = dict(model.named_parameters(remove_duplicate=False))
    params: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}  # a tied param is named by its first read, as the rank program names it
    aliases: dict[str, str] = {}
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op != "get_attr" or name not in full or not full[name].requires_grad:
            continue
        aliases[name] = first.setdefault(id(full[name]), name)
        if aliases[name] != name:
            continue
        shape = list(full[name].shape)
        for axis, p in placements.get(name, {}).items():
            if isinstance(p, Shard):
                shape[p.dim] = p.chunk(shape[p.dim], layout.size(axis))
        params[name] = torch.empty(shape, dtype=full[name].dtype, device="meta")
    reduce = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.precision.reduce]
    where = f"{dp.span.path}:{dp.span.line}"
    # the gradient norm sums squares per set of axes that shard a parameter, and one for the rest
    kinds = {
        tuple(a for a, p in placements.get(name, {}).items() if isinstance(p, Shard) and layout.size(a) > 1)
        for name in params
    }
    norm_sums = len(kinds - {()}) + 1
    return DataParallelFacts(
        dp.axis, dp.zero, dp.bucket_bytes, reduce, list(params.items()), aliases, decays, where, norm_sums
    )


def _precision_spec(plan: Plan, resolution: Resolution) -> PrecisionSpec:
    overrides = {}
    for path, kinds in resolution.placements.items():
        rule = kinds.get("dtype")
        if rule is not None and isinstance(rule.action, ast.DtypeOverride):
            overrides[path] = (DTYPES[rule.action.dtype], rule)
    return PrecisionSpec(DTYPES[plan.precision.compute], overrides)


def _layout(plan: Plan, world_size: int | None) -> MeshLayout:
    sizes = []
    for axis in plan.mesh.axes:
        if axis.size is None:
            raise PlanValidationError(
                [
                    Diagnostic(
                        axis.span,
                        f"axis `{axis.name}` is `*` but no world size was given",
                        hint="pass --world-size N (or launch with torchrun, which sets it)",
                    )
                ],
                {plan.path: plan.source},
            )
        sizes.append(axis.size)
    if world_size is not None and math.prod(sizes) != world_size:
        raise AssertionError("the checker resolves the mesh against the world size")
    return MeshLayout(plan.mesh.names, tuple(sizes))


_EMBEDDING_LIKE = (nn.Embedding,)


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, or Hugging Face's Conv1D (GPT-2), a linear layer whose weight is stored (in, out)."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _tensor_spec(
    plan: Plan, resolution: Resolution, model: nn.Module, layout: MeshLayout
) -> tuple[str | None, TensorParallelSpec | None, list[Diagnostic]]:
    """Parameter placements over the tensor axis, from the winning tensor rules."""
    diagnostics: list[Diagnostic] = []
    tensor_rules = [r for r in plan.rules if isinstance(r.action, ast.TensorParallel)]
    axes = sorted({r.axis for r in tensor_rules if r.axis})
    if not axes:
        return None, None, diagnostics
    if len(axes) > 1:
        diagnostics.append(
            Diagnostic(
                tensor_rules[-1].span,
                f"tensor rules use two axes ({', '.join(axes)}); meshplan splits tensors over one axis",
                hint="use one tensor axis",
            )
        )
        return None, None, diagnostics
    axis = axes[0]
    n = layout.size(axis)
    modules = dict(model.named_modules())
    params: dict[str, ParamPlacement] = {}
    replicated: dict[str, ParamPlacement] = {}  # kept whole by an explicit `replicate` rule
    for path, kinds in resolution.placements.items():
        rule = kinds.get("tensor")
        if rule is not None and isinstance(rule.action, ast.Replicate):
            for pname, _ in modules[path].named_parameters(recurse=False):
                replicated[f"{path}.{pname}"] = ParamPlacement(REPLICATE, rule)
        if rule is None or not isinstance(rule.action, ast.TensorParallel):
            continue
        module = modules[path]
        style = rule.action.style
        placement = _module_placements(style, module, path, rule, n, diagnostics)
        for pname, p in placement.items():
            params[f"{path}.{pname}"] = ParamPlacement(p, rule)
    diagnostics = _collapse_repeats(diagnostics)
    heads = _check_heads(plan, model, axis, n, tensor_rules)
    diagnostics = _behind_root_cause(heads, diagnostics, model) + heads
    diagnostics += _check_ties(model, {**replicated, **params})
    _share_tied_placements(model, params)
    kv_replicas = _replicate_kv_heads(model, n, params, modules)
    seq_rules = [r for r in plan.rules if isinstance(r.action, ast.SequenceParallel) and r.axis == axis]
    sequence_modules = {p: k["sequence"] for p, k in resolution.placements.items() if "sequence" in k}
    spec = TensorParallelSpec(
        axis,
        n,
        params,
        sequence_parallel=bool(seq_rules),
        sequence_modules=sequence_modules,
        fallback_span=plan.mesh.span,
        kv_replicas=kv_replicas,
    )
    return axis, spec, diagnostics


def _module_placements(
    style: str, module: nn.Module, path: str, rule: PlanRule, n: int, diagnostics: list[Diagnostic]
) -> dict[str, Placement]:
    """Which parameters of the module are split, and along which dim, for a tensor rule."""
    kind = type(module).__name__
    if style in ("column", "row") and not is_linear(module):
        linears = [name for name, m in module.named_modules() if name and is_linear(m)]
        hint = (
            f"linear layers inside it: {', '.join(linears[:8])}"
            if linears
            else "column and row splits apply to nn.Linear layers"
        )
        diagnostics.append(
            Diagnostic(
                rule.pattern_span, f"`{style}` needs a linear layer, but `{path}` is a {kind}", hint=hint
            )
        )
        return {}
    if style == "vocab" and not (is_linear(module) or isinstance(module, _EMBEDDING_LIKE)):
        diagnostics.append(
            Diagnostic(
                rule.pattern_span, f"`vocab` needs an embedding or an LM head, but `{path}` is a {kind}"
            )
        )
        return {}
    weight = module.weight
    dim = 1 if style == "row" else 0
    if _is_conv1d(module):
        dim = 1 - dim  # the weight is stored transposed: (in, out)
    if style == "vocab" and weight.shape[dim] % n:  # the last ranks' chunks are zero-padded
        padded = Shard(dim, padded=weight.shape[dim])
        bias = getattr(module, "bias", None)
        return {"weight": padded} | ({"bias": Shard(0, padded=bias.shape[0])} if bias is not None else {})
    if weight.shape[dim] % n:
        what = {"column": "output features", "row": "input features"}[style]
        diagnostics.append(
            Diagnostic(
                rule.span,
                f"`{path}` has {weight.shape[dim]} {what}, not divisible by {n} ranks over `{rule.axis}`",
                hint="pick a tensor-parallel size that divides it",
            )
        )
        return {}
    out: dict[str, Placement] = {"weight": Shard(dim)}
    if getattr(module, "bias", None) is not None:
        out["bias"] = REPLICATE if style == "row" else Shard(0)
    return out


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
    if not all(isinstance(v, int) for v in (kv, heads, hidden)) or kv >= n or n % kv or kv == heads:
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


# ---------------------------------------------------------------------------- per-rank programs


def build_rank_program(
    compiled: Compiled | Executable, model: nn.Module, rank: int, mesh=None
) -> fx.GraphModule:
    """The program rank `rank` runs: the shared graph with this rank's shards and process groups.

    `compiled` is a fresh compile or one loaded from disk (`executable.py`); `model` holds
    the full (unpartitioned) parameters and buffers; `mesh` is the
    DeviceMesh (None for an axis-free plan). Tied parameters stay tied.
    """
    state: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    coords = compiled.layout.coords(rank)
    graph = compiled.graph.graph
    root: dict[str, object] = {}
    local_of: dict[int, nn.Parameter] = {}  # id(full tensor) -> its local parameter, keeps ties
    for node in graph.nodes:
        if node.op == "get_attr":
            name = str(node.target)
            if name not in state:  # a nested graph (e.g. a set_grad_enabled region): shared as is
                root[name] = _get_attr(compiled.graph, name)
                continue
            full = state[name]
            placement = compiled.param_placements.get(name, {})
            local = local_shard(full, placement, coords, compiled.layout)
            if isinstance(full, nn.Parameter):
                if id(full) not in local_of:
                    local_of[id(full)] = nn.Parameter(
                        local.detach().clone(), requires_grad=full.requires_grad
                    )
                root[name] = local_of[id(full)]
            else:
                root[name] = local.detach().clone()
        elif node.op == "call_module":
            root[str(node.target)] = for_rank(compiled.graph.get_submodule(str(node.target)), mesh)
    return bind_regions(fx.GraphModule(root, graph), mesh)


def _get_attr(module: nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def local_shard(
    full: torch.Tensor, placement: dict[str, Placement], coords: dict[str, int], layout: MeshLayout
) -> torch.Tensor:
    """This rank's piece of a full tensor: for `Shard(d, blocks=sizes)`, its chunk of each block."""
    local = full
    for axis, p in placement.items():
        if isinstance(p, Shard):
            local = shard_of(local, Cut(p.dim, p.blocks, p.padded), coords[axis], layout.size(axis))
    return local
