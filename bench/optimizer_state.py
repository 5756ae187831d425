"""Optimizer state bytes per rank for each optimizer a plan can choose, measured vs the formula.

    python bench/optimizer_state.py [--layers 8] [--hidden 192]

Model: the example Llama in fp32 (default 8 layers, H=192, I=516, V=256), one step on B=2, S=32
per rank. Layouts: dp=1 (`Local`: the optimizer over whole parameters) and dp=2 on gloo with
ZeRO-1 (`Zero`: the optimizer over each rank's fp32 shard of the flats; Adafactor over each
parameter's piece of them, its row and column moments whole on both ranks).

Measured: `GradSync.memory()["optimizer"]` right after the step, the live storages of the
optimizer's state as the engine holds them (rank 0; rank 1 differs by the flats' padding).
Formula: `meshplan estimate`'s arithmetic (`compiler.estimate.state_of` with the plan's
optimizer, `compiler/optimizer_state.py`): per parameter, AdamW 2 x 4 B + a 4 B step counter
per tensor, SGD with momentum 4 B (0 without), Lion 4 B, Adafactor (rows + cols) x 4 B per
matrix and 4 B per vector element, + a step counter; under ZeRO-1 the elementwise state of each
flat's shard (1/2 here), a step counter per flat, and Adafactor's whole rows and columns of every
matrix, a vector's elements / 2 and a step counter per parameter. The ratio column is each
optimizer's measured bytes over AdamW's at the same dp size. The script exits 1 if any
measurement is off the formula by a byte, except Adafactor under ZeRO, whose formula divides each
vector's moment evenly over the ranks where ZeRO's element ranges cut it anywhere: its rank 0
may differ by 4 B per vector (the sum over the ranks is exact, and checked).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist
from common import result

from meshplan.compiler.estimate import state_of
from meshplan.dsl.optimizer import OptimizerSpec
from meshplan.examples.models.llama import build, example_inputs
from meshplan.grammar import OPTIMIZERS
from meshplan.runtime.buckets import decays
from meshplan.runtime.grad_sync import GradSync, Local
from meshplan.runtime.launch import spawn
from meshplan.runtime.optimizers import OptimizerChoice
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import ZeroOptions, shard_for_zero

WORLD = 2
BUCKET_BYTES = 2**20
CHOICES = {
    "adamw": {},
    "sgd": {"momentum": 0.9},
    "sgd (no momentum)": {"momentum": 0.0},
    "lion": {},
    "adafactor": {},
}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    return build(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=516)


def _measure(model: torch.nn.Module, sync: GradSync, choice: OptimizerChoice, rank: int, world: int) -> int:
    """The optimizer bytes `sync` holds after one step of `choice` on this rank's batch."""
    optimizer = sync.optimizer(TrainConfig(lr=1e-4, weight_decay=0.1, optimizer=choice))
    ids, labels = example_inputs(2 * world, 32, seed=0)
    mine = slice(2 * rank, 2 * rank + 2)
    model(ids[mine], labels[mine]).backward()
    sync.finish()
    optimizer.step()
    optimizer.zero_grad()
    return sync.memory()["optimizer"]


def _formula(model: torch.nn.Module, kind: str, args: dict[str, float], zero: int, world: int) -> int:
    spec = OptimizerSpec(kind, OPTIMIZERS[kind] | args)
    params = dict(model.named_parameters())
    engine = "zero" if zero else "none"
    return state_of(
        params,
        zero=zero,
        group_size=lambda n: world,
        engine=engine,
        bucket_bytes=BUCKET_BYTES,
        optimizer=spec,
    ).optimizer


def _vector_slack(model: torch.nn.Module, world: int) -> int:
    """How much `world` ranks' formulas overcount vectors' moments together: each rounds up."""
    return sum(4 * (-(-p.numel() // world) * world - p.numel()) for p in model.parameters() if p.dim() < 2)


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for label, hyper in CHOICES.items():
        kind = label.split()[0]
        choice = OptimizerChoice(kind, hyper)
        model = _model(args)
        options = ZeroOptions(stage=1, bucket_bytes=BUCKET_BYTES, decay=decays)
        sync: GradSync = shard_for_zero(model, dist.group.WORLD, options)
        measured = _measure(model, sync, choice, rank, world)
        total = torch.tensor(measured)
        dist.all_reduce(total)
        row = {"optimizer": label, "layout": f"dp={world} ZeRO-1", "measured": measured}
        row["formula"] = _formula(model, kind, hyper, 1, world)
        row["slack"] = 4 * sum(p.dim() < 2 for p in model.parameters()) if kind == "adafactor" else 0
        row["sum_ok"] = kind != "adafactor" or int(total) == world * row["formula"] - _vector_slack(
            model, world
        )
        rows.append(row)
        if rank == 0:  # dp=1 in the same process, outside the group
            model = _model(args)
            rows.append(
                {
                    "optimizer": label,
                    "layout": "dp=1",
                    "measured": _measure(model, Local(model), choice, 0, 1),
                    "formula": _formula(model, kind, hyper, 0, 1),
                    "num_params": sum(p.numel() for p in model.parameters()),
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=192)
    args = parser.parse_args()
    rows = spawn(worker, WORLD, (args,), timeout_s=600)[0]
    num_params = next(r["num_params"] for r in rows if "num_params" in r)
    print(f"Llama fp32, {num_params / 1e6:.2f}M params; optimizer state bytes per rank after one step\n")
    adamw = {r["layout"].split()[0]: r["measured"] for r in rows if r["optimizer"] == "adamw"}
    print(f"{'optimizer':<18} {'layout':<16} {'measured':>12} {'formula':>12} {'B/param':>8} {'/ AdamW':>8}")
    off, sums_ok = 0, True
    for r in rows:
        off = max(off, abs(r["measured"] - r["formula"]) - r.get("slack", 0))
        sums_ok = sums_ok and r.get("sum_ok", True)
        ratio = r["measured"] / adamw[r["layout"].split()[0]]
        print(
            f"{r['optimizer']:<18} {r['layout']:<16} {r['measured']:>12,} {r['formula']:>12,}"
            f" {r['measured'] / num_params:>8.3f} {ratio:>8.3f}"
        )
    print(f"\nlargest |measured - formula|: {off} bytes (target 0; Adafactor under ZeRO: past 4 B a vector)")
    print(
        f"Adafactor under ZeRO, the ranks' bytes together: {'the formula' if sums_ok else 'OFF the formula'}"
    )
    values = {f"{r['optimizer']}, {r['layout']}": round(r["measured"] / 2**20, 3) for r in rows}
    result("optimizer state per rank", "MiB", values)
    return 0 if off == 0 and sums_ok else 1


if __name__ == "__main__":
    sys.exit(main())
