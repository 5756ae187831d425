"""`compress` composed with the other axes.

The per-axes engines: the gradient sync of plans whose weight gradients are reduced over more
than the data axis, one engine per set of axes (`expert_data_parallel`, `expert_zero`), each
set over a data axis compressed.

- dp=2 x tp=2 with sequence-parallel norms, PowerSGD: the norms' gradients summed over tp and
  averaged over dp in one engine (`dp x tp`), the rest over dp, both compressed.
- dp=2 x cp=2 under a ring, bf16: every weight's gradient over `dp x cp`.
- dp=2 x ep=2 under ZeRO-2, bf16: the dense state cut over `dp x ep`, the experts' over dp,
  each engine's reduce-scatter in bf16 with its own error feedback.
- `experts over dp` on dp=4, bf16: the dense gradients compressed over dp; each rank's
  experts, which no other rank holds, reduced by no one (no residual kept for them).

Pipelines, on the example GPT, whose embedding is its LM head:

- dp=2 x pp=2 under ZBV: the embedding and the head are stages 0 and 3, both on pipeline rank
  0; the weight's gradient is whole after the rank's last backward only, so its bucket is
  reduced last (`DataParallel`'s late buckets), compressed like the others.
- dp=2 x pp=2 under 1F1B with ZeRO-2, bf16: the tied weight's two copies on the two pipeline
  ranks, each reduced over dp on its own (compressed), then their shards summed over pp: the
  copies stay equal.

Each plan is verified (held to the same plan's uncompressed run, `cli/verify_lossy.py`) and, from
that verify's own ranks, what each engine sent in the last step is the compiler's ledger (but
under a pipeline, whose ledger lists the whole model's reductions, not a rank's), and
what error feedback keeps is counted in the engine's gradient memory, as `meshplan estimate`
counts it. The data-parallel replicas end the run bit for bit equal, and so do the copies of
a weight tied across pipeline ranks.
"""

from __future__ import annotations

import functools
import pickle
from collections import Counter
from pathlib import Path

import pytest
from gloo_pool import shared_processes
from plans import data_parallel, llama_rules, llama_sequence, plan
from runs import verified_rank

from meshplan.verify import Report

pytestmark = pytest.mark.slow

LLAMA, MOE = "meshplan.examples.models.llama:build", "meshplan.examples.models.moe:build"
GPT = "meshplan.examples.models.gpt:build"
PIPELINE = "mesh dp=2, pp=2\n\npipeline over pp {{\n    schedule = {}\n    microbatches = 4\n}}\n"
PLANS = {  # name: (plan, model)
    "sp-powersgd": (
        plan(
            llama_rules(vocab=False) + llama_sequence(),
            mesh="dp=2, tp=2",
            extra=data_parallel(compress="powersgd(rank=2, warmup=1)"),
        ),
        LLAMA,
    ),
    "cp-bf16": (
        plan(
            "\n    layers.*.self_attn: context ring over cp\n",
            mesh="dp=2, cp=2",
            extra=data_parallel(compress="bf16"),
        ),
        LLAMA,
    ),
    "experts-zero2-bf16": (
        plan(
            "\n    layers.*.mlp.experts: experts over ep (top_k=2)\n",
            mesh="dp=2, ep=2",
            extra=data_parallel(zero=2, compress="bf16"),
        ),
        MOE,
    ),
    "experts-over-dp-bf16": (
        plan(
            "\n    layers.*.mlp.experts: experts over dp (top_k=2)\n",
            mesh="dp=4",
            extra=data_parallel(compress="bf16"),
        ),
        MOE,
    ),
    "pp-zbv-powersgd": (
        PIPELINE.format("zbv") + data_parallel(compress="powersgd(rank=2, warmup=1)"),
        GPT,
    ),
    "pp-zero2-bf16": (
        PIPELINE.format("1f1b") + data_parallel(zero=2, compress="bf16"),
        GPT,
    ),
}
STEPS, MICRO_BATCH, SEQ = 3, 2, 16


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


def worker(facts: str, rank: int, world_size: int, job):
    """`meshplan verify`'s own rank; for the compressed run, what its engines did, written to
    `facts`/rank{R}.pkl."""
    from meshplan.runtime.data_parallel import DataParallel

    result, session = verified_rank(rank, world_size, job)
    if Path(job.plan).parent.name == "uncompressed":  # verify's yardstick run
        return result
    sync = session.dp
    sent: Counter[tuple[str, int]] = Counter()
    if hasattr(sync, "issued"):  # ZeRO: what the last step issued, reductions only
        for c in sync.issued():
            if c.op != "all_gather":
                sent[c.op, c.bytes] += c.count
        zeros = getattr(sync, "engines", [sync])
        compressed = [e.axis for e in zeros if e.feedback()]
        compressors = [c for e in zeros for c in e.feedback()]
    else:  # the last step's launches of each bucket engine
        engines = [e for e in getattr(sync, "engines", [sync]) if isinstance(e, DataParallel)]
        for e in engines:
            for launch in e.launches[-len(e.ledger()) :]:
                sent["all_reduce", launch.nbytes] += 1
        compressed = [e.axis for e in engines if e.compressors()]
        compressors = [c for e in engines for c in e.compressors()]
    with (Path(facts) / f"rank{rank}.pkl").open("wb") as f:
        pickle.dump(
            {
                "sent": dict(sent),
                "compressed": compressed,
                "feedback": sum(t.nbytes for c in compressors for t in c.state()),  # kept across steps
                "grads": sync.memory()["grads"],
                "params": {n: p.detach().clone() for n, p in session.program.named_parameters()},
            },
            f,
        )
    return result


@pytest.fixture(scope="module", params=sorted(PLANS))
def run(request, tmp_path_factory) -> tuple[str, Report, dict, list[dict]]:
    """(name, the verify report, the compiler's ledger of the data-parallel reductions, each
    rank's engine facts)."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.load import load_model
    from meshplan.dsl import check_text, load_plan
    from meshplan.verify import verify
    from meshplan.verify_lossy import uncompressed_text

    name = request.param
    text, model = PLANS[name]
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
    source = with_token_shape(load_model(model), batch=MICRO_BATCH, seq=SEQ)
    checked = load_plan(plan_path, world_size=4)
    compiled = compile_plan(checked, source)
    estimated = [r.grads for r in estimate(compiled).ranks]
    # what error feedback keeps: the gradient bytes beyond the same plan's uncompressed
    exact = compile_plan(check_text(uncompressed_text(checked), "exact.plan", world_size=4), source)
    estimated = [a - b.grads for a, b in zip(estimated, estimate(exact).ranks, strict=True)]
    ledger: Counter[tuple[str, int]] = Counter()
    for row in compiled.ledger.rows:
        if row.kind == "dp_bucket" or (row.kind.startswith("zero_") and row.op != "all_gather"):
            ledger[row.op, row.bytes] += row.count
    facts = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    for r, held in zip(facts, estimated, strict=True):
        r["estimated"] = held
    return name, report, dict(ledger), facts


def test_converges_as_the_uncompressed_plan_does(run) -> None:
    from meshplan.verify import render

    _, report, _, _ = run
    assert report.ok, render(report)
    assert report.lossy and not report.float64
    assert report.partitioned.losses != report.reference.losses  # the compression acted


def test_every_engine_over_a_data_axis_compresses(run) -> None:
    name, _, _, facts = run
    expected = {
        "sp-powersgd": ["dp", "dp x tp"],
        "cp-bf16": ["dp x cp"],
        "experts-zero2-bf16": ["dp", "dp x ep"],
        "experts-over-dp-bf16": ["dp"],  # each rank's experts its own: exact, no feedback
        "pp-zbv-powersgd": ["dp"],
        "pp-zero2-bf16": ["dp"],
    }[name]
    for r in facts:
        assert sorted(r["compressed"]) == expected
        assert 0 < r["feedback"] <= r["grads"]  # error feedback, counted as gradient memory
        assert r["feedback"] == r["estimated"]  # and by `meshplan estimate`


def test_the_engines_send_the_ledgers_bytes(run) -> None:
    name, _, ledger, facts = run
    if name.startswith("pp-"):
        pytest.skip("a pipeline's ledger lists the whole model's reductions, not one rank's")
    for r in facts:
        assert r["sent"] == ledger


def test_replicas_and_tied_copies_end_equal(run) -> None:
    """Every rank applied the same reduced gradient to what it shares with another: its data
    replica (ranks dp-major: rank r and r + 2 under `dp=2` beside another axis of 2, r and r + 1
    on `dp=4`), and a pipeline neighbour holding a copy of the same tied weight."""
    import torch

    name, _, _, facts = run
    pairs = [(0, 1), (2, 3)] if name.startswith("experts-over") else [(0, 2), (1, 3)]
    for a, b in pairs:
        for n, p in facts[a]["params"].items():
            if not (name.startswith("experts-over") and ".experts." in n):  # each rank's own experts
                assert torch.equal(p, facts[b]["params"][n]), (name, n)
    if name == "pp-zero2-bf16":  # 1F1B: the embedding on rank 0, the head on rank 1
        shared = set(facts[0]["params"]) & set(facts[1]["params"])
        assert shared
        for n in shared:
            assert torch.equal(facts[0]["params"][n], facts[1]["params"][n]), n
