"""Compressed gradient all-reduce (`compress = powersgd(...)`, `bf16`) on 2 gloo processes.

One spawn trains the small Llama with `DataParallel` over 2 ranks four ways on the same
batches: exactly (the yardstick), with PowerSGD at rank 2 (and again with one warm-up step),
and with bf16 plus error feedback; then with ZeRO (`ZERO_CASES`): both methods under stages
1, 2 and 3. Compression is lossy, so the runs are held to the exact one by their losses (the
convergence yardstick of `cli/verify_lossy.py`), and to each other's ranks bit for bit: every
rank applies the same all-reduced approximation (under ZeRO, the parameters gathered after the
last step). The bytes each engine issued in its last step are the ledger's
(`buckets.compressed_wire`, `buckets.zero_compressed_wire`). ZeRO-2 keeping its shard of the
same reduction is ZeRO-1's update, bit for bit, for both methods.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import spawn

from meshplan.examples import CORPUS
from meshplan.examples.models.llama import build
from meshplan.runtime.axes import Axes
from meshplan.runtime.buckets import compressed_wire, decays, low_rank_shape, zero_compressed_wire
from meshplan.runtime.compression import Compression
from meshplan.runtime.data import TextBatches, read_bytes
from meshplan.runtime.data_parallel import DataParallel
from meshplan.runtime.train import TrainConfig, train
from meshplan.runtime.zero import ZeroOptions, shard_for_zero
from meshplan.verify_lossy import LOSS_MARGIN

pytestmark = pytest.mark.slow

STEPS = 6
SEQ = 32
BUCKET_BYTES = 100_000  # the 2-layer model has ~140k params (560 KB): several buckets
CASES = {
    "exact": None,
    "powersgd": Compression("powersgd", rank=2),
    "warmup": Compression("powersgd", rank=2, warmup=1),
    "bf16": Compression("bf16"),
}
ZERO_CASES = {  # name -> (ZeRO stage, compression)
    "zero1-powersgd": (1, Compression("powersgd", rank=2)),
    "zero2-powersgd": (2, Compression("powersgd", rank=2)),
    "zero1-bf16": (1, Compression("bf16")),
    "zero2-bf16": (2, Compression("bf16")),
    "zero3-bf16": (3, Compression("bf16")),
    "zero3-powersgd": (3, Compression("powersgd", rank=2)),
}


def run(rank: int, tokens: torch.Tensor, tmp: str, name: str) -> dict:
    model = build(num_hidden_layers=2)
    dp = DataParallel(model, dist.group.WORLD, bucket_bytes=BUCKET_BYTES, compression=CASES[name])
    batches = TextBatches(tokens, batch=4, seq=SEQ, seed=0, dp_rank=rank, dp_size=2)
    cfg = TrainConfig(steps=STEPS, lr=3e-3, warmup_steps=1, run_dir=Path(tmp) / name, seed=0)
    summary = train(
        model,
        lambda x, y: dp(x, y),
        batches,
        cfg,
        axes=Axes(groups={"dp": dist.group.WORLD}, data=("dp",)),
        sync=dp,
    )
    last = [launch.nbytes for launch in dp.launches][-len(dp.ledger()) :]
    return {
        "losses": summary.losses,
        "params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
        "issued": last,
        "ledger": [nbytes for nbytes, _ in dp.ledger()],
        "first_step": [launch.nbytes for launch in dp.launches[: len(dp.buckets)]],
        "bucket_bytes": [b.nbytes for b in dp.buckets],
        "grads": dp.memory()["grads"],  # the buckets' gradients, and what error feedback keeps
        "estimated": estimated_grads(model, 0, CASES[name]),
    }


def estimated_grads(model: torch.nn.Module, stage: int, compression: Compression | None) -> int:
    """What `meshplan estimate` counts as this rank's gradient memory (`engine_state.state_of`)
    beyond the gradients themselves: error feedback's (ZeRO), or with them (plain data parallel)."""
    from meshplan.compiler.engine_state import state_of

    def grads(compress: tuple[str, int] | None) -> int:
        params = dict(model.named_parameters())
        engine = "data parallel" if stage == 0 else "zero"
        return state_of(
            params,
            zero=stage,
            group_size=lambda n: 2,
            engine=engine,
            bucket_bytes=BUCKET_BYTES,
            compress=compress,
        ).grads

    compress = (compression.method, compression.rank) if compression is not None else None
    return grads(compress) if stage == 0 else grads(compress) - grads(None)


def run_zero(rank: int, tokens: torch.Tensor, tmp: str, name: str) -> dict:
    stage, compression = ZERO_CASES[name]
    model = build(num_hidden_layers=2)
    options = ZeroOptions(stage=stage, bucket_bytes=BUCKET_BYTES, decay=decays, compression=compression)
    zero = shard_for_zero(model, dist.group.WORLD, options)
    batches = TextBatches(tokens, batch=4, seq=SEQ, seed=0, dp_rank=rank, dp_size=2)
    cfg = TrainConfig(steps=STEPS, lr=3e-3, warmup_steps=1, run_dir=Path(tmp) / name, seed=0)
    axes = Axes(groups={"dp": dist.group.WORLD}, data=("dp",))
    summary = train(model, lambda x, y: model(x, y), batches, cfg, axes=axes, sync=zero)
    with zero.gathered():
        params = {n: p.detach().clone().numpy() for n, p in model.named_parameters()}
    return {
        "losses": summary.losses,
        "params": params,
        # the reductions (compression leaves the parameter gathers alone)
        "issued": Counter({(c.op, c.bytes): c.count for c in zero.issued() if c.op != "all_gather"}),
        "ledger": Counter({(c.op, c.bytes): c.count for c in zero.collectives() if c.op != "all_gather"}),
        "wire": Counter(
            (op, nbytes)
            for f in zero.flats
            for op, _, nbytes in zero_compressed_wire(f.params, f.padded, stage, compression.method, 2)
        ),
        "exact": sum(f.padded * 4 for f in zero.flats),
        "memory": zero.memory()["grads"],
        "estimated": estimated_grads(model, stage, compression),
    }


def worker(rank: int, world_size: int, tmp: str) -> dict:
    tokens = read_bytes(CORPUS)
    plain = {name: run(rank, tokens, tmp, name) for name in CASES}
    return plain | {name: run_zero(rank, tokens, tmp, name) for name in ZERO_CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(worker, 2, (str(tmp_path_factory.mktemp("compress")),))


@pytest.mark.parametrize("name", ["powersgd", "warmup", "bf16", *ZERO_CASES])
def test_converges_as_the_exact_all_reduce_does(results: list[dict], name: str) -> None:
    exact, lossy = results[0]["exact"]["losses"], results[0][name]["losses"]
    for loss, ref in zip(lossy, exact, strict=True):
        assert abs(loss - ref) / ref < LOSS_MARGIN, (name, lossy, exact)
    assert lossy[-1] < lossy[0]  # it trains


@pytest.mark.parametrize("name", ["powersgd", "bf16", "zero1-powersgd", "zero2-bf16"])
def test_lossy_means_not_exact(results: list[dict], name: str) -> None:
    """The compression did act: the weights left the exact run's (bitwise equal would mean the
    compressor was never called)."""
    exact, lossy = results[0]["exact"]["params"], results[0][name]["params"]
    assert any((exact[n] != lossy[n]).any() for n in exact)


@pytest.mark.parametrize("name", [*CASES, *ZERO_CASES])
def test_replicas_stay_bitwise_identical(results: list[dict], name: str) -> None:
    a, b = results[0][name]["params"], results[1][name]["params"]
    assert all((a[n] == b[n]).all() for n in a), name


@pytest.mark.parametrize("name", ["powersgd", "warmup", "bf16"])
def test_the_engine_sends_the_ledgers_bytes(results: list[dict], name: str) -> None:
    run = results[0][name]
    # as multisets: Q's all-reduces are issued after every bucket's P, the ledger lists a bucket's together
    assert sorted(run["issued"]) == sorted(run["ledger"])
    exact = sum(run["bucket_bytes"])
    assert sum(run["ledger"]) <= exact / 2  # bf16: half; PowerSGD rank 2: far less


@pytest.mark.parametrize("name", list(ZERO_CASES))
def test_zero_sends_the_ledgers_bytes(results: list[dict], name: str) -> None:
    """The gradient reductions ZeRO issued in its last step are its ledger's (`Zero.collectives`,
    from `buckets.zero_compressed_wire`, which the compiler's ledger lists too): bf16 a
    reduce-scatter under ZeRO-2/3, PowerSGD all-reduces at every stage."""
    for rank in results:
        run = rank[name]
        # what the engine's ledger leaves to the compiler's: the gradient norm's one sum (8 bytes)
        assert run["issued"] - run["ledger"] == Counter({("all_reduce", 8): 1})
        assert run["ledger"] == run["wire"]
        assert sum(nbytes * n for (_, nbytes), n in run["wire"].items()) <= run["exact"] / 2
        ops = {op for op, _ in run["wire"]}
        assert ops == ({"reduce_scatter"} if name in ("zero2-bf16", "zero3-bf16") else {"all_reduce"})


@pytest.mark.parametrize("method", ["powersgd", "bf16"])
def test_zero2_keeps_its_shard_of_zero1s_update(results: list[dict], method: str) -> None:
    """ZeRO-2's compressed reduction is ZeRO-1's, of which it keeps its shard: the same
    parameters, bit for bit (PowerSGD's factors all-reduced, M_hat made whole, then cut)."""
    one, two = results[0][f"zero1-{method}"]["params"], results[0][f"zero2-{method}"]["params"]
    assert all((one[n] == two[n]).all() for n in one)


@pytest.mark.parametrize("name", ["zero2-powersgd", "zero2-bf16", "zero3-bf16", "zero3-powersgd"])
def test_error_feedback_is_counted_as_gradient_memory(results: list[dict], name: str) -> None:
    """Each rank keeps a residual of the whole flat it sent, and `Zero.memory()` says so: after
    the run (gradients dropped) it still holds a whole gradient's bytes, where uncompressed
    ZeRO-2/3 would hold none."""
    run = results[0][name]
    assert run["memory"] >= run["exact"] - 4 * 2 * 16  # every gradient (less the flats' padding)


@pytest.mark.parametrize("name", ["exact", "powersgd", "bf16", *ZERO_CASES])
def test_estimate_counts_what_error_feedback_keeps(results: list[dict], name: str) -> None:
    """`meshplan estimate`'s gradient memory is the engine's, error feedback included: plain data
    parallelism's buckets and feedback, ZeRO's feedback (what is left once `zero_grad` dropped
    the gradients)."""
    run = results[0][name]
    assert run["estimated"] == (run["grads"] if "grads" in run else run["memory"]), name


def test_warm_up_steps_send_the_whole_buckets(results: list[dict]) -> None:
    assert results[0]["warmup"]["first_step"] == results[0]["warmup"]["bucket_bytes"]


def test_the_wire_of_a_bucket() -> None:
    """PowerSGD sends a matrix as (rows + cols) x rank numbers when that is at least 2x fewer,
    1-D tensors and small matrices whole; bf16 sends every element in two bytes."""
    params = [torch.empty(64, 32), torch.empty(64), torch.empty(4, 4)]
    assert low_rank_shape(params[0], 2) == (64, 32)
    assert low_rank_shape(params[2], 2) is None
    assert compressed_wire(params, "powersgd", 2) == [
        ("whole", (64 + 16) * 4),
        ("P", 64 * 2 * 4),
        ("Q", 32 * 2 * 4),
    ]
    assert compressed_wire(params, "bf16") == [("bf16", (64 * 32 + 64 + 16) * 2)]
