"""Module placement (`lm_head: on cpu`) trained, on gloo processes: `meshplan verify` against the
unpartitioned model in float64 under data parallelism and ZeRO-2, the host parameters reduced by
an engine of their own whose collectives are the compiler's ledger's (under HSDP too: cut and
copied over the same axes as the device's), and `meshplan run`. On a
CPU every copy is a no-op: what this proves is the program, the engines and the ledger; the real
copies are the `gpu` tier's (tests/gpu/test_gpu_placement.py)."""

from __future__ import annotations

import functools
import math
import pickle
from collections import Counter
from pathlib import Path

import pytest
from gloo_pool import shared_processes
from plans import data_parallel, plan
from runs import meshplan_run, verified_rank

from meshplan.verify import Report

pytestmark = pytest.mark.slow

LLAMA = "meshplan.examples.models.llama:build"
ON_CPU = "\n    lm_head:      on cpu\n    embed_tokens: on cpu\n"
HOST = {"lm_head.weight", "embed_tokens.weight"}
STEPS, BATCH, SEQ = 3, 2, 16


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


def worker(facts: str, rank: int, world_size: int, job):
    """`meshplan verify`'s own rank, then what its engines did, written to `facts`/rank{R}.pkl."""
    from meshplan.runtime.data_parallel import DataParallel

    result, session = verified_rank(rank, world_size, job)
    names = {id(p): n for n, p in session.program.named_parameters()}
    issued: Counter[tuple[str, int]] = Counter()
    engines = []
    for engine in session.dp.engines:
        if isinstance(engine, DataParallel):
            for launch in engine.launches[-len(engine.buckets) :]:  # the last step's
                issued["all_reduce", launch.nbytes] += 1
            engines.append(sorted(names[id(p)] for p in engine.params))
        else:
            for c in engine.issued():
                issued[c.op, c.bytes] += c.count
            engines.append(sorted(n for f in engine.flats for n in f.names))
    with (Path(facts) / f"rank{rank}.pkl").open("wb") as f:
        pickle.dump({"issued": dict(issued), "engines": engines}, f)
    return result


# (zero, mesh, data axes): data parallelism, ZeRO-2, and HSDP (ZeRO-2 cut over `dp`, each
# shard's gradient all-reduced over `node` too, the host's as the device's)
CASES = {
    "zero0": (0, "dp=2", "dp"),
    "zero2": (2, "dp=2", "dp"),
    "hsdp2": ("2 over dp", "node=2, dp=2", "node x dp"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request, tmp_path_factory) -> tuple[int | str, Report, dict, list[dict]]:
    """(zero, the verify report, the compiler's data-parallel ledger, each rank's engine facts)."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model
    from meshplan.dsl import load_plan
    from meshplan.verify import verify

    zero, mesh, axis = CASES[request.param]
    world = 4 if "node" in mesh else 2
    tmp = tmp_path_factory.mktemp(request.param)
    path = tmp / "on_cpu.plan"
    path.write_text(plan(ON_CPU, mesh=mesh, extra=data_parallel(zero=zero, bucket="64KB", axis=axis)))
    report = verify(
        str(path), LLAMA, steps=STEPS, batch=BATCH, seq=SEQ, worker=functools.partial(worker, str(tmp))
    )
    compiled = compile_plan(
        load_plan(path, world_size=world), with_token_shape(load_model(LLAMA), batch=BATCH, seq=SEQ)
    )
    ledger: Counter[tuple[str, int]] = Counter()
    for row in compiled.ledger.rows:
        if row.kind in ("dp_bucket", "zero_bucket", "zero_gather", "zero_norm"):
            ledger[row.op, row.bytes] += row.count
    facts = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    return zero, report, dict(ledger), facts


def test_trains_like_one_device(run) -> None:
    from meshplan.verify import render

    _, report, _, _ = run
    assert report.ok and report.float64, render(report)


def test_the_host_parameters_have_an_engine_of_their_own(run) -> None:
    _, _, _, facts = run
    for f in facts:
        device, host = f["engines"]
        assert set(host) == HOST and not HOST & set(device)


def test_the_ledger_is_what_the_engines_issued(run) -> None:
    _, _, ledger, facts = run
    for f in facts:
        assert ledger == f["issued"]


def test_meshplan_run_trains_two_steps_with_the_head_on_the_host(tmp_path: Path) -> None:
    path = tmp_path / "on_cpu.plan"
    path.write_text(plan(ON_CPU, mesh="dp=2", extra=data_parallel(zero=0)))
    records = meshplan_run(str(path), "--model", LLAMA, "--steps", "2", "--out", str(tmp_path / "run"))
    assert [r["step"] for r in records[0]] == [1, 2]
    assert all(math.isfinite(r["loss"]) for rank in records for r in rank)
    assert records[0][-1]["loss"] == records[1][-1]["loss"]  # the data ranks' average: the same
