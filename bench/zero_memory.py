"""Per-rank parameter + gradient + optimizer bytes under ZeRO 0-3, measured vs analytical.

    python bench/zero_memory.py [--layers 32] [--hidden 192] [--bucket-mib 1]

Model: the example Llama in bf16 (default 32 layers, H=192, I=516, V=256, GQA 4/2 heads,
about 13M params), inputs B=2, S=32 per rank, AdamW with an fp32 master copy, on 2 gloo
ranks. Analytical bytes per parameter (SPEC): 2 bf16 weight + 2 bf16 grad + 12 optimizer
(4 fp32 master + 4 m + 4 v) = 16, divided over N ranks as ZeRO divides it:

    stage 0   2 + 2 + 12          stage 2   2 + (2 + 12)/N
    stage 1   2 + 2 + 12/N        stage 3   (2 + 2 + 12)/N

Measured: `Zero.memory()` (the live storages of params, grads, in-flight gradient buckets,
fp32 masters, m and v) sampled at every layer's forward entry and exit, before every
parameter's gradient is reduced, before every layer's backward and after the step; `peak`
is the largest sum seen, `steady` the value after the step. Stage 0 is `Zero` stage 1 over
a one-rank group (nothing sharded, same code and dtypes). The peak includes what the
stage really needs beyond the analytical value: a gradient bucket in flight (stages 1-2,
`--bucket-mib`), and for stage 3 the gathered layers (the root's embedding, norm and head,
the current layer and the prefetched next one) and a layer's full gradients before they
are reduced.

Then the same model compiled from `data_parallel over dp { zero = 3 }` (what `meshplan run`
trains): the most parameter bytes gathered at once during a step (`Zero.peak_gathered`),
as a fraction of the whole model, once with the compiler's per-layer gather/release nodes
and, for comparison, on the same flat program without them (one unit: everything gathered).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist
from common import result
from torch import nn

from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl.check import check_text
from meshplan.examples.models.llama import build, example_inputs
from meshplan.runtime.launch import spawn
from meshplan.runtime.mesh import init_mesh
from meshplan.runtime.train import TrainConfig
from meshplan.runtime.zero import Zero, ZeroOptions, shard_for_zero

WORLD = 2
SETTINGS = TrainConfig(lr=1e-4, weight_decay=0.1)  # AdamW, betas (0.9, 0.95), eps 1e-8
BYTES_PER_PARAM = {"weight": 2, "grad": 2, "optimizer": 12}


def analytical(num_params: int, stage: int, world: int) -> float:
    weight, grad, opt = (BYTES_PER_PARAM[k] * num_params for k in ("weight", "grad", "optimizer"))
    if stage >= 1:
        opt /= world
    if stage >= 2:
        grad /= world
    if stage >= 3:
        weight /= world
    return weight + grad + opt


class PeakSampler:
    """Samples `zero.memory()` from hooks at the points where a stage holds the most."""

    def __init__(self, model: nn.Module) -> None:
        self.zero: Zero | None = None
        self.peak: dict[str, int] = {"total": 0}
        # Before Zero's hooks exist, so this one runs first: full grads not yet reduced.
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.sample())

    def attach(self, zero: Zero, layers: nn.ModuleList) -> None:
        self.zero = zero
        for layer in layers:
            layer.register_forward_pre_hook(lambda m, a: self.sample())  # after Zero's gather
            layer.register_forward_hook(lambda m, a, o: self.sample(), prepend=True)  # before its free
            layer.register_forward_hook(self._hook_backward_entry)  # after Zero's pre-backward hook

    def _hook_backward_entry(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda g: self.sample())

    def sample(self) -> None:
        if self.zero is None:
            return
        now = self.zero.memory()
        if now["total"] > self.peak["total"]:
            self.peak = now


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    overrides = {
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "intermediate_size": int(args.hidden * 2.6875),  # Llama-7B's 11008/4096: 516 for 192
    }
    solo = [dist.new_group([r]) for r in range(world)][rank]  # stage 0: a group of one rank
    rows = []
    for stage in (0, 1, 2, 3):
        model = build(**overrides).to(torch.bfloat16)
        num_params = sum(p.numel() for p in model.parameters())
        sampler = PeakSampler(model)
        options = ZeroOptions(stage=max(stage, 1), bucket_bytes=args.bucket_mib * 2**20)
        group = solo if stage == 0 else dist.group.WORLD
        zero = shard_for_zero(model, group, options)
        zero.optimizer(SETTINGS)
        sampler.attach(zero, model.layers)
        for step in range(2):
            ids, labels = example_inputs(2, 32, seed=world * step + rank)
            model(ids, labels).backward()
            zero.step()
            sampler.sample()
            steady = zero.memory()
            zero.zero_grad()
        rows.append(
            {
                "stage": stage,
                "num_params": num_params,
                "peak": sampler.peak,
                "steady": steady,
                "analytical": analytical(num_params, stage, world),
            }
        )
        zero.remove_hooks()
    for per_layer in (True, False):
        rows.append(compiled_peak(rank, world, overrides, per_layer))
    return rows


def compiled_peak(rank: int, world: int, overrides: dict, per_layer: bool) -> dict[str, Any]:
    """One ZeRO-3 step of the compiled program: the peak of gathered parameter bytes."""
    model = build(**overrides).to(torch.bfloat16)
    plan = check_text(f"mesh dp={world}\ndata_parallel over dp {{\n    zero = 3\n}}\n", world_size=world)
    source = ModelSource(spec="llama", model=model, args=example_inputs(2, 32))
    compiled = compile_plan(plan, source, world_size=world)
    program = build_rank_program(compiled, model, rank, init_mesh(compiled.layout))
    # units=[] ignores the graph's nodes: the whole program is one unit (the root)
    zero = shard_for_zero(program, dist.group.WORLD, ZeroOptions(stage=3), units=None if per_layer else [])
    zero.optimizer(SETTINGS)
    for step in range(2):
        ids, labels = example_inputs(2, 32, seed=world * step + rank)
        program(*bind_inputs(model, compiled.graph, (ids, labels), {}))[0].backward()
        zero.step()
        zero.zero_grad()
    whole = sum(f.full_nbytes() for f in zero.flats)
    return {"stage": "3c" if per_layer else "3c-flat", "peak_gathered": zero.peak_gathered, "whole": whole}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--bucket-mib", type=int, default=1)
    args = parser.parse_args()
    rows = spawn(worker, WORLD, (args,), timeout_s=600)[0]  # rank 0; rank 1 holds the same up to padding
    compiled = [r for r in rows if "peak_gathered" in r]
    rows = [r for r in rows if "peak_gathered" not in r]
    mib = 2**20
    print(
        f"Llama bf16, {rows[0]['num_params'] / 1e6:.2f}M params, {WORLD} gloo ranks, bytes per rank (MiB)\n"
    )
    header = (
        f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'peak':>8} {'steady':>8}"
        f" {'analytic':>9} {'peak/an':>8} {'steady/an':>9}"
    )
    print(header)
    worst = 0.0
    for r in rows:
        peak, steady, expected = r["peak"], r["steady"], r["analytical"]
        worst = max(worst, abs(peak["total"] / expected - 1))
        print(
            f"{r['stage']:>5} {peak['params'] / mib:>8.2f} {peak['grads'] / mib:>8.2f}"
            f" {peak['optimizer'] / mib:>8.2f} {peak['total'] / mib:>8.2f} {steady['total'] / mib:>8.2f}"
            f" {expected / mib:>9.2f} {peak['total'] / expected:>8.3f} {steady['total'] / expected:>9.3f}"
        )
    print(f"\nlargest |peak/analytical - 1|: {worst:.1%} (target 5%)")
    values = {f"zero {r['stage']}": round(r["peak"]["total"] / mib, 2) for r in rows}
    result("training state per rank, peak (params + grads + optimizer)", "MiB", values)
    print("\nZeRO-3 on the compiled program: most parameter bytes gathered at once / whole model")
    for r in compiled:
        how = "per-layer nodes" if r["stage"] == "3c" else "no nodes (one unit)"
        print(
            f"  {how:<20} {r['peak_gathered'] / mib:8.2f} MiB / {r['whole'] / mib:.2f} MiB = {r['peak_gathered'] / r['whole']:.3f}"
        )
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
