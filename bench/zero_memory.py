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
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshplan.examples.models.llama import build, example_inputs
from meshplan.runtime.launch import spawn
from meshplan.runtime.zero import Zero, ZeroConfig, shard_for_zero

WORLD = 2
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
        config = ZeroConfig(stage=max(stage, 1), bucket_bytes=args.bucket_mib * 2**20)
        group = solo if stage == 0 else dist.group.WORLD
        zero = shard_for_zero(model, group, config, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
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
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--bucket-mib", type=int, default=1)
    args = parser.parse_args()
    rows = spawn(worker, WORLD, (args,), timeout_s=600)[0]  # rank 0; rank 1 holds the same up to padding
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
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
