"""ZeRO in the graph: a layer's parameters are gathered before its first use and freed after its last.

Requires: the final graph of the other passes (after activation checkpointing: a
checkpointed layer is one call node whose inputs include its parameters), a plan with
`data_parallel { zero = N }` over an axis of size > 1.
Ensures: every trainable parameter belongs to one *unit* (but those a device rule placed off
the rank's device, `on cpu`: `passes/devices.py`), the layer that owns it (the
first numbered module on its path: `layers.3`, `model.layers.3`, `h.3`) or the root for
the rest (embeddings, final norm, LM head). Each unit gets

- a `ZeroGather` node placed just before the first node that reads its parameters
  (parameter-only nodes, like the precision pass's casts, are first moved down to their
  first user, so nothing reads a parameter ahead of its layer);
- under ZeRO-3, a `ZeroRelease` node right after the last node that reads them, taking
  every value computed since the gather that later nodes use. Its forward frees the
  gathered parameters; its backward (every gradient into the unit flows through these
  values) gathers them again before the unit's backward. The unit released last (the
  root, whose LM head ends forward) keeps its parameters: backward starts with it.

Under mixed precision (ZeRO-3) a parameter the graph only reads cast to the
compute dtype (the precision pass's `_to_copy(w, dtype=bfloat16)`) is gathered in that
dtype: the gather node returns it, its casts are gone, and the engine fills a bf16 buffer
from the fp32 shards (half the bytes on the wire) that the release frees with the layer, so
the weights a layer's matmuls save for backward are not bf16 copies kept alive until then:

    zero_gather_layers_0 = self.zero_gather_layers_0(layers_0_input_layernorm_weight, ...)
    getitem = zero_gather_layers_0[0]      # layers.0.input_layernorm.weight, as bf16
    ...

Under a pipeline (the pipeline pass gave each activation its stage) a unit never spans two
stages, so each stage program holds the nodes of its own units and a pipeline rank's engine
binds the ones its stages run: the root is a unit per stage (`root@stage0` for the
embeddings, `root@stage1` for the final norm and the head), as is a layer a cut splits; a
weight several stages read (an embedding tied to the LM head) is in the unit of each, with
its casts copied per stage. Every unit is released, the last one too: the microbatches'
forwards and backwards interleave.

The runtime's ZeRO engine (`runtime.zero`) binds itself to these nodes: it decides what
"gather" means (stage 3: all-gather the unit's flats and prefetch the next unit; stages
1/2: wait for the all-gather of the updated parameters that the optimizer step left
running). Unbound, both nodes are identities, so `meshplan verify` runs the program as is.

After (`zero = 3`, a Llama layer):

    zero_gather_layers_0 = self.zero_gather_layers_0(layers_0_input_layernorm_weight, ...)
    ...
    linear_6 = torch.ops.aten.linear.default(mul_7, layers_0_mlp_down_proj_weight)
    zero_release_layers_0 = self.zero_release_layers_0(add_3, linear_6)
    getitem = zero_release_layers_0[0]
    getitem_1 = zero_release_layers_0[1]
    add_5 = torch.ops.aten.add.Tensor(getitem, getitem_1)

Golden: `tests/compiler/golden/passes/zero.diff`, this pass's before/after on a tiny model,
kept equal by `tests/compiler/test_pass_golden.py`.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import fx

from meshplan.runtime.mesh import MeshLayout, axes_of
from meshplan.runtime.zero_nodes import ZeroGather, ZeroRelease

from .. import meta
from ..graph import is_tensor_node, module_path
from ..stages import stages_reading
from . import Context, Pass


@dataclass(frozen=True)
class ZeroSpec:
    axis: str
    stage: int
    where: str  # `file:line` of the plan's `data_parallel` block, for printers


def run(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    dp = ctx.plan.data_parallel
    if dp is None or dp.zero == 0:
        return gm
    # under expert parallelism the expert axes are data axes too: `dp=1, ep=2` shards over ep;
    # a weight whose gradient the sync sums over a context or tensor axis is sharded over it too
    groups = averaging_groups(ctx) if ctx.experts or ctx.grad_sums else None
    if (not groups.dense) if groups is not None else ctx.layout.size(dp.axis) == 1:
        return gm
    spec = ZeroSpec(dp.axis, dp.zero, f"{dp.span.path}:{dp.span.line}")
    return shard_parameters(gm, spec, groups=groups)


@dataclass(frozen=True)
class Groups:
    """Each parameter's ZeRO group, named by the axes its gradient is reduced over as the
    runtime names its engines (`runtime/expert_zero.py`, `Axes.reduced_over`): under expert
    parallelism the dense ones `dp x ep`, an expert's `dp`, or "" where no other rank holds it
    (`experts over dp`); a weight whose gradient is partial over `cp` (or a sequence-parallel
    norm's over `tp`) adds that axis. `dense` is the group of most parameters, whose units
    keep the layer's name (`layers.0`); the others' add theirs (`layers.0+dp+tp`)."""

    dense: str
    others: dict[str, str]  # a parameter outside the dense group -> its group

    def of(self, name: str) -> str:
        return self.others.get(name, self.dense)


def reduce_axes(
    layout: MeshLayout, batch_axes: Collection[str], cut: Collection[str], summed: Collection[str]
) -> tuple[str, ...]:
    """The axes (of more than one rank, in mesh order) a parameter's gradient is reduced over,
    as the runtime's `Axes.reduced_over` reduces it: averaged over the axes that split the batch
    and do not cut the parameter, summed over those its gradient is partial over (`summed`)."""
    return tuple(
        a for a in layout.names if layout.size(a) > 1 and a not in cut and (a in batch_axes or a in summed)
    )


def averaging_groups(ctx: Context) -> Groups:
    layout = ctx.layout
    data = [a for a in layout.names if a in ctx.plan.batch_axes and layout.size(a) > 1]

    def group(name: str) -> str:
        expert = ctx.experts.get(name)  # the data axes cutting a parameter: its expert axis
        cut = set(axes_of(expert.axis)) if expert is not None else set()
        return " x ".join(reduce_axes(layout, data, cut, ctx.grad_sums.get(name, ())))

    names = [n for n, p in ctx.source.model.named_parameters(remove_duplicate=False) if p.requires_grad]
    counts = Counter(group(n) for n in names)
    plain = " x ".join(data)
    dense = plain if counts[plain] or not counts else counts.most_common(1)[0][0]
    return Groups(dense, {n: g for n in names if (g := group(n)) != dense})


PASS = Pass(
    "zero",
    run,
    requires="the final graph, checkpoint regions outlined (a checkpointed layer is one call node)",
    ensures="a gather node before each unit's first parameter use; under ZeRO-3 a release after its last",
)


def unit_of(param: str) -> str:
    """The unit that owns a parameter: its path up to the first numbered part, or the root ('')."""
    parts = param.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def shard_parameters(gm: fx.GraphModule, spec: ZeroSpec, *, groups: Groups | None = None) -> fx.GraphModule:
    """Insert the units' gather (and, for ZeRO-3, release) nodes; see the module docstring.

    `groups` (expert parallelism): each parameter's ZeRO group, where engines over different
    ranks hold a layer's parameters (its dense ones over `dp x ep`, its experts' over `dp`): a
    layer is then a unit per group, `layers.0` and `layers.0+dp`, whose nodes carry the group
    as their axis (the engine of that group binds them). A parameter in group "" is sharded
    over no other rank: it is in no unit."""
    graph = gm.graph
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    # a parameter a device rule placed elsewhere (`on cpu`) is in no unit: its engine is its own
    reads = [
        n
        for n in graph.nodes
        if n.op == "get_attr" and str(n.target) in trainable and n.users and meta.device(n) is None
    ]
    pipeline = meta.stage_cuts(gm) is not None
    _hoist(graph, reads)
    if pipeline:
        _copy_per_stage(graph, reads)
    _sink_parameter_nodes(graph, reads)
    order = {n: i for i, n in enumerate(graph.nodes)}
    units: dict[str, list[fx.Node]] = {}
    group: dict[fx.Node, str] = {}  # a parameter read -> the group its unit's nodes name
    for node in reads:
        unit, group[node] = unit_of(str(node.target)), spec.axis
        if groups is not None:
            group[node] = groups.of(str(node.target))
            if not group[node]:
                continue
            if group[node] != groups.dense:
                unit = f"{unit or 'root'}+{group[node].replace(' x ', '+')}"
        units.setdefault(unit, []).append(node)
    unit_stage: dict[str, int | None] = dict.fromkeys(units)
    if pipeline:
        units, unit_stage = _per_stage(units)
    units, unit_stage = _split_root(units, unit_stage, order)
    spans = {unit: _span(params, order, unit_stage[unit]) for unit, params in units.items()}
    by_start = sorted(units, key=lambda u: order[spans[u][0]])
    last_released = max(by_start, key=lambda u: order[spans[u][1]])
    for unit in by_start:
        params = units[unit]
        first, last = spans[unit]
        name, axis = _target("zero_gather", unit), group[params[0]]
        # ZeRO-3 gathers a parameter the unit only reads cast (bf16 compute) in that dtype
        in_stage = unit_stage[unit]
        dtypes = [_read_as(_reads(p, in_stage)) if spec.stage == 3 else None for p in params]
        gm.add_submodule(name, ZeroGather(axis, unit, [str(p.target) for p in params], dtypes))
        with graph.inserting_before(first):
            gather = graph.call_module(name, tuple(params))
        _read_from(graph, gather, params, dtypes, in_stage)
        meta.set_collective(gather, {"kind": "zero_gather", "axis": axis, "unit": unit, "where": spec.where})
        meta.set_module_tag(gather, unit_of(str(params[0].target)))  # `root@stage0` is the root's
        if in_stage is not None:
            meta.set_stage(gather, in_stage)
        # Under a pipeline every unit is released: the microbatches' forwards and backwards
        # interleave (GPipe runs every forward first), so no unit can stay gathered from its
        # forward to its backward; the release's backward gathers it for each microbatch.
        if spec.stage == 3 and (pipeline or unit != last_released):
            _release(gm, unit, gather, last, spec, axis, in_stage=unit_stage[unit])
    graph.lint()
    gm.recompile()
    return gm


def _reads(param: fx.Node, in_stage: int | None) -> list[fx.Node]:
    """The nodes reading `param` in a unit: under a pipeline, those of the unit's stage (a
    weight several stages read has a cast per stage, and a unit in each)."""
    return [
        u
        for u in param.users
        if not _is_zero_gather(u) and (in_stage is None or stages_reading(u) == {in_stage})
    ]


def _is_zero_gather(node: fx.Node) -> bool:
    return node.op == "call_module" and str(node.target).startswith("zero_gather")


def _read_as(reads: list[fx.Node]) -> torch.dtype | None:
    """The dtype `reads` (of one parameter) all cast it to (the precision pass's casts), if one."""
    if not reads or not all(_is_cast(u) for u in reads):
        return None
    dtypes = {u.kwargs["dtype"] for u in reads}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _is_cast(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is torch.ops.aten._to_copy.default
        and len(node.args) == 1
        and set(node.kwargs) == {"dtype"}
    )


def _read_from(
    graph: fx.Graph, gather: fx.Node, params: list[fx.Node], dtypes: list, in_stage: int | None
) -> None:
    """The unit's casts of the parameters read in another dtype replaced by the gather's outputs."""
    anchor = gather
    for i, (param, dtype) in enumerate(zip(params, dtypes, strict=True)):
        if dtype is None:
            continue
        casts = _reads(param, in_stage)
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (gather, i))
        anchor.meta = dict(casts[0].meta)
        if in_stage is not None:
            meta.set_stage(anchor, in_stage)  # runs in its unit's stage program, after the gather
        for cast in casts:
            cast.replace_all_uses_with(anchor)
            graph.erase_node(cast)


def _per_stage(units: dict[str, list[fx.Node]]) -> tuple[dict[str, list[fx.Node]], dict[str, int | None]]:
    """Under a pipeline, a unit's parameters read by different stages (the root's embedding
    in the first, its norm and LM head in the last; a layer cut in two) become one unit per
    stage, named `root@stage0`, `layers.2@stage1`: each pipeline rank gathers what its own
    stages read, and a unit's gather and release run in one stage program. A weight several
    stages read (an embedding tied to the LM head) is in the unit of each: every pipeline
    rank holding one of those stages holds a copy of it. Returns the units and their stages."""
    out: dict[str, list[fx.Node]] = {}
    stage_of: dict[str, int | None] = {}
    for unit, params in units.items():
        by_stage: dict[int, list[fx.Node]] = {}
        for p in params:
            for s in sorted(stages_reading(p)) or [0]:
                by_stage.setdefault(s, []).append(p)
        for s, ps in sorted(by_stage.items()):
            name = unit if len(by_stage) == 1 else f"{unit or 'root'}@stage{s}"
            out[name], stage_of[name] = ps, s
    return out, stage_of


def _copy_per_stage(graph: fx.Graph, reads: list[fx.Node]) -> None:
    """Under a pipeline, give each stage its own copy of a node computed from parameters alone
    (the cast of a tied weight) that several stages read.

    Each stage program runs its nodes in graph order; a shared cast would run in the last
    stage where the first stage reads it, ahead of that stage's gather of the weight. With a
    copy per stage, the ZeRO nodes of each stage's unit surround its own reads.
    """
    derived = _derived(graph, reads)
    serves: dict[fx.Node, set[int]] = {}
    for node in reversed(derived):  # users first
        serves[node] = set()
        for user in node.users:
            s = meta.stage(user)
            serves[node] |= serves.get(user, set()) if s is None else {s}
    copies: dict[tuple[fx.Node, int], fx.Node] = {}

    def in_stage(s: int) -> Callable[[fx.Node], fx.Node]:
        return lambda a: copies.get((a, s), a)

    for node in derived:  # inputs first: a copy reads its stage's copies of them
        for s in sorted(serves[node])[1:]:
            with graph.inserting_after(node):
                copies[(node, s)] = graph.node_copy(node, in_stage(s))
    for (node, s), copy in copies.items():
        for user in list(node.users):
            # an activation of stage s, or the original of a derived node whose first stage is s
            # (copies already read their stage's copies)
            reader = meta.stage(user) if user not in serves else min(serves[user], default=None)
            if reader == s:
                user.replace_input_with(node, copy)


def _hoist(graph: fx.Graph, reads: list[fx.Node]) -> None:
    """Move the parameter reads to the top of the graph, in their order.

    A get_attr has no inputs, so this is always legal; it guarantees that every parameter
    of a unit exists before the unit's gather, wherever other passes left the reads (the
    tensor-parallel pass puts a sequence-parallel norm weight's `copy_to` right after its
    read, which can come before the reads of the layer's other parameters).
    """
    anchor = next((n for n in reversed(graph.nodes) if n.op == "placeholder"), None)
    for node in reads:
        if anchor is None:
            next(iter(graph.nodes)).prepend(node)
        elif anchor is not node:
            anchor.append(node)
        anchor = node


def _derived(graph: fx.Graph, reads: list[fx.Node]) -> list[fx.Node]:
    """The nodes computed from the parameters `reads` and constants alone, in graph order: a
    cast of a weight, or T5's relative position bias (an embedding of buckets made from fixed
    sizes), which no pipeline stage owns. Constants (a buffer, an `arange` of fixed sizes) are
    not themselves derived."""
    derived: list[fx.Node] = []
    sources = set(reads)
    constant: set[fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr" and node not in sources:
            constant.add(node)
        elif (
            node.op in ("call_function", "call_module")
            and meta.stage(node) is None
            and all(a in sources or a in constant for a in inputs)
        ):
            if any(a in sources for a in inputs):
                sources.add(node)
                derived.append(node)
            else:
                constant.add(node)
    return derived


def _sink_parameter_nodes(graph: fx.Graph, reads: list[fx.Node]) -> None:
    """Move nodes computed from parameters alone (casts, transposes, the tensor-parallel
    `copy_to` of a sequence-parallel norm weight) down to their first user."""
    derived = _derived(graph, reads)
    for node in reversed(derived):
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_user = min(node.users, key=order.__getitem__, default=None)
        if first_user is not None and first_user is not node.next:
            first_user.prepend(node)


def _split_root(
    units: dict[str, list[fx.Node]], unit_stage: dict[str, int | None], order: dict[fx.Node, int]
) -> tuple[dict[str, list[fx.Node]], dict[str, int | None]]:
    """A root unit whose parameters are read in runs with other units between them (a decoder's
    embedding before its layers, its final norm and LM head after) becomes a unit per run, so
    ZeRO-3 gathers the embedding for the first layer and the head for the end, never both with
    the layers between (or their gradients at once). A run is named by its parameters' common
    module (`model.embed_tokens`), the root's name where they have none; a weight read in two
    runs (an embedding tied to the head) joins them: one unit, as before."""
    out: dict[str, list[fx.Node]] = {}
    stages: dict[str, int | None] = {}
    for unit, params in units.items():
        runs = [params] if unit_of(str(params[0].target)) else _runs(params, units, unit, unit_stage, order)
        for i, run in enumerate(runs):
            name = unit
            if len(runs) > 1:
                common = _common_module([str(p.target) for p in run])
                name = common + unit.removeprefix("root") if common else unit
                name = name if name not in out else f"{unit or 'root'}-{i}"
            out[name], stages[name] = run, unit_stage[unit]
    return out, stages


def _runs(
    params: list[fx.Node],
    units: dict[str, list[fx.Node]],
    unit: str,
    unit_stage: dict[str, int | None],
    order: dict[fx.Node, int],
) -> list[list[fx.Node]]:
    """`params` (of one unit) grouped into runs: overlapping read spans joined, and two runs
    with no other unit's reads wholly between them joined."""
    stage = unit_stage[unit]
    spans = sorted(
        ((order[a], order[b], p) for p in params for a, b in [_span([p], order, stage)]), key=lambda t: t[0]
    )
    others = [
        (order[a], order[b])
        for u, ps in units.items()
        if u != unit and unit_stage[u] == stage
        for a, b in [_span(ps, order, stage)]
    ]
    runs: list[tuple[int, int, list[fx.Node]]] = []
    for first, last, p in spans:
        if runs and (first <= runs[-1][1] or not any(runs[-1][1] < a and b < first for a, b in others)):
            start, end, members = runs[-1]
            runs[-1] = (start, max(end, last), [*members, p])
        else:
            runs.append((first, last, [p]))
    return [[p for p in params if p in members] for _, _, members in runs]  # in the unit's order


def _common_module(names: list[str]) -> str:
    """The longest module path every parameter name in `names` lies under ('' for none)."""
    paths = [name.split(".")[:-1] for name in names]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _span(params: list[fx.Node], order: dict[fx.Node, int], in_stage: int | None) -> tuple[fx.Node, fx.Node]:
    """The first and last node reading the unit's parameters (directly or through casts); under
    a pipeline, of those in the unit's stage (a tied weight is read by other stages too)."""
    readers: set[fx.Node] = set()
    frontier = list(params)
    while frontier:
        for user in frontier.pop().users:
            if user not in readers:
                readers.add(user)
                if user.op in ("call_function", "call_module") and all(
                    a in readers or a in params for a in user.all_input_nodes
                ):
                    # a cast of a parameter, or the tensor-parallel pass's `copy_to` (the
                    # identity forward of a sequence-parallel bias): its users read it too
                    frontier.append(user)
    if in_stage is not None:
        readers = {r for r in readers if stages_reading(r) == {in_stage}}
    ranked = sorted(readers, key=order.__getitem__)
    return ranked[0], ranked[-1]


def _release(
    gm: fx.GraphModule,
    unit: str,
    gather: fx.Node,
    last: fx.Node,
    spec: ZeroSpec,
    axis: str,
    *,
    in_stage: int | None,
) -> None:
    """After `last`: pass every value made since `gather` and used later through a ZeroRelease.

    Under a pipeline the release (and its getitems) take `last`'s module path, so that a stage
    cut `after` that module puts them in `last`'s stage, with the gather, not in the next.
    """
    graph = gm.graph
    inside: list[fx.Node] = []
    node = gather.next
    while True:
        inside.append(node)
        if node is last:
            break
        node = node.next
    members = set(inside)
    leaving = [
        n
        for n in inside
        if n.op in ("call_function", "call_module", "call_method")
        and is_tensor_node(n)
        and any(u not in members for u in n.users)
    ]
    if not leaving:
        return
    name = _target("zero_release", unit)
    position = next(i for i, n in enumerate(graph.nodes) if n is last)  # releases in graph order
    gm.add_submodule(name, ZeroRelease(axis, unit, position))
    with graph.inserting_after(last):
        release = graph.call_module(name, tuple(leaving))
    module = module_path(last) if in_stage is not None else unit
    meta.set_module_tag(release, module)
    if in_stage is not None:
        meta.set_stage(release, in_stage)
    meta.set_collective(release, {"kind": "zero_release", "axis": axis, "unit": unit, "where": spec.where})
    if len(leaving) == 1:
        release.meta["val"] = leaving[0].meta.get("val")
        outs = [release]
    else:
        release.meta["val"] = tuple(n.meta.get("val") for n in leaving)
        outs = []
        anchor = release
        for i, n in enumerate(leaving):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (release, i))
            anchor.meta["val"] = n.meta.get("val")
            meta.set_module_tag(anchor, module)
            outs.append(anchor)
    for n, out in zip(leaving, outs, strict=True):
        # the same value, as the ranks hold it (the ledger reads its shards)
        meta.copy_facts(n, out, meta.PLACEMENT)
        n.replace_all_uses_with(out, delete_user_cb=lambda u: u not in members and u is not release)


def _target(kind: str, unit: str) -> str:
    return f"{kind}_{unit.replace('.', '_').replace('@', '_').replace('+', '_')}" if unit else f"{kind}_root"
