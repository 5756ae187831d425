"""Op rules from PyTorch's own: DTensor's registered sharding strategies, asked about one node.

meshplan's tensor-parallel pass has hand-written rules for the ops whose placement it must
decide itself (linear splits, fused blocks, vocab-parallel embedding and loss, views that
need local sizes). Every other ATen op is asked of DTensor's sharding propagator, the same
table `torch.distributed.tensor` dispatches with, so an op that DTensor can shard (a
`rms_norm`, `view_as_complex` in a complex RoPE, a new pointwise op) needs no rule here:

    ask(aten.rms_norm.default, node.args, {x: Shard(1), w: Replicate()}, axis="tp", size=2)
    -> Strategy(inputs={x: Shard(1), w: Replicate()}, output=Shard(1))

The answer says which placement each tensor input must have (the pass inserts the
collectives that get it there) and the output's placement. DTensor is asked with a device
mesh that has no process group behind it (`_init_backend=False`): strategies only read the
mesh's shape.

Ops whose arguments include sizes (`SymInt[]`: view, expand, new_zeros) are not asked: their
size arguments would have to be rewritten to local sizes, which only a hand rule knows how
to do. Blocked shards (a fused projection's chunks) have no DTensor counterpart either.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import cast

import torch
from torch import fx

from ...graph import hint, is_guard_error, value
from ...placement import PARTIAL, REPLICATE, Partial, Placement, Shard


@dataclass(frozen=True)
class Strategy:
    inputs: dict[fx.Node, Placement]  # the placement each tensor input must be converted to
    output: Placement


@cache
def _mesh(size: int):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(size), mesh_dim_names=("axis",), _init_backend=False, _rank=0)


def _to_dtensor(p: Placement):
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.placement_types import Partial as DPartial

    if isinstance(p, Shard):
        return DShard(p.dim)
    return DPartial() if isinstance(p, Partial) else DReplicate()


def _from_dtensor(p) -> Placement | None:
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.placement_types import Partial as DPartial

    if type(p) is DShard:  # not _StridedShard, a subclass with an interleaved layout
        return Shard(p.dim)
    if isinstance(p, DReplicate):
        return REPLICATE
    if isinstance(p, DPartial) and p.reduce_op == "sum":
        return PARTIAL
    return None


def takes_sizes(op) -> bool:
    """Whether the op has size arguments (`SymInt[]`), which sharding would change."""
    schema = getattr(op, "_schema", None)
    return schema is None or any("SymInt" in str(a.type) for a in schema.arguments)


def ask(op, args: tuple, kwargs: dict, placements: dict[fx.Node, Placement], size: int) -> Strategy | None:
    """DTensor's strategy for `op` on inputs placed as given over one axis of `size` ranks, or
    None if DTensor has none (or one meshplan cannot express)."""
    if not isinstance(op, torch._ops.OpOverload) or takes_sizes(op):
        return None
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
    from torch.utils._pytree import tree_leaves, tree_map

    mesh = _mesh(size)

    def spec(a):
        if not isinstance(a, fx.Node):
            return a
        v = value(a)
        p = placements.get(a, REPLICATE)
        if not isinstance(v, torch.Tensor):
            raise _Unsupported
        return DTensorSpec(mesh, (_to_dtensor(p),), TensorMeta(*_example(v), v.dtype))

    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, fx.Node)]
    # Equal blocks (a sequence shard flattened with the batch) are asked about as a plain shard
    # of that dim: an op that leaves the dim alone (row-wise) cannot tell them apart. So they
    # are only accepted when every sharded input is placed the same and nothing sharded moves
    # (a whole input DTensor cuts on that dim is cut in the same blocks).
    given = [placements[a] for a in tensors if a in placements]
    blocked = {p for p in given if isinstance(p, Shard) and p.blocks}
    if blocked:
        sharded = {p for p in given if isinstance(p, (Shard, Partial))}
        if len(sharded) != 1 or len(set(next(iter(blocked)).blocks)) != 1:
            return None
    propagator = DTensor._op_dispatcher.sharding_propagator
    # how DTensor reads the op's arguments (a list of tensors, as `index` takes its indices, is
    # flattened), as its dispatcher looks it up
    info = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(
        op
    )
    try:
        schema = OpSchema(op, tree_map(spec, tuple(args)), tree_map(spec, dict(kwargs)), schema_info=info)
        # the propagator's cache returns what it wraps returns (DTensor casts it the same way)
        sharding = cast(OutputSharding, propagator.propagate_op_sharding(schema))
    except _Unsupported:
        return None
    except Exception as e:  # no strategy registered, or one that rejects these inputs
        if is_guard_error(e):
            raise
        return None
    chosen = sharding.redistribute_schema or schema
    specs = [s for s in tree_leaves((chosen.args_schema, chosen.kwargs_schema)) if isinstance(s, DTensorSpec)]
    if len(specs) != len(tensors):
        return None
    inputs: dict[fx.Node, Placement] = {}
    for node, wanted in zip(tensors, specs, strict=True):
        converted = _from_dtensor(wanted.placements[0])
        if converted is None:
            return None
        have = placements.get(node, REPLICATE)
        if isinstance(have, Shard) and have.blocks:
            if converted != Shard(have.dim):
                return None
            converted = have
        elif blocked and isinstance(converted, Shard) and converted != have:
            # a whole input cut to meet blocked ones (BLOOM's ALiBi, (batch x heads, 1, T), beside
            # queries whose heads tp cuts inside each batch row): cut in the same blocks
            (block,) = blocked
            if converted != Shard(block.dim):
                return None
            converted = block
        inputs[node] = converted
    outs: object = sharding.output_spec  # a spec, a sequence of them (None for a non-tensor), or None
    specs = [s for s in (outs if isinstance(outs, (list, tuple)) else [outs]) if isinstance(s, DTensorSpec)]
    placed = {_from_dtensor(s.placements[0]) for s in specs}
    if len(placed) != 1 or None in placed:
        return None  # no tensor output, or outputs placed differently (one placement per node here)
    (output,) = placed
    assert output is not None
    if blocked:
        (block,) = blocked
        if output != Shard(block.dim):
            return None
        output = block
    return Strategy(inputs, output)


def _example(v: torch.Tensor) -> tuple[tuple, tuple]:
    """Shape and strides to ask DTensor with: a size that follows from the token shape at its
    example value. DTensor's strategies depend on sizes only for whether a dim can be sharded,
    and the pass notes every such cut of a token-shaped size for the run to check
    (`Walk.cut`), so the answer holds for every shape the program accepts. Data-dependent
    sizes stay symbolic (DTensor treats them as such)."""
    sizes = tuple(hint(s) if hint(s) is not None else s for s in v.shape)
    strides = tuple(hint(s) if hint(s) is not None else s for s in v.stride())
    return sizes, strides


class _Unsupported(Exception):
    pass
