"""The unpartitioned model trained the way `meshplan run` trains, on one device: the reference
the runtime's parity tests compare against, run in the same process as the partitioned one."""

from __future__ import annotations

import torch
from torch import nn

from meshplan.examples import CORPUS
from meshplan.examples.models.llama import example_inputs
from meshplan.runtime.data import TextBatches, read_bytes
from meshplan.runtime.grad_sync import make_optimizer
from meshplan.runtime.train import TrainConfig, lr_at


def single_device_losses(
    model: nn.Module, cfg: TrainConfig, *, batch: int, seq: int, clip: float
) -> list[float]:
    """`cfg.steps` steps of AdamW (`make_optimizer`, the run's LR schedule, global-norm clipping)
    on the shipped corpus, each on the whole global batch of `batch` sequences; `model` is trained
    in place and the losses returned."""
    optimizer = make_optimizer(model, cfg)
    batches = TextBatches(read_bytes(CORPUS), batch=batch, seq=seq, seed=0)
    losses = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(*batches(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def zero_steps(zero, model: nn.Module, seeds, *, world: int, seq: int) -> list[float]:
    """A step per seed under a ZeRO engine (`runtime.zero.Zero`): this rank's row of the example
    batch of `world` sequences, forward, backward, `zero.step()`, `zero.zero_grad()`; the losses."""
    rank = torch.distributed.get_rank()
    losses = []
    for seed in seeds:
        ids, labels = example_inputs(world, seq, seed=seed)
        loss = model(ids[rank : rank + 1], labels[rank : rank + 1])
        loss.backward()
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
    return losses
