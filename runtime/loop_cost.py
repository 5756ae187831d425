"""What `meshplan run`'s training loop spends on a step beyond the program's forward and
backward: the learning rate set, the gradient norm read back, clipping, the optimizer's step,
the gradients let go, the loss read back and the step's metrics record. `meshplan estimate
--calibrate` measures it here, on this machine, through the loop itself (`train.train`), so
the estimate's step time carries what a run's `time_s` carries.

    per_step, per_tensor = measure(torch.device("cpu"))

Measured with few and with many small parameters (their bytes cost nothing next to their
count), in alternating rounds, each count's fastest round kept (a busy machine only ever adds
time); the difference is the cost of one more tensor, the rest the step's own.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from .train import TrainConfig, train

FEW, MANY = 8, 256  # parameters of the two runs: many enough that their difference outweighs noise
STEPS = 40
ROUNDS = 3


def measure(device: torch.device) -> tuple[float, float]:
    """Seconds the loop spends per step, and per parameter it steps, beside forward and backward."""
    rounds = [(_per_step(FEW, device), _per_step(MANY, device)) for _ in range(ROUNDS)]
    few, many = (min(times) for times in zip(*rounds, strict=True))
    per_tensor = max((many - few) / (MANY - FEW), 0.0)
    return max(few - FEW * per_tensor, 0.0), per_tensor


def _per_step(count: int, device: torch.device) -> float:
    """The median `time_s` of `train` over `count` parameters, less its forward and backward:
    here each parameter's gradient made, as a first backward makes it."""
    params = nn.ParameterList(nn.Parameter(torch.randn(64, device=device)) for _ in range(count))
    spent: list[float] = []

    def forward_backward(input_ids: Tensor, labels: Tensor, k: int, scale: float) -> Tensor:
        start = time.perf_counter()
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        spent.append(time.perf_counter() - start)
        return torch.zeros((), device=device)

    def batches(step: int, micro: int) -> tuple[Tensor, Tensor]:
        return torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)

    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(steps=STEPS, run_dir=Path(folder), warmup_steps=1, log_every=STEPS)
        train(params, lambda *_: torch.zeros(()), batches, config, forward_backward=forward_backward)
        records = [
            json.loads(line) for line in (Path(folder) / "metrics" / "rank0.jsonl").read_text().splitlines()
        ]
    # the steps after the first few, but those the peak tracker measured (it slows every op)
    steps = [
        r["time_s"] - made
        for r, made in zip(records, spent, strict=True)
        if r["step"] > 4 and r["peak_tensor_bytes"] is None
    ]
    return statistics.median(steps)
