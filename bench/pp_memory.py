"""Pipeline activation memory: the most bytes each rank keeps for backward during a step, 1F1B vs GPipe.

    python bench/pp_memory.py [--ranks 4] [--microbatches 8] [--quick]

Model: the example Llama in fp32, 8 layers, H=256, I=688, V=256, heads 8/4; microbatches of
B=2, T=128; p=4 gloo ranks, m=8 microbatches; equal layer counts per stage (2 layers, or 1
under the schedules with 2 stages per rank). Every schedule `runtime.schedules.build` knows
runs one step (forward and backward of the m microbatches) after one warm-up step; memory does
not depend on timing, so 4 processes on 2 cores measure it as well as 4 devices would.

Measured: the bytes of every storage made during the step and still alive, seen by a
TorchDispatchMode holding weak references (as `bench/checkpoint_memory.py` does), less the
parameters and their gradients (a view of a weight, `t(w)`, shows its storage): what autograd saved for backward, the received activations, the
outputs kept until their backward, the buffers of sends not yet complete. Sampled as each
action ends (`pp_common.ActionClock`); the peak over the step is printed per rank, with the
share of it that is send buffers (`PipelineStep` keeps each sent tensor until the end of the
step). Activations grow during a forward and shrink during a backward, so the peak is at the
end of a forward: a sample there sees it.

Expected: GPipe runs every forward before any backward, so each rank holds all m
microbatches' activations; 1F1B holds at most p - r on rank r (p on the first), so the
ratio 1F1B / GPipe on rank r is (p - r) / m.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from common import result
from pp_common import (
    SCHEDULES,
    ActionClock,
    built_schedules,
    compile_llama,
    equal_cuts,
    microbatches,
    new_step,
    rank_stages,
    zero_grads,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshplan.examples.models.llama import build
from meshplan.runtime.launch import spawn
from meshplan.runtime.schedules import Action

MODEL = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=128,
)
BATCH, SEQ = 2, 128


class LiveStorages(TorchDispatchMode):
    """Every storage an op makes while the mode is on, by weak reference."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.storages.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def live(self, leaving: set[int]) -> int:
        return sum(n for key, (ref, n) in self.storages.items() if not ref.expired() and key not in leaving)


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """{schedule: (peak live bytes, send buffers at that moment)} on this rank."""
    compiled = compile_llama(world, batch=BATCH, seq=SEQ, **MODEL)
    out = {}
    for name, schedule in built_schedules(world, opts.microbatches).items():
        model = build(**MODEL)
        stages = rank_stages(
            compiled, model, rank, schedule, equal_cuts(MODEL["num_hidden_layers"], schedule.stages)
        )
        step = new_step(stages, schedule, rank, world)
        params = [p for stage in stages.values() for p in stage.parameters()]
        watch = LiveStorages()
        peak = [0, 0]

        def sample(_: Action, step=step, params=params, watch=watch, peak=peak) -> None:
            grads = {p.grad.untyped_storage()._cdata for p in params if p.grad is not None}
            live = watch.live(grads | {p.untyped_storage()._cdata for p in params})
            if live > peak[0]:
                sends = {v.untyped_storage()._cdata: v.untyped_storage().nbytes() for _, v in step._pending}
                peak[:] = [live, sum(sends.values())]

        ActionClock(step, after=sample)
        for i in range(2):  # a warm-up step, then the measured one
            micro = microbatches(compiled, model, batch=BATCH, seq=SEQ, m=opts.microbatches, seed=i)
            zero_grads(stages)
            watch.storages.clear()
            peak[:] = [0, 0]
            dist.barrier()
            with watch:
                step.run(micro)
        out[name] = (peak[0], peak[1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="p=2, m=4")
    opts = parser.parse_args()
    if opts.quick:
        opts.ranks, opts.microbatches = 2, 4
    p, m = opts.ranks, opts.microbatches
    results = spawn(worker, p, (opts,), timeout_s=1200)
    names = [n for n, _ in SCHEDULES if n in results[0]]

    print(
        f"Llama fp32, {MODEL['num_hidden_layers']} layers, H={MODEL['hidden_size']}, V={MODEL['vocab_size']}; "
        f"microbatch B={BATCH} T={SEQ}; p={p} gloo ranks, m={m}; equal layers per stage\n"
    )
    print("peak bytes kept during a step (MiB), per rank; in brackets the send buffers among them")
    print(f"{'schedule':<14}" + "".join(f"{f'rank {r}':>18}" for r in range(p)))
    for name in names:
        cells = [f"{results[r][name][0] / 2**20:8.1f} [{results[r][name][1] / 2**20:5.1f}]" for r in range(p)]
        print(f"{name:<14}" + "".join(f"{c:>18}" for c in cells))
    if "gpipe" in names:
        print("\nratio to GPipe on the same rank, and (p - r) / m for 1F1B")
        for name in names:
            if name == "gpipe":
                continue
            ratios = [results[r][name][0] / results[r]["gpipe"][0] for r in range(p)]
            print(f"{name:<14}" + "".join(f"{x:>18.3f}" for x in ratios))
        print(f"{'(p - r) / m':<14}" + "".join(f"{min(p - r, m) / m:>18.3f}" for r in range(p)))
    for r in range(p):
        values = {name: round(results[r][name][0] / 2**20, 1) for name in names}
        result(f"pipeline rank {r}: peak bytes kept during a step", "MiB", values)
    return 0


if __name__ == "__main__":
    sys.exit(main())
