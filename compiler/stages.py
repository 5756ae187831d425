"""Pipeline stages: where the graph is cut, and the stage programs the cuts make.

A pipeline cuts the one SPMD graph into a chain of stage programs. Stage `s` runs on
pipeline rank `s % p` (with `v` virtual stages per rank, rank r holds stages r, r+p, ...),
receives what earlier stages made and later stages read, and sends on what it made or
passed through. The last stage computes the loss.

Where the cuts go:

- From the plan: `cut before layers.2` starts a stage with the first op of `layers.2`;
  `cut after layers.2` starts one right after its last op.
- Balanced: with no cuts, stages are cut between the blocks of the model's layer list
  (`model.layers`, `transformer.h`), minimising the most expensive stage; a block's cost is
  the FLOPs of its ops in the captured graph (2mnk per matmul, the element count for the
  rest), and the embedding and the LM head count in the first and last stage's cost.

Which node runs where:

- An *activation* (a node that depends on a trainable parameter and on the inputs) runs in
  the stage its position in the graph says; a later stage that reads it receives it.
- A *free* node (one that depends on no trainable parameter: position ids, rotary tables,
  the attention mask, the labels' shift) is recomputed by every stage that reads it;
  sending it would cost a transfer for what is cheap to make again. A value written in place
  (T5's decoder inputs: zeros, the labels copied in shifted by one) is remade with every write
  into its storage, which no op reads and data flow alone would leave out; a value an
  activation writes into becomes an activation, received by the stages after.
- A *weight-side* node (a cast or view of a parameter, depending on no input) runs in the
  stage that reads it. A parameter read by several stages (an input embedding tied to the
  LM head) is held by each of them (`Stages.shared`): the runtime sums its gradient over
  the pipeline ranks that hold it before each optimizer step, so the copies stay equal.

    stages = cut_stages(graph, cuts_from(plan, model, graph))
    stages.programs(rank_program)   # [stage 0 GraphModule, stage 1, ...]

A stage program's placeholders are the graph's inputs (every stage gets the microbatch;
each uses what it needs) followed by what it receives, in the order the previous stage
sends; it returns a tuple of what it sends, or the graph's output for the last stage.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from meshplan.dsl.check import Plan
from meshplan.dsl.errors import Span
from meshplan.dsl.patterns import Glob
from meshplan.runtime.shared_cast import SharedCast
from meshplan.runtime.zero_nodes import ZeroGather

from . import meta
from .graph import module_path, shape, shape_text
from .outline import OPS, cut, within

aten = torch.ops.aten


class StageError(ValueError):
    """Cuts that cannot make the stages the plan asks for. `span`: the plan text at fault
    (None: the pipeline block as a whole)."""

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None):
        super().__init__(message)
        self.span, self.hint = span, hint


@dataclass(frozen=True)
class Cut:
    """A stage starts `before` module `path`'s first op or right `after` its last."""

    side: str  # "before" | "after"
    path: str

    def __str__(self) -> str:
        return f"cut {self.side} {self.path}"


@dataclass(frozen=True)
class Stages:
    """The stage of every op node of a graph, and what flows between stages."""

    count: int
    stage_of: dict[fx.Node, int]  # op node -> its stage (activations only)
    needs: tuple[tuple[fx.Node, ...], ...]  # per stage: every node it runs, in graph order
    receives: tuple[tuple[fx.Node, ...], ...]  # per stage: the values it gets from the one before
    inputs: tuple[fx.Node, ...]  # the graph's placeholders, given to every stage
    cost: tuple[float, ...]  # per stage: its share of the FLOPs
    modules: tuple[tuple[str, ...], ...]  # per stage: the top-level modules it runs (for explain)
    shared: dict[str, tuple[int, ...]]  # a parameter read by several stages -> those stages

    def sends(self, stage: int) -> tuple[fx.Node, ...]:
        return self.receives[stage + 1] if stage + 1 < self.count else ()

    def programs(self, program: fx.GraphModule, *, share_casts: Collection[int] = ()) -> list[fx.GraphModule]:
        """The stage programs of `program` (the graph these stages were cut from, or a rank
        program built from it: same nodes, this rank's parameters and process groups).
        `share_casts`: the stages whose casts of a trainable parameter are `SharedCast`s, which
        a pipeline step makes once for all their microbatches (`runtime/shared_cast.py`): those
        that keep several microbatches in flight (`Schedule.in_flight`)."""
        same = {n.name: n for n in program.graph.nodes}
        out: list[fx.GraphModule] = []
        output = next(n for n in program.graph.nodes if n.op == "output")
        for s in range(self.count):
            nodes = [same[n.name] for n in self.needs[s]]
            inputs = [same[n.name] for n in (*self.inputs, *self.receives[s])]
            if s == self.count - 1:
                piece = cut(nodes, inputs=inputs, result=output.args[0])
            else:
                piece = cut(nodes, inputs=inputs, outputs=[same[n.name] for n in self.sends(s)])
            _copy_written_inputs(piece.graph)
            stage = fx.GraphModule(program, piece.graph, class_name=f"Stage{s}")
            if s in share_casts:
                _share_casts(stage)
            out.append(stage)
        return out


def _share_casts(stage: fx.GraphModule) -> None:
    """Each cast of a trainable parameter of `stage` (`aten._to_copy(weight, dtype=...)`, which
    `passes/precision.py` makes) called through a `SharedCast` of its own. Not a weight ZeRO-3
    gathers: it frees the gathered weight after use, and a kept cast would hold it all step."""
    for node in list(stage.graph.nodes):
        if node.op != "call_function" or node.target is not aten._to_copy.default:
            continue
        weight = node.args[0]
        if set(node.kwargs) != {"dtype"} or not isinstance(weight, fx.Node) or weight.op != "get_attr":
            continue
        param = _parameter(stage, str(weight.target))
        gathered = any(
            u.op == "call_module" and isinstance(stage.get_submodule(str(u.target)), ZeroGather)
            for u in weight.users
        )
        if param is None or not param.requires_grad or gathered:
            continue
        name = f"shared_cast_{node.name}"
        stage.add_submodule(name, SharedCast(node.kwargs["dtype"]))
        with stage.graph.inserting_before(node):
            call = stage.graph.call_module(name, (weight,))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        stage.graph.erase_node(node)
    stage.recompile()


def _parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    try:
        return module.get_parameter(name)
    except AttributeError:  # a buffer, or a constant
        return None


def _copy_written_inputs(graph: fx.Graph) -> None:
    """A stage that writes into one of its inputs in place writes into a copy of it: the
    microbatch is every stage's, and two stages of one rank would each write into it."""
    root = _alias_roots(graph)
    targets = {root[w] for n in graph.nodes for w in written(n)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for x in (x for x in placeholders if x in targets):
        with graph.inserting_after(placeholders[-1]):
            copy = graph.call_function(aten.clone.default, (x,))
        copy.meta = dict(x.meta)
        x.replace_all_uses_with(copy, delete_user_cb=lambda u, copy=copy: u is not copy)


# ---------------------------------------------------------------------------- splitting


def cut_stages(gm: fx.GraphModule, cuts: Sequence[Cut]) -> Stages:
    """Assign every op node of `gm` to a stage (`len(cuts) + 1` of them)."""
    graph = gm.graph
    ops = [n for n in graph.nodes if n.op in OPS]
    kind = _kinds(graph)
    activations = [n for n in ops if kind[n] == "activation"]
    starts = sorted(_start_index(activations, c) for c in cuts)
    for a, b in zip([0, *starts], [*starts, len(activations)], strict=True):
        if a >= b:
            raise StageError(_empty_stage(cuts), hint="each stage needs at least one operation")
    count = len(cuts) + 1
    stage_of: dict[fx.Node, int] = {}
    for i, n in enumerate(activations):
        stage_of[n] = sum(1 for s in starts if s <= i)

    needs: list[set[fx.Node]] = [set() for _ in range(count)]
    users_of_param: dict[str, set[int]] = {}

    def need(node: fx.Node, s: int) -> None:
        """Stage s runs `node` (free or weight-side, with what it reads) or receives it."""
        if node.op == "placeholder" or node in needs[s]:
            return
        if node.op == "get_attr":
            if _trainable(gm, node):
                users_of_param.setdefault(str(node.target), set()).add(s)
            needs[s].add(node)
            return
        if kind[node] == "activation":
            return  # made by its own stage, received if that is an earlier one
        needs[s].add(node)
        for a in node.all_input_nodes:
            need(a, s)

    for n in activations:
        s = stage_of[n]
        needs[s].add(n)
        for a in n.all_input_nodes:
            need(a, s)
    # a node run for its effect alone (ZeRO's gather: no output, no user) runs in the stage of
    # the next activation, the one it prepares
    upcoming = count - 1
    for n in reversed(ops):
        if n in stage_of:
            upcoming = stage_of[n]
        elif not n.users and n.op == "call_module" and n.is_impure():
            needs[upcoming].add(n)
            for a in n.all_input_nodes:
                need(a, upcoming)
    output = next(n for n in graph.nodes if n.op == "output")
    for a in output.all_input_nodes:
        if kind.get(a) != "activation":
            need(a, count - 1)
    # a value written in place (T5's decoder inputs: the labels copied into a tensor of zeros,
    # shifted by one) is not made by the op that allocated it alone: a stage that runs or reads
    # that storage runs every write into it that is not an activation's (an activation's runs
    # in its own stage, and what it wrote is received)
    root = _alias_roots(graph)
    writers: dict[fx.Node, list[fx.Node]] = {}
    for n in ops:
        if kind[n] != "activation":
            for w in written(n):
                writers.setdefault(root[w], []).append(n)
    grown = bool(writers)
    while grown:
        grown = False
        for s in range(count):
            read = {root[a] for n in list(needs[s]) for a in (n, *n.all_input_nodes)}
            for m in (m for r in read for m in writers.get(r, ()) if m not in needs[s]):
                need(m, s)
                grown = True
    # a write into an input or a buffer that no stage reads again runs where an effect-only node
    # does: in the stage of the next activation
    upcoming = count - 1
    for n in reversed(ops):
        if n in stage_of:
            upcoming = stage_of[n]
        elif n in kind and kind[n] != "activation" and not any(n in ns for ns in needs) and written(n):
            need(n, upcoming)

    # what each stage receives: activations made before it and read by it or after it
    order = {n: i for i, n in enumerate(graph.nodes)}
    receives: list[tuple[fx.Node, ...]] = [()]
    for s in range(1, count):
        later: set[fx.Node] = set().union(*needs[s:])
        crossing = {a for n in later for a in n.all_input_nodes if stage_of.get(a, s) < s}
        crossing |= {a for a in output.all_input_nodes if stage_of.get(a, s) < s}
        receives.append(tuple(sorted(crossing, key=order.__getitem__)))

    cost = [0.0] * count
    for n in ops:
        if n in stage_of:
            cost[stage_of[n]] += flops(n)
    modules = tuple(_top_modules(sorted(needs[s], key=order.__getitem__)) for s in range(count))
    return Stages(
        count,
        stage_of,
        tuple(tuple(sorted(ns, key=order.__getitem__)) for ns in needs),
        tuple(receives),
        tuple(n for n in graph.nodes if n.op == "placeholder"),
        tuple(cost),
        modules,
        {name: tuple(sorted(used)) for name, used in users_of_param.items() if len(used) > 1},
    )


def stages_reading(node: fx.Node) -> set[int]:
    """The pipeline stages of the activations that read `node` (a parameter, or a node made
    from parameters alone), directly or through nodes made from parameters alone, which have no
    stage of their own; for a node with a stage, that stage."""
    own = meta.stage(node)
    if own is not None:
        return {own}
    stages: set[int] = set()
    seen: set[fx.Node] = set()
    frontier = [node]
    while frontier:
        for user in frontier.pop().users:
            if user in seen:
                continue
            seen.add(user)
            s = meta.stage(user)
            if s is not None:
                stages.add(s)
            elif user.op != "output":
                frontier.append(user)
    return stages


def _kinds(graph: fx.Graph) -> dict[fx.Node, str]:
    """Each node: "activation" (reads a parameter and an input), "free" (reads no trainable
    parameter) or "weight" (reads a parameter but no input). An op that writes into a value in
    place (`copy_`, `index_add_`) makes what it read part of that storage: the storage and every
    view of it made so far take on the writer's dependencies (zeros filled with an activation
    are an activation from there on)."""
    gm_params: dict[fx.Node, tuple[bool, bool]] = {}  # node -> (reads a parameter, reads an input)
    owner = graph.owning_module
    root = _alias_roots(graph)
    views: dict[fx.Node, list[fx.Node]] = {}  # a storage -> the nodes seen so far that alias it
    for n in graph.nodes:
        if n.op == "placeholder":
            gm_params[n] = (False, True)
        elif n.op == "get_attr":
            gm_params[n] = (owner is not None and _trainable(owner, n), False)
        else:
            ins = [gm_params[a] for a in n.all_input_nodes]
            gm_params[n] = (any(p for p, _ in ins), any(i for _, i in ins))
        views.setdefault(root[n], []).append(n)
        param, data = gm_params[n]
        for w in written(n):
            for v in views.get(root[w], ()):
                p, d = gm_params[v]
                gm_params[v] = (p or param, d or data)
    kinds: dict[fx.Node, str] = {}
    for n, (param, data) in gm_params.items():
        kinds[n] = "activation" if param and data else "weight" if param else "free"
    return kinds


def written(node: fx.Node) -> list[fx.Node]:
    """The inputs `node` writes in place: those its op's schema marks `Tensor(a!)` (`copy_`,
    `fill_`, `masked_fill_`, `index_put_`)."""
    return [
        a for formal, a in _schema_args(node) if formal.alias_info is not None and formal.alias_info.is_write
    ]


def _alias_roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node -> the node whose storage its value is (itself, unless it is a view or the
    result of an in-place op: then the root of the input it aliases)."""
    root: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        source = aliased_input(n)
        root[n] = root[source] if source is not None else n
    return root


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage `node`'s value shares (a view's or an in-place op's `self`; a
    piece of a split), or None for a value of its own."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return source if isinstance(source, fx.Node) and aliased_input(source) is not None else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not any(r.alias_info is not None for r in schema.returns):
        return None
    return next((a for formal, a in _schema_args(node) if formal.alias_info is not None), None)


def _schema_args(node: fx.Node) -> list[tuple[torch._C.Argument, fx.Node]]:
    """The node inputs of an ATen op call, each with its formal argument."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    out = []
    for i, formal in enumerate(schema.arguments):
        actual = node.args[i] if i < len(node.args) else node.kwargs.get(formal.name)
        if isinstance(actual, fx.Node):
            out.append((formal, actual))
    return out


def _trainable(gm: nn.Module, node: fx.Node) -> bool:
    try:
        value = gm.get_parameter(str(node.target))
    except AttributeError:
        return False
    return value.requires_grad


def _start_index(activations: list[fx.Node], c: Cut) -> int:
    where = [i for i, n in enumerate(activations) if within(module_path(n), c.path)]
    if not where:
        raise StageError(f"`{c}`: `{c.path}` runs no operation of the model's forward")
    return where[0] if c.side == "before" else where[-1] + 1


def _empty_stage(cuts: Sequence[Cut]) -> str:
    return "the cuts " + ", ".join(f"`{c}`" for c in cuts) + " leave a stage with no operation"


def _top_modules(nodes: list[fx.Node]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for n in nodes:
        path = module_path(n)
        if path and n.op in OPS:
            seen.setdefault(path, None)
    return tuple(seen)


# ---------------------------------------------------------------------------- cost and balance

_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default, aten.linear.default}


def flops(node: fx.Node) -> float:
    """A rough FLOP count of one op: 2mnk for a matmul, 4*B*H*T*S*D for attention, else the
    output's element count. Enough to balance stages, not to report."""
    region = meta.checkpoint_region(node)
    if region is not None:  # an outlined checkpoint region: the ops inside it
        owner = node.graph.owning_module
        assert owner is not None, "a checkpoint call node belongs to its graph module"
        inner = owner.get_submodule(region.target)
        assert isinstance(inner, fx.GraphModule)
        return sum(flops(n) for n in inner.graph.nodes if n.op in OPS)
    val = node.meta.get("val")
    if node.op == "call_module" and isinstance(val, tuple):  # linears grouped on one input (`overlap`)
        x = node.args[0]
        depth = _int(shape(x)[-1]) if isinstance(x, fx.Node) else 1
        return sum(2.0 * _numel(v.shape) * depth for v in val if isinstance(v, torch.Tensor))
    if not isinstance(val, torch.Tensor):
        return 0.0
    out = _numel(shape(node))
    if node.target in _MATMULS:
        arg = node.args[0]
        k = (
            shape(arg)[-1]
            if isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)
            else 1
        )
        return 2.0 * out * _int(k)
    if "scaled_dot_product" in str(node.target):
        q, kk = node.args[0], node.args[1]
        if isinstance(q, fx.Node) and isinstance(kk, fx.Node):
            qs, ks = shape(q), shape(kk)
            return 4.0 * _numel(qs) * _int(ks[-2])
    return float(out)


def _int(s) -> int:
    return s if isinstance(s, int) else int(s.node.hint) if hasattr(s, "node") and s.node.hint else 1


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= _int(s)
    return n


def balanced_cuts(gm: fx.GraphModule, model: nn.Module, stages: int) -> list[Cut]:
    """`stages - 1` cuts between the blocks of the model's layer list that minimise the
    costliest stage (a linear-partition dynamic program over the blocks' FLOPs)."""
    layers = layer_list(model)
    if layers is None:
        raise StageError(
            "the model has no list of layers to cut between", hint="give the cuts: `cut before PATH`"
        )
    path, n = layers
    if stages > n:
        raise StageError(
            f"{stages} stages, but `{path}` has {n} layers: a stage would hold no layer",
            hint=f"make the pipeline at most {n} stages",
        )
    ops = [x for x in gm.graph.nodes if x.op in OPS]
    unit = [0.0] * n
    first = next(
        (i for i, x in enumerate(ops) if within(module_path(x), f"{path}.0")),
        0,
    )
    for i, x in enumerate(ops):
        p = module_path(x)
        block = _block_index(p, path)
        if block is None:
            block = 0 if i < first else n - 1  # embedding before, norm and head after
        unit[block] += flops(x)
    bounds = _partition(unit, stages)
    return [Cut("before", f"{path}.{b}") for b in bounds]


def _block_index(p: str, path: str) -> int | None:
    if not within(p, path) or p == path:
        return None
    head = p[len(path) + 1 :].split(".")[0]
    return int(head) if head.isdigit() else None


def _partition(costs: list[float], k: int) -> list[int]:
    """Start indices of groups 2..k of the contiguous split of `costs` into k groups that
    minimises the largest group sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[j][i]: first i units in j groups
    split = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for m in range(j - 1, i):
                worst = max(best[j - 1][m], prefix[i] - prefix[m])
                if worst < best[j][i]:
                    best[j][i], split[j][i] = worst, m
    bounds, i = [], n
    for j in range(k, 1, -1):
        i = split[j][i]
        bounds.append(i)
    return sorted(bounds)


def layer_list(model: nn.Module) -> tuple[str, int] | None:
    """The model's outermost non-empty list of modules (`model.layers`, `transformer.h`)."""
    lists = [
        (path.count("."), -len(module), path)
        for path, module in model.named_modules()
        if path and isinstance(module, nn.ModuleList) and len(module)
    ]
    if not lists:
        return None
    _, neg, path = min(lists)
    return path, -neg


def compiled_cuts(graph: fx.GraphModule, saved: Sequence[tuple[str, str]] = ()) -> list[Cut]:
    """The cuts the pipeline pass chose, from the compiled graph or a loaded program's record."""
    return [Cut(side, path) for side, path in (saved or meta.stage_cuts(graph) or ())]


def cuts_from(plan: Plan, model: nn.Module, gm: fx.GraphModule, *, ranks: int) -> list[Cut]:
    """The plan's cuts resolved to module paths, or balanced ones for `ranks` pipeline ranks
    (times the virtual stages) when it gives none."""
    p = plan.pipeline
    assert p is not None, "a plan with a pipeline block"
    if not p.cuts:
        return balanced_cuts(gm, model, ranks * p.virtual_stages)
    paths = [name for name, _ in model.named_modules() if name]
    out = []
    for c in p.cuts:
        glob = Glob.compile(c.pattern.text)
        found = [x for x in paths if glob.matches(x)]
        if len(found) != 1:
            what = "matches no module" if not found else f"matches {len(found)} modules"
            raise StageError(
                f"`cut {c.side} {c.pattern.text}` {what}", c.pattern.span, "a cut names one module"
            )
        out.append(Cut(c.side, found[0]))
    return out


# ---------------------------------------------------------------------------- explain


def describe(stages: Stages, cuts: Sequence[Cut], model: nn.Module, owner: Sequence[int]) -> list[str]:
    """Each stage's rank, modules, share of the FLOPs and what it receives; then the cuts as
    plan text (to paste into the `pipeline` block and freeze a balanced choice)."""
    layers = layer_list(model)
    total = sum(stages.cost) or 1.0
    lines = []
    for s in range(stages.count):
        received = ", ".join(f"{n.name} {shape_text(n)}" for n in stages.receives[s]) or "the inputs"
        lines.append(
            f"    stage {s} on rank {owner[s]}: {_span_text(stages.modules[s], layers)}"
            f"  ({stages.cost[s] / total:.0%} of the FLOPs; receives {received})"
        )
    lines.append("    as plan text (paste into the pipeline block to keep these cuts):")
    lines += [f"        {c}" for c in cuts]
    return lines


def _span_text(modules: Sequence[str], layers: tuple[str, int] | None) -> str:
    """`embed_tokens, layers.{0..1}`: the top-level modules, blocks of the layer list by index."""
    shown: dict[str, None] = {}
    blocks: list[int] = []
    for path in modules:
        block = _block_index(path, layers[0]) if layers else None
        if block is not None:
            if block not in blocks:
                blocks.append(block)
            continue
        head = path.split(".")[0]
        if head.startswith("_") or (layers and within(layers[0], head)):  # export's own, or the list's parent
            continue  # the list's own parent (`model`): its blocks say it
        shown.setdefault(head, None)
    parts = list(shown)
    if blocks and layers:
        run = f"{blocks[0]}" if len(blocks) == 1 else f"{{{min(blocks)}..{max(blocks)}}}"
        first_after = next((i for i, p in enumerate(modules) if _block_index(p, layers[0]) is not None), 0)
        before = [p for p in parts if any(m.split(".")[0] == p for m in modules[:first_after])]
        after = [p for p in parts if p not in before]
        parts = [*before, f"{layers[0]}.{run}", *after]
    return ", ".join(parts) or "(no module)"
