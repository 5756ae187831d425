"""ZeRO on compiled programs: the compiler's gather/release nodes, trained through `meshplan run`'s
own worker setup (`session.open_session`) on gloo processes, against the unpartitioned model on one device.

- ZeRO-3 x TP on dp=2 x tp=2, with one checkpointed layer: per-layer units from the graph's
  `ZeroGather` nodes (root first, then layers.0 ...), the compiler's ledger equal to what the
  engine issued, and a peak of gathered parameter bytes well below the whole model.
- ZeRO-2 on dp=2: the all-gather of the updated parameters is left running after the
  optimizer step and each layer's node waits for its own flats; the ledger again.
- ZeRO-3 on the example GPT, whose embedding and LM head are one tied parameter read under
  two names: it is gathered once, in the root unit.
- ZeRO-3 under bf16 compute (one layer checkpointed, the final norm in fp32): the fp32 weights
  are gathered as bf16 and no bf16 copy of a weight is kept for backward.
- ZeRO-3 under expert parallelism (dp=2 x ep=2, one layer checkpointed): a layer's dense
  parameters gathered over all four ranks and its experts over the two holding them, each
  by its own engine; the ledger again, summed over both.
- HSDP (`data_parallel over node x dp` with `zero = N over dp`), ZeRO-3 and, under expert
  parallelism, ZeRO-2: the state cut over dp only, each gradient shard all-reduced over node;
  the ledger again, and each rank holds half the state, not a quarter.

Each plan also trains like one device: `meshplan verify` against float64 and the yardstick. The
facts above are read from the ranks of that same verify run (its worker is `meshplan verify`'s,
recording the ZeRO engine after training): one launch per plan checks both, and the plans of
one world size run on the same processes (`gloo_pool`).
"""

from __future__ import annotations

import functools
import pickle
from collections import Counter
from pathlib import Path

import pytest
from gloo_pool import shared_processes
from plans import data_parallel, llama_rules, plan
from runs import verified_rank

from meshplan.verify import Report

pytestmark = pytest.mark.slow

LLAMA, GPT = "meshplan.examples.models.llama:build", "meshplan.examples.models.gpt:build"
MOE = "meshplan.examples.models.moe:build"
PLANS = {  # name: (plan, world size, model)
    "zero3_tp": (
        plan(
            llama_rules(vocab=False) + "    layers.1: checkpoint\n",
            mesh="dp=2, tp=2",
            extra=data_parallel(zero=3),
        ),
        4,
        LLAMA,
    ),
    "zero2": ("mesh dp=2\ndata_parallel over dp {\n    zero = 2\n    bucket = 64KB\n}\n", 2, LLAMA),
    "zero3_tied": ("mesh dp=2\ndata_parallel over dp {\n    zero = 3\n}\n", 2, GPT),
    "zero3_bf16": (
        "mesh dp=2\n\nprecision {\n    compute = bf16\n}\n\nmodules {\n    layers.1: checkpoint\n"
        "    norm: precision fp32\n}\n\ndata_parallel over dp {\n    zero = 3\n}\n",
        2,
        LLAMA,
    ),
    "experts_zero3": (
        "mesh dp=2, ep=2\n\nmodules {\n    layers.*.mlp.experts: experts over ep (top_k=2)\n"
        "    layers.1: checkpoint\n}\n\ndata_parallel over dp {\n    zero = 3\n}\n",
        4,
        MOE,
    ),
    # HSDP: the state cut over dp, copied over node; each gradient shard all-reduced over node
    "hsdp3": ("mesh node=2, dp=2\ndata_parallel over node x dp {\n    zero = 3 over dp\n}\n", 4, LLAMA),
    # the per-axes engine: the dense state cut over dp, the experts' (which dp splits) copied
    # whole over node, each engine's shards all-reduced over node
    "hsdp2_experts": (
        "mesh node=2, dp=2\n\nmodules {\n    layers.*.mlp.experts: experts over dp (top_k=2)\n}\n\n"
        "data_parallel over node x dp {\n    zero = 2 over dp\n}\n",
        4,
        MOE,
    ),
}
# 24 tokens a micro-batch: no activation has a parameter's shape (`compute_copies_kept`)
STEPS, MICRO_BATCH, SEQ = 3, 2, 12


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


def worker(facts: str, rank: int, world_size: int, job):
    """`meshplan verify`'s own rank, then what its ZeRO engine did, written to `facts`/rank{R}.pkl."""
    import torch.distributed as dist

    result, session = verified_rank(rank, world_size, job)
    zero = session.dp
    engines = getattr(zero, "engines", [zero])  # under expert parallelism, one per group
    issued: Counter[tuple[str, int]] = Counter()
    for c in zero.issued():
        issued[c.op, c.bytes] += c.count
    units = [u for e in engines for u in e.units]
    copies = compute_copies_kept(session.program, [f for e in engines for f in e.flats])
    with (Path(facts) / f"rank{rank}.pkl").open("wb") as f:
        pickle.dump(
            {
                "issued": dict(issued),
                "units": [u.name for u in units],
                "peak_gathered": sum(e.peak_gathered for e in engines),
                "full_bytes": sum(f.full_nbytes() for e in engines for f in e.flats),
                "shards": [dist.get_world_size(e.group) for e in engines],
                "replicas": [e.replicas.size if e.replicas else 1 for e in engines],
                "unit_bytes": {u.name: sum(f.full_nbytes() for f in u.flats) for u in units},
                "layer_bytes": max(
                    (sum(f.full_nbytes() for f in u.flats) for u in units if _is_layer(u.name)), default=0
                ),
                "layer_numel": max(
                    (sum(f.padded for f in u.flats) for u in units if _is_layer(u.name)), default=0
                ),
                "gathered_in": {
                    str((f.low if f.low is not None else f.full).dtype) for e in engines for f in e.flats
                },
                "copies_kept": copies,
            },
            f,
        )
    return result


def compute_copies_kept(program, flats) -> int:
    """Bytes autograd keeps for backward, after one forward, in copies of parameters made in
    another dtype (a bf16 cast of an fp32 weight that a matmul saves); what is read from a
    ZeRO gather's buffer in the compute dtype is freed with the layer and does not count."""
    import torch

    params = {(tuple(p.shape), p.dtype) for p in program.parameters()}
    buffers = {f.low.untyped_storage()._cdata for f in flats if f.low is not None}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        shape_of_param = any(tuple(t.shape) == shape and t.dtype != dtype for shape, dtype in params)
        if shape_of_param and t.dtype != torch.float32 and storage._cdata not in buffers:
            kept[storage._cdata] = storage.nbytes()
        return t

    ids = torch.randint(0, 256, (MICRO_BATCH, SEQ))  # the shape the program is compiled for
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        program(ids, ids)
    return sum(kept.values())


@pytest.fixture(scope="module", params=sorted(PLANS))
def run(request, tmp_path_factory) -> tuple[str, Report, dict, list[dict]]:
    """(name, the verify report, the compiler's dp ledger, each rank's ZeRO facts)."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model
    from meshplan.dsl import load_plan
    from meshplan.verify import verify

    name = request.param
    text, world, model = PLANS[name]
    tmp = tmp_path_factory.mktemp(name)
    plan_path = tmp / f"{name}.plan"
    plan_path.write_text(text)
    report = verify(
        str(plan_path),
        model,
        steps=STEPS,
        batch=MICRO_BATCH,
        seq=SEQ,
        worker=functools.partial(worker, str(tmp)),
    )
    # the compiler's ledger, compiled here once: one program serves every rank
    compiled = compile_plan(
        load_plan(plan_path, world_size=world),
        with_token_shape(load_model(model), batch=MICRO_BATCH, seq=SEQ),
    )
    ledger: Counter[tuple[str, int]] = Counter()
    for row in compiled.ledger.rows:
        if row.kind.startswith("zero_"):  # over `dp`, or under experts `dp x ep` and `dp`
            ledger[row.op, row.bytes] += row.count
    facts = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    return name, report, dict(ledger), facts


def test_trains_like_one_device(run) -> None:
    from meshplan.verify import render

    name, report, _, _ = run
    assert report.world_size == PLANS[name][1]
    assert report.ok and report.float64, render(report)


def test_ledger_is_what_the_engine_issued(run) -> None:
    _, _, ledger, results = run
    for r in results:
        assert ledger == r["issued"]


def test_zero3_gathers_layer_by_layer(run) -> None:
    name, _, _, results = run
    if not name.startswith("zero3"):
        pytest.skip("stage 3 only")
    for r in results:
        if name == "zero3_tied":  # the embedding is the head: one root unit, read first and last
            assert r["units"] == ["", *(f"h.{i}" for i in range(4))]  # graph order
            ends = r["unit_bytes"][""]
        else:  # the embedding a unit of its own, the final norm and head the root's
            assert r["units"] == ["embed_tokens", *(f"layers.{i}" for i in range(4)), ""]
            ends = max(r["unit_bytes"]["embed_tokens"], r["unit_bytes"][""])  # never both at once
        # at most two layers at once (one prefetched) beside the ends
        assert r["peak_gathered"] <= ends + 2 * r["layer_bytes"]
        assert r["peak_gathered"] < 0.75 * r["full_bytes"]


def test_zero3_under_bf16_gathers_in_bf16_and_keeps_no_bf16_copy(run) -> None:
    """Under `compute = bf16` each layer's fp32 weights are gathered as bf16 (half the bytes: the
    ledger says so, and equals what was issued) into a buffer its release frees: no bf16 copy
    of a weight stays alive from forward to backward (they were 2 bytes per parameter)."""
    name, _, _, results = run
    if name != "zero3_bf16":
        pytest.skip("bf16 compute only")
    for r in results:
        assert r["gathered_in"] == {"torch.bfloat16", "torch.float32"}  # the fp32 norm: fp32
        assert r["copies_kept"] == 0
        assert r["layer_bytes"] == 2 * r["layer_numel"]  # every weight of a layer, 2 bytes each


def test_experts_and_dense_parameters_are_units_of_their_own_groups(run) -> None:
    """Under `mesh dp=2, ep=2` a layer is two units: its dense parameters over dp x ep and its
    experts over dp (`layers.0+dp`), each gathered by the engine of its group."""
    name, _, _, results = run
    if name != "experts_zero3":
        pytest.skip("expert parallelism only")
    for r in results:
        # by engine, in graph order; the root's embedding and its norm and head: two units
        assert r["units"] == ["layers.0+dp", "layers.1+dp", "embed_tokens", "layers.0", "layers.1", ""]


def _is_layer(unit: str) -> bool:
    return unit.split("+")[0].split(".")[-1].isdigit()


def test_hsdp_cuts_the_state_over_its_shard_axis_and_copies_it_over_the_others(run) -> None:
    """`zero = N over dp` of `data_parallel over node x dp`: each engine's group is the dp pair
    (the experts', which dp splits, this rank alone), and its shards have a copy on the node peer."""
    name, _, _, results = run
    if not name.startswith("hsdp"):
        pytest.skip("HSDP only")
    for r in results:
        assert r["replicas"] == [2] * len(r["shards"])
        assert sorted(r["shards"]) == ([1, 2] if name == "hsdp2_experts" else [2])
