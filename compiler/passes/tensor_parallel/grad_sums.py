"""Weight gradients that are partial over an axis, summed by the gradient sync in buckets
rather than one all-reduce per weight in backward.

A weight kept whole over an axis whose ranks each compute with a shard of the activations (a
norm between sequence-parallel regions, every weight under context parallelism, a
replicated key/value projection under GQA) gets only its shard's share of the gradient on
each rank. The walk reads such a weight through Megatron's f (identity forward, all-reduce
backward), which makes the gradient whole where it is made: one all-reduce per weight and
micro-step, dozens of small collectives each backward. When every use of a weight goes
through an f over the axis, the f's are taken out and the weight is recorded as summed over
the axis (`Compiled.grad_sums`): the gradient sync then reduces its gradient over the data
axes and this one together, in its buckets and once per optimizer step, summing over this
axis while it averages over the data axes (`runtime/expert_data_parallel.averaged_over`).

    copy_to_cp = self.copy_to_cp(layers_0_input_layernorm_weight)     # before: f per weight
    rms_norm = torch.ops.aten.rms_norm.default(x, [64], copy_to_cp, 1e-06)
->
    rms_norm = torch.ops.aten.rms_norm.default(x, [64], layers_0_input_layernorm_weight, 1e-06)
                                                    # its gradient summed over dp x cp in a bucket

A weight with any other use (a replicated computation beside the sharded one) keeps its f's:
its gradient is whole from that use on every rank, and a sum would count it n times.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from meshplan.runtime.collectives import CopyToAxis

aten = torch.ops.aten
_CASTS = (aten._to_copy.default, aten.to.dtype)


def defer_weight_sums(gm: fx.GraphModule, axis: str) -> list[str]:
    """Take out the f's over `axis` of every trainable parameter all of whose uses (through
    casts, and through the kept f's of other axes) are such f's; returns those parameters."""
    reads: dict[int, list[fx.Node]] = {}  # a parameter (tied ones once) -> its reads, by any name
    for node in gm.graph.nodes:
        if node.op == "get_attr" and (param := _trainable(gm, str(node.target))) is not None:
            reads.setdefault(id(param), []).append(node)
    deferred = []
    for nodes in reads.values():
        fs = [_fs_if_only(node, axis) for node in nodes if node.users]
        if not fs or not all(fs):  # a tied weight: every name's uses, or none
            continue
        for f in (f for group in fs for f in group):
            f.replace_all_uses_with(f.args[0])  # type: ignore[arg-type]
            gm.graph.erase_node(f)
        deferred += [str(node.target) for node in nodes]
    if deferred:
        gm.graph.lint()
        gm.recompile()
    return deferred


def _fs_if_only(param: fx.Node, axis: str) -> list[fx.Node]:
    """The f's over `axis` that `param`'s uses end in, if every use ends in one; else []."""
    fs, frontier = [], [param]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            f = _copy_to(user)
            if f is not None and f.axis == axis:
                fs.append(user)
            elif user.target in _CASTS or f is not None:  # a cast, or another axis's f
                frontier.append(user)
            else:
                return []
    return fs


def _copy_to(node: fx.Node) -> CopyToAxis | None:
    if node.op != "call_module":
        return None
    module = node.graph.owning_module.get_submodule(str(node.target))  # type: ignore[union-attr]
    return module if isinstance(module, CopyToAxis) else None


def _trainable(gm: fx.GraphModule, target: str) -> nn.Parameter | None:
    try:
        attr = gm.get_parameter(target)
    except AttributeError:
        return None
    return attr if isinstance(attr, nn.Parameter) and attr.requires_grad else None
