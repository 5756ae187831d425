"""The optimizers a plan can choose (`runtime/optimizers.py`), on 2 gloo ranks against one device.

Each worker trains the example Llama for `STEPS` steps with SGD (momentum), Lion and Adafactor
under plain data parallelism and ZeRO-1/3 (Adafactor's step over ZeRO's shards sums each
parameter's pieces over the ranks, `runtime/adafactor.py`), every rank on its half of the global batch, and in the same process the unpartitioned
model with the same torch optimizer on the whole batch (`make_optimizer`), in float32 and
float64. Losses agree to float32 rounding; parameters within `YARDSTICK_FACTOR` times the
float32 one-device run's own distance to float64 (as `test_zero.py`: a reduction in another
order is a rounding, and Lion's sign or Adafactor's divisions carry it like AdamW's).

Checkpoints: SGD with momentum saved under ZeRO-1 at dp=2 resumes under plain data parallelism
(ZeRO 1 -> 0) in the spawn and on one process (dp=2 -> 1) here, and so does Adafactor (its
sharded steps saved, torch.optim.Adafactor resuming); a run with another optimizer is refused by
name.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pool import spawn

from meshplan.examples.models.llama import build, example_inputs
from meshplan.runtime.buckets import decays
from meshplan.runtime.data_parallel import DataParallel
from meshplan.runtime.grad_sync import GradSync, Local, make_optimizer
from meshplan.runtime.optimizers import Lion, OptimizerChoice
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import ZeroOptions, shard_for_zero

WORLD = 2
MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
BATCH, SEQ, STEPS = 4, 16, 3
FP32_RTOL = 1e-5
FP32_EPS = torch.finfo(torch.float32).eps
YARDSTICK_FACTOR = 4  # the ratio `meshplan verify` allows
CHOICES = {
    "sgd": OptimizerChoice("sgd", {"momentum": 0.9}),
    "lion": OptimizerChoice("lion"),
    "adafactor": OptimizerChoice("adafactor"),
}
ENGINES = {kind: ("dp", "zero1", "zero3") for kind in CHOICES}


def _config(kind: str) -> TrainConfig:
    lr = 1e-3 if kind == "lion" else 1e-2  # Lion's sign steps are lr-sized: 3-10x smaller (paper)
    return TrainConfig(lr=lr, weight_decay=0.1, optimizer=CHOICES[kind])


def _engine(model: torch.nn.Module, engine: str) -> GradSync:
    if engine == "dp":
        return DataParallel(model, dist.group.WORLD, bucket_bytes=4096)
    stage = int(engine[-1])
    return shard_for_zero(model, dist.group.WORLD, ZeroOptions(stage=stage, bucket_bytes=4096, decay=decays))


def _batch(step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`, or rank `rank`'s half of it."""
    ids, labels = example_inputs(BATCH, SEQ, seed=step)
    if rank is None:
        return ids, labels
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    return ids[half], labels[half]


def _steps(model, sync: GradSync, optimizer, steps, rank: int | None) -> list[float]:
    """Train `steps`; the loss of each step, averaged over the ranks."""
    losses = []
    for step in steps:
        loss = model(*_batch(step, rank))
        loss.backward()
        sync.finish()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if rank is not None:
            dist.all_reduce(total)
            total /= WORLD
        losses.append(total.item())
    return losses


def _one_device(kind: str, dtype: torch.dtype = torch.float32) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(**MODEL).to(dtype)
    optimizer = make_optimizer(model, _config(kind))
    losses = _steps(model, Local(model), optimizer, range(STEPS), None)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _distance(params: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    diff = sum(float((params[n].double() - e).norm()) ** 2 for n, e in exact.items())
    return (diff / sum(float(e.norm()) ** 2 for e in exact.values())) ** 0.5


def _parity(rank: int, kind: str, engine: str) -> dict:
    model = build(**MODEL)
    sync = _engine(model, engine)
    losses = _steps(model, sync, sync.optimizer(_config(kind)), range(STEPS), rank)
    gathered = sync.gathered() if hasattr(sync, "gathered") else contextlib.nullcontext()
    with gathered:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_losses, ref_params = _one_device(kind)
    exact = _one_device(kind, torch.float64)[1]
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
        "distance": _distance(params, exact),
        "yardstick": _distance(ref_params, exact),
        "state_bytes": sync.memory()["optimizer"],
    }


def _saved(rank: int, tmp: str, kind: str, engine: str) -> dict:
    """2 steps under `engine`, a checkpoint, then 2 more (the uninterrupted losses); under ZeRO, a
    fresh plain data-parallel run resumed from the checkpoint does the same 2 steps."""
    from meshplan.runtime import checkpoint  # DCP's imports cost 1.5 s: only where used

    model = build(**MODEL)
    sync = _engine(model, engine)
    optimizer = sync.optimizer(_config(kind))
    _steps(model, sync, optimizer, [0, 1], rank)
    path = checkpoint.save(Path(tmp) / f"{kind}-{engine}", 2, sync)
    expected = _steps(model, sync, optimizer, [2, 3], rank)
    out = {"path": str(path), "expected": expected}
    if engine != "dp":
        fresh = build(seed=1, **MODEL)  # other weights: the checkpoint replaces them all
        plain = _engine(fresh, "dp")
        resumed = plain.optimizer(_config(kind))
        checkpoint.load(path, plain)
        out["resumed_dp"] = _steps(fresh, plain, resumed, [2, 3], rank)
    return out


def worker(rank: int, world: int, tmp: str) -> dict:
    parity = {(k, e): _parity(rank, k, e) for k, engines in ENGINES.items() for e in engines}
    saved = {k: _saved(rank, tmp, k, e) for k, e in (("sgd", "zero1"), ("adafactor", "zero1"))}
    return {"parity": parity, "saved": saved}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return spawn(worker, WORLD, (str(tmp_path_factory.mktemp("optimizers")),))[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", [(k, e) for k, engines in ENGINES.items() for e in engines])
def test_parity_with_one_device(results: dict, case: tuple[str, str]) -> None:
    got = results["parity"][case]
    assert got["loss_rel"] < FP32_RTOL, got
    assert got["distance"] <= YARDSTICK_FACTOR * max(got["yardstick"], FP32_EPS), got


@pytest.mark.slow
def test_zero_holds_half_the_state(results: dict) -> None:
    """SGD's momentum and Lion's are one fp32 tensor per parameter: ZeRO-1 at dp=2 holds half
    (plus the fp32 master, which is the shard itself here), the flats' padding aside."""
    for kind in ("sgd", "lion"):
        whole, zero1 = (
            results["parity"][(kind, "dp")]["state_bytes"],
            results["parity"][(kind, "zero1")]["state_bytes"],
        )
        num_params = sum(p.numel() for p in build(**MODEL).parameters())
        assert whole == 4 * num_params
        assert 4 * num_params / 2 <= zero1 <= 4 * num_params / 2 + 4 * 4096


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sgd", "adafactor"])
def test_checkpoint_resumes_on_another_layout(results: dict, kind: str) -> None:
    """dp=2 under ZeRO-1 -> plain data parallelism at dp=2 (in the spawn) and -> one process."""
    from meshplan.runtime import checkpoint

    saved = results["saved"][kind]
    if "resumed_dp" in saved:
        assert max(abs(a - b) for a, b in zip(saved["resumed_dp"], saved["expected"], strict=True)) < 1e-5
    model = build(seed=1, **MODEL)
    local = Local(model)
    optimizer = local.optimizer(_config(kind))
    assert checkpoint.load(saved["path"], local).step == 2
    got = _steps(model, local, optimizer, [2, 3], None)
    assert max(abs(a - b) / b for a, b in zip(got, saved["expected"], strict=True)) < FP32_RTOL


@pytest.mark.slow
def test_resuming_with_another_optimizer_is_refused(results: dict) -> None:
    from meshplan.runtime import checkpoint

    model = build(**MODEL)
    local = Local(model)
    local.optimizer(TrainConfig())  # AdamW
    with pytest.raises(
        checkpoint.CheckpointError, match="holds sgd's state, but this run's optimizer is adamw"
    ):
        checkpoint.load(results["saved"]["sgd"]["path"], local)


def test_lion_step_is_the_papers() -> None:
    """Two steps of `Lion` against Algorithm 2 written out: c = b1 m + (1 - b1) g;
    p = p (1 - lr wd) - lr sign(c); m = b2 m + (1 - b2) g."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    lr, wd, (b1, b2) = 0.1, 0.2, (0.9, 0.99)
    lion = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    want, m = p.detach().clone(), torch.zeros(5, 3)
    for _ in range(2):
        g = torch.randn(5, 3)
        p.grad = g.clone()
        lion.step()
        c = b1 * m + (1 - b1) * g
        want = want * (1 - lr * wd) - lr * torch.sign(c)
        m = b2 * m + (1 - b2) * g
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(lion.state[p]["exp_avg"], m, rtol=0, atol=1e-7)
