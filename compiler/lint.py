"""Invariants the compiled graph keeps after every pass; `compile_plan` checks them after each.

fx's own `Graph.lint()` (every argument defined before its use, every target present), then
meshplan's, each stated independently of the pass that should keep it:

- every collective runs over an axis of the plan's mesh, so its process group exists;
- every placement is over a mesh axis, on a dim the tensor has, and a shard's global size
  divides over the axis (or the shard is padded and records that size, or is cut in blocks
  that add up to it);
- ZeRO-3: a unit's parameters are read only between its gather and its release (under a
  pipeline, by the unit's stage: a tied weight is in a unit of each stage reading it). "Read"
  follows every value that may share a parameter's storage, by PyTorch's own alias
  annotations (`view`, `t`, `expand`, ...) and through meshplan's collectives whose forward
  is the identity; nothing handed to a release may share that storage, since the release
  frees it.

A violation is a bug in meshplan, not in the plan: `GraphLintError` names the pass after
which it was found and the node.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from meshplan.runtime.collectives import AxisCollective, CopyToAxis, KeyValueGroup
from meshplan.runtime.mesh import MeshLayout
from meshplan.runtime.zero_nodes import ZeroGather, ZeroRelease

from . import meta
from .graph import describe, is_tensor_node, shape
from .placement import Shard
from .stages import stages_reading


class GraphLintError(AssertionError):
    """The compiled graph broke an invariant: a meshplan bug."""


def lint(gm: fx.GraphModule, layout: MeshLayout, *, after: str) -> None:
    """Check every invariant of the graph; raise `GraphLintError` naming pass `after`."""
    try:
        gm.graph.lint()
        for name, sub in gm.named_modules():
            if name and isinstance(sub, fx.GraphModule):
                sub.graph.lint()
    except Exception as e:  # fx raises RuntimeError for a broken graph
        raise GraphLintError(f"after the {after} pass: {e}") from e
    problems = [*_collectives(gm, layout), *_placements(gm, layout), *_zero_spans(gm)]
    if problems:
        unique = list(dict.fromkeys(problems))
        raise GraphLintError(f"after the {after} pass: " + "; ".join(unique[:5]))


def _collectives(gm: fx.GraphModule, layout: MeshLayout) -> list[str]:
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        axis = (
            getattr(module, "axis", None)
            if isinstance(module, (AxisCollective, ZeroGather, ZeroRelease))
            else None
        )
        # ZeRO's nodes under expert parallelism run over a group of axes: `dp x ep`
        missing = [a for a in axis.split(" x ") if a not in layout.names] if axis is not None else []
        if missing:
            out.append(f"{node.name} runs over `{axis}`, which the mesh ({', '.join(layout.names)}) lacks")
    return out


def _placements(gm: fx.GraphModule, layout: MeshLayout) -> list[str]:
    out = []
    for node in gm.graph.nodes:
        for axis, p in meta.placement(node).items():
            if axis not in layout.names:
                out.append(f"{describe(node)} is placed over `{axis}`, which is not a mesh axis")
                continue
            if not isinstance(p, Shard) or not is_tensor_node(node):
                continue
            sizes = shape(node)
            if not 0 <= p.dim < len(sizes):
                out.append(f"{describe(node)} is {p} but has {len(sizes)} dims")
                continue
            size, pieces = sizes[p.dim], layout.size(axis) // p.replicas
            if not isinstance(size, int):
                continue  # a data-dependent size: never sharded into (the pass refuses it)
            if p.padded:
                fits = size == p.padded
            elif p.blocks:
                fits = sum(p.blocks) == size and all(b % pieces == 0 for b in p.blocks)
            else:
                fits = size % pieces == 0
            if not fits:
                out.append(
                    f"{describe(node)} is {p} over `{axis}` (size {layout.size(axis)}) but dim {p.dim} is {size}"
                )
    return out


def _zero_spans(gm: fx.GraphModule) -> list[str]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    reads = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    gathers: dict[str, tuple[fx.Node, ZeroGather]] = {}
    releases: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if isinstance(module, ZeroGather):
                gathers[module.unit] = (node, module)
            elif isinstance(module, ZeroRelease):
                releases[module.unit] = node
    out = []
    for unit, release in releases.items():
        if unit not in gathers:
            out.append(f"unit `{unit}` is released but never gathered")
            continue
        gather, module = gathers[unit]
        sharing = _sharing_storage(gm, [reads[p] for p in module.params if p in reads])
        in_stage = meta.stage(gather)  # under a pipeline: other stages' reads of a tied weight are theirs
        for value in sharing:
            for user in value.users:
                if in_stage is not None and in_stage not in stages_reading(user):
                    continue
                if user is release:
                    out.append(
                        f"{describe(value)} shares a parameter's storage and is handed to `{unit}`'s release"
                    )
                elif not order[gather] <= order[user] < order[release]:  # the gather takes them as inputs
                    out.append(
                        f"{describe(user)} reads a parameter of `{unit}` outside its gather and release"
                    )
    return out


def _sharing_storage(gm: fx.GraphModule, params: list[fx.Node]) -> set[fx.Node]:
    """The parameters and every value that may be a view of one of them."""
    found, frontier = set(params), list(params)
    while frontier:
        for user in frontier.pop().users:
            if user not in found and _may_alias(gm, user):
                found.add(user)
                frontier.append(user)
    return found


def _may_alias(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node`'s output may share storage with an input: an op whose schema says so, or a
    collective whose forward is the identity or a slice (`copy_to`, the GQA head pick)."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _VIEWING_COLLECTIVES)
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in node.target._schema.returns)
    return node.target is operator.getitem


_VIEWING_COLLECTIVES = (CopyToAxis, KeyValueGroup)
