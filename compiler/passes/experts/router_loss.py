"""The router z-loss of an `experts` rule (`experts over ep (top_k=2, z_loss=1e-3)`), added to
the program's loss by the experts pass; and the same loss on the unpartitioned model, for
`meshplan verify`'s reference.

ST-MoE's z-loss (Zoph et al. 2022, eq. 5) keeps the router's logits small: for each MoE layer,
over the B tokens it routes,

    L_z = c / B * sum_i (logsumexp_j x_ij)^2     x: (B, E) the router's logits, in fp32 at least

and the program's loss becomes loss + sum over the layers of L_z. The logits are found from
the experts unit's routing: its `top_k_index` is `topk(softmax(logits))` (any casts around
the softmax skipped), which is Hugging Face's MoE routers and `examples/models/moe.py`. Each
rank computes its layers' L_z over its own tokens, as one device computes it over each
micro-batch, and data parallelism averages the ranks' losses, as it averages everything else.
Where an axis that does not split the batch cuts the router's tokens (sequence or context
parallelism, experts borrowing a tensor axis), each rank's mean over its equal share is
all-reduced over that axis and divided by its size: the micro-batch's mean on every rank.

Before (`layers.0.mlp.gate` the router):

    linear_4 = torch.ops.aten.linear.default(reshape_1, layers_0_mlp_gate_weight)
    softmax = torch.ops.aten.softmax.int(linear_4, -1)
    ...
    return (cross_entropy_loss,)

After (z_loss=1e-3):

    linear_4 = torch.ops.aten.linear.default(reshape_1, layers_0_mlp_gate_weight)
    z_lse = torch.ops.aten.logsumexp.default(linear_4, [-1])     # (under bf16: of fp32 z_logits)
    z_square = torch.ops.aten.mul.Tensor(z_lse, z_lse)
    z_mean = torch.ops.aten.mean.default(z_square)
    z_loss = torch.ops.aten.mul.Tensor(z_mean, 0.001)
    softmax = torch.ops.aten.softmax.int(linear_4, -1)
    ...
    add_z = torch.ops.aten.add.Tensor(cross_entropy_loss, z_loss)
    return (add_z,)
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator

import torch
from torch import fx, nn

from meshplan.dsl import ast
from meshplan.dsl.check import PlanRule
from meshplan.dsl.errors import Diagnostic
from meshplan.runtime.collectives import COLLECTIVES
from meshplan.runtime.mesh import MeshLayout

from ... import meta
from ...graph import arg_node, is_loss, is_tensor_node, value
from ...placement import Shard
from .units import argument_error

aten = torch.ops.aten
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default}


def z_loss_of(rule: PlanRule) -> float | None:
    """The rule's `z_loss` coefficient, or None."""
    assert isinstance(rule.action, ast.ExpertParallel)
    arg = rule.action.arg("z_loss")
    return None if arg is None else float(arg.value)


def router_path(logits: fx.Node) -> str:
    """The module that computed the logits (the innermost of their module stack)."""
    stack = logits.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def router_logits(top_k_index: fx.Node) -> fx.Node | str:
    """The logits node whose softmax's top-k chose `top_k_index`, or why there is none."""
    topk = top_k_index.args[0] if top_k_index.target is operator.getitem else None
    if not isinstance(topk, fx.Node) or topk.target is not aten.topk.default:
        return "its top_k_index is not a top-k's indices"
    node = _uncast(arg_node(topk, 0))
    if node.target not in _SOFTMAX:
        return f"its top-k is taken over `{node.name}`, not over a softmax of the router's logits"
    logits = _uncast(arg_node(node, 0))
    uneven = [a for a, p in meta.placement(logits).items() if isinstance(p, Shard) and not _even(p, logits)]
    if uneven:
        return f"its router's logits `{logits.name}` are cut unevenly over `{uneven[0]}`"
    if not router_path(logits):
        return f"its router's logits `{logits.name}` are computed outside any module"
    return logits


def _even(p: Shard, logits: fx.Node) -> bool:
    """Whether every rank holds as many of the logits' rows: a plain cut of the tokens (by
    sequence, or flattened sequence blocks), not the expert dim, no padding or sharing."""
    return p.dim < len(value(logits).shape) - 1 and not p.padded and p.replicas == 1


def _cut_over(logits: fx.Node) -> list[str]:
    """The axes the router's tokens are cut over (sequence or context parallelism, experts
    borrowing a tensor axis): each rank's logits are its share of the tokens."""
    return [a for a, p in meta.placement(logits).items() if isinstance(p, Shard)]


def _uncast(node: fx.Node) -> fx.Node:
    while node.target in _CASTS:
        node = arg_node(node, 0)
    return node


def z_loss_problem(rule: PlanRule, modules: str, why: str) -> Diagnostic:
    """The located error of a rule whose `z_loss` finds no router logits (`router_logits`'s why)."""
    return argument_error(
        rule,
        "z_loss",
        f"`z_loss` needs the router logits of {modules}: {why}",
        hint="the z-loss is taken over the logits whose softmax's top-k routes the tokens "
        "(Hugging Face's routers); remove `z_loss` or compute it in the model",
    )


def add_z_loss(gm: fx.GraphModule, units: list[tuple[fx.Node, float, PlanRule]], layout: MeshLayout) -> None:
    """Add each unit's router z-loss (its `top_k_index`, coefficient and rule given) to the
    graph's loss output."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    losses = [o for o in flat if is_tensor_node(o) and is_loss(value(o))]
    assert len(losses) == 1, "the experts pass needs the graph's one loss output (keep_loss_output)"
    loss = losses[0]
    terms = []
    for top_k_index, coefficient, rule in units:
        logits = router_logits(top_k_index)
        assert isinstance(logits, fx.Node)
        assert logits.next is not None
        with gm.graph.inserting_before(logits.next):  # in the router's place, in order
            terms.append(_z_term(gm, logits, coefficient, rule, layout))
    total = loss
    with gm.graph.inserting_before(output):
        for term in terms:
            if value(term).dtype != value(total).dtype:
                term = _node(
                    gm.graph, aten._to_copy.default, (term,), {"dtype": value(total).dtype}, "z_cast"
                )
            total = _node(gm.graph, aten.add.Tensor, (total, term), {}, "add_z")
    output.args = (
        (tuple(total if o is loss else o for o in flat),) if isinstance(outs, (list, tuple)) else (total,)
    )


def _z_term(
    gm: fx.GraphModule, logits: fx.Node, coefficient: float, rule: PlanRule, layout: MeshLayout
) -> fx.Node:
    """c * mean(logsumexp(logits, -1) ** 2), in fp32 at least (bf16 or fp16 logits are cast),
    its nodes in the router's module (so a checkpointed layer recomputes them with it). Logits
    cut by tokens over an axis (n ranks, equal shares) give each rank the mean of its share:
    the tokens' mean is their sum over the axis / n, an all-reduce whose backward passes each
    rank's gradient through (its share's, c / N per token)."""
    graph = gm.graph
    stack = {k: v for k, v in logits.meta.items() if k in ("nn_module_stack", "stack_trace")}
    wide = logits
    if value(logits).dtype.itemsize < 4:
        wide = _node(graph, aten._to_copy.default, (logits,), {"dtype": torch.float32}, "z_logits", stack)
    lse = _node(graph, aten.logsumexp.default, (wide, [-1]), {}, "z_lse", stack)
    square = _node(graph, aten.mul.Tensor, (lse, lse), {}, "z_square", stack)
    mean = _node(graph, aten.mean.default, (square,), {}, "z_mean", stack)
    ranks = 1
    for axis in _cut_over(logits):
        name = f"all_reduce_{axis}"
        if not hasattr(gm, name):
            gm.add_submodule(name, COLLECTIVES["all_reduce"](None, axis))
        summed = graph.call_module(name, (mean,))
        summed.meta.update({"val": value(mean), **stack})
        meta.set_collective(summed, {"kind": "all_reduce", "axis": axis, "dim": None, "rule": rule})
        mean, ranks = summed, ranks * layout.size(axis)
    return _node(graph, aten.mul.Tensor, (mean, coefficient / ranks), {}, "z_loss", stack)


def _node(
    graph: fx.Graph, target, args: tuple, kwargs: dict, name: str, stack: dict | None = None
) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.name = graph._graph_namespace.create_name(name, None)
    vals = [value(a) if isinstance(a, fx.Node) else a for a in args]
    node.meta["val"] = target(*vals, **kwargs)  # the inputs' fake tensors give the output's
    node.meta.update(stack or {})
    return node


# ---------------------------------------------------------------------------- the reference


def z_loss_units(gm: fx.GraphModule) -> dict[str, tuple[str, int, float]]:
    """Experts path -> (router module path, number of experts, z-loss coefficient), for every
    experts unit of a compiled graph that adds a z-loss: what `z_loss_applied` takes."""
    from ..checkpoint import collective_nodes  # a checkpointed layer's unit is in its region

    return {
        info["path"]: (info["router"], int(info["experts"]), float(info["z_loss"]))
        for n, _ in collective_nodes(gm)
        if (info := meta.collective_of(n)).get("z_loss") is not None
    }


@contextlib.contextmanager
def z_loss_applied(units: dict[str, tuple[str, int, float]], model: nn.Module) -> Iterator[Callable]:
    """While it lasts, each router module of `units` (experts path -> (router module path, its
    number of experts, coefficient)) adds its z-loss, computed from its own output (the first
    floating tensor with one logit per expert), to a sum; the context gives `take()`, which
    returns that sum (0 when none) and starts a new one. So an unpartitioned model's loss plus
    `take()` is the loss the compiled program computes."""
    found: list[torch.Tensor] = []
    handles = []
    for experts_path, (router, count, coefficient) in units.items():

        def hook(module, args, out, _count=count, _c=coefficient, _where=experts_path):
            leaves = out if isinstance(out, (tuple, list)) else (out,)
            logits = next(
                (t for t in leaves if torch.is_tensor(t) and t.is_floating_point() and t.shape[-1] == _count),
                None,
            )
            if logits is None:
                raise RuntimeError(
                    f"the router of {_where} returned no tensor with {_count} logits per token"
                )
            lse = torch.logsumexp(logits.float() if logits.dtype.itemsize < 4 else logits, -1)
            found.append(_c * (lse * lse).mean())

        handles.append(model.get_submodule(router).register_forward_hook(hook))

    def take() -> torch.Tensor | float:
        total = sum(found, torch.zeros(())) if found else 0.0
        found.clear()
        return total

    try:
        yield take
    finally:
        for handle in handles:
            handle.remove()
