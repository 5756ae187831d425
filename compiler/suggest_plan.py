"""The text of a suggested plan: rules over the parts `structure.py` found, a comment on each
block saying why, formatted as `meshplan fmt` prints it.

    text = write_plan(shape, candidate, compute="bf16", world=64, hw=hw, limit=80 * 2**30, batch=64, seq=4096)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.dsl.fmt import format_plan
from meshplan.dsl.parser import parse

from .hardware import Hardware
from .structure import ModelShape, Pair

if TYPE_CHECKING:
    from .suggest import Candidate


def base_plan(shape: ModelShape, compute: str) -> str:
    """The plan the model is captured for once: its compute dtype, its experts as units."""
    lines = ["mesh ep=1" if shape.experts else "mesh dp=1", ""]
    if shape.experts:
        lines += ["modules {", f"    {_experts_rule(shape)}", "}", ""]
    lines += _precision(compute)
    return "\n".join(lines) + "\n"


def write_plan(
    shape: ModelShape,
    cand: Candidate,
    *,
    compute: str,
    world: int,
    hw: Hardware,
    limit: int | None,
    batch: int,
    seq: int | None,
    memory: int | None = None,
) -> str:
    """The plan of `cand` as `meshplan fmt` prints it, a comment on each block saying why;
    `memory` a rank's, of which the plan was sized for `limit` (default: all of it)."""
    lay = cand.layout
    peak = cand.estimated_peak if cand.estimate is not None else None
    step = cand.estimated_time if cand.estimate is not None else None
    memory = memory or limit
    planned = f" ({gib(limit)} planned)" if limit is not None and memory != limit else ""
    memory_note = f" of {gib(memory)} each{planned}" if memory is not None else ""
    tokens = f"{batch} x {seq}" if seq is not None else f"{batch}"
    lines = [
        f"# Suggested by `meshplan suggest` for {world} ranks of {hw.name}{memory_note}, batch {tokens} a step:",
        f"# `meshplan run --batch {lay.rows(batch)}{f' --seq {seq}' if seq is not None else ''}` "
        f"({_batch_note(lay, batch)}).",
    ]
    if peak is not None:
        lines.append(
            f"# estimated: at most {gib(peak)} per rank, a step in {seconds(step)} (`meshplan estimate`)."
        )
    mesh = [
        f"{n}={s}"
        for n, s in lay.sizes()
        if s > 1 or (n == "ep" and shape.experts) or (n == "dp" and world == 1)
    ]
    lines += [f"mesh {', '.join(mesh) or 'dp=1'}", ""]

    rules: list[str] = []
    if lay.cp > 1:
        assert shape.attention is not None and seq is not None
        if lay.context == "ulysses":
            rules.append(
                f"# cp={lay.cp}: each sequence's {seq} tokens cut over {lay.cp} ranks; all-to-alls move "
                f"attention to {lay.cp} head shards, each over the whole sequence (Ulysses)"
            )
        else:
            rules.append(
                f"# cp={lay.cp}: each sequence's {seq} tokens cut over {lay.cp} ranks (balanced for causal "
                "attention); keys and values go around the ring"
            )
        rules.append(f"{shape.block(shape.attention)}: context {lay.context} over cp")
    if lay.tp > 1:
        rules.append(
            f"# tp={lay.tp}: each block's {_pair_names(shape)} split over {lay.tp} ranks of a node "
            "(column then row: one reduction each way)"
        )
        for pair in shape.pairs:
            rules += _pair_rules(shape, pair)
        if lay.vocab:
            rules.append("# the vocabulary split too: embedding and head, the loss computed on the shards")
            ends = [
                p
                for p in (shape.embedding, shape.head)
                if p is not None and not (shape.tied and p == shape.head)
            ]
            rules += [f"{p}: vocab over tp" for p in ends]
            if shape.tied and shape.head is not None:
                rules.append(f"{shape.head}: vocab over tp")
        if lay.sp:
            rules.append(
                "# sequence parallel: norms and residuals on a sequence shard (less memory, same traffic)"
            )
            rules += [f"{shape.block(n)}: sequence over tp" for n in shape.norms]
            if shape.final_norm is not None:
                rules.append(f"{shape.final_norm}: sequence over tp")
    if shape.experts:
        per = (shape.num_experts or 0) // lay.ep
        rules.append(
            f"# ep={lay.ep}: {per} of the {shape.num_experts} experts on each rank, tokens sent to them and back"
            if lay.ep > 1
            else f"# the experts as one unit, all {shape.num_experts} on every rank (ep=1: nothing to send)"
        )
        rules.append(_experts_rule(shape))
    if lay.checkpoint == "full":
        rules.append("# recompute each block in backward: only its input is kept for it")
        rules.append(f"{shape.block()}: checkpoint")
    elif lay.checkpoint == "selective":
        rules.append("# recompute each block's cheap ops in backward: its matmul and attention outputs kept")
        rules.append(f"{shape.block()}: checkpoint selective")
    if rules:
        lines += ["modules {", *(f"    {r}" for r in rules), "}", ""]
    if lay.pp > 1:
        v = lay.virtual
        bubble = (lay.pp - 1) / (v * lay.microbatches + lay.pp - 1)
        chunks = f"{lay.pp * v} chunks, {v} on each rank" if v > 1 else f"{lay.pp} stages"
        lines += [
            f"# pp={lay.pp}: {shape.layers} blocks in {chunks}, cut where the cost balances; bubble {bubble:.0%}",
            "pipeline over pp {",
            f"    schedule = {'interleaved' if v > 1 else '1f1b'}",
            *([f"    virtual_stages = {v}"] if v > 1 else []),
            f"    microbatches = {lay.microbatches}",
            "}",
            "",
        ]
    if lay.dp > 1:
        where = f" over each node's {lay.shards} dp ranks, a copy on each node" if lay.copies > 1 else ""
        why = {
            0: "gradients all-reduced in buckets, overlapping backward",
            1: f"the optimizer's state sharded{where}",
            2: f"the optimizer's state and the gradients sharded{where}",
            3: f"parameters, gradients and optimizer state sharded{where}; each block gathered when used",
        }[lay.zero]
        over = "node x dp" if lay.copies > 1 else "dp"
        sizes = f"node x dp={lay.copies} x {lay.shards}" if lay.copies > 1 else f"dp={lay.dp}"
        lines.append(f"# {sizes}: {why}" + ("; the optimizer's state in host memory" if lay.offload else ""))
        if lay.copies > 1:
            lines.append("# (HSDP: gathers stay within a node; only the reduced gradient shards cross nodes)")
        lines.append(f"data_parallel over {over} {{")
        lines.append(f"    zero = {lay.zero}" + (" over dp" if lay.copies > 1 else ""))
        if lay.offload:
            lines.append("    offload = optimizer")
        lines += ["}", ""]
    lines += _precision(compute)
    text = "\n".join(lines) + "\n"
    return format_plan(parse(text, "<suggested>"), text)


def _batch_note(lay, batch: int) -> str:
    """How `--batch` makes the step's batch: its rows on each data rank, times the microbatches."""
    data = lay.dp * lay.ep
    rows = lay.rows(batch)
    seqs = f"{rows} sequence{'s' if rows != 1 else ''}"
    each = f"{seqs} on each of {data} data ranks" if data > 1 else f"{seqs} a microbatch, no data parallelism"
    return each + (f", {lay.microbatches} microbatches a step" if lay.microbatches > 1 else "")


def _precision(compute: str) -> list[str]:
    if compute == "fp32":
        return []
    return [
        f"# {compute} matmuls; fp32 weights, gradients and optimizer state",
        "precision {",
        f"    compute = {compute}",
        "    params = fp32",
        "}",
    ]


def _experts_rule(shape: ModelShape) -> str:
    top_k = f" (top_k={shape.top_k})" if shape.top_k else ""
    return f"{shape.block(shape.experts or '')}: experts over ep{top_k}"


def _pair_names(shape: ModelShape) -> str:
    names = [pair.row.rpartition(".")[0].rpartition(".")[2] or "linears" for pair in shape.pairs]
    return " and ".join(names)


def _pair_rules(shape: ModelShape, pair: Pair) -> list[str]:
    return [
        f"{shape.block(_alternatives(pair.columns))}: column over tp",
        f"{shape.block(pair.row)}: row over tp",
    ]


def _alternatives(paths: tuple[str, ...]) -> str:
    """`self_attn.q_proj`, `self_attn.k_proj` -> `self_attn.{q_proj,k_proj}`."""
    if len(paths) == 1:
        return paths[0]
    parents = {p.rpartition(".")[0] for p in paths}
    if len(parents) != 1:
        return "{" + ",".join(paths) + "}"
    parent = parents.pop()
    names = ",".join(p.rpartition(".")[2] for p in paths)
    return f"{parent}.{{{names}}}" if parent else f"{{{names}}}"


def gib(nbytes: float | None) -> str:
    if nbytes is None:
        return "?"
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


def seconds(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"
