"""Activation checkpointing: each checkpointed module becomes one call through torch's checkpoint.

Requires: a normalized graph (after tensor parallelism, if any) whose nodes carry their
module path (`graph.module_path`); the nodes of one module are contiguous in graph order
once the parameter-side nodes that do not depend on them are moved ahead (export order
puts a transformer block's nodes together). Regions come from the plan's `checkpoint`
rules (`regions_from`).
Ensures: the nodes of every region are outlined into a submodule `checkpoint_<path>` of
the graph, called through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`
(with a selective context that keeps matmul outputs for `checkpoint selective`). The call
node carries `meta["meshplan.checkpoint"]`. The submodule holds no parameters: they stay
`get_attr` nodes of the outer graph and enter the region as inputs, so optimizers, tied
weights and per-rank shards (`lower.build_rank_program`) see the same parameters as before.
A parameter's cast to the compute dtype that only the region reads moves into it: the region
keeps the fp32 parameter as its input (a reference, no bytes) and recasts it when it
recomputes, instead of keeping a bf16 copy of every weight per microbatch in flight (not under
ZeRO-3, which gathers such a weight in bf16 and frees it after forward).
Collective modules called inside a region are shared with the outer graph; a rank program
rebinds them to its process groups with `lower.bind_regions`. Numbers are unchanged: the region
runs the same ops in the same order, and its recomputation in backward is bit-identical.

Before (`layers.1: checkpoint`):

    add_5 = aten.add(add_3, linear_6)                  # last node of layers.0
    to_2 = aten.to(add_5, torch.float32)               # layers.1.input_layernorm
    ...
    add_11 = aten.add(add_9, linear_13)                # layers.1 residual
    to_4 = aten.to(add_11, torch.float32)              # layers.2.input_layernorm

After:

    checkpoint_layers_1 = self.checkpoint_layers_1
    layers_1 = torch.utils.checkpoint.checkpoint(checkpoint_layers_1, add_5,
        layers_1_input_layernorm_weight, ..., use_reentrant = False)
    to_4 = aten.to(layers_1, torch.float32)

and `self.checkpoint_layers_1` is a GraphModule whose placeholders are the region's inputs
(activations, parameters, the rope tables) and whose output is what later nodes use.

A checkpointed region runs its forward twice: once in forward, once in backward just
before its gradients. Collectives inside it are issued again by that recomputation (as in
Megatron's full recomputation); `collective_nodes` tells the ledger which nodes those are.

Golden: `tests/compiler/golden/passes/checkpoint.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.utils.checkpoint
from torch import fx

from meshplan.dsl import ast
from meshplan.dsl.check import Plan, PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.collectives import COLLECTIVES

from .. import meta, outline
from ..graph import written_buffer
from ..match import Resolution
from ..meta import CheckpointRegion
from . import Context, Pass

aten = torch.ops.aten

Mode = Literal["full", "selective"]

# Ops whose outputs selective checkpointing keeps: the matmuls and attention, the costly
# ops to recompute. They are named as they reach dispatch: `linear` and `matmul` decompose
# into mm/addmm/bmm (kept here too, in case a backend dispatches them whole), and
# `scaled_dot_product_attention` into its backend's kernel.
MATMUL_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.linear.default,
        aten.scaled_dot_product_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }
)


@dataclass(frozen=True)
class Region:
    """A module whose activations are recomputed in backward instead of kept."""

    path: str  # module path, as named_modules() spells it: `layers.2`
    mode: Mode = "full"
    rule: PlanRule | None = None  # the plan rule behind it, for messages and printers

    @property
    def target(self) -> str:
        """The name of the outlined submodule in the graph: `checkpoint_layers_2`."""
        return "checkpoint_" + self.path.replace(".", "_")

    def contains(self, path: str) -> bool:
        return path == self.path or path.startswith(self.path + ".")


class CheckpointError(ValueError):
    """A region the pass cannot outline. `diagnostic` points at the plan rule (None without one)."""

    def __init__(self, message: str, *, rule: PlanRule | None = None, hint: str | None = None):
        super().__init__(message)
        self.diagnostic = Diagnostic(rule.span, message, hint) if rule is not None else None


def regions_from(plan: Plan, resolution: Resolution) -> list[Region]:
    """The regions the plan's `checkpoint` rules ask for, outermost only, sorted by path.

    `checkpoint every K` takes every K-th module the rule matches, starting with the first
    (`layers.*: checkpoint every 2` on 4 layers: layers.0 and layers.2). A module where a
    more specific checkpoint rule wins is governed by that rule instead. A region inside
    another one is dropped: the outer region already recomputes it.
    """
    chosen: dict[str, Region] = {}
    for rule in plan.rules:
        action = rule.action
        if not isinstance(action, ast.Checkpoint):
            continue
        every = action.every or 1
        for i, path in enumerate(resolution.matched.get(rule.order, ())):
            if i % every == 0 and resolution.rule_for(path, "checkpoint") is rule:
                chosen[path] = Region(path, action.mode or "full", rule)
    regions = sorted(chosen.values(), key=lambda r: _path_key(r.path))
    return [r for r in regions if not any(o is not r and o.contains(r.path) for o in regions)]


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    # ZeRO-3 gathers a unit's weights in the compute dtype when a cast reads them
    # (`passes/zero.py`) and frees the gathered copies after forward: it keeps no cast either
    dp = ctx.plan.data_parallel
    recast = dp is None or dp.zero != 3
    try:
        return checkpoint_regions(gm, regions_from(ctx.plan, ctx.resolution), recast=recast)
    except CheckpointError as e:
        ctx.diagnostics.append(e.diagnostic)
        return gm


PASS = Pass(
    "checkpoint",
    run,
    requires="a graph whose collectives are nodes (so regions recompute them too)",
    ensures="each checkpoint region outlined into a submodule called through torch.utils.checkpoint",
)


def _path_key(path: str) -> tuple:
    # `layers.10` after `layers.9`: numbers compare as numbers
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def checkpoint_regions(
    gm: fx.GraphModule, regions: Sequence[Region], *, recast: bool = True
) -> fx.GraphModule:
    """Outline every region's nodes and call them through `torch.utils.checkpoint`; `recast`:
    with the casts of the parameters only the region reads (`_weight_casts`).

    A region whose module runs no op in the captured forward is left alone.
    Raises `CheckpointError` when a region's nodes are interleaved with nodes that
    depend on them (the module is not one contiguous piece of the graph).
    """
    buffers = {name for name, _ in gm.named_buffers()}
    for region in regions:
        nodes = outline.nodes_under(gm.graph, region.path)
        written = next((b for n in nodes if (b := written_buffer(n, buffers))), None)
        if written is not None:
            raise CheckpointError(
                f"`{region.path}` writes the buffer `{written}` in its forward: recomputing it in "
                "backward would write it again (a count would count twice)",
                rule=region.rule,
                hint="checkpoint modules that only read their buffers (e.g. the layer's attention)",
            )
        if nodes:
            try:
                outline.make_contiguous(gm.graph, nodes, what=f"checkpoint `{region.path}`")
            except outline.NotContiguous as e:
                raise CheckpointError(
                    str(e), rule=region.rule, hint="checkpoint a module whose forward runs as one piece"
                ) from None
            _outline(gm, region, nodes, _weight_casts(nodes) if recast else [])
    gm.graph.lint()
    gm.recompile()
    return gm


def _outline(gm: fx.GraphModule, region: Region, nodes: list[fx.Node], casts: list[fx.Node]) -> None:
    """`nodes` (contiguous) and the parameter `casts` ahead of them into one region, called
    where `nodes` were."""
    piece = outline.cut([*casts, *nodes])
    # the collectives the region calls: the same module objects as the outer graph's
    modules = {str(n.target): gm.get_submodule(str(n.target)) for n in nodes if n.op == "call_module"}
    gm.add_submodule(region.target, fx.GraphModule(modules, piece.graph, class_name=_class_name(region)))

    kwargs: dict[str, fx.node.Argument] = {"use_reentrant": False}
    if region.mode == "selective":
        kwargs["context_fn"] = SelectiveContext.SAVE_MATMULS  # type: ignore[assignment]  # fx prints the enum member by name
    with gm.graph.inserting_before(nodes[0]):
        fn = gm.graph.get_attr(region.target)
        call = gm.graph.create_node(
            "call_function",
            torch.utils.checkpoint.checkpoint,
            (fn, *piece.inputs),
            kwargs,
            name=region.path.replace(".", "_"),
        )
    meta.set_checkpoint_region(call, CheckpointRegion(region.path, region.mode, region.rule, region.target))
    meta.set_module_tag(call, region.path)
    outline.replace_outputs(gm.graph, piece, call, tag=region.path)


def _weight_casts(nodes: list[fx.Node]) -> list[fx.Node]:
    """The casts of a parameter to the compute dtype (`passes/precision.py`) that only the region
    reads, in graph order: outlined with it, so the region keeps the parameter (nothing) rather
    than its cast (two bytes an element, per microbatch in flight) and recasts it when it
    recomputes."""
    inside = set(nodes)
    read = dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside)
    return [
        a
        for a in read
        if a.op == "call_function"
        and a.target is aten._to_copy.default
        and isinstance(a.args[0], fx.Node)
        and a.args[0].op == "get_attr"
        and all(u in inside for u in a.users)
    ]


def _class_name(region: Region) -> str:
    return "Checkpoint_" + region.path.replace(".", "_")


class SelectiveContext(enum.Enum):
    """`context_fn` values for selective checkpointing, one per policy.

    An enum rather than a function so that fx prints the call readably
    (`context_fn = SelectiveContext.SAVE_MATMULS`); calling a member makes the contexts.
    """

    SAVE_MATMULS = "save_matmuls"  # keep matmul and attention outputs, recompute the rest

    def __call__(self):
        return torch.utils.checkpoint.create_selective_checkpoint_contexts(_save_matmuls)


def _save_matmuls(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy:
    if op in MATMUL_OPS:
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


# ---------------------------------------------------------------------------- after the pass


def region_modules(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, fx.GraphModule]]:
    """Each checkpoint call node of `gm` with its outlined submodule (a later stage's program
    receives a region's outputs as placeholders carrying its tag: not a call)."""
    for node in gm.graph.nodes:
        info = meta.checkpoint_region(node)
        if info is not None and node.op == "call_function":
            yield node, _region(gm, info.target)


def selective_ops(gm: fx.GraphModule) -> int:
    """The ops `gm`'s selective regions run in a forward: each passes through torch's policy
    once there and once more as backward recomputes (`Hardware.selective_op` prices both)."""
    count = 0
    for node, region in region_modules(gm):
        info = meta.checkpoint_region(node)
        if info is not None and info.mode == "selective":
            count += sum(isinstance(n.target, torch._ops.OpOverload) for n in region.graph.nodes)
    return count


def _region(gm: fx.GraphModule, target: str) -> fx.GraphModule:
    region = gm.get_submodule(target)
    assert isinstance(region, fx.GraphModule), f"{target} is an outlined region"
    return region


def collective_nodes(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, bool]]:
    """Every collective node of `gm` and of its regions, in program order, with whether
    backward's recomputation issues its forward collectives again.

    For the ledger: a recomputed collective is issued once in forward and once more in
    backward, before its own backward collective (which runs once: the recomputed
    forward's autograd graph is thrown away).
    """
    for node in gm.graph.nodes:
        info = meta.checkpoint_region(node)
        if info is None:
            if meta.collective(node) is not None:
                yield node, False
            continue
        region = _region(gm, info.target)
        again = set(recomputed_collectives(region))
        for inner in region.graph.nodes:
            if meta.collective(inner) is not None:
                yield inner, inner in again


def recomputed_collectives(region: fx.GraphModule) -> list[fx.Node]:
    """The collective nodes of an outlined region that its recomputation issues again.

    Non-reentrant checkpointing stops recomputing as soon as it has rebuilt every tensor
    the region saved for backward ("early stop"). Collectives after the region's last
    op that saves a tensor are not issued again: in a Llama block, the all-reduce (or
    reduce-scatter) after `down_proj` only feeds the residual add, so of a block's two
    row-split reductions only the first is recomputed. Which ops save tensors is judged
    from `_SAVES_NOTHING`, conservatively: an op not listed counts as saving.
    """
    return recomputed_nodes(region, lambda n: meta.collective(n) is not None)


def recomputed_nodes(region: fx.GraphModule, which: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """The nodes of an outlined region, of those `which` picks, that its recomputation runs
    again (`recomputed_collectives`; the device copies, `passes/devices.py`)."""
    nodes = [n for n in region.graph.nodes if n.op in ("call_function", "call_module")]
    last = max((i for i, n in enumerate(nodes) if _saves_tensors(n)), default=-1)
    return [n for n in nodes[:last] if which(n)]


# Ops whose backward needs no saved tensor (only shapes, or nothing).
_SAVES_NOTHING = frozenset(
    {
        operator.getitem,
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.neg.default,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.transpose.int,
        aten.permute.default,
        aten.t.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.slice.Tensor,
        aten.select.int,
        aten.chunk.default,
        aten.split.Tensor,
        aten.cat.default,
        aten.clone.default,
        aten.contiguous.default,
        aten.to.dtype,
        aten._to_copy.default,
        aten.type_as.default,
    }
)


# The collectives whose autograd functions save no tensor (their backward is a collective).
def _saves_tensors(node: fx.Node) -> bool:
    if node.op == "call_module" and meta.device_copy(node) is not None:
        return False  # a copy's backward copies the gradient back
    if node.op == "call_module":  # a collective says so itself (`runtime.collectives`)
        info = meta.collective(node)
        declared = COLLECTIVES.get(info["kind"]) if info is not None else None
        return declared is None or declared.saves_tensors
    return node.target not in _SAVES_NOTHING
