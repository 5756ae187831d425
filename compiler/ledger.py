"""The collective ledger: every collective a compiled program issues per step, and why.

Each inserted collective node becomes rows: op, mesh axis, the tensor's full shape,
bytes of that tensor, how many times per step in forward and in backward, and the plan
line that caused it. The ops a node issues per call are the ones its module class
declares (`runtime.collectives`: `forward_wire`, `backward_wire`), not a table of the
ledger's own. Bytes are what each rank contributes to the collective (the full tensor for
an all-reduce, the full gathered tensor for all-gather and reduce-scatter); `traffic` is
what a ring algorithm moves per rank: 2(n-1)/n x bytes for all-reduce, (n-1)/n x bytes for
all-gather and reduce-scatter.

Counts are per optimizer step: with `gradient_accumulation = k` the graph's collectives
run k times, the gradient reductions once. Data-parallel rows come from the runtime's
own grouping rule (`runtime.buckets`: DataParallel's buckets, ZeRO's flats), so they are
the collectives `meshplan run` issues, byte for byte (a test compares them):

    zero  backward                         step
    0     all_reduce per bucket            -
          under `compress`: per bucket, bf16: one all_reduce of half the bytes; powersgd: one of
          the tensors sent whole, one of the P factors, one of the Q factors
          (`buckets.compressed_wire`; PowerSGD's warm-up steps are uncompressed and not counted)
    1     all_reduce per bucket            all_gather per bucket (waited for in the next forward)
    2     reduce_scatter per bucket        all_gather per bucket
    3     reduce_scatter per unit flat;    -
          all_gather per flat before each unit's forward, and again before its backward
          (not for the unit released last)
    1-3   an all_reduce of 8 bytes per sum of squares the gradient norm needs (one per set of
          axes that shard parameters, one for the rest)
          under `compress`, each flat's reduction is `buckets.zero_compressed_wire`'s: bf16, the
          padded flat in bf16 (all_reduce at stage 1, reduce_scatter at 2 and 3); powersgd, the
          all_reduces of the whole tensors, P and Q at every stage

An experts unit (`experts over ep`) issues three all-to-alls in forward: the token counts
((E,) int64), the dispatch of every (token, slot) pair's row ((N k, H)) and the combine that
brings the outputs back (the same shape); backward reverses the last two. Dropless, the
dispatch (and the combine's backward) sends a rank's N k rows, the rows it keeps included;
the combine (and the dispatch's backward) sends back what its experts got, N k on average
over the axis's ranks and exactly that summed over them. Where the rows go follows the
routing: `traffic`, (n-1)/n x bytes, is the balanced prediction. With a capacity
(`capacity_factor`) the buffers are fixed: no counts, and the dispatch and the combine each
send E C rows (C = ceil(N k factor / E) per expert, `runtime.experts.expert_capacity`),
exactly, on every rank, whatever the routing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from meshplan.dsl.check import Plan
from meshplan.dsl.errors import Span
from meshplan.dsl.settings import CompressSpec
from meshplan.runtime.buckets import (
    bucket_sizes,
    compressed_wire,
    dp_buckets,
)
from meshplan.runtime.collectives import COLLECTIVES, Wire
from meshplan.runtime.device_copy import DEVICE, HOST
from meshplan.runtime.experts import expert_capacity
from meshplan.runtime.mesh import MeshLayout, axes_of

from . import meta
from .graph import arg_node, hint, shape, value
from .ledger_row import COPY, LedgerRow, plan_line
from .ledger_zero import Replicas, zero_bucket_rows, zero_unit_rows
from .meta import Collective
from .passes.checkpoint import collective_nodes
from .passes.devices import copy_nodes
from .passes.zero import reduce_axes
from .placement import Placement, Shard

PHASES = ("forward", "backward", "step")  # a row's phase, in the order a step runs them


@dataclass(frozen=True)
class Ledger:
    rows: tuple[LedgerRow, ...]

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(
            r.count for r in self.rows if (op is None or r.op == op) and (phase is None or r.phase == phase)
        )

    def total_bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(
            r.bytes * r.count
            for r in self.rows
            if (op is None or r.op == op) and (phase is None or r.phase == phase)
        )

    def collectives(self) -> Ledger:
        """The rows on the wire, between ranks: all but the device copies."""
        return Ledger(tuple(r for r in self.rows if r.kind != COPY))

    def copies(self) -> Ledger:
        """The device copies of placed modules' boundaries, within the rank."""
        return Ledger(tuple(r for r in self.rows if r.kind == COPY))

    def summary(self) -> str:
        """`29 collectives per step (10 forward, 18 backward, 1 after the optimizer step), 2.444 MB`,
        and where a device rule placed modules, `; 4 device copies per step (2 forward, 2 backward),
        0.278 MB`."""
        wire = self.collectives()
        phases = [f"{wire.count(phase='forward')} forward", f"{wire.count(phase='backward')} backward"]
        if wire.count(phase="step"):
            phases.append(f"{wire.count(phase='step')} after the optimizer step")
        text = f"{wire.count()} collectives per step ({', '.join(phases)}), {wire.total_bytes() / 1e6:.3f} MB"
        copies = self.copies()
        if copies.rows:
            phases = [
                f"{copies.count(phase=p)} {p}" for p in ("forward", "backward") if copies.count(phase=p)
            ]
            text += (
                f"; {copies.count()} device copies per step ({', '.join(phases)}), "
                f"{copies.total_bytes() / 1e6:.3f} MB"
            )
        return text

    def to_json(self) -> list[dict]:
        return [
            {
                "node": r.node,
                "kind": r.kind,
                "op": r.op,
                "phase": r.phase,
                "axis": r.axis,
                "shape": list(r.shape),
                "bytes": r.bytes,
                "count": r.count,
                "group_size": r.group_size,
                "rule": plan_line(r.rule),
            }
            for r in self.rows
        ]


@dataclass(frozen=True)
class DataParallelFacts:
    """What the ledger needs to list a plan's data-parallel collectives for one rank."""

    axis: str
    zero: int  # 0: plain data parallel
    bucket_bytes: int
    reduce_dtype: torch.dtype | None  # None: the params' dtype
    params: Sequence[tuple[str, torch.Tensor]]  # this rank's trainable params (meta tensors), program order
    aliases: dict[str, str]  # every name a param has in the graph -> its name in `params` (ties)
    decay: Callable[[str, torch.Tensor], bool]  # which params AdamW decays (they get their own flats)
    where: Span  # the plan's data_parallel block
    norm_sums: int = (
        2  # float64 sums the gradient norm all-reduces: one per set of sharding axes, one for the rest
    )
    # params a device rule placed off the rank's device (`on cpu`): an engine of their own reduces
    # them (buckets; under ZeRO flats of at most stage 2), after the device's
    host: frozenset[str] = frozenset()
    compress: CompressSpec | None = None  # the buckets' (or ZeRO flats') reduction compressed
    replicated: tuple[str, ...] = ()  # HSDP: the data axes over which ZeRO's shards are copies

    def zero_groups(self, layout: MeshLayout) -> tuple[str, Replicas | None]:
        """The axes ZeRO cuts the state over and, under HSDP, the replicas of each shard."""
        return zero_groups(self.axis, self.replicated, layout)


@dataclass(frozen=True)
class ExpertDataFacts:
    """Gradient averaging under expert parallelism (`runtime.experts.expert_data_parallel`): one
    data-parallel engine per set of data axes some parameters are averaged over (the dense ones
    over `dp` x `ep`, the experts over `dp`), each with its own buckets."""

    groups: Sequence[tuple[tuple[str, ...], int, Sequence[tuple[str, torch.Tensor]]]]  # (axes, ranks, params)
    bucket_bytes: int
    reduce_dtype: torch.dtype | None
    where: Span  # the data_parallel block, or the first experts rule
    zero: int = 0  # ZeRO: each group's state sharded over its ranks (`runtime/expert_zero.py`)
    decay: Callable[[str, torch.Tensor], bool] | None = None  # which params AdamW decays (ZeRO's flats)
    aliases: dict[str, str] = field(default_factory=dict)  # a param's graph names -> its name (ties)
    replicated: tuple[str, ...] = ()  # HSDP: the data axes over which ZeRO's shards are copies
    compress: CompressSpec | None = None  # `compress`: the reductions of the groups over a data axis
    data_axes: tuple[str, ...] = ()  # the data_parallel block's axes (which groups compress)

    def compress_of(self, axes: Sequence[str]) -> CompressSpec | None:
        """The compression of the group over `axes` (`runtime.expert_data_parallel`): the plan's
        where the group takes in a data-parallel axis; a sum over other axes alone is exact."""
        return self.compress if any(a in self.data_axes for a in axes) else None


def zero_groups(axis: str, replicated: Sequence[str], layout: MeshLayout) -> tuple[str, Replicas | None]:
    """The group `axis` (the axes a ZeRO engine averages over) as its engine splits it: the axes
    that cut the state, and HSDP's copies of each shard over the `replicated` ones (None: none
    of more than one rank), as `cli/session/sync.py` builds the engine."""
    axes = axes_of(axis) if axis else ()
    cut = " x ".join(a for a in axes if a not in replicated)
    copies = [a for a in axes if a in replicated and layout.size(a) > 1]
    return cut, Replicas(" x ".join(copies), layout.size(" x ".join(copies))) if copies else None


def data_parallel_facts(
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

    params, aliases = _local_params(gm, model, placements, layout)
    reduce = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.precision.reduce]
    where = dp.span
    # the gradient norm sums squares per set of axes that shard a parameter, and one for the rest
    kinds = {
        tuple(a for a, p in placements.get(name, {}).items() if isinstance(p, Shard) and layout.size(a) > 1)
        for name in params
    }
    norm_sums = len(kinds - {()}) + 1
    host = frozenset(
        str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and meta.device(n) is not None
    )
    return DataParallelFacts(
        dp.axis,
        dp.zero,
        dp.bucket_bytes,
        reduce,
        list(params.items()),
        aliases,
        decays,
        where,
        norm_sums,
        host & set(params),
        dp.compress,
        dp.replicated_over if dp.zero else (),
    )


def _local_params(
    gm: fx.GraphModule, model: nn.Module, placements: dict[str, dict[str, Placement]], layout: MeshLayout
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One rank's trainable params, as meta tensors of their local shapes in the order the rank
    program holds them, and every name a param has in the graph -> its name there (ties)."""
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
    return params, aliases


def expert_data_facts(
    plan: Plan,
    gm: fx.GraphModule,
    model: nn.Module,
    placements: dict[str, dict[str, Placement]],
    layout: MeshLayout,
    grad_sums: dict[str, tuple[str, ...]],
) -> ExpertDataFacts | None:
    """Under expert parallelism the batch is split over the data axis and every expert axis;
    each parameter is averaged over those that do not shard it (`runtime.experts`), and summed
    over the axes its gradient is partial over (`grad_sums`), grouped as
    `expert_data_parallel` groups them. None without an expert axis of more than one rank or
    a gradient sum: then one data axis averages every parameter (`data_parallel_facts`)."""
    experts = {a for r in plan.rules_of("experts") if r.axis for a in axes_of(r.axis)}
    dp = plan.data_parallel
    data = [a for a in layout.names if a in plan.batch_axes and layout.size(a) > 1]
    if not any(a in experts for a in data) and not grad_sums:
        return None
    from meshplan.runtime.buckets import decays

    params, aliases = _local_params(gm, model, placements, layout)
    groups: dict[tuple[str, ...], list[tuple[str, torch.Tensor]]] = {}
    for name, p in params.items():
        sharded = {a for a, pl in placements.get(name, {}).items() if isinstance(pl, Shard)}
        over = reduce_axes(layout, data, sharded, grad_sums.get(name, ()))
        groups.setdefault(over, []).append((name, p))
    reduce = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.precision.reduce]
    # the block or rule that asks for these reductions: data parallelism, the experts' axis,
    # or the context or sequence rule whose shards make weight gradients partial
    rules = [*plan.rules_of("experts"), *plan.rules_of("context"), *plan.rules_of("sequence")]
    span = dp.span if dp is not None else rules[0].span if rules else plan.mesh.span
    zero = dp.zero if dp is not None else 0
    return ExpertDataFacts(
        tuple(
            (over, math.prod(layout.size(a) for a in over), tuple(ps))
            for over, ps in sorted(groups.items())
            if over or zero  # ZeRO keeps a group of one rank too: its optimizer step
        ),
        dp.bucket_bytes if dp is not None else 25_000_000,
        reduce,
        span,
        zero,
        decays,
        aliases,
        dp.replicated_over if dp is not None and zero else (),
        dp.compress if dp is not None else None,
        dp.axes if dp is not None else (),
    )


def build_ledger(
    gm: fx.GraphModule,
    layout: MeshLayout,
    *,
    accumulation: int = 1,
    data: DataParallelFacts | None = None,
    experts_data: ExpertDataFacts | None = None,
) -> Ledger:
    """Every collective of one optimizer step: the graph's, then the data-parallel ones."""
    rows = [
        LedgerRow(
            r.node,
            r.kind,
            r.op,
            r.phase,
            r.axis,
            r.shape,
            r.bytes,
            r.count * accumulation,
            r.group_size,
            r.rule,
            r.recompute,
        )
        for r in _graph_rows(gm, layout)
    ]
    if data is not None and layout.size(data.axis) > 1:
        rows += _data_parallel_rows(gm, layout, data, accumulation)
    if experts_data is not None:
        rows += _expert_data_rows(gm, layout, experts_data, accumulation)
    rows += _copy_rows(gm, layout, accumulation)
    return Ledger(tuple(rows))


def _copy_rows(gm: fx.GraphModule, layout: MeshLayout, accumulation: int) -> list[LedgerRow]:
    """Each device copy (`passes/devices.py`): its tensor, as this rank holds it, copied in forward
    (and again where its checkpoint region is recomputed), its gradient copied back in backward.
    The `axis` column names the other end of the link: `host`, or the placed device `cuda:N`."""
    rows = []
    for node, recomputed in copy_nodes(gm):
        fact = meta.device_copy(node)
        assert fact is not None, "copy_nodes yields device copies"
        held = held_shape(node, shape(node), "", layout)
        if not all(isinstance(d, int) for d in held):
            continue  # a data-dependent size (a list of experts' rows): not in a placed module
        nbytes = math.prod(held) * value(node).element_size()
        link = (
            "host"
            if HOST in (fact.to, fact.source)
            else next(d for d in (fact.to, fact.source) if d != DEVICE)
        )
        copies = [("forward", fact.to, False)]
        if fact.grad:
            copies.append(("backward", fact.source, False))
        if recomputed:
            copies.append(("backward", fact.to, True))
        where = fact.rule.span
        rows += [
            LedgerRow(
                node.name,
                COPY,
                f"copy_to_{_side(to)}",
                phase,
                link,
                held,
                nbytes,
                accumulation,
                1,
                where,
                again,
            )
            for phase, to, again in copies
        ]
    return rows


def _side(to: str) -> str:
    """`host`, `device` (the rank's own) or `cuda:1`: where a copy goes, as an op names it."""
    return "host" if to == HOST else to


def held_shape(
    node: fx.Node, full: tuple[int | torch.SymInt, ...], axis: str, layout: MeshLayout
) -> tuple[int | torch.SymInt, ...]:
    """The shape of `node` as one rank of `axis`'s group holds it: cut by every other axis that
    shards it (a tensor on sequence shards over `tp` is all-reduced over `tq` a shard at a time).
    Sizes that follow from the token shape are the example's: the ledger is of the example run."""
    held = [s if (h := hint(s)) is None else h for s in full]
    for other, p in meta.placement(node).items():
        if other != axis and isinstance(p, Shard) and p.dim < len(held) and isinstance(held[p.dim], int):
            held[p.dim] = p.chunk(int(held[p.dim]), layout.size(other))
    return tuple(held)


def _graph_rows(gm: fx.GraphModule, layout: MeshLayout) -> list[LedgerRow]:
    rows = []
    # a list of experts' rows, one per routed pair (`passes/experts/rows.py`): their data-dependent
    # count is the example's routed pairs wherever it appears (a row split inside the experts
    # reduces them over tp)
    routed = {
        str(shape(arg_node(node, 0))[0]): pairs
        for node, _ in collective_nodes(gm)
        if (pairs := meta.collective_of(node).get("routed_pairs")) is not None
    }
    for node, recomputed in collective_nodes(gm):
        info = meta.collective_of(node)
        if info["kind"] in ("zero_gather", "zero_release"):
            continue  # listed with the data-parallel rows
        if info["kind"] == "experts":  # over one rank it sends nothing
            rows += _expert_rows(node, info, layout, recomputed) if layout.size(info["axis"]) > 1 else []
            continue
        kind, axis = info["kind"], info["axis"]
        val = value(node)
        full = held_shape(node, tuple(routed.get(str(d), d) for d in shape(node)), axis, layout)
        if not all(isinstance(d, int) for d in full):
            continue  # rows whose count follows the data and no routing says (warned at compile)
        nbytes = math.prod(full) * val.element_size()
        if kind == "all_to_all":  # a rank sends (n-1)/n of what it holds: its shard, not the whole
            nbytes //= layout.size(axis)
        if kind == "ring_attention":  # the key block is what travels (whole: n blocks)
            keys = arg_node(node, 1)
            full = held_shape(keys, shape(keys), axis, layout)
            nbytes = math.prod(full) * value(keys).element_size()
        if kind == "vocab_cross_entropy":  # all-reduces of one float per token
            logits = arg_node(node, 0)
            full = held_shape(logits, shape(logits), axis, layout)[:-1]
            nbytes = math.prod(full) * 4
        rule = info.get("rule")
        where = rule.span if rule is not None else None
        declared = COLLECTIVES[kind]  # the ops it issues per call, as its module class declares them
        forward, backward = declared.forward_wire, declared.backward_wire
        if kind == "vocab_cross_entropy" and len(node.args) > 4 and node.args[4]:
            forward = (Wire("all_reduce", 4),)  # label smoothing: the sum of the logits too
        phases = [("forward", forward, False), ("backward", backward, False)]
        if recomputed:  # a checkpointed region runs its forward again during backward
            phases.append(("backward", forward, True))
        for phase, steps, again in phases:
            for op, count in steps:
                rows.append(
                    LedgerRow(
                        node.name, kind, op, phase, axis, full, nbytes, count, layout.size(axis), where, again
                    )
                )
    return rows


def unit_tokens(node: fx.Node, layout: MeshLayout) -> tuple[tuple, int | torch.SymInt]:
    """An experts unit's tokens as one rank holds them, (N, H) (cut by every axis that cuts
    them, the unit's own included: experts borrowing a tensor axis route their rank's rows), and
    the experts each routes a token to, k (a list's rows are pairs already: k = 1)."""
    tokens, index = arg_node(node, 0), arg_node(node, 1)
    routed = meta.collective_of(node).get("routed_pairs")
    if routed is not None:  # a list's rows, one per pair: as many as its routing makes
        return held_shape(tokens, (routed, *shape(tokens)[1:]), "", layout), 1
    return held_shape(tokens, shape(tokens), "", layout), held_shape(index, shape(index), "", layout)[-1]


def shared_axis(info: Collective) -> str:
    """The axis whose ranks queue their tokens together under a capacity ("": none)."""
    shared = info.get("shared") or ""
    return info["axis"] if shared is True else shared  # (True: compiled before groups of axes)


def unit_capacity(node: fx.Node, layout: MeshLayout) -> int:
    """C, the pairs each expert of a unit with a `capacity_factor` takes per call: of the
    tokens its rank routes, or those the ranks of its shared axis route together."""
    info = meta.collective_of(node)
    held, k = unit_tokens(node, layout)
    shared = shared_axis(info)
    routed = held[0] * (layout.size(shared) if shared else 1)  # the tokens it queues
    return expert_capacity(int(routed), int(k), int(info["experts"]), info["capacity_factor"])


def _expert_rows(node: fx.Node, info: Collective, layout: MeshLayout, recomputed: bool) -> list[LedgerRow]:
    """An experts unit's all-to-alls (see the module docstring): the counts, then each pair's
    row dispatched and combined in forward, and both again, reversed, in backward."""
    axis, rule = info["axis"], info.get("rule")
    where = rule.span if rule is not None else None
    tokens = arg_node(node, 0)
    held, k = unit_tokens(node, layout)
    factor, experts, shared = info.get("capacity_factor"), int(info["experts"]), shared_axis(info)
    if factor is None:
        pairs = (held[0] * k, *held[1:])  # (N k, H): every (token, slot) pair's row
    else:
        places = experts * unit_capacity(node, layout)  # E C
        # its own kept pairs where the ranks of `shared` queue together: at most N k, or E C
        pairs = (min(held[0] * k, places) if shared else places, *held[1:])
    nbytes = math.prod(pairs) * value(tokens).element_size()
    n = layout.size(axis)
    if not isinstance(nbytes, int):  # a list's rows, with no routing to count them (warned at compile)
        return [
            LedgerRow(
                node.name, "experts", "all_to_all", "forward", axis, (experts,), 8 * experts, 1, n, where
            )
        ]

    def row(op_phase: str, shape_: tuple, size: int, count: int, again: bool = False) -> LedgerRow:
        return LedgerRow(
            node.name, "experts", "all_to_all", op_phase, axis, shape_, size, count, n, where, again
        )

    forward = [row("forward", pairs, nbytes, 2)]
    if factor is None or shared:  # the sizes follow the counts (of the kept pairs)
        forward.insert(0, row("forward", (experts,), 8 * experts, 1))
    if factor is not None and shared:  # the routing of the tokens its ranks share, N k int64 from each
        sent = int(held[0]) * int(k) * 8  # (a capacity needs the example's sizes: they are concrete)
        m = layout.size(shared)
        gathered = LedgerRow(
            node.name, "experts", "all_gather", "forward", shared, (m, held[0], k), sent, 1, m, where
        )
        forward.insert(0, gathered)
    rows = [*forward, row("backward", pairs, nbytes, 2)]
    if recomputed:  # checkpointing runs the forward again in backward
        rows += [dataclasses.replace(r, phase="backward", recompute=True) for r in forward]
    return rows


def _expert_data_rows(
    gm: fx.GraphModule, layout: MeshLayout, facts: ExpertDataFacts, accumulation: int
) -> list[LedgerRow]:
    """Each group's buckets, all-reduced; under ZeRO its flats (stages 1/2: reduced and gathered
    back over the group's ranks; 3: its units' nodes), and its engine's gradient-norm sums. A
    group no other rank shares (`experts over dp`) is ZeRO-2 at most, over this rank alone:
    it sends nothing, and has no rows."""
    rows = []
    decay = facts.decay or (lambda name, p: True)
    for axes, n, params in facts.groups:
        axis = " x ".join(axes)
        cut, replicas = zero_groups(axis, facts.replicated, layout)
        m = layout.size(cut) if cut else 1
        if n <= 1 or (facts.zero and replicas is None and m <= 1):
            continue
        compress = facts.compress_of(axes)
        if not facts.zero and compress is not None:
            rows += compressed_bucket_rows(
                [p for _, p in params], facts.bucket_bytes, compress, axis, n, facts.where
            )
            continue
        if not facts.zero:
            sizes = bucket_sizes([p for _, p in params], facts.bucket_bytes, facts.reduce_dtype)
            rows += [
                LedgerRow(
                    f"bucket {i}", "dp_bucket", "all_reduce", "backward", axis, (b,), b, 1, n, facts.where
                )
                for i, b in enumerate(sizes)
            ]
            continue
        reduce, where = facts.reduce_dtype, facts.where
        compress = compress if m > 1 else None  # a group of this rank alone reduces nothing
        if facts.zero == 3 and m > 1:
            rows += zero_unit_rows(
                gm,
                params,
                facts.aliases,
                cut,
                m,
                decay,
                reduce,
                where,
                accumulation,
                compress,
                replicas,
                axis,
            )
        else:
            stage = min(facts.zero, 2)
            rows += zero_bucket_rows(
                params,
                cut,
                m,
                stage,
                facts.bucket_bytes,
                reduce,
                decay,
                where,
                compress=compress,
                replicas=replicas,
            )
        if m > 1:
            rows.append(LedgerRow("grad norm", "zero_norm", "all_reduce", "step", cut, (2,), 16, 1, m, where))
    return rows


def compressed_bucket_rows(
    params: Sequence[torch.Tensor], bucket_bytes: int, compress: CompressSpec, axis: str, n: int, where: Span
) -> list[LedgerRow]:
    """`DataParallel`'s buckets under `compress`: each bucket's parts as the compression sends
    them (`buckets.compressed_wire`), all-reduced over the `n` ranks of `axis` in backward."""
    return [
        LedgerRow(f"bucket {i} {what}", "dp_bucket", "all_reduce", "backward", axis, (b,), b, 1, n, where)
        for i, (ps, _) in enumerate(dp_buckets(params, bucket_bytes, None))
        for what, b in compressed_wire(ps, compress.method, compress.rank)
    ]


def _data_parallel_rows(
    gm: fx.GraphModule, layout: MeshLayout, data: DataParallelFacts, accumulation: int
) -> list[LedgerRow]:
    """The engine's rows, then those of the engine of the parameters a device rule placed on the
    host (`DataParallelFacts.host`): buckets of their own, under ZeRO flats of at most stage 2
    (under HSDP over the same shard and replica groups as the device's), and its own
    gradient-norm sums."""
    axis, n, where, replicas = data.axis, layout.size(data.axis), data.where, None
    if data.zero:  # HSDP: the state cut over some of the data axes, copied over the others
        axis, replicas = data.zero_groups(layout)
        n = layout.size(axis)
    params = [(name, p) for name, p in data.params if name not in data.host]
    host = [(name, p) for name, p in data.params if name in data.host]
    if data.zero == 0 and data.compress is not None:  # `dsl.check` refuses it with `on cpu`
        return compressed_bucket_rows(
            [p for _, p in params], data.bucket_bytes, data.compress, axis, n, where
        )
    if data.zero == 0:
        return [
            LedgerRow(f"{label} {i}", "dp_bucket", "all_reduce", "backward", axis, (b,), b, 1, n, where)
            for label, ps in (("bucket", params), ("host bucket", host))
            for i, b in enumerate(bucket_sizes([p for _, p in ps], data.bucket_bytes, data.reduce_dtype))
        ]
    rows = []
    if params and data.zero in (1, 2):
        stage, bucket_bytes, reduce = data.zero, data.bucket_bytes, data.reduce_dtype
        rows += zero_bucket_rows(
            params, axis, n, stage, bucket_bytes, reduce, data.decay, where, "bucket", data.compress, replicas
        )
    elif params:
        reduce, decay, compress = data.reduce_dtype, data.decay, data.compress
        rows += zero_unit_rows(
            gm,
            params,
            data.aliases,
            axis,
            n,
            decay,
            reduce,
            where,
            accumulation,
            compress,
            replicas,
            data.axis,
        )
    if host:  # HSDP's replicas of the host's shards too: the same groups, on the host
        stage = min(data.zero, 2)
        rows += zero_bucket_rows(
            host,
            axis,
            n,
            stage,
            data.bucket_bytes,
            data.reduce_dtype,
            data.decay,
            where,
            label="host bucket",
            replicas=replicas,
        )
    sums = data.norm_sums
    return rows + [
        LedgerRow(label, "zero_norm", "all_reduce", "step", axis, (sums,), 8 * sums, 1, n, where)
        for label, ps in (("grad norm", params), ("host grad norm", host))
        if ps
    ]
