"""ZeRO's rows of the collective ledger (`ledger.py`): per flat, its gradients reduced in
backward (under `compress`, the collectives that compression sends instead) and its parameters
gathered, from the runtime's own grouping rule (`runtime.buckets`), so the rows are what
`runtime/zero.py` issues, byte for byte."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import fx

from meshplan.dsl.errors import Span
from meshplan.dsl.settings import CompressSpec
from meshplan.runtime.buckets import bucket_params, group_by_kind, zero_compressed_wire
from meshplan.runtime.zero_nodes import ZeroGather, ZeroRelease

from .ledger_row import LedgerRow


class Replicas(NamedTuple):
    """HSDP's copies of a ZeRO group's shards (`runtime.zero_grads.Replicas`): their axes' name
    and how many ranks hold each shard."""

    axis: str
    size: int


def zero_bucket_rows(
    params: Sequence[tuple[str, torch.Tensor]],
    axis: str,
    n: int,
    zero: int,
    bucket_bytes: int,
    reduce_dtype: torch.dtype | None,
    decay: Callable[[str, torch.Tensor], bool],
    where: Span,
    label: str = "bucket",
    compress: CompressSpec | None = None,
    replicas: Replicas | None = None,
) -> list[LedgerRow]:
    """ZeRO-1/2's flats: each gradient flat reduced in backward (all-reduce for stage 1,
    reduce-scatter for 2), its updated params all-gathered after the step; padded to n shards.
    Over a group of one rank (`n == 1`) only HSDP's `replicas` rows send anything."""
    decays = {id(p): decay(name, p) for name, p in params}
    rows = []
    for i, (_, group) in enumerate(bucket_params(params, bucket_bytes, decays)):
        numel = math.ceil(sum(p.numel() for p in group) / n) * n
        name, gathered = f"{label} {i}", numel * group[0].dtype.itemsize
        rows += _reduction_rows(
            name, "zero_bucket", group, numel, zero, reduce_dtype, compress, axis, n, where, replicas
        )
        rows.append(
            LedgerRow(name, "zero_bucket", "all_gather", "step", axis, (numel,), gathered, 1, n, where)
        )
    return [r for r in rows if r.group_size > 1]


def _reduction_rows(
    node: str,
    kind: str,
    params: Sequence[torch.Tensor],
    numel: int,
    zero: int,
    reduce_dtype: torch.dtype | None,
    compress: CompressSpec | None,
    axis: str,
    n: int,
    where: Span,
    replicas: Replicas | None = None,
) -> list[LedgerRow]:
    """The backward reduction of one ZeRO flat of `params` (`numel` padded elements): one
    all-reduce (stage 1) or reduce-scatter (2, 3) in the reduce dtype, then under HSDP the
    all-reduce of what this rank keeps over its `replicas`; or under `compress`
    `buckets.zero_compressed_wire`'s collectives, each a row named by what it sends (and HSDP's
    all-reduce in bf16)."""
    if compress is None:
        op = "all_reduce" if zero == 1 else "reduce_scatter"
        dtype, across = reduce_dtype or params[0].dtype, node
        rows = [LedgerRow(node, kind, op, "backward", axis, (numel,), numel * dtype.itemsize, 1, n, where)]
    else:  # bf16 across the copies (dsl.check refuses PowerSGD with them)
        dtype, across = torch.bfloat16, f"{node} bf16"
        rows = [
            LedgerRow(f"{node} {what}", kind, op, "backward", axis, (b,), b, 1, n, where)
            for op, what, b in zero_compressed_wire(params, numel, zero, compress.method, compress.rank)
        ]
    if replicas is not None:  # what this rank keeps, all-reduced over the copies
        kept = numel if zero == 1 else numel // n
        nbytes = kept * dtype.itemsize
        rows.append(
            LedgerRow(
                across,
                kind,
                "all_reduce",
                "backward",
                replicas.axis,
                (kept,),
                nbytes,
                1,
                replicas.size,
                where,
            )
        )
    return rows


def zero_unit_rows(
    gm: fx.GraphModule,
    params: Sequence[tuple[str, torch.Tensor]],
    aliases: dict[str, str],
    axis: str,
    n: int,
    decay: Callable[[str, torch.Tensor], bool],
    reduce_dtype: torch.dtype | None,
    where: Span,
    accumulation: int,
    compress: CompressSpec | None = None,
    replicas: Replicas | None = None,
    node_axis: str | None = None,
) -> list[LedgerRow]:
    """ZeRO-3's units, from the graph's `ZeroGather` nodes of the group `node_axis` (default
    `axis`; under expert parallelism a layer has one per group): each unit's flats gathered over
    `axis` before its forward (and again before its backward unless it stays gathered), its
    gradients reduce-scattered, and under HSDP their shards all-reduced over `replicas`."""
    node_axis = node_axis or axis
    decays = {id(p): decay(name, p) for name, p in params}
    params_by_name = dict(params)
    left = dict(params)  # not yet in a unit
    released = {m.unit for m in gm.modules() if isinstance(m, ZeroRelease)}
    rows = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if not isinstance(module, ZeroGather) or module.axis != node_axis:
            continue
        names = [aliases[p] for p in module.params if p in aliases]
        named = [(p, left.pop(p)) for p in dict.fromkeys(names) if p in left]
        phases = ["forward", "backward"] if module.unit in released else ["forward"]
        read_as = {  # gathered in the dtype the graph reads them in (bf16 compute)
            id(params_by_name[aliases[p]]): d
            for p, d in zip(module.params, module.dtypes, strict=True)
            if d is not None and p in aliases
        }
        for group in group_by_kind(named, decays, read_as):
            numel = math.ceil(sum(p.numel() for _, p in group) / n) * n
            gathered = numel * read_as.get(id(group[0][1]), group[0][1].dtype).itemsize
            for phase in phases:
                rows.append(
                    LedgerRow(
                        node.name,
                        "zero_gather",
                        "all_gather",
                        phase,
                        axis,
                        (numel,),
                        gathered,
                        accumulation,
                        n,
                        where,
                    )
                )
            ps = [p for _, p in group]
            rows += _reduction_rows(
                node.name, "zero_gather", ps, numel, 3, reduce_dtype, compress, axis, n, where, replicas
            )
    return rows
