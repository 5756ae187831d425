"""Per-rank memory while saving and loading a checkpoint: meshplan ZeRO-3 vs FSDP2 (sharded and full state dicts).

    python bench/save_memory.py [--world 4] [--layers 8] [--hidden 512]

Model: the example Llama, fp32, one optimizer step done (AdamW's moments exist), gloo on CPU.
Each layout runs in fresh processes:

    meshplan   `zero = 3` over dp (compiled program, `Zero` engine); `runtime.checkpoint.save`/`load`
    fsdp2      `fully_shard` per layer and root; `dcp.save`/`dcp.load` of `get_state_dict`
               (DTensor shards: PyTorch's sharded checkpoint, the baseline)
    fsdp2-full the same model; `get_state_dict(full_state_dict=True, cpu_offload=True)` and
               `torch.save` on rank 0 (a consolidated file: what gathering to save costs; its
               load is not measured)

Measured per rank: `state`, the bytes of training state the rank holds (its shards of the fp32
parameters and both moments); `save` and `load`, how far the process's resident memory rose
above where it stood before the call (the peak, VmHWM reset through /proc/self/clear_refs,
minus VmRSS before; freed heap memory is first returned to the OS with `malloc_trim`, so
memory reused by the call counts). `peak / state` = (state + save) / state: the issue's goal is at most 1.2.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import resident_rise, result, sized_llama
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl.check import check_text
from meshplan.examples.models.llama import example_inputs
from meshplan.runtime import checkpoint
from meshplan.runtime.launch import spawn
from meshplan.runtime.mesh import init_mesh
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import ZeroOptions, shard_for_zero

LAYOUTS = ("meshplan", "fsdp2", "fsdp2-full")
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}
# ZeRO's AdamW (its eps, 1e-8, is the default)
SETTINGS = TrainConfig(lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"])
BATCH, SEQ = 2, 32


def _meshplan(model: torch.nn.Module, world: int, folder: str) -> dict[str, int]:
    plan = check_text(
        f"mesh dp={world}\ndata_parallel over dp {{\n    zero = 3\n}}\n", "bench.plan", world_size=world
    )
    source = ModelSource(spec="llama", model=model, args=example_inputs(BATCH, SEQ))
    compiled = compile_plan(plan, source, world_size=world)
    program = build_rank_program(compiled, model, dist.get_rank(), init_mesh(compiled.layout))
    zero = shard_for_zero(program, dist.group.WORLD, ZeroOptions(stage=3))
    zero.optimizer(SETTINGS)
    ids, labels = example_inputs(BATCH, SEQ, seed=dist.get_rank())
    program(*bind_inputs(model, compiled.graph, (ids, labels), {}))[0].backward()
    zero.step()
    zero.zero_grad()
    state = sum(e.data.nbytes for held in zero.own_elements().values() for e in held.values())
    save = resident_rise(lambda: checkpoint.save(folder, 1, zero))
    load = resident_rise(lambda: checkpoint.load(checkpoint.latest(folder), zero))
    return {"state": state, "save": save, "load": load}


def _fsdp2(model: torch.nn.Module, world: int, folder: str, *, full: bool) -> dict[str, int]:
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    ids, labels = example_inputs(BATCH, SEQ, seed=dist.get_rank())
    model(ids, labels).backward()
    opt.step()
    opt.zero_grad()
    state = sum(p.to_local().nbytes for p in model.parameters())
    state += sum(t.to_local().nbytes for s in opt.state.values() for k, t in s.items() if k != "step")
    path = Path(folder) / "full.pt"

    def save() -> None:
        if full:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_sd, optim_sd = get_state_dict(model, opt, options=options)
            if dist.get_rank() == 0:
                torch.save({"model": model_sd, "optim": optim_sd}, path)
        else:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)

    def load() -> None:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)

    if full:  # loading a consolidated file back into shards is not measured
        return {"state": state, "save": resident_rise(save), "load": -1}  # -1: not measured
    return {"state": state, "save": resident_rise(save), "load": resident_rise(load)}


def worker(rank: int, world: int, layout: str, args: argparse.Namespace, folder: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = sized_llama(args.layers, args.hidden)
    if layout == "meshplan":
        return _meshplan(model, world, folder)
    return _fsdp2(model, world, folder, full=layout == "fsdp2-full")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    mib = 2**20
    rows = {}
    for layout in LAYOUTS:
        with tempfile.TemporaryDirectory(prefix="meshplan-save-") as folder:
            rows[layout] = spawn(worker, args.world, (layout, args, folder), timeout_s=900)
    print(f"Llama fp32, {args.layers} layers, H={args.hidden}, AdamW, {args.world} gloo ranks (CPU)\n")
    print(
        f"{'layout':<11} {'rank':>4} {'state MiB':>10} {'save MiB':>9} {'load MiB':>9} {'peak / state':>13}"
    )
    worst: dict[str, float] = {}
    for layout, by_rank in rows.items():
        for rank, r in enumerate(by_rank):
            peak = (r["state"] + r["save"]) / r["state"]
            worst[layout] = max(worst.get(layout, 0.0), peak)
            print(
                f"{layout:<11} {rank:>4} {r['state'] / mib:>10.1f} {r['save'] / mib:>9.1f} "
                f"{r['load'] / mib if r['load'] >= 0 else float('nan'):>9.1f} {peak:>13.2f}"
            )
    print()
    for layout in LAYOUTS:
        print(f"{layout}: peak save memory / shard bytes, worst rank = {worst[layout]:.2f}  (goal <= 1.2)")
    save = {layout: max(r["save"] for r in by_rank) for layout, by_rank in rows.items()}
    print(f"save memory meshplan / fsdp2 (worst ranks) = {save['meshplan'] / max(save['fsdp2'], 1):.2f}")
    print(
        f"save memory meshplan / fsdp2-full (worst ranks) = {save['meshplan'] / max(save['fsdp2-full'], 1):.2f}"
    )
    result(
        "memory rise while saving, worst rank",
        "MiB",
        {layout: round(value / mib, 1) for layout, value in save.items()},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
