"""ZeRO 1/2/3 and offload on 2 gloo ranks vs single-device AdamW on the same global batch.

Each worker trains the ZeRO-sharded model for 3 steps (every rank on its half of the
batch) and, in the same process, the unpartitioned model with `torch.optim.AdamW` on the
whole batch, in float32 and in float64. Losses agree within float32 rounding (`FP32_RTOL`).
Parameters after AdamW cannot be held to a fixed tolerance: Adam divides by the square root of
its second moment, so a gradient element near zero moves its parameter by a rounding-sized
difference times `lr / eps`-ish, and the reduction order of a data-parallel all-reduce differs
from one device's by rounding. So the parameters' distance to the float64 run is compared with
the float32 single-device run's own distance to it (the *yardstick*: rounding alone): within
`YARDSTICK_FACTOR` times it. Every case, the checkpoint resume included, runs in one spawn
(`results`; process start-up dominates) and the tests read its results.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import weakref
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from gloo_pool import spawn
from reference import zero_steps
from torch.utils.checkpoint import checkpoint

from meshplan.examples.models.llama import build, example_inputs
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import Collective, Zero, ZeroOptions, shard_for_zero

pytestmark = pytest.mark.slow

WORLD = 2
MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}
SETTINGS = TrainConfig(lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"])  # eps 1e-8
BATCH, SEQ, STEPS = 4, 16, 3
FP32_RTOL = 1e-5
FP32_EPS = torch.finfo(torch.float32).eps
YARDSTICK_FACTOR = 4  # the same ratio `meshplan verify` allows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _distance(params: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    """The whole model's relative distance: ||params - exact|| / ||exact|| over every tensor."""
    diff = sum(float((params[n].double() - e).norm()) ** 2 for n, e in exact.items())
    return (diff / sum(float(e.norm()) ** 2 for e in exact.values())) ** 0.5


def assert_params_close(result: dict) -> None:
    """Within `YARDSTICK_FACTOR` times float32 rounding's own distance to the float64 run."""
    limit = YARDSTICK_FACTOR * max(result["param_yardstick"], FP32_EPS)
    assert result["param_distance"] <= limit, (result["param_distance"], result["param_yardstick"])


class Case(NamedTuple):
    options: ZeroOptions
    kind: str = "eager"  # eager, checkpointed, exported, unflattened (`_make_model`)
    accumulate: int = 1  # micro-batches per step on each rank
    clip: float | None = None  # max gradient norm


def _reference(
    clip: float | None, dtype: torch.dtype = torch.float32
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Single-device AdamW on the global batch: losses, gradient norms (when clipping), final params."""
    model = build(**MODEL).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, norms = [], []
    for step in range(STEPS):
        ids, labels = example_inputs(BATCH, SEQ, seed=step)
        loss = model(ids, labels)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _make_model(kind: str) -> torch.nn.Module:
    model = build(**MODEL)
    if kind == "checkpointed":  # non-reentrant activation checkpointing inside every layer
        for layer in model.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    if kind in ("exported", "unflattened"):
        ids, labels = example_inputs(BATCH // WORLD, SEQ)
        program = torch.export.export(model, (ids, labels), strict=False)
        return program.module() if kind == "exported" else torch.export.unflatten(program)
    return model


def _zero(model: torch.nn.Module, options: ZeroOptions) -> Zero:
    """`model` sharded over both ranks, its AdamW built with `ADAMW`'s settings."""
    zero = shard_for_zero(model, dist.group.WORLD, options)
    zero.optimizer(SETTINGS)
    return zero


def _train_zero(rank: int, case: Case) -> dict:
    """ZeRO on this rank's half of each global batch (split into `accumulate` micro-batches)."""
    model = _make_model(case.kind)
    zero = _zero(model, case.options)
    accumulate = case.accumulate
    local, micro = BATCH // WORLD, BATCH // WORLD // accumulate
    losses, norms, memory = [], [], {}
    for step in range(STEPS):
        ids, labels = example_inputs(BATCH, SEQ, seed=step)
        ids, labels = ids[rank * local : (rank + 1) * local], labels[rank * local : (rank + 1) * local]
        total = torch.zeros(())
        for k in range(accumulate):
            sync = zero.no_sync() if k < accumulate - 1 else contextlib.nullcontext()
            with sync:
                chunk = slice(k * micro, (k + 1) * micro)
                loss = model(ids[chunk], labels[chunk]) / accumulate
                loss.backward()
            total += loss.detach()
        if case.clip is not None:
            norms.append(zero.clip_grad_norm_(case.clip).item())
        zero.step()
        memory = zero.memory()  # after the step, before zero_grad: grads still held
        zero.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    with zero.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    by_unit: dict[str, torch.Tensor] = {}  # what an export sees, one unit gathered at a time
    most_gathered = 0
    for names in zero.gathered_by_unit():
        most_gathered = max(most_gathered, sum(f.is_gathered(whole=True) for f in zero.flats))
        by_unit |= {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    return {
        "engine": weakref.ref(zero),  # held by nothing once this returns: see `parity_worker`
        "by_unit_equal": by_unit.keys() == params.keys()
        and all(torch.equal(by_unit[n], params[n]) for n in params),
        "most_gathered": most_gathered,
        "largest_unit": max((len(u.flats) for u in zero.units), default=len(zero.flats)),
        "flats": len(zero.flats),
        "losses": losses,
        "norms": norms,
        "params": params,
        "memory": memory,
        "collectives": zero.collectives(micro_steps=accumulate),
        "issued": zero.issued(),
        "units": [u.name for u in zero.units],
    }


def parity_worker(rank: int, world: int, case: Case) -> dict:
    ref_losses, ref_norms, ref_params = _reference(case.clip)
    got = _train_zero(rank, case)
    engine = got.pop("engine")
    gc.collect()
    got["freed"] = engine() is None  # the run returned: its parameters' hooks hold it weakly
    got["ref_norms"] = ref_norms
    got["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses, strict=True))
    exact = _reference(case.clip, torch.float64)[2]
    got["param_distance"] = _distance(got["params"], exact)
    got["param_yardstick"] = _distance(ref_params, exact)
    got["num_params"] = sum(p.numel() for p in ref_params.values())
    del got["params"]
    return got


# every case runs in one spawn: process start-up dominates the time
CASES = {
    "zero1": Case(ZeroOptions(stage=1, bucket_bytes=4096)),
    "zero2": Case(ZeroOptions(stage=2, bucket_bytes=4096)),
    "zero3": Case(ZeroOptions(stage=3)),
    "zero1-offload": Case(ZeroOptions(stage=1, bucket_bytes=4096, offload_optimizer=True)),
    "zero3-offload": Case(ZeroOptions(stage=3, offload_optimizer=True, offload_params=True)),
    "zero2-accumulate": Case(ZeroOptions(stage=2, bucket_bytes=4096), accumulate=2),
    "zero3-accumulate": Case(ZeroOptions(stage=3), accumulate=2),
    "zero3-checkpointed": Case(ZeroOptions(stage=3), kind="checkpointed"),
    "zero1-exported": Case(ZeroOptions(stage=1, bucket_bytes=4096), kind="exported"),
    "zero2-exported": Case(ZeroOptions(stage=2, bucket_bytes=4096), kind="exported"),
    "zero3-exported": Case(ZeroOptions(stage=3), kind="exported"),
    "zero3-unflattened": Case(ZeroOptions(stage=3), kind="unflattened"),
    "zero1-clip": Case(ZeroOptions(stage=1, bucket_bytes=4096), clip=0.05),
    "zero3-clip": Case(ZeroOptions(stage=3), clip=0.05),
}


def all_cases_worker(rank: int, world: int, tmp: str) -> dict[str, dict]:
    out = {name: parity_worker(rank, world, case) for name, case in CASES.items()}
    out["bf16"] = bf16_worker(rank, world)
    out["checkpoint"] = checkpoint_worker(rank, world, tmp)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, dict]]:
    """Every case's result, by rank."""
    return spawn(all_cases_worker, WORLD, (str(tmp_path_factory.mktemp("zero")),))


# ---------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", ["zero1", "zero2", "zero3"])
def test_parity_with_single_device_adamw(results: list[dict], case: str) -> None:
    for by_case in results:
        assert by_case[case]["loss_rel"] <= FP32_RTOL
        assert_params_close(by_case[case])


@pytest.mark.parametrize("case", ["zero1-offload", "zero3-offload"])
def test_offload_parity(results: list[dict], case: str) -> None:
    # On a CPU-only machine the offload device is the compute device: this checks the code
    # path (a separate fp32 master and shard copies every step), not the placement.
    for by_case in results:
        assert by_case[case]["loss_rel"] <= FP32_RTOL
        assert_params_close(by_case[case])


@pytest.mark.parametrize("case", ["zero2-accumulate", "zero3-accumulate"])
def test_accumulation_matches_one_larger_batch(results: list[dict], case: str) -> None:
    # 2 ranks x 2 micro-batches of 1 sample, synced once, vs the global batch of 4 on one device
    for by_case in results:
        assert by_case[case]["loss_rel"] <= FP32_RTOL
        assert_params_close(by_case[case])


@pytest.mark.parametrize("case", ["zero1-clip", "zero3-clip"])
def test_clip_grad_norm_matches_single_device(results: list[dict], case: str) -> None:
    for by_case in results:
        norms, ref_norms = by_case[case]["norms"], by_case[case]["ref_norms"]
        assert norms == pytest.approx(ref_norms, rel=FP32_RTOL)
        assert min(norms) > 0.05  # every step is clipped
        assert by_case[case]["loss_rel"] <= FP32_RTOL
        assert_params_close(by_case[case])


@pytest.mark.parametrize("case", ["zero3-checkpointed"])
def test_activation_checkpointing_recomputes_with_gathered_params(results: list[dict], case: str) -> None:
    # the recomputation in backward runs after the layer's params were gathered again
    for by_case in results:
        assert by_case[case]["loss_rel"] <= FP32_RTOL
        assert_params_close(by_case[case])


@pytest.mark.parametrize("case", ["zero1-exported", "zero2-exported", "zero3-exported", "zero3-unflattened"])
def test_exported_graph_module(results: list[dict], case: str) -> None:
    """torch.export's flat GraphModule: stage 3 falls back to one root unit; the numbers still match.
    `torch.export.unflatten` keeps a forward per layer: per-layer units again."""
    for by_case in results:
        assert by_case[case]["loss_rel"] <= FP32_RTOL
        assert_params_close(by_case[case])


# ---------------------------------------------------------------------------- ledger and memory


@pytest.mark.parametrize("case", [name for name, case in CASES.items() if case.clip is None])
def test_ledger_matches_what_was_issued(results: list[dict], case: str) -> None:
    result = results[0][case]
    assert result["collectives"] == result["issued"]  # per optimizer step, micro-steps included
    ops = {c.op for c in result["collectives"]}
    assert ops == (
        {"all_reduce", "all_gather"} if case.startswith("zero1") else {"reduce_scatter", "all_gather"}
    )


@pytest.mark.parametrize(
    ("case", "units"),
    [
        ("zero3", ["", "layers.0", "layers.1", "layers.2"]),
        ("zero3-unflattened", ["", "layers.0", "layers.1", "layers.2"]),
        ("zero3-exported", [""]),  # one flat graph: no layer's forward to hook
    ],
)
def test_zero3_units(results: list[dict], case: str, units: list[str]) -> None:
    assert sorted(results[0][case]["units"]) == units


def test_zero3_communicates_about_one_and_a_half_times_dp(results: list[dict]) -> None:
    """SPEC: ZeRO-3 moves ~1.5x DP (all-gather forward and backward, reduce-scatter vs all-reduce)."""

    def traffic(rows: list[Collective]) -> float:
        factor = {"all_reduce": 2 * (WORLD - 1) / WORLD}
        return sum(factor.get(r.op, (WORLD - 1) / WORLD) * r.bytes * r.count for r in rows)

    plain_dp = [c for c in results[0]["zero1"]["collectives"] if c.op == "all_reduce"]
    ratio = traffic(results[0]["zero3"]["collectives"]) / traffic(plain_dp)
    assert 1.3 <= ratio <= 1.5  # the root (embedding, norm, head) is gathered once, not twice


def test_a_finished_run_frees_its_engine(results: list[dict]) -> None:
    """Its parameters' hooks hold the engine weakly (they live on autograd's C++ side, where the
    cycle collector does not look): dropped, it is freed, with its program and process group."""
    # torch.export.unflatten's modules are never freed, with or without an engine (torch 2.13)
    cases = [c for c in CASES if CASES[c].kind != "unflattened"]
    assert all(r[case]["freed"] for r in results for case in cases), [
        c for c in cases if not results[0][c]["freed"]
    ]


@pytest.mark.parametrize("case", ["zero1", "zero2", "zero3"])
def test_memory_is_sharded(results: list[dict], case: str) -> None:
    """fp32 AdamW: params 4, grads 4, m and v 8 bytes/param unsharded; each stage shards one more."""
    stage = int(case[-1])
    for by_case in results:
        n, mem = by_case[case]["num_params"], by_case[case]["memory"]
        expected = {
            "params": 4 * n / (WORLD if stage == 3 else 1),
            "grads": 4 * n / (1 if stage == 1 else WORLD),
            "optimizer": 8 * n / WORLD,
        }
        for key, value in expected.items():
            assert mem[key] == pytest.approx(value, rel=0.01), key


def test_bf16_keeps_fp32_master(results: list[dict]) -> None:
    for by_case in results:
        assert by_case["bf16"]["param_dtypes"] == {torch.bfloat16}
        assert by_case["bf16"]["master_dtype"] == torch.float32
        assert by_case["bf16"]["param_rel"] <= FP32_RTOL  # the reference makes the same casts


# ---------------------------------------------------------------------------- mixed precision, checkpoint


def bf16_worker(rank: int, world: int) -> dict:
    """bf16 params, fp32 master, fp32 reduction vs one device making the same casts: each
    half-batch's bf16 grads summed in fp32, AdamW on an fp32 copy, the result cast to bf16."""
    ref = build(**MODEL).to(torch.bfloat16)
    master = [p.detach().float() for p in ref.parameters()]
    opt = torch.optim.AdamW(master, **ADAMW)
    model = build(**MODEL).to(torch.bfloat16)
    zero = _zero(model, ZeroOptions(stage=2, reduce_dtype=torch.float32))
    local = BATCH // WORLD
    for step in range(STEPS):
        ids, labels = example_inputs(BATCH, SEQ, seed=step)
        for m in master:
            m.grad = torch.zeros_like(m)
        for r in range(WORLD):  # what each rank computes, reduced in fp32
            half = slice(r * local, (r + 1) * local)
            ref(ids[half], labels[half]).backward()
            for m, p in zip(master, ref.parameters(), strict=True):
                m.grad += p.grad.float()
                p.grad = None
        for m in master:
            m.grad /= WORLD
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, ref.parameters(), strict=True):
                p.copy_(m)
        half = slice(rank * local, (rank + 1) * local)
        model(ids[half], labels[half]).backward()
        zero.step()
        zero.zero_grad()
    worst = max(_rel(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return {
        "param_rel": worst,
        "param_dtypes": {p.dtype for p in model.parameters()},
        "master_dtype": zero.optim.masters[0].dtype,
    }


def checkpoint_worker(rank: int, world: int, tmp: str) -> dict[int, float]:
    """Per stage: 2 steps, save a checkpoint (`runtime.checkpoint`, the training loop's), 2 more; a
    fresh run loads the checkpoint and does the same 2 steps. Returns the largest loss difference."""
    from meshplan.runtime import checkpoint  # DCP's imports cost 1.5 s: only in the worker that uses it

    def steps(zero, model, seeds) -> list[float]:
        return zero_steps(zero, model, seeds, world=WORLD, seq=SEQ)

    diffs, written = {}, {}
    for stage in (1, 2, 3):
        root = os.path.join(tmp, f"zero{stage}")
        model = build(**MODEL)
        zero = _zero(model, ZeroOptions(stage=stage, bucket_bytes=4096))
        steps(zero, model, [0, 1])
        saved = checkpoint.save(root, 2, zero)
        written[stage] = (elements_written(saved, rank, zero), sum(f.local_numel for f in zero.flats))
        expected = steps(zero, model, [2, 3])

        fresh = build(seed=1, **MODEL)  # other initial weights: the checkpoint must replace them all
        resumed = _zero(fresh, ZeroOptions(stage=stage, bucket_bytes=4096))
        assert checkpoint.load(saved, resumed).step == 2
        got = steps(resumed, fresh, [2, 3])
        diffs[stage] = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    return {"diffs": diffs, "written": written}


def elements_written(path: Path, rank: int, zero: Zero) -> int:
    """Elements of the engine's parameters that `rank`'s file of checkpoint `path` holds (DCP's
    metadata names the file of every box)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    total = 0
    for name in (n for f in zero.flats for n in f.names):
        key = f"replicated.model.{name}"
        for chunk in metadata.state_dict_metadata[key].chunks:
            where = metadata.storage_data[MetadataIndex(key, chunk.offsets)].relative_path
            if where.startswith(f"__{rank}_"):
                total += math.prod(chunk.sizes)
    return total


def test_an_export_gathers_one_unit_at_a_time(results: list[dict]) -> None:
    """`gathered_by_unit` (what `--export` consolidates from) hands out every parameter with the
    value `gathered()` gives, and under ZeRO-3 holds at most one unit's flats gathered at once."""
    checked = 0
    for by_case in results:
        for case, r in by_case.items():
            if not isinstance(r, dict) or "by_unit_equal" not in r:
                continue
            assert r["by_unit_equal"], case
            if r["units"]:  # stage 3: the unit being handed out, nothing else
                assert 1 <= r["most_gathered"] <= r["largest_unit"], case
                if len(r["units"]) > 1:
                    assert r["most_gathered"] < r["flats"], case
                    checked += 1
    assert checked


def test_distributed_checkpoint_resume(results: list[dict]) -> None:
    """Resuming from a ZeRO checkpoint continues bit-identically (CPU), every stage."""
    for by_case in results:
        assert by_case["checkpoint"]["diffs"] == {1: 0.0, 2: 0.0, 3: 0.0}


def test_each_rank_writes_exactly_its_own_zero_shard(results: list[dict]) -> None:
    """No rank gathers the model to save it: each rank's file holds the elements of its own
    ZeRO shard, nothing more (the parameters' fp32 values; moments alike)."""
    for by_case in results:
        for stage, (written, own) in by_case["checkpoint"]["written"].items():
            assert written == own > 0, stage


def test_config_rejects_params_offload_below_stage_3() -> None:
    with pytest.raises(ValueError, match="needs ZeRO-3"):
        ZeroOptions(stage=2, offload_params=True)
