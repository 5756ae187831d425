"""Outlining: cutting a contiguous piece of the graph out into a graph of its own.

Checkpoint regions and pipeline stages are the same operation on a graph: take the nodes
of some modules (by module path), make them one contiguous run of the graph, and move them
into a graph whose placeholders are the values they read from outside and whose output is
what the rest of the graph reads from them. This module is that operation once.

    nodes = nodes_under(gm.graph, "layers.1")       # the call nodes of layers.1, in order
    make_contiguous(gm.graph, nodes, what="checkpoint `layers.1`")
    piece = cut(nodes)                              # inputs, outputs, and the new graph

`cut` copies the nodes; the caller decides what replaces them: a checkpoint call node
(`passes/checkpoint.py`) or a stage boundary (`passes/pipeline.py`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch import fx

from . import meta
from .graph import module_path

OPS = ("call_function", "call_module", "call_method")

# meta that describes the op that made a value, not the value: a placeholder or a call
# node standing for it is not that op (export's keys, and meshplan's `meta.OP_FACTS`)
NOT_INHERITED = meta.OP_FACTS | frozenset(
    {
        "nn_module_stack",
        "stack_trace",
        "source_fn_stack",
        "torch_fn",
        "original_aten",
        "from_node",
        "seq_nr",
    }
)


def value_meta(node: fx.Node) -> dict:
    """The meta of `node` that describes its value (its `val`, placements), not the op."""
    return {k: v for k, v in node.meta.items() if k not in NOT_INHERITED}


def within(path: str, prefix: str) -> bool:
    """`layers.1.mlp` is within `layers.1`; `layers.10` is not."""
    return path == prefix or path.startswith(prefix + ".")


def nodes_under(graph: fx.Graph, path: str) -> list[fx.Node]:
    """The op nodes that came from module `path` or a module inside it, in graph order."""
    return [n for n in graph.nodes if n.op in OPS and within(module_path(n), path)]


class NotContiguous(ValueError):
    """A piece's nodes are interleaved with a node that uses them. `node` is that node."""

    def __init__(self, message: str, node: fx.Node):
        super().__init__(message)
        self.node = node


def make_contiguous(graph: fx.Graph, nodes: list[fx.Node], *, what: str) -> None:
    """Move the nodes lying between `nodes` but independent of them ahead of the first.

    Export order keeps a module's nodes together except for parameter-side nodes (casts,
    views of weights) that a later module's code put in between; those move. A node in
    between that reads the piece's values cannot move: `NotContiguous`.
    """
    inside = set(nodes)
    first, last = nodes[0], nodes[-1]
    node = first.next
    while node is not last:
        nxt = node.next
        if node not in inside:
            if any(a in inside for a in node.all_input_nodes):
                raise NotContiguous(
                    f"cannot {what}: its operations are interleaved with `{node.name}` "
                    f"({module_path(node) or 'top level'}), which uses them",
                    node,
                )
            first.prepend(node)
        node = nxt


@dataclass
class Piece:
    """A contiguous run of nodes, copied into a graph of its own.

    `inputs`: the outside values the nodes read, in first-use order (the new graph's
    placeholders); `outputs`: the nodes whose values are read outside the piece, in graph
    order (the new graph's output: one value, or a tuple of several).
    """

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    graph: fx.Graph
    env: dict[fx.Node, fx.Node]  # outer node -> its copy in `graph`

    @property
    def single_output(self) -> bool:
        return len(self.outputs) == 1


def cut(
    nodes: list[fx.Node],
    *,
    inputs: Sequence[fx.Node] | None = None,
    outputs: Sequence[fx.Node] | None = None,
    result: fx.node.Argument = None,
    keep_inside: Callable[[fx.Node], bool] = lambda n: False,
) -> Piece:
    """Copy `nodes` (in graph order) into a new graph.

    By default the placeholders are the outside values the nodes read, in first-use order,
    and the output is every node read outside the piece (one value, or a tuple). A caller
    with a protocol of its own (a pipeline stage) gives `inputs` (a superset of what is
    read, in its order) and `outputs` (always a tuple; may include inputs, passed through)
    or `result` (an argument structure over the piece's nodes). An input that `keep_inside`
    accepts is copied into the graph instead of becoming a placeholder.
    """
    inside = set(nodes)
    read: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                read.setdefault(a, None)
    kept = [x for x in read if keep_inside(x)]
    if inputs is None:
        inputs = [x for x in read if not keep_inside(x)]
    missing = [x.name for x in read if x not in inputs and not keep_inside(x)]
    assert not missing, f"the piece reads {missing}, which are not among its inputs"
    explicit = outputs is not None
    if outputs is None:
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in inputs:
        env[x] = graph.placeholder(x.name)
        env[x].meta = value_meta(x)
    for x in (*kept, *nodes):
        env[x] = graph.node_copy(x, lambda a: env[a])
    if result is not None:
        graph.output(fx.node.map_arg(result, lambda n: env[n]))
    elif explicit or len(outputs) != 1:
        graph.output(tuple(env[o] for o in outputs))
    else:
        graph.output(env[outputs[0]])
    return Piece(list(nodes), list(inputs), list(outputs), graph, env)


def replace_outputs(
    graph: fx.Graph, piece: Piece, call: fx.Node, *, tag: str, inside: Iterable[fx.Node] = ()
) -> None:
    """Make the rest of `graph` read `piece`'s outputs from `call` (one value, or a tuple
    unpacked with getitem nodes right after it), then erase the piece's nodes.

    `tag` becomes the module tag (`meta.set_module_tag`) of the new nodes (the piece's module path).
    """
    skip = set(piece.nodes) | set(inside)
    if piece.single_output:
        call.meta.update(value_meta(piece.outputs[0]))
        piece.outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in skip)
    else:
        call.meta["val"] = tuple(o.meta.get("val") for o in piece.outputs)
        anchor = call
        for i, out in enumerate(piece.outputs):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (call, i))
            anchor.meta.update(value_meta(out))
            meta.set_module_tag(anchor, tag)
            out.replace_all_uses_with(anchor, delete_user_cb=lambda u: u not in skip)
    for n in reversed(piece.nodes):
        graph.erase_node(n)
