"""Training step time: meshplan's data parallel and ZeRO vs PyTorch's DDP and FSDP2, same model, same ranks.

    python bench/dp_step_time.py [--layers 8] [--hidden 256] [--steps 10] [--bucket-mib 25]

Model: the example Llama in fp32 (default 8 layers, H=256, I=688, V=256), B=4, S=64 per
rank, AdamW, on 2 gloo ranks (CPU). One step = forward, backward, optimizer step, zero_grad.
Every configuration is built once, then they take turns, one step each per round (so they share\nthe machine's load): `--warmup` rounds, then `--steps` timed rounds; the median is printed.

    ddp          DistributedDataParallel + torch.optim.AdamW (every rank holds everything)
    ddp-fused    the same with AdamW's fused kernel (`fused=True`), as meshplan steps: the
                 data-parallel engines alone compared
    fsdp2-noresh fully_shard per layer and root, reshard_after_forward=False (ZeRO-2 like)
    fsdp2        fully_shard per layer and root, reshard_after_forward=True  (ZeRO-3)
    dp, zero1..3 what `meshplan run` runs: the program compiled from `data_parallel over dp
                 { zero = N }` (ZeRO nodes in the graph), with runtime.data_parallel and
                 `meshplan run`'s AdamW (N = 0) or runtime.zero (per-bucket flats; stage 3
                 per-layer units, prefetched; AdamW over the flats)

Ratios below 1.0 mean meshplan is faster. On a shared 2-core machine the numbers are noisy:
read ratios from one run, not across runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import result
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl.check import check_text
from meshplan.examples.models.llama import build, example_inputs
from meshplan.runtime.data_parallel import DataParallel
from meshplan.runtime.grad_sync import make_optimizer
from meshplan.runtime.launch import spawn
from meshplan.runtime.mesh import init_mesh
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import ZeroOptions, shard_for_zero

WORLD = 2
BATCH, SEQ = 4, 64
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}


def _setup(
    name: str, model: torch.nn.Module, world: int, args: argparse.Namespace
) -> tuple[Callable, Callable, Callable]:
    """The forward (ids, labels) -> loss, the optimizer step and zero_grad."""
    if name.startswith("ddp"):
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), **ADAMW, fused=name == "ddp-fused")
        return ddp, opt.step, opt.zero_grad
    if name.startswith("fsdp2"):
        mesh = init_device_mesh("cpu", (world,))
        reshard = name == "fsdp2"
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        return model, opt.step, opt.zero_grad
    stage = 0 if name == "dp" else int(name[-1])
    plan = check_text(
        f"mesh dp={world}\ndata_parallel over dp {{\n    zero = {stage}\n    bucket = {args.bucket_mib}MiB\n}}\n",
        path=f"{name}.plan",
        world_size=world,
    )
    source = ModelSource(spec="llama", model=model, args=example_inputs(BATCH, SEQ))
    compiled = compile_plan(plan, source, world_size=world)
    program = build_rank_program(compiled, model, dist.get_rank(), init_mesh(compiled.layout))
    wrapped: torch.nn.Module = program

    def forward(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return wrapped(*bind_inputs(model, compiled.graph, (ids, labels), {}))[0]

    config = TrainConfig(lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"])
    if stage == 0:
        dp = wrapped = DataParallel(program, dist.group.WORLD, bucket_bytes=args.bucket_mib * 2**20)
        opt = make_optimizer(program, config)  # `meshplan run`'s: fused, no decay on 1-D weights

        def step() -> None:
            dp.finish()
            opt.step()

        return forward, step, opt.zero_grad
    options = ZeroOptions(stage=stage, bucket_bytes=args.bucket_mib * 2**20)
    zero = shard_for_zero(program, dist.group.WORLD, options)
    zero.optimizer(config)
    return forward, zero.step, zero.zero_grad


def worker(rank: int, world: int, args: argparse.Namespace, names: list[str]) -> dict[str, float]:
    overrides = {
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "intermediate_size": int(args.hidden * 2.6875),
    }
    runs = {name: _setup(name, build(**overrides), world, args) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    # One step of each per round: on a shared machine every configuration sees the same load. Each
    # round in its own order (the same on every rank): none always runs first or after the same one.
    order = random.Random(0)
    for i in range(args.warmup + args.steps):
        ids, labels = example_inputs(BATCH, SEQ, seed=world * i + rank)
        for name in order.sample(list(runs), len(runs)):
            model, step, zero_grad = runs[name]
            dist.barrier()
            start = time.perf_counter()
            model(ids, labels).backward()
            step()
            zero_grad()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t[args.warmup :]) for name, t in times.items()}
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=25, help="ZeRO bucket size; DDP's default is 25")
    args = parser.parse_args()
    names = ["ddp", "ddp-fused", "dp", "zero1", "zero2", "fsdp2-noresh", "fsdp2", "zero3"]
    by_rank = spawn(worker, WORLD, (args, names), timeout_s=600)
    t = {name: max(r[name] for r in by_rank) for name in names}  # a step ends when the slowest rank does
    print(f"Llama fp32, {args.layers} layers, H={args.hidden}, B=4 S=64 per rank, {WORLD} gloo ranks\n")
    for name in names:
        print(f"{name:>13}  {t[name] * 1e3:8.1f} ms/step")
    print()
    pairs = [
        ("dp", "ddp"),
        ("dp", "ddp-fused"),
        ("zero1", "ddp"),
        ("zero2", "ddp"),
        ("zero2", "fsdp2-noresh"),
        ("zero3", "fsdp2"),
    ]
    for ours, theirs in pairs:
        print(f"{ours} / {theirs:<13} {t[ours] / t[theirs]:.2f}")
    result("DP step time by layout (slowest rank)", "ms", {name: round(t[name] * 1e3, 1) for name in names})
    return 0


if __name__ == "__main__":
    sys.exit(main())
