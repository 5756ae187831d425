"""Context parallelism: bytes on the wire vs the formulas, activation memory, step time per variant.

    python bench/context.py [--seq 2048] [--cp 2] [--layers 2] [--hidden 256] [--heads 8] [--kv-heads 8]

Model: the example Llama (causal SDPA, RoPE), fp32, batch 1, on `--cp` gloo ranks (CPU).
Each variant is the program `meshplan run` runs for `mesh cp=P` and
`layers.*.self_attn: context MODE over cp`; `none` is the same model compiled for one
process (`mesh dp=1`), run by every rank on the whole sequence (the baseline).

Bytes: what leaves a rank in one training step, counted at torch.distributed's entry points
(all-to-all: the chunks addressed to other ranks; batched isend: every tensor sent;
all-gather: its input, (P-1) times, as a ring moves it), against the formulas per layer
and per forward, with N = B*T tokens, h = query heads * head_dim, h_kv = key/value heads *
head_dim, and the element size:

    ulysses     (2h + 2h_kv) * (N/P) * (P-1)/P    q, k, v to head shards, the output back
    ring        2h_kv * (N/P) * (P-1)             each key/value block visits every other rank
    all_gather  2h_kv * (N/P) * (P-1)             every rank's block of k and v, gathered once

and the ledger's prediction of the same. Backward is shown beside (ring: the blocks and
their gradients travel again; all_gather: the key/value gradients are reduce-scattered;
Ulysses: the four all-to-alls reversed). All-reduces (the gradients of weights used on
sequence shards, summed over cp in one bucket by the gradient sync as `meshplan run` does,
and the loss's token count) are listed apart.

Memory: bytes of every storage made during forward that is still alive before backward
(activations kept for backward; parameters and inputs not counted), per rank, and its
ratio to `none` (goal: about 1/P).

Time: forward + backward, median of `--steps` rounds, variants taking turns (one step each
per round) so that they share the machine's load; a step ends when the slowest rank does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
from common import LiveStorages, result, sized_llama

from meshplan.compiler.capture import bind_inputs
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl.check import check_text
from meshplan.examples.models.llama import example_inputs
from meshplan.runtime import collectives as meshplan_collectives
from meshplan.runtime.mesh import init_mesh
from meshplan.session import partial_grad_sync

MODES = ("all_gather", "ring", "ulysses")
WIRE = ("all_to_all", "send", "all_gather", "reduce_scatter")  # the attention's traffic


# ---------------------------------------------------------------------------- counting bytes sent


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SentBytes:
    """Bytes this rank sends, by (op, phase), while `phase(name)` is open."""

    def __init__(self) -> None:
        self.bytes: Counter = Counter()
        self._phase = ""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        rank = dist.get_rank()

        def all_to_all(outputs, inputs, group=None, **_):
            mine = dist.get_group_rank(group, rank) if group is not None else rank
            return "all_to_all", sum(_nbytes(t) for i, t in enumerate(inputs) if i != mine)

        def batch_isend_irecv(ops, **_):
            return "send", sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend)

        def all_gather(output, input, group=None, **_):
            return "all_gather", _nbytes(input) * (dist.get_world_size(group) - 1)

        def reduce_scatter(output, input, group=None, **_):
            n = dist.get_world_size(group)
            return "reduce_scatter", _nbytes(input) * (n - 1) // n

        def all_reduce(tensor, *_, group=None, **__):
            n = dist.get_world_size(group)
            return "all_reduce", 2 * _nbytes(tensor) * (n - 1) // n

        targets = [
            (dist, "all_to_all", all_to_all),
            (dist, "batch_isend_irecv", batch_isend_irecv),
            (dist, "all_gather_into_tensor", all_gather),
            (dist, "reduce_scatter_tensor", reduce_scatter),
            (dist, "all_reduce", all_reduce),
            (meshplan_collectives, "_all_gather", all_gather),
            (meshplan_collectives, "_reduce_scatter", reduce_scatter),
        ]
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets if hasattr(owner, attr)]
        depth = [0]

        def wrap(fn, describe):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                if depth[0] == 0:
                    op, n = describe(*args, **kwargs)
                    self.bytes[op, self._phase] += n
                depth[0] += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    depth[0] -= 1

            return wrapper

        self._phase = name
        for owner, attr, describe in targets:
            if hasattr(owner, attr):
                setattr(owner, attr, wrap(getattr(owner, attr), describe))
        try:
            yield
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)

    def total(self, ops: tuple[str, ...], phase: str) -> int:
        return sum(n for (op, p), n in self.bytes.items() if op in ops and p == phase)


# ---------------------------------------------------------------------------- the programs


def _program(text: str, args: argparse.Namespace, world: int):
    model = sized_llama(
        args.layers, args.hidden, heads=args.heads, kv_heads=args.kv_heads, max_position_embeddings=args.seq
    )
    source = ModelSource("llama", model, example_inputs(1, args.seq), {})
    compiled = compile_plan(check_text(text, "bench.plan", world_size=world), source, world_size=world)
    mesh = init_mesh(compiled.layout) if world > 1 else None
    program = build_rank_program(compiled, model, dist.get_rank() if world > 1 else 0, mesh)
    # what `meshplan run` adds after backward: every weight's gradient is partial over cp (each
    # rank's sequence shard), summed over it in one bucket
    finish = partial_grad_sync(compiled, program, mesh).finish if mesh is not None else lambda: None

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        (loss,) = program(*bind_inputs(model, compiled.graph, (ids, labels), {}))
        return loss

    return step, compiled.ledger, program, finish


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    runs = {"none": _program("mesh dp=1\n", args, 1)}
    for mode in MODES:
        text = f"mesh cp={world}\n\nmodules {{\n    layers.*.self_attn: context {mode} over cp\n}}\n"
        runs[mode] = _program(text, args, world)
    ids, labels = example_inputs(1, args.seq, seed=1)
    out: dict = {"sent": {}, "kept": {}, "ledger": {}, "times": {name: [] for name in runs}}
    for name, (step, ledger, program, finish) in runs.items():  # one counted step each (after a warm-up)
        step(ids, labels).backward()
        finish()
        sent, live = SentBytes(), LiveStorages(program)
        with sent.phase("forward"), live:
            loss = step(ids, labels)
        kept = live.live_bytes()
        with sent.phase("backward"):
            loss.backward()
            finish()
        out["sent"][name], out["kept"][name] = dict(sent.bytes), kept
        out["ledger"][name] = {
            phase: sum(r.traffic for r in ledger.rows if r.phase == phase and r.op != "all_reduce")
            for phase in ("forward", "backward")
        }
    for _ in range(args.warmup + args.steps):
        for name, (step, _, _, finish) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step(ids, labels).backward()
            finish()
            out["times"][name].append(time.perf_counter() - start)
    return out


def formula(mode: str, args: argparse.Namespace, world: int) -> float:
    """Forward bytes per layer (module docstring), fp32."""
    head_dim = args.hidden // args.heads
    h, h_kv, n, p = args.heads * head_dim, args.kv_heads * head_dim, args.seq, world
    if mode == "ulysses":
        return (2 * h + 2 * h_kv) * (n / p) * (p - 1) / p * 4
    return 2 * h_kv * (n / p) * (p - 1) * 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()

    from meshplan.runtime.launch import spawn

    by_rank = spawn(worker, args.cp, (args,), timeout_s=1800)
    L, P = args.layers, args.cp
    print(
        f"Llama fp32, {L} layers, H={args.hidden}, {args.heads} query / {args.kv_heads} kv heads, "
        f"B=1 T={args.seq}, cp={P} gloo ranks\n"
    )
    print("bytes sent per rank and step (attention's collectives; rank 0), forward per layer vs formula:")
    print(
        f"{'':>11} {'formula/L':>11} {'sent/L':>11} {'ratio':>7} {'ledger/L':>11} {'ratio':>7} {'backward/L':>11} {'all-reduce':>11}"
    )
    sent_ratio = {}
    for mode in MODES:
        sent = Counter({tuple(k): v for k, v in by_rank[0]["sent"][mode].items()})
        forward = sum(n for (op, p), n in sent.items() if op in WIRE and p == "forward") / L
        backward = sum(n for (op, p), n in sent.items() if op in WIRE and p == "backward") / L
        reduce = sum(n for (op, _), n in sent.items() if op == "all_reduce")
        ledger = by_rank[0]["ledger"][mode]["forward"] / L
        f = formula(mode, args, P)
        sent_ratio[mode] = forward / f
        print(
            f"{mode:>11} {f / 1e6:>9.3f}MB {forward / 1e6:>9.3f}MB {forward / f:>7.3f} "
            f"{ledger / 1e6:>9.3f}MB {ledger / f:>7.3f} {backward / 1e6:>9.3f}MB {reduce / 1e6:>9.3f}MB"
        )
    print("\nactivations kept for backward, per rank (MiB), and / none:")
    base = max(r["kept"]["none"] for r in by_rank)
    for name in ("none", *MODES):
        kept = [r["kept"][name] for r in by_rank]
        print(f"{name:>11} " + " ".join(f"{k / 2**20:>8.2f}" for k in kept) + f"   {max(kept) / base:.3f}")
    print(f"\nforward + backward, median of {args.steps} rounds (slowest rank), and / none:")
    times = {
        name: statistics.median(
            max(r["times"][name][i] for r in by_rank) for i in range(args.warmup, args.warmup + args.steps)
        )
        for name in ("none", *MODES)
    }
    for name, t in times.items():
        print(f"{name:>11} {t * 1e3:>9.1f} ms   {t / times['none']:.2f}")
    result(
        f"forward + backward at T={args.seq}, cp={P}", "ms", {k: round(v * 1e3, 1) for k, v in times.items()}
    )
    kept = {name: round(max(r["kept"][name] for r in by_rank) / 2**20, 2) for name in ("none", *MODES)}
    result("activations kept for backward, per rank", "MiB", kept)
    print()
    print("sent / formula: " + ", ".join(f"{m} {sent_ratio[m]:.3f}" for m in MODES))
    print("kept / none:    " + ", ".join(f"{m} {kept[m] / kept['none']:.3f}" for m in MODES))
    print("time / none:    " + ", ".join(f"{m} {times[m] / times['none']:.2f}" for m in MODES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
