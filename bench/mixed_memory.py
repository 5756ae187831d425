"""ZeRO-3 under bf16 compute: memory of a training step and gather bytes, vs FSDP2's mixed precision.

    python bench/mixed_memory.py [--layers 8] [--hidden 512] [--steps 3]

Model: the example Llama with fp32 parameters, bf16 compute, AdamW, B=2 S=48 per rank, 2 gloo
ranks (CPU). Two layouts, each in fresh processes:

    meshplan  `compute = bf16` and `zero = 3` over dp: the compiled program, as `meshplan run` runs it
    fsdp2     `fully_shard` per layer and root with MixedPrecisionPolicy(param_dtype=bf16,
              reduce_dtype=fp32): PyTorch's equivalent, the baseline

Measured per rank, after warm-up steps: `step`, how far resident memory rose above where it
stood before one forward + backward + optimizer step (`common.resident_rise`: the peak, freed
heap memory returned to the OS first); `kept`, the bytes of bf16 copies of weights autograd
holds for backward after a forward (saved tensors with a weight's shape that are not in a
gathered buffer: 0 when gathers land in the compute dtype, 2 bytes per parameter when each use
casts an fp32 weight). meshplan's all-gather bytes per step are the compiler's ledger, checked
against what its engine issued, beside what the same gathers would move in fp32.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import resident_rise, result, sized_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl.check import check_text
from meshplan.examples.models.llama import example_inputs
from meshplan.runtime.launch import spawn
from meshplan.runtime.mesh import init_mesh
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import ZeroOptions, shard_for_zero

WORLD, BATCH, SEQ = 2, 2, 48  # 96 tokens: no activation has a weight's shape
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}
# ZeRO's AdamW (its eps, 1e-8, is the default)
SETTINGS = TrainConfig(lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"])
PLAN = "mesh dp=2\n\nprecision {\n    compute = bf16\n}\n\ndata_parallel over dp {\n    zero = 3\n}\n"


def kept_copies(forward, params: list[torch.Tensor], buffers: set[int]) -> int:
    """Bytes of bf16 tensors shaped like a weight that one forward leaves saved for backward,
    outside the gathered buffers (`buffers`: storages by `_cdata`)."""
    shapes = {tuple(p.shape) for p in params if p.dim() == 2}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes and storage._cdata not in buffers:
            kept[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    return sum(kept.values())


def worker(rank: int, world: int, layout: str, args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    model = sized_llama(args.layers, args.hidden)
    ids, labels = example_inputs(BATCH, SEQ, seed=rank)
    out: dict[str, float] = {}
    if layout == "meshplan":
        plan = check_text(PLAN, "bench.plan", world_size=world)
        source = ModelSource(spec="llama", model=model, args=example_inputs(BATCH, SEQ))
        compiled = compile_plan(plan, source, world_size=world)
        program = build_rank_program(compiled, model, rank, init_mesh(compiled.layout))
        zero = shard_for_zero(program, dist.group.WORLD, ZeroOptions(stage=3))
        zero.optimizer(SETTINGS)
        params = list(program.parameters())
        buffers = {f.low.untyped_storage()._cdata for f in zero.flats if f.low is not None}

        def forward() -> torch.Tensor:
            return program(*bind_inputs(model, compiled.graph, (ids, labels), {}))[0]

        step, zero_grad = zero.step, zero.zero_grad
        gathers = [r for r in compiled.ledger.rows if r.kind == "zero_gather" and r.op == "all_gather"]
        out["ledger_gather_bytes"] = sum(r.bytes * r.count for r in gathers)
        out["fp32_gather_bytes"] = sum(4 * int(r.shape[0]) * r.count for r in gathers)
    else:
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        params, buffers = [p.to_local() for p in model.parameters()], set()

        def forward() -> torch.Tensor:
            return model(ids, labels)

        step, zero_grad = opt.step, opt.zero_grad

    def one_step() -> None:
        forward().backward()
        step()
        zero_grad()

    for _ in range(args.steps):  # warm-up: optimizer state, allocator
        one_step()
    out["step"] = resident_rise(one_step)
    out["kept"] = kept_copies(forward, params, buffers)
    zero_grad()
    if layout == "meshplan":
        issued = sum(c.bytes * c.count for c in zero.issued() if c.op == "all_gather")
        out["issued_gather_bytes"] = issued
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    mib = 2**20
    rows = {layout: spawn(worker, WORLD, (layout, args), timeout_s=900) for layout in ("meshplan", "fsdp2")}
    print(f"Llama fp32 params, bf16 compute, {args.layers} layers, H={args.hidden}, {WORLD} gloo ranks\n")
    print(f"{'layout':<9} {'rank':>4} {'step MiB':>9} {'kept MiB':>9}")
    for layout, by_rank in rows.items():
        for rank, r in enumerate(by_rank):
            print(f"{layout:<9} {rank:>4} {r['step'] / mib:>9.1f} {r['kept'] / mib:>9.2f}")
    worst = {layout: max(r["step"] for r in by_rank) for layout, by_rank in rows.items()}
    print()
    print(f"step memory meshplan / fsdp2 (worst ranks) = {worst['meshplan'] / worst['fsdp2']:.2f}")
    mesh = rows["meshplan"][0]
    print(
        f"meshplan all-gather bytes per step: {mesh['ledger_gather_bytes'] / mib:.2f} MiB in the ledger, "
        f"{mesh['issued_gather_bytes'] / mib:.2f} MiB issued; in fp32 they would be {mesh['fp32_gather_bytes'] / mib:.2f}"
    )
    result(
        "memory rise in a ZeRO-3 bf16 step, worst rank",
        "MiB",
        {k: round(v / mib, 1) for k, v in worst.items()},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
