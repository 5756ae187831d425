"""`meshplan explain` (and a compile folder's `explain.txt`): rule by rule, what it matched, the
local shapes it gives and the collectives it causes; then the data-parallel, expert, gradient
sum and pipeline blocks, and the linears no tensor rule splits.

Plain text built from a `Compiled`, so the same text appears on screen and on disk.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable

import torch

from meshplan.dsl.fmt import action_text
from meshplan.dsl.optimizer import OptimizerSpec
from meshplan.runtime.buckets import low_rank_shape
from meshplan.runtime.collectives import AxisCollective
from meshplan.runtime.mesh import axes_of
from meshplan.runtime.zero_nodes import ZeroGather

from . import meta
from .compile import Compiled
from .engine_state import DISK_RESIDENT_FLATS
from .graph import module_path, shape, value
from .ledger import COPY, PHASES, data_parallel_facts, held_shape, unit_capacity
from .optimizer_state import describe, whole_state_bytes
from .passes import overlap
from .passes.checkpoint import collective_nodes, region_modules
from .passes.devices import device_of
from .passes.zero import reduce_axes
from .placement import Shard
from .print_schedule import unit_costs


def compress_paths(paths: Iterable[str]) -> list[str]:
    """`layers.0.mlp.up_proj`, `layers.1.mlp.up_proj` -> `layers.{0..1}.mlp.up_proj`."""
    groups: dict[str, list[tuple[int, ...]]] = defaultdict(list)
    for path in paths:
        parts = path.split(".")
        key = ".".join("#" if p.isdigit() else p for p in parts)
        groups[key].append(tuple(int(p) for p in parts if p.isdigit()))
    out: list[str] = []
    for key, indices in groups.items():
        if key.count("#") != 1:
            out.extend(_fill(key, i) for i in indices)
            continue
        values = sorted(i[0] for i in indices)
        if len(values) == 1:
            text = str(values[0])
        elif values == list(range(values[0], values[-1] + 1)):
            text = f"{{{values[0]}..{values[-1]}}}"
        else:
            text = "{" + ",".join(map(str, values)) + "}"
        out.append(key.replace("#", text))
    return out


def _fill(key: str, numbers: tuple[int, ...]) -> str:
    it = iter(numbers)
    return re.sub("#", lambda _: str(next(it)), key)


def explain(compiled: Compiled) -> str:
    """Per rule: what it matched, the local shapes it gives, and the collectives it causes."""
    plan, res = compiled.plan, compiled.resolution
    params = dict(compiled.captured.model.named_parameters())
    by_rule_line: dict[int, list] = defaultdict(list)
    for row in compiled.ledger.rows:
        if row.rule is not None:
            by_rule_line[row.rule.line].append(row)
    issued_early = {  # entries whose backward reduction a `linears` group issues early
        n.name
        for gm in (compiled.graph, *(region for _, region in region_modules(compiled.graph)))
        for n in gm.graph.nodes
        if any(u.op == "call_module" and u.target == overlap.TARGET for u in n.users)
    }
    lines = [
        f"{plan.path}: mesh "
        + " x ".join(f"{n}={s}" for n, s in zip(compiled.layout.names, compiled.layout.sizes, strict=True))
        + f" ({compiled.layout.world_size} ranks)",
        "",
    ]
    for rule in plan.rules:
        matched = res.matched.get(rule.order, ())
        overridden = {p for p, _ in res.overridden.get(rule.order, ())}
        governs = [p for p in matched if p not in overridden]
        lines.append(f"line {rule.span.line}: {rule.pattern}: {action_text(rule.action)}")
        if not matched:
            lines.append("    matches nothing")
        for path in compress_paths(governs):
            lines.append(f"    {path}")
        shapes = _param_shapes(compiled, rule, params, governs)
        for text in shapes:
            lines.append(f"      {text}")
        for path, winner in res.overridden.get(rule.order, ()):
            lines.append(
                f"    {path}: overridden by line {winner.span.line} ({winner.pattern}, more specific)"
            )
        rows = [r for r in by_rule_line.get(rule.span.line, []) if r.kind != COPY]
        if rule.kind == "device":
            lines += _device_lines(compiled, rule, by_rule_line.get(rule.span.line, []))
        if rows:
            counts: dict[tuple[str, str], int] = defaultdict(int)
            for r in rows:
                counts[(r.phase, r.op)] += r.count
            summary = ", ".join(f"{n} {op} {phase}" for (phase, op), n in sorted(counts.items()))
            lines.append(f"    collectives per step: {summary}")
            early = sum(r.count for r in rows if r.phase == "backward" and r.node in issued_early)
            if early:
                lines.append(
                    f"    issued early: {early} backward, each overlapping the weight gradients of the "
                    "linears that read it"
                )
        if rule.kind == "context":
            lines += _context_lines(compiled, rule)
        lines.append("")
    lines += _data_parallel_lines(compiled)
    lines += _optimizer_lines(compiled)
    lines += _expert_lines(compiled)
    lines += _grad_sum_lines(compiled)
    lines += _pipeline_lines(compiled)
    replicated = _replicated_linears(compiled) if compiled.tensor_axes else []
    if replicated:
        lines.append("replicated on every rank (no tensor rule):")
        lines += [f"    {p}" for p in compress_paths(replicated)]
    return "\n".join(lines).rstrip() + "\n"


def _device_lines(compiled: Compiled, rule, rows: list) -> list[str]:
    """A device rule: the tensors that live where it puts them, and the copies at its boundary
    per step, by direction, with their bytes."""
    held = sorted(
        str(n.target)
        for n in compiled.graph.graph.nodes
        if n.op == "get_attr" and meta.device(n) is not None and placed_by(compiled, n) == rule.order
    )
    lines = []
    if held:
        where = "the host" if device_of(rule) == "cpu" else device_of(rule)
        lines.append(
            f"    held on {where} with their gradients and optimizer state: {', '.join(compress_paths(held))}"
        )
    copies: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        if r.kind == COPY:
            entry = copies[(r.phase, r.op)]
            entry[0] += r.count
            entry[1] += r.bytes * r.count
    if copies:
        text = ", ".join(
            f"{n} {op} {phase} ({_kb(nbytes)})"
            for (phase, op), (n, nbytes) in sorted(
                copies.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0][1])
            )
        )
        lines.append(f"    device copies per step: {text}")
    return lines


def placed_by(compiled: Compiled, node) -> int | None:
    """The order of the device rule that placed a model tensor (its owner module's)."""
    path = str(node.target).rpartition(".")[0]
    while True:
        rule = compiled.resolution.rule_for(path, "device")
        if rule is not None or not path:
            return rule.order if rule is not None else None
        path = path.rpartition(".")[0]


def _data_parallel_lines(compiled: Compiled) -> list[str]:
    """The `data_parallel` block: what each rank keeps, its units or buckets, and its collectives."""
    dp = compiled.plan.data_parallel
    if dp is None:
        return []
    size = compiled.layout.size(dp.axis)
    copies = [a for a in dp.replicated_over if compiled.layout.size(a) > 1] if dp.zero else []
    cut = compiled.layout.size(dp.sharded_over)
    keeps = {
        0: "a full copy of parameters, gradients and optimizer state; gradients all-reduced in buckets",
        1: f"1/{cut} of the optimizer state; gradients all-reduced in buckets, parameters all-gathered",
        2: f"1/{cut} of the optimizer state and gradients (reduce-scatter in buckets)",
        3: f"1/{cut} of parameters, gradients and optimizer state; each layer gathered before use, freed after",
    }[dp.zero]
    layout, plan = compiled.layout, compiled.plan
    # expert axes that split the batch (not those borrowing a tensor axis)
    experts = {
        a for r in plan.rules_of("experts") if r.axis for a in axes_of(r.axis) if layout.size(a) > 1
    } & set(plan.batch_axes)
    if dp.zero and experts:  # each parameter's state over the ranks that average it
        data = [a for a in layout.names if a in plan.batch_axes and layout.size(a) > 1 and a not in copies]
        others = [a for a in data if a not in experts]
        what = {1: "optimizer state", 2: "optimizer state and gradients"}.get(
            dp.zero, "parameters, gradients and optimizer state"
        )
        keeps = f"1/{math.prod(layout.size(a) for a in data)} of the dense parameters' {what} (over " + (
            f"{' x '.join(data)}), "
            + (
                f"1/{math.prod(layout.size(a) for a in others)} of its experts' (over {' x '.join(others)})"
                if others
                else "its experts' whole (no other rank holds them)"
            )
        )
    elif dp.zero and compiled.grad_sums:  # weights partial over an axis are sharded over it too
        keeps = _state_over_sum_groups(compiled, dp.zero)
    lines = [
        f"line {dp.span.line}: data_parallel over {dp.axis} ({size} rank{'s' * (size != 1)}): ZeRO-{dp.zero}"
        + (f" over {dp.shard}" if dp.shard else "")
        if dp.zero
        else f"line {dp.span.line}: data_parallel over {dp.axis} ({size} rank{'s' * (size != 1)})",
        f"    each rank keeps {keeps}",
    ]
    if copies:
        group = " x ".join(copies)
        lines.append(
            f"    HSDP: sharded over {dp.sharded_over} only, {compiled.layout.size(group)} copies of each shard "
            f"over {group}; each reduced gradient shard all-reduced over {group}, so every copy takes the same step"
        )
    if dp.optimizer_on_disk:
        lines.append(
            "    offload = optimizer:disk: each rank's fp32 masters and optimizer moments live in files, "
            "one per flat, under --offload-dir (default: the run folder's offload/rank<r>); a step "
            "reads flat i+1 while flat i steps and flat i-1 is written back, so at most "
            f"{DISK_RESIDENT_FLATS} flats' state is in host memory (bytes per rank: `meshplan estimate`)"
        )
    if dp.params_on_disk and dp.zero == 3:
        lines.append(
            "    offload = params:disk: each rank's parameter shards live in files, one per flat, under "
            "--offload-dir (default: the run folder's offload/rank<r>); each unit's shards are read "
            "just before its all-gather, the next unit's meanwhile (in forward order, then in "
            "backward order), and freed after it, so about two units' shards are in host memory; "
            + (
                "the step writes each back with its flat's state"
                if dp.optimizer_on_disk
                else "the step reads them all, updates them and writes them back"
            )
            + " (bytes per rank: `meshplan estimate`)"
        )
    if any(r.node.startswith("host ") for r in compiled.ledger.rows):
        how = (
            "in buckets of their own"
            if not dp.zero
            else f"their gradients and optimizer state in ZeRO-{min(dp.zero, 2)} flats of their own, on the host"
        )
        lines.append(
            f"    parameters a device rule holds on the host are reduced apart, {how} "
            "(over gloo where the device's group is NCCL)"
        )
    units = [
        str(info["unit"]) or "root"
        for n in compiled.graph.graph.nodes
        if (info := meta.collective(n)) is not None and info["kind"] == "zero_gather"
    ]
    if dp.zero == 3 and units:
        lines.append(f"    units, in forward order: {', '.join(compress_paths(units))}")
        read_as = Counter(
            _DTYPE_NAMES.get(d, str(d))
            for module in compiled.graph.modules()
            if isinstance(module, ZeroGather)
            for d in module.dtypes
        )
        cast = {d: n for d, n in read_as.items() if d != "None"}
        if cast:
            total = sum(read_as.values())
            each = ", ".join(f"{n} of {total} as {d}" for d, n in sorted(cast.items()))
            lines.append(
                f"    weights gathered in the dtype the layers read them in: {each} (freed with their layer)"
            )
    # under expert parallelism over `dp x ep`, `dp`, or `ep` alone when dp has one rank
    rows = [r for r in compiled.ledger.rows if r.kind in _DP_KINDS]
    if rows:
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for r in rows:
            counts[(r.phase, r.op)] += r.count
        summary = ", ".join(
            f"{n} {op} {phase}"
            for (phase, op), n in sorted(counts.items(), key=lambda kv: (PHASES.index(kv[0][0]), kv[0][1]))
        )
        nbytes = sum(r.bytes * r.count for r in rows)
        lines.append(f"    collectives per step: {summary} ({nbytes / 1e6:.3f} MB)")
        reduced = sum(r.bytes * r.count for r in rows if r.phase == "backward" and r.op != "all_gather")
        lines += _compression_lines(compiled, reduced)
    return [*lines, ""]


def _optimizer_lines(compiled: Compiled) -> list[str]:
    """`train { optimizer = ... }`, where the plan names one: its state and what it costs this
    model beside AdamW's (`optimizer_state.py`), and that an elementwise one adds no collective."""
    spec, dp = compiled.plan.train.optimizer, compiled.plan.data_parallel
    if spec.span is None:
        return []
    trainable = [p for p in compiled.captured.model.parameters() if p.requires_grad]
    mine = sum(whole_state_bytes(spec, p) for p in trainable)
    adamw = sum(whole_state_bytes(OptimizerSpec(), p) for p in trainable)
    sharded = (
        f", 1/{compiled.layout.size(dp.sharded_over)} of it on each rank under ZeRO" if dp and dp.zero else ""
    )
    if spec.kind == "adafactor" and dp and dp.zero:
        sharded = (
            ", its vectors' moments cut by ZeRO, its matrices' row and column moments whole on every rank"
        )
    lines = [
        f"line {spec.span.line}: optimizer = {spec.text}",
        f"    {describe(spec)}",
        f"    state of the whole model: {mine / 1e6:.3f} MB{sharded} "
        f"(AdamW's: {adamw / 1e6:.3f} MB, {mine / adamw:.2f}x)",
    ]
    if spec.kind != "adafactor":
        lines.append("    elementwise: each rank steps its own elements, no collective of its own")
    else:
        lines.append(
            "    reads whole parameters: where a rank holds pieces (ZeRO, a split rule), two all-reduces "
            "a step of each parameter's row, column and RMS sums over the ranks holding the others"
        )
    return [*lines, ""]


def _compression_lines(compiled: Compiled, sent: int) -> list[str]:
    """`compress`: what its gradient reductions send (`sent` bytes) against the exact ones', what
    it keeps exact, and under ZeRO-2/3 what it costs the memory ZeRO saves."""
    dp = compiled.plan.data_parallel
    if dp is None or dp.compress is None or compiled.source is None:
        return []
    c = dp.compress
    facts = data_parallel_facts(
        compiled.plan, compiled.graph, compiled.source.model, compiled.param_placements, compiled.layout
    )
    assert facts is not None
    params = [p for _, p in facts.params]
    exact = sum(p.numel() * p.element_size() for p in params)
    if c.method == "bf16":
        how = "rounded to bf16, each rank's rounding error added to its next step's gradients"
    else:
        matrices = sum(low_rank_shape(p, c.rank) is not None for p in params)
        how = (
            f"{matrices} of {len(params)} gradients as rank-{c.rank} factors P and Q (error feedback, "
            "Q warm-started), the rest whole"
            + (f"; the first {c.warmup} steps uncompressed" if c.warmup > 1 else "")
            + ("; the first step uncompressed" if c.warmup == 1 else "")
        )
    lines = [
        f"    gradients compressed ({c.text}, line {c.span.line if c.span else dp.span.line}): {how}",
        f"    {sent / 1e6:.3f} MB per step instead of {exact / 1e6:.3f} MB ({exact / max(sent, 1):.1f}x less); "
        "lossy: verify holds it to the uncompressed run's losses",
    ]
    if dp.zero >= 2:
        sends = (
            "reduce-scattered in bf16"
            if c.method == "bf16"
            else "P and Q all-reduced (no reduce-scatter form), each rank keeping its shard of P Q^T"
        )
        lines.append(
            f"    under ZeRO-{dp.zero}: {sends}; error feedback keeps a residual of every gradient on "
            f"each rank ({exact / 1e6:.3f} MB), the memory ZeRO-{dp.zero} saves on gradients"
        )
    copies = [a for a in dp.replicated_over if compiled.layout.size(a) > 1] if dp.zero else []
    if copies:
        lines.append(
            f"    HSDP: each rank's reduced {'gradient' if dp.zero == 1 else 'shard'} all-reduced over "
            f"{' x '.join(copies)} in bf16 too, with a residual of its own"
        )
    return lines


def _reduce_groups(compiled: Compiled) -> Counter[tuple[str, ...]]:
    """Trainable parameters by the axes their gradient is reduced over (`reduce_axes`)."""
    groups: Counter[tuple[str, ...]] = Counter()
    assert compiled.source is not None
    for name, p in compiled.source.model.named_parameters():
        if p.requires_grad:
            cut = {a for a, pl in compiled.param_placements.get(name, {}).items() if isinstance(pl, Shard)}
            summed = compiled.grad_sums.get(name, ())
            groups[reduce_axes(compiled.layout, compiled.plan.batch_axes, cut, summed)] += 1
    return groups


def _state_over_sum_groups(compiled: Compiled, zero: int) -> str:
    """What a ZeRO rank keeps when some weights are sharded over the axes they are summed over
    too: "1/4 of parameters, ... (over dp x cp)", each group after the first "and ..." ."""
    what = {1: "optimizer state", 2: "optimizer state and gradients"}.get(
        zero, "parameters, gradients and optimizer state"
    )
    layout, dp = compiled.layout, compiled.plan.data_parallel
    copies = dp.replicated_over if dp is not None else ()
    parts = []
    for i, (over, count) in enumerate(_reduce_groups(compiled).most_common()):
        over = tuple(a for a in over if a not in copies)
        ranks = math.prod(layout.size(a) for a in over)
        share = f"1/{ranks}" if ranks > 1 else "all"
        whose = f"the {what} of {count} weights" if i == 0 else f"{count} more weights'"
        parts.append(f"{share} of {whose} (over {' x '.join(over) or 'this rank alone'})")
    return ", ".join(parts)


def _grad_sum_lines(compiled: Compiled) -> list[str]:
    """Weights whose gradients are partial over an axis, summed in the gradient sync's buckets."""
    if not compiled.grad_sums:
        return []
    by_axes = Counter(compiled.grad_sums.values())
    assert compiled.source is not None
    total = len([p for p in compiled.source.model.parameters() if p.requires_grad])
    lines = ["weight gradients partial over an axis (each rank computes with its shard of the activations):"]
    for axes, count in sorted(by_axes.items()):
        lines.append(
            f"    {count} of {total} summed over {' x '.join(axes)} by the gradient sync, in its buckets "
            "once per step (not an all-reduce per weight in backward)"
        )
    return [*lines, ""]


_DP_KINDS = ("dp_bucket", "zero_bucket", "zero_gather", "zero_norm")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # the plan's words


def _expert_sums(compiled: Compiled, axis: str, paths: list[str]) -> list[str]:
    """The axes over which each rank's unit routes its own rows of tokens whole experts see (a
    sequence shard, or its split of whole tokens): their gradients are summed over them."""
    summed = sorted(
        {
            a
            for name, over in compiled.grad_sums.items()
            if any(name.startswith(f"{p}.") for p in paths)
            for a in over
        }
    )
    if not summed:
        return []
    over = " x ".join(summed)
    tensor = {r.axis for r in compiled.plan.rules if r.kind in ("tensor", "sequence")}
    instead = (
        f"; `experts over {axis} x {over}` would give each `{over}` rank other experts instead, nothing to sum"
        if set(summed) <= tensor and len(axes_of(axis)) == 1
        else ""
    )
    return [
        f"    each rank of `{over}` routes its own rows of the tokens (a sequence shard, or its split of whole "
        f"tokens) through the same experts: their gradients are summed over `{over}` by the gradient sync{instead}"
    ]


def _expert_lines(compiled: Compiled) -> list[str]:
    """Expert parallelism: the experts each rank holds, how the batch and the gradients are
    split, and each unit's all-to-all bytes per step."""
    # checkpointed layers' units are in their regions
    units = [n for n, _ in collective_nodes(compiled.graph) if meta.collective_of(n)["kind"] == "experts"]
    axes = list(dict.fromkeys(meta.collective_of(n)["axis"] for n in units))  # an axis or a group (`dp x tp`)
    if not units:
        return []
    layout = compiled.layout
    data = [a for a in layout.names if a in compiled.plan.batch_axes and layout.size(a) > 1]
    lines = []
    for axis in axes:
        mine = [n for n in units if meta.collective_of(n)["axis"] == axis]
        total = meta.collective_of(mine[0])["experts"]
        n = layout.size(axis)
        paths = compress_paths(module_path(u) for u in mine)
        lines.append(
            f"experts over {axis} ({n} ranks): each rank holds {total // n} of the {total} experts of "
            + ", ".join(paths)
        )
        shared = [a for a in axes_of(axis) if a not in compiled.plan.batch_axes and layout.size(a) > 1]
        if shared:
            lines.append(
                f"    `{' x '.join(shared)}` splits no batch (its ranks share the tokens): each rank routes "
                "its own rows of them"
            )
        lines += _expert_sums(compiled, axis, [module_path(u) for u in mine])
    others = [a for a in data if not any(a in axes_of(x) for x in axes)]
    lines.append(
        f"    the batch is split over {' x '.join(data) or 'no axis'} ({math.prod(layout.size(a) for a in data)} "
        f"data ranks); gradients are averaged over them, an expert's over "
        + (" x ".join(others) if others else "none (its ranks hold other experts)")
    )
    z_losses = [meta.collective_of(u) for u in units if meta.collective_of(u).get("z_loss") is not None]
    if z_losses:
        routers = compress_paths(info["router"] for info in z_losses)
        coefficients = sorted({info["z_loss"] for info in z_losses})
        lines.append(
            f"    router z-loss {', '.join(f'{c:g}' for c in coefficients)} x mean(logsumexp(logits)^2) "
            f"of {', '.join(routers)} added to the loss, each rank's over its tokens"
        )
    rows = [r for r in compiled.ledger.rows if r.kind == "experts"]
    if rows:
        first = [r for r in rows if r.node == rows[0].node and r.op == "all_to_all"]
        text = ", ".join(f"{r.count} x {r.bytes:,} B {r.phase}" for r in first if not r.recompute)
        info = meta.collective_of(next(u for u in units if u.name == rows[0].node))
        if info.get("capacity_factor") is None:
            lines.append(f"    all_to_all per unit and step: {text} (token counts, dispatch and combine)")
        elif not info.get("shared"):  # fixed buffers: E C rows each way, whatever the routing
            capacity = first[0].shape[0] // info["experts"]
            lines.append(
                f"    all_to_all per unit and step: {text} (dispatch and combine of {info['experts']} x "
                f"{capacity} rows: capacity_factor={info['capacity_factor']:g} lets each expert take "
                f"{capacity} (token, slot) pairs of a rank's tokens here; the rest are dropped)"
            )
        else:  # each rank sends its own kept pairs of the tokens its ranks queue together
            unit = next(u for u in units if u.name == rows[0].node)
            capacity = unit_capacity(unit, compiled.layout)
            lines.append(
                f"    all_to_all per unit and step: {text} (token counts, then dispatch and combine of "
                f"the rank's kept pairs, at most {first[-1].shape[0]} rows: capacity_factor="
                f"{info['capacity_factor']:g} lets each expert take {capacity} (token, slot) pairs of the "
                f"tokens the ranks of `{info['shared']}` share here; the rest are dropped)"
            )
            gathers = [r for r in rows if r.node == rows[0].node and r.op == "all_gather" and not r.recompute]
            if gathers:
                lines.append(
                    f"    all_gather per unit and step: {gathers[0].bytes:,} B forward (the routing of every "
                    f"rank of `{gathers[0].axis}`: their pairs queue as one device's)"
                )
    return [*lines, ""]


def _context_lines(compiled: Compiled, rule) -> list[str]:
    """What each way of splitting attention over the sequence would move per layer, for the
    first attention the rule governs, so the choice is visible: a rank's received bytes in
    forward (backward moves as much again, gradients the other way). With h = heads x
    head_dim of q, h_kv of k and v as they travel (before a GQA repeat), N tokens, P ranks:

        all_gather, ring   2 h_kv (N / P) (P - 1)      (k and v blocks of the P - 1 others)
        ulysses            (2 h + 2 h_kv) (N / P) (P - 1) / P      (q, k, v in, the output back)
                           2 h (N / P) (P - 1) / P + 2 h_kv (N / P) (P - 1)   (kv heads < P: k, v gathered)
    """
    axis = rule.axis
    governed = compiled.resolution.matched.get(rule.order, ())
    attention = next(
        (
            n
            for n in compiled.graph.graph.nodes
            if (
                n.target is torch.ops.aten.scaled_dot_product_attention.default
                or str(n.target).startswith("ring_attention")
            )
            # (a tensor axis walked after may have set its own rule on heads it splits too)
            and (meta.rule(n) is rule or any(f"{module_path(n)}.".startswith(f"{g}.") for g in governed))
        ),
        None,
    )
    if attention is None or axis is None:
        return []
    p = compiled.layout.size(axis)
    q, k = attention.args[0], attention.args[1]
    if k.target is torch.ops.aten.repeat_interleave.self_int:  # the key/value heads move, then repeat
        k = k.args[0]
    b, heads, n, d = held_shape(q, shape(q), axis, compiled.layout)
    kv_heads = held_shape(k, shape(k), axis, compiled.layout)[1]
    size = value(q).element_size()
    h, h_kv = heads * d, kv_heads * d
    moved = {
        "all_gather": 2 * h_kv * (n // p) * (p - 1) * b * size,
        "ring": 2 * h_kv * (n // p) * (p - 1) * b * size,
        "ulysses": _ulysses_bytes(h, h_kv, kv_heads, n, p) * b * size,
    }
    mode = rule.action.mode
    text = ", ".join(f"{m} {_kb(v)}" + (" (this plan)" if m == mode else "") for m, v in moved.items())
    return [
        f"    per layer, a rank receives in forward: {text}",
        f"      ({b} x {n} tokens over {p} ranks; q {heads} heads, k/v {kv_heads} heads of {d} as they travel)",
        _context_layout(compiled, axis, p),
    ]


def _context_layout(compiled: Compiled, axis: str, p: int) -> str:
    """How the sequence is cut over the context axis: the load-balanced causal layout when the
    axis's collectives are built balanced (`TensorParallelSpec.balanced`), else contiguous."""
    balanced = any(
        isinstance(m, AxisCollective) and m.axis == axis and m.balanced for m in compiled.graph.modules()
    )
    if balanced:
        return (
            f"    layout: load-balanced causal, the sequence in {2 * p} chunks, rank r holding chunks r and "
            f"{2 * p - 1} - r (the same attention work on every rank)"
        )
    return f"    layout: contiguous, the sequence in {p} chunks, rank r holding chunk r"


def _ulysses_bytes(
    h: int | torch.SymInt,
    h_kv: int | torch.SymInt,
    kv_heads: int | torch.SymInt,
    n: int | torch.SymInt,
    p: int,
) -> int | torch.SymInt:
    """Per sequence: q in and the output back by all-to-all; k and v likewise, or, with fewer
    key/value heads than ranks, gathered whole (each rank then keeps the head its queries use)."""
    if kv_heads < p:
        return 2 * h * (n // p) * (p - 1) // p + 2 * h_kv * (n // p) * (p - 1)
    return (2 * h + 2 * h_kv) * (n // p) * (p - 1) // p


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1e3:.1f} KB"


def _pipeline_lines(compiled: Compiled) -> list[str]:
    """The `pipeline` block: each stage's rank, modules, share of the FLOPs and what it receives,
    the schedule's bubble, and the cuts as plan text to paste in and freeze."""
    from meshplan.runtime.schedules import build, simulate

    from .stages import compiled_cuts, cut_stages, describe

    p = compiled.plan.pipeline
    if p is None or compiled.source is None:
        return []
    ranks = compiled.layout.size(p.axis)
    micro = p.microbatches or ranks
    schedule = build(p.schedule, ranks, micro, p.virtual_stages)
    cuts = compiled_cuts(compiled.graph)
    stages = cut_stages(compiled.graph, cuts)
    how = "at the plan's cuts" if p.cuts else "balanced automatically by FLOPs"
    lines = [
        f"line {p.span.line}: pipeline over {p.axis} ({ranks} ranks): {p.schedule}, {stages.count} stages "
        f"{how}, {micro} microbatches per micro-step",
        *describe(stages, cuts, compiled.source.model, schedule.owner),
        f"    bubble {simulate(schedule).bubble:.3f} of the step at unit costs ({unit_costs(schedule)})",
        "",
    ]
    return lines


def _param_shapes(compiled: Compiled, rule, params, modules: list[str]) -> list[str]:
    """`weight (128, 64) -> (64, 64) per rank, Shard(0) over tp`, once per distinct shape; each
    parameter named from the module the rule governs (`gate_proj.weight` in a list of experts)."""
    seen: dict[str, None] = {}
    for pname, rule_of in compiled.param_rules.items():
        if rule_of is not rule or pname not in params:
            continue
        full = tuple(params[pname].shape)
        placed = dict(compiled.param_placements[pname])
        if rule.kind == "experts" and rule.axis and len(group := axes_of(rule.axis)) > 1:  # one line
            placed = {rule.axis: Shard(0), **{a: p for a, p in placed.items() if a not in group}}
        for axis, p in placed.items():
            local = list(full)
            n = compiled.layout.size(axis)
            if isinstance(p, Shard):
                local[p.dim] = p.chunk(full[p.dim], n)
            owner = max((m for m in modules if pname.startswith(f"{m}.")), key=len, default="")
            leaf = pname.removeprefix(f"{owner}.") if owner else pname.rsplit(".", 1)[1]
            if pname in compiled.kv_replicas:
                seen.setdefault(
                    f"{leaf} {full} whole on every rank, {p} over {axis}: fewer key/value heads than "
                    f"ranks, so each rank keeps the head its queries use ({compiled.kv_replicas[pname]} "
                    "ranks per head)",
                    None,
                )
                continue
            line = f"{leaf} {full} -> {tuple(local)} per rank, {p} over {axis}"
            if isinstance(p, Shard) and p.padded:
                pad = local[p.dim] * n - p.padded
                line += (
                    f"; {p.padded} do not divide by {n}: {pad} zero padding at the end, masked by the loss"
                )
            seen.setdefault(line, None)
    return list(seen)


def _replicated_linears(compiled: Compiled) -> list[str]:
    res = compiled.resolution
    out = []
    for path, cls in compiled.captured.modules.items():
        if cls.__name__ in ("Linear", "Embedding", "Conv1D") and res.rule_for(path, "tensor") is None:
            out.append(path)
    return out
