"""Activation memory kept for backward with checkpointing off, full, every 2nd block, selective.

    python bench/checkpoint_memory.py [--layers 8] [--hidden 256] [--batch 4] [--seq 256]

Model: the example Llama (GQA 8/4 heads, I = 8/3 H rounded), fp32, one process, CPU.
Each plan is `layers.*: <rule>` compiled by meshplan (its checkpoint pass,
`compiler/passes/checkpoint.py`, outlines the regions). Measured after the forward, before backward:

- kept: bytes of every storage made during forward that is still alive (what autograd
  keeps for backward: saved activations, the selective cache, checkpoint inputs), seen
  by a TorchDispatchMode holding weak references. Parameters and inputs are not counted.
- hooks: bytes of distinct storages packed through `saved_tensors_hooks` at the top
  level. Checkpointing packs its region's saves with its own hooks, and selective mode
  caches matmul outputs outside them, so this column under-counts checkpointed runs; it
  is shown because it is the usual quick measure, and why it misleads.
- step: forward + backward wall time (median of 3), the price of recomputation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import LiveStorages, sized_llama

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl import check_text
from meshplan.examples.models.llama import example_inputs

RULES = (None, "checkpoint", "checkpoint every 2", "checkpoint selective")


def program_for(rule: str | None, source: ModelSource):
    text = f"mesh dp=1\n\nmodules {{\n    layers.*: {rule}\n}}\n" if rule else "mesh dp=1\n"
    # compiling runs the checkpoint pass: the regions come outlined
    compiled = compile_plan(check_text(text, "bench.plan"), source)
    return build_rank_program(compiled, source.model, 0)


def measure(program, args) -> tuple[int, int, float]:
    params = {p.untyped_storage()._cdata for p in program.parameters()}
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s._cdata not in params:
            packed.setdefault(s._cdata, s.nbytes())
        return t

    watch = LiveStorages(program)
    with watch, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (loss,) = program(*args)
    kept = watch.live_bytes()
    loss.backward()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        (loss,) = program(*args)
        loss.backward()
        times.append(time.perf_counter() - start)
    return kept, sum(packed.values()), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    a = parser.parse_args()
    torch.manual_seed(0)
    model = sized_llama(a.layers, a.hidden, max_position_embeddings=a.seq)
    args = example_inputs(a.batch, a.seq)
    source = ModelSource("llama", model, args, {})
    params = sum(p.numel() for p in model.parameters())
    print(f"Llama L={a.layers} H={a.hidden} ({params / 1e6:.1f}M params), B={a.batch} S={a.seq}, fp32, CPU")
    print(f"{'layers.*:':<22} {'kept MiB':>9} {'vs off':>7} {'hooks MiB':>10} {'step s':>7} {'vs off':>7}")
    base = None
    for rule in RULES:
        kept, hooked, step = measure(program_for(rule, source), args)
        base = base or (kept, step)
        print(
            f"{rule or 'off':<22} {kept / 2**20:>9.2f} {kept / base[0]:>7.2f} "
            f"{hooked / 2**20:>10.2f} {step:>7.3f} {step / base[1]:>7.2f}"
        )


if __name__ == "__main__":
    main()
