"""Training step time: meshplan's compiled TP vs PyTorch's `parallelize_module` vs one process.

    python bench/tp_step_time.py [--steps 15] [--warmup 3]

Model: the example Llama at a size where compute matters on a CPU: hidden 256, 4 layers,
8 heads, 4 kv heads, intermediate 688, vocab 256; B=4, T=128; fp32. A step is forward,
backward and AdamW (lr 1e-3), same batch every step.

    meshplan TP       compile_plan(bench/plans/llama_tp_nosp.plan) -> build_rank_program, 2 ranks
    pytorch TP        parallelize_module with Colwise/RowwiseParallel on the same modules,
                      vocab-parallel embedding and LM head, loss under loss_parallel(), 2 ranks
    megatron TP       the same layout written by hand (bench/common.py `MegatronLlama`), 2 ranks
    megatron TP, fused AdamW   the same, stepped by AdamW's fused kernel as meshplan's is (the
                      programs alone compared; the others use torch.optim.AdamW's default)
    meshplan TP, no overlap   meshplan TP compiled without the `overlap` pass (each input
                      gradient reduced after the weight gradients, as Megatron's code above does)
    meshplan TP+SP    examples/llama_tp.plan (norms on sequence shards), 2 ranks
    pytorch TP+SP     the same with SequenceParallel norms (torchtitan's layout), 2 ranks
    single            the unpartitioned model, one process, with 1 and with 2 intra-op threads

The 2-rank runs are gloo processes with 1 intra-op thread each (OMP_NUM_THREADS=1,
torch.set_num_threads(1), set by `meshplan.runtime.launch.spawn`), so they use the machine's
two cores as the single process with 2 threads does. Every variant runs interleaved inside
the same two processes (step i of every variant, then step i+1; each round in its own order,
the same on both ranks, so no variant always runs first or after the same neighbour), each step started by a barrier, so a change in the machine's load hits all of them alike; a step's time is the
slower rank's. The single-process variants run on rank 0 (torch.set_num_threads(1 or 2)
for the step) while rank 1 waits in the next barrier, which costs no CPU. Reported: the
median over the measured steps, and the fastest step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from common import (
    PLAN_TP,
    PLAN_TP_SP,
    MegatronLlama,
    llama_source,
    median,
    parallelize_with_pytorch,
    result,
)
from torch.distributed.tensor.parallel import loss_parallel

from meshplan.compiler import compile as compile_module
from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl import load_plan
from meshplan.runtime.launch import spawn
from meshplan.runtime.mesh import init_mesh
from meshplan.session import partial_grad_sync

WORLD = 2
BATCH, SEQ = 4, 128
MODEL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=688,
    vocab_size=256,
    max_position_embeddings=SEQ,
)


def make_step(
    model: torch.nn.Module,
    forward: Callable[[], torch.Tensor],
    *,
    parallel_loss: bool = False,
    finish: Callable[[], None] = lambda: None,
    fused: bool = False,
) -> Callable[[], float]:
    """One training step as a callable returning the loss; `finish` after backward (meshplan's
    gradient sync of the weights partial over tp: the sequence-parallel norms). `fused`: AdamW's
    fused kernel, as `meshplan run` steps (`runtime.grad_sync.make_optimizer`); otherwise
    torch.optim.AdamW's default, as a hand-written trainer does."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        if parallel_loss:  # vocab-sharded DTensor logits: forward and backward in loss_parallel
            with loss_parallel():
                loss = forward()
                loss.backward()
        else:
            loss = forward()
            loss.backward()
        finish()
        optimizer.step()
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    return step


def build_variants(rank: int, world_size: int) -> dict[str, Callable[[], float]]:
    variants: dict[str, Callable[[], float]] = {}
    mesh = None
    for name, plan_path in (
        ("meshplan TP", PLAN_TP),
        ("meshplan TP+SP", PLAN_TP_SP),
        ("meshplan TP, no overlap", PLAN_TP),
    ):
        source = llama_source(batch=BATCH, seq=SEQ, **MODEL)
        with without_pass("overlap") if "no overlap" in name else contextlib.nullcontext():
            plan = load_plan(plan_path, world_size=world_size)
            compiled = compile_plan(plan, source, world_size=world_size)
        mesh = mesh or init_mesh(compiled.layout)
        program = build_rank_program(compiled, source.model, rank, mesh)
        inputs = bind_inputs(source.model, compiled.graph, source.args, source.kwargs)
        sync = partial_grad_sync(compiled, program, mesh)
        forward = lambda program=program, inputs=inputs: program(*inputs)[0]  # noqa: E731
        variants[name] = make_step(program, forward, finish=sync.finish, fused=True)

    source = llama_source(batch=BATCH, seq=SEQ, **MODEL)
    args = source.args
    for name, sp in (("pytorch TP", False), ("pytorch TP+SP", True)):
        model = parallelize_with_pytorch(copy.deepcopy(source.model), mesh, sequence_parallel=sp)
        variants[name] = make_step(model, lambda model=model: model(*args), parallel_loss=True)
    for name, fused in (("megatron TP", False), ("megatron TP, fused AdamW", True)):
        megatron = MegatronLlama(copy.deepcopy(source.model), mesh.get_group("tp"))
        variants[name] = make_step(megatron, lambda megatron=megatron: megatron(*args), fused=fused)
    return variants


@contextlib.contextmanager
def without_pass(name: str) -> Iterator[None]:
    """Compile without one of the compiler's passes (to measure what it buys)."""
    passes = compile_module.PASSES
    compile_module.PASSES = tuple(p for p in passes if p.name != name)
    try:
        yield
    finally:
        compile_module.PASSES = passes


SINGLE_THREADS = {"single, 1 thread": 1, "single, 2 threads": 2}


def worker(rank: int, world_size: int, warmup: int, steps: int) -> dict[str, list[tuple[float, float]]]:
    """{variant: [(seconds, loss) per measured step]} on this rank (empty for the
    single-process variants on rank 1)."""
    variants = build_variants(rank, world_size)
    for name in SINGLE_THREADS:
        source = llama_source(batch=BATCH, seq=SEQ, **MODEL)
        variants[name] = make_step(source.model, lambda model=source.model, args=source.args: model(*args))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    order = random.Random(0)  # the same on every rank
    for i in range(warmup + steps):
        # each round in its own order: no variant always runs first, or always right after the
        # same neighbour (after a single-process one, say, with rank 1 idle meanwhile)
        for name in order.sample(list(variants), len(variants)):
            step = variants[name]
            dist.barrier()
            if name in SINGLE_THREADS:
                if rank != 0:
                    continue  # waits in the next barrier
                torch.set_num_threads(SINGLE_THREADS[name])
            t0 = time.perf_counter()
            loss = step()
            elapsed = time.perf_counter() - t0
            torch.set_num_threads(1)
            if i >= warmup:
                times[name].append((elapsed, loss))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    opts = parser.parse_args()

    load_before = os.getloadavg()[0]
    results = spawn(worker, WORLD, (opts.warmup, opts.steps), timeout_s=600)
    load_after = os.getloadavg()[0]

    params = sum(p.numel() for p in llama_source(**MODEL).model.parameters())
    print(
        f"Llama {MODEL['num_hidden_layers']} layers, H={MODEL['hidden_size']}, "
        f"I={MODEL['intermediate_size']}, heads {MODEL['num_attention_heads']}/"
        f"{MODEL['num_key_value_heads']}, V={MODEL['vocab_size']}, {params / 1e6:.2f}M params; "
        f"B={BATCH} T={SEQ} fp32, fwd+bwd+AdamW; {opts.steps} steps after {opts.warmup} warm-up"
    )
    print(
        f"2-rank runs: gloo, 1 thread per rank; single: rank 0 alone with 1 or 2 threads "
        f"({os.cpu_count()} cores; 1-min load average {load_before:.2f} before, {load_after:.2f} after)\n"
    )
    print(f"{'variant':<24}{'median s':>10}{'min s':>10}{'max s':>10}   last loss")
    medians: dict[str, float] = {}
    fastest: dict[str, float] = {}
    for name in results[0]:
        ranks = [r[name] for r in results if r[name]]
        per_step = [max(r[i][0] for r in ranks) for i in range(opts.steps)]  # the slower rank
        medians[name], fastest[name] = median(per_step), min(per_step)
        loss = results[0][name][-1][1]
        print(f"{name:<24}{medians[name]:>10.4f}{fastest[name]:>10.4f}{max(per_step):>10.4f}   {loss:.6f}")

    def ratios(t: dict[str, float]) -> str:
        return (
            f"compiled/pytorch {t['meshplan TP'] / t['pytorch TP']:.3f}, "
            f"compiled/single(2 threads) {t['meshplan TP'] / t['single, 2 threads']:.3f}, "
            f"compiled/single(1 thread) {t['meshplan TP'] / t['single, 1 thread']:.3f}"
        )

    print()
    for t, what in ((medians, "medians"), (fastest, "fastest")):
        print(
            f"{what}: TP+SP meshplan/pytorch {t['meshplan TP+SP'] / t['pytorch TP+SP']:.3f}, "
            f"TP meshplan/megatron {t['meshplan TP'] / t['megatron TP']:.3f} "
            f"(with its AdamW fused too {t['meshplan TP'] / t['megatron TP, fused AdamW']:.3f}), "
            f"overlap/no overlap {t['meshplan TP'] / t['meshplan TP, no overlap']:.3f}"
        )
    print(f"fastest steps: {ratios(fastest)}")
    print(f"ratio (medians) {ratios(medians)}")
    result(
        "TP=2 step time (median, slower rank)", "ms", {name: round(t * 1e3, 1) for name, t in medians.items()}
    )


if __name__ == "__main__":
    sys.exit(main())
