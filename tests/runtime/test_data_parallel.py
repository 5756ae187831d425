"""Data parallel on 2 gloo processes vs one device, same global batch, same test.

One spawn runs everything (process start-up is the expensive part on 2 cores). Each rank:

- trains the full model on the whole global batch of 8 sequences (the reference, a plain
  torch loop: AdamW, the same LR schedule, `clip_grad_norm_`);
- trains it with `DataParallel` over 2 ranks, 4 sequences each (1 micro-step);
- trains it with `DataParallel` over 2 ranks, 1 sequence per micro-step, 4 micro-steps
  (gradient accumulation: sync only on the last micro-step);
- and with the gradients reduced in bf16 (converted, not reduced in place).

All three see the same 8 windows per step (`TextBatches` is layout independent), so
losses and parameters must agree to float32 rounding after 3 AdamW steps.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import spawn

from meshplan.examples import CORPUS
from meshplan.examples.models.llama import build
from meshplan.runtime.axes import Axes
from meshplan.runtime.data import TextBatches, read_bytes
from meshplan.runtime.data_parallel import DataParallel
from meshplan.runtime.grad_sync import make_optimizer
from meshplan.runtime.train import TrainConfig, lr_at, train

pytestmark = pytest.mark.slow

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 32
BUCKET_BYTES = 40_000  # the 2-layer model has ~140k params (560 KB): many buckets


def small_model() -> torch.nn.Module:
    return build(num_hidden_layers=2)


def arrays(model: torch.nn.Module) -> dict:
    """Parameters as numpy arrays: tensors would go back through shared memory, which dies with the worker."""
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def config(tmp: str, name: str, accumulation: int) -> TrainConfig:
    return TrainConfig(
        steps=STEPS, lr=3e-3, warmup_steps=1, accumulation=accumulation, run_dir=Path(tmp) / name, seed=0
    )


def reference(tokens: torch.Tensor, cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device run: whole global batch, plain torch."""
    model = small_model()
    optimizer = make_optimizer(model, cfg)
    batches = TextBatches(tokens, batch=GLOBAL_BATCH, seq=SEQ, seed=cfg.seed)
    losses = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(*batches(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, arrays(model)


def data_parallel_run(
    rank: int,
    tokens: torch.Tensor,
    cfg: TrainConfig,
    micro_batch: int,
    reduce_dtype: torch.dtype | None = None,
) -> dict:
    model = small_model()
    if rank == 1:  # a different start on rank 1: the wrap-time broadcast must make them equal
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    dp = DataParallel(model, dist.group.WORLD, bucket_bytes=BUCKET_BYTES, reduce_dtype=reduce_dtype)
    batches = TextBatches(
        tokens,
        batch=micro_batch,
        seq=SEQ,
        seed=cfg.seed,
        dp_rank=rank,
        dp_size=2,
        accumulation=cfg.accumulation,
    )
    summary = train(
        model,
        dp,
        batches,
        cfg,
        axes=Axes(groups={"dp": dist.group.WORLD}, data=("dp",)),
        sync=dp,
    )
    params, launches = arrays(model), list(dp.launches)
    dp(*batches(0)).backward()  # one more backward: where do the gradients live?
    dp.finish()
    storages = {b.buffer.untyped_storage().data_ptr() for b in dp.buckets if b.buffer is not None}
    done = {
        "losses": summary.losses,
        "params": params,
        "launches": launches,
        "num_buckets": len(dp.buckets),
        "ledger": dp.ledger(),
        "grads_in_buckets": all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters()),
    }
    engine = weakref.ref(dp)
    del dp, model
    gc.collect()
    return done | {"freed": engine() is None}


def worker(rank: int, world_size: int, tmp: str) -> dict:
    tokens = read_bytes(CORPUS)
    ref_losses, ref_params = reference(tokens, config(tmp, "ref", 1))
    plain = data_parallel_run(rank, tokens, config(tmp, "dp", 1), micro_batch=GLOBAL_BATCH // 2)
    accumulated = data_parallel_run(rank, tokens, config(tmp, "acc", 4), micro_batch=GLOBAL_BATCH // 8)
    bf16 = data_parallel_run(
        rank, tokens, config(tmp, "bf16", 1), micro_batch=GLOBAL_BATCH // 2, reduce_dtype=torch.bfloat16
    )
    return {"ref_losses": ref_losses, "ref_params": ref_params, "dp": plain, "acc": accumulated, "bf16": bf16}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(worker, 2, (str(tmp_path_factory.mktemp("dp")),))


def rel(a, b) -> float:
    a, b = torch.from_numpy(a), torch.from_numpy(b)
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("case", ["dp", "acc"])
def test_matches_one_device(results: list[dict], case: str) -> None:
    for r in results:
        run = r[case]
        for loss, ref in zip(run["losses"], r["ref_losses"], strict=True):
            assert abs(loss - ref) / abs(ref) < 1e-5, (case, run["losses"], r["ref_losses"])
        worst = max(rel(run["params"][n], p) for n, p in r["ref_params"].items())
        assert worst < 1e-5, (case, worst)


def test_gradients_live_in_the_buckets(results: list[dict]) -> None:
    """Reduced in their own dtype, the gradients are views of the buckets (no copy in or out);
    reduced in bf16 they are converted, and train like one device to bf16's rounding."""
    for r in results:
        assert r["dp"]["grads_in_buckets"] and r["acc"]["grads_in_buckets"]
        assert not r["bf16"]["grads_in_buckets"]
        for loss, ref in zip(r["bf16"]["losses"], r["ref_losses"], strict=True):
            assert abs(loss - ref) / abs(ref) < 1e-2, (r["bf16"]["losses"], r["ref_losses"])


def test_replicas_stay_identical(results: list[dict]) -> None:
    for case in ("dp", "acc"):
        a, b = results[0][case]["params"], results[1][case]["params"]
        assert all((a[n] == b[n]).all() for n in a), case


def test_buckets_overlap_backward(results: list[dict]) -> None:
    run = results[0]["dp"]
    assert run["num_buckets"] > 1
    per_step = run["launches"][: run["num_buckets"]]
    assert [launch.bucket for launch in per_step] == list(range(run["num_buckets"]))
    # launched from backward hooks, before finish(): communication overlapped compute
    assert sum(launch.during_backward for launch in per_step) > 1
    assert sum(b for b, _ in run["ledger"]) == sum(p.numel() * 4 for p in small_model().parameters())


def test_a_finished_run_frees_its_engine(results: list[dict]) -> None:
    """Its parameters' hooks hold the engine weakly (they live on autograd's C++ side, where the
    cycle collector does not look): dropped, it is freed, with its program and process group."""
    assert all(r[case]["freed"] for r in results for case in ("dp", "acc", "bf16"))


def test_accumulation_syncs_once_per_optimizer_step(results: list[dict]) -> None:
    run = results[0]["acc"]
    assert len(run["launches"]) == STEPS * run["num_buckets"]  # not 4x: no_sync on 3 of 4 micro-steps


def test_buckets_follow_the_size_limit() -> None:
    from meshplan.runtime.data_parallel import _make_buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5)]  # 40, 40, 120, 20 bytes
    buckets = _make_buckets(params, 50, None)
    # reverse order: [5, 30] reaches 50 bytes... 20 + 120 >= 50, then [10, 10] = 80
    assert [[p.numel() for p in b.params] for b in buckets] == [[5, 30], [10, 10]]
    assert [b.nbytes for b in buckets] == [140, 80]
