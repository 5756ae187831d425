"""Optimizer state offloaded to disk (`offload = optimizer:disk`) vs to host memory (`offload =
optimizer`): host bytes of optimizer state per rank, and step time, on this machine's disk.

    python bench/disk_offload.py [--layers 8] [--hidden 512] [--bucket-mib 8] [--steps 5] [--dir DIR]

Model: the example Llama in fp32 (default 8 layers, H=512, I=1376, V=256, about 25M params),
inputs B=2, S=64 per rank, AdamW, ZeRO-1 over 2 gloo ranks with the optimizer offloaded, both
runs from the same weights on the same batches (their losses must be equal: the same
arithmetic). Per rank:

- host state between steps: the optimizer's live storages after a step (`Zero.memory()`):
  every master and moment for `optimizer`, only the step counters for `optimizer:disk`;
- host state during a step: for `optimizer:disk`, the most flats in memory at once
  (`DiskState.peak_resident`, goal: at most 3) times the largest flat's master and moments;
- the step time (forward, backward, optimizer step; median of `--steps` after a warm-up), and the
  optimizer step alone, as ratios of disk over host memory.

The files are written under `--dir` (default: a temporary folder in the system's), so what the
reads cost depends on that disk and on the page cache (a file written a step ago is usually still
cached: a model larger than the free memory is where the disk itself is read).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import result

from meshplan.examples.models.llama import build, example_inputs
from meshplan.runtime.disk_offload import state_bytes
from meshplan.runtime.launch import spawn
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import ZeroOptions, shard_for_zero

WORLD = 2
SETTINGS = TrainConfig(lr=1e-4, weight_decay=0.1)
BATCH, SEQ = 2, 64
RESIDENT_GOAL = 3  # flats in memory during a step: stepping, being read, being written


def run(rank: int, args: argparse.Namespace, folder: Path | None) -> dict:
    """One run of `args.steps` measured steps (after one warm-up) with the state in memory
    (`folder` None) or in files under it."""
    model = build(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16
    )
    options = ZeroOptions(
        stage=1, bucket_bytes=args.bucket_mib * 2**20, offload_optimizer=True, offload_dir=folder
    )
    zero = shard_for_zero(model, dist.group.WORLD, options).optimizer(SETTINGS)
    steps, optimizer_steps, losses = [], [], []
    for step in range(args.steps + 1):
        ids, labels = example_inputs(WORLD * BATCH, SEQ, seed=step)
        dist.barrier()
        start = time.perf_counter()
        loss = model(ids[rank * BATCH : (rank + 1) * BATCH], labels[rank * BATCH : (rank + 1) * BATCH])
        loss.backward()
        before_step = time.perf_counter()
        zero.step()
        end = time.perf_counter()
        zero.zero_grad()
        losses.append(loss.item())
        if step > 0:  # the first step builds the fused kernels' and the files' first reads
            steps.append(end - start)
            optimizer_steps.append(end - before_step)
    disk = zero.optim.disk
    largest = max(state_bytes(f.local_numel, 2) for f in zero.flats)
    between = zero.memory()["optimizer"]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "flats": len(zero.flats),
        "between": between,
        "during": between if disk is None else disk.peak_resident * largest,
        "peak_flats": None if disk is None else disk.peak_resident,
        "on_disk": sum(state_bytes(f.local_numel, 2) for f in zero.flats),
        "step": statistics.median(steps),
        "optimizer_step": statistics.median(optimizer_steps),
        "losses": losses,
    }


def worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict:
    torch.set_num_threads(1)
    return {"optimizer": run(rank, args, None), "optimizer:disk": run(rank, args, Path(root))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--bucket-mib", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="meshplan-offload-") as root:
        by_rank = spawn(worker, WORLD, (args, root), timeout_s=600)
    memory, disk = by_rank[0]["optimizer"], by_rank[0]["optimizer:disk"]
    mib = 2**20
    print(
        f"Llama fp32, {memory['params'] / 1e6:.1f}M params, ZeRO-1 over {WORLD} gloo ranks, "
        f"{disk['flats']} flats per rank, files under {args.dir or tempfile.gettempdir()}\n"
    )
    print(
        f"{'offload':<16}{'between steps':>15}{'during a step':>15}{'on disk':>10}"
        f"{'step':>10}{'opt step':>10}"
    )
    for name, r in (("optimizer", memory), ("optimizer:disk", disk)):
        print(
            f"{name:<16}{r['between'] / mib:>11.2f} MiB{r['during'] / mib:>11.2f} MiB"
            f"{(r['on_disk'] if name.endswith('disk') else 0) / mib:>6.1f} MiB"
            f"{r['step'] * 1e3:>7.0f} ms{r['optimizer_step'] * 1e3:>7.0f} ms"
        )
    same = all(r["optimizer"]["losses"] == r["optimizer:disk"]["losses"] for r in by_rank)
    peak = max(r["optimizer:disk"]["peak_flats"] for r in by_rank)
    print(f"\nlosses equal to the bit: {same}")
    print(f"flats in memory during a step (goal <= {RESIDENT_GOAL}): {peak} of {disk['flats']}")
    print(f"host state during a step / in memory: {disk['during'] / memory['during']:.3f}")
    print(f"step time ratio disk / memory: {disk['step'] / memory['step']:.2f}")
    print(f"optimizer step ratio disk / memory: {disk['optimizer_step'] / memory['optimizer_step']:.2f}")
    result(
        "host optimizer state per rank",
        "MiB",
        {
            "optimizer (between/during)": memory["during"] / mib,
            "optimizer:disk between steps": disk["between"] / mib,
            "optimizer:disk during a step": disk["during"] / mib,
        },
    )
    return 0 if same and peak <= RESIDENT_GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
