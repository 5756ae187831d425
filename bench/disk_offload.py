"""Optimizer state offloaded to disk (`offload = optimizer:disk`) vs to host memory (`offload =
optimizer`), and ZeRO-3's parameter shards on disk (`params:disk`) vs in host memory (`params`):
host bytes per rank, and step time, on this machine's disk.

    python bench/disk_offload.py [--layers 8] [--hidden 512] [--bucket-mib 8] [--steps 5] [--dir DIR]

Model: the example Llama in fp32 (default 8 layers, H=512, I=1376, V=256, about 25M params),
inputs B=2, S=64 per rank, AdamW, ZeRO-1 over 2 gloo ranks with the optimizer offloaded, both
runs from the same weights on the same batches (their losses must be equal: the same
arithmetic). Per rank:

- host state between steps: the optimizer's live storages after a step (`Zero.memory()`):
  every master and moment for `optimizer`, only the step counters for `optimizer:disk`;
- host state during a step: for `optimizer:disk`, the most flats in memory at once
  (`DiskState.peak_resident`, goal: at most 2) times the largest flat's master and moments;
- the step time (forward, backward, optimizer step; median of `--steps` after a warm-up), and the
  optimizer step alone, as ratios of disk over host memory.

Then ZeRO-3 (one unit a layer) with the parameter shards in host memory or in files, twice:
with the optimizer's state on disk (`optimizer:disk, params` vs `optimizer:disk, params:disk`)
and in host memory (`optimizer, params` vs `optimizer, params:disk`). Per rank: the parameter
shards' host bytes between steps (`Flat.shard`'s storages), the most at once during forward
and backward (`ParamFiles.gathers_peak_bytes`, goal: two units' worth) and during the whole
step (`peak_bytes`: with the optimizer's state in memory the step reads every shard), and the
step time as a ratio of files over host memory; the losses of each pair must be equal.

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
# flats in memory during a step: the one stepping, and the next being read or the last being written
RESIDENT_GOAL = 2
UNITS_GOAL = 2  # ZeRO-3 units' parameter shards in memory in forward and backward


def run(
    rank: int, args: argparse.Namespace, folder: Path | None, *, params: Path | None = None, stage: int = 1
) -> dict:
    """One run of `args.steps` measured steps (after one warm-up) with the state in memory
    (`folder` None) or in files under it; at `stage` 3 the parameter shards offloaded, to host
    memory (`params` None) or in files under `params`."""
    model = build(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16
    )
    options = ZeroOptions(
        stage=stage,
        bucket_bytes=args.bucket_mib * 2**20,
        offload_optimizer=True,
        offload_dir=folder,
        offload_params=stage == 3,
        params_dir=params,
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
    files = zero._files
    shards = sum(f.shard.numel() * f.shard.element_size() for f in zero.flats)
    units = [sum(f.shard_numel * f.dtype.itemsize for f in u.flats) for u in zero.units]
    return {
        "shards_between": shards,
        "shards_gathers": shards if files is None else files.gathers_peak_bytes,
        "shards_step": shards if files is None else files.peak_bytes,
        "shards_all": sum(f.shard_numel * f.dtype.itemsize for f in zero.flats),
        "unit": max(units, default=0),
        "units": len(units),
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


ZERO3 = {  # name -> (the optimizer's state on disk, the parameter shards on disk)
    "optimizer:disk, params": (True, False),
    "optimizer:disk, params:disk": (True, True),
    "optimizer, params": (False, False),
    "optimizer, params:disk": (False, True),
}


def worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict:
    torch.set_num_threads(1)
    out = {"optimizer": run(rank, args, None), "optimizer:disk": run(rank, args, Path(root) / "zero1")}
    for name, (state, shards) in ZERO3.items():
        folder = Path(root) / name.replace(", ", "+").replace(":", "-")
        out[name] = run(rank, args, folder if state else None, params=folder if shards else None, stage=3)
    return out


def zero3_table(by_rank: list[dict]) -> bool:
    """Print the ZeRO-3 rows; whether each pair's losses are equal and the shards' peak in
    forward and backward is within `UNITS_GOAL` units."""
    mib, first = 2**20, by_rank[0]
    print(
        f"\nZeRO-3, {first['optimizer, params']['units']} units, the largest "
        f"{first['optimizer, params']['unit'] / mib:.2f} MiB of shards a rank; parameter shards in host memory:"
    )
    print(f"{'offload':<30}{'between steps':>15}{'fwd/bwd peak':>15}{'step peak':>12}{'step':>10}")
    for name in ZERO3:
        r = first[name]
        print(
            f"{name:<30}{r['shards_between'] / mib:>11.2f} MiB{r['shards_gathers'] / mib:>11.2f} MiB"
            f"{r['shards_step'] / mib:>8.2f} MiB{r['step'] * 1e3:>7.0f} ms"
        )
    ok = True
    for state in ("optimizer:disk", "optimizer"):
        memory, disk = first[f"{state}, params"], first[f"{state}, params:disk"]
        same = all(r[f"{state}, params"]["losses"] == r[f"{state}, params:disk"]["losses"] for r in by_rank)
        peak = max(r[f"{state}, params:disk"]["shards_gathers"] for r in by_rank)
        units = peak / max(disk["unit"], 1)
        ok = ok and same and units <= UNITS_GOAL
        print(
            f"{state}: losses equal to the bit: {same}; shards in forward/backward / in memory: "
            f"{peak / memory['shards_all']:.3f} ({units:.2f} units, goal <= {UNITS_GOAL}); "
            f"step time ratio params:disk / params: {disk['step'] / memory['step']:.2f}"
        )
    both = first["optimizer:disk, params:disk"]
    result(
        "host parameter shards per rank, ZeRO-3",
        "MiB",
        {
            "params (between/during)": first["optimizer:disk, params"]["shards_all"] / mib,
            "params:disk between steps": both["shards_between"] / mib,
            "params:disk forward/backward": both["shards_gathers"] / mib,
            "params:disk step (optimizer:disk)": both["shards_step"] / mib,
        },
    )
    return ok


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
    zero3_ok = zero3_table(by_rank)
    return 0 if same and peak <= RESIDENT_GOAL and zero3_ok else 1


if __name__ == "__main__":
    sys.exit(main())
