"""Causal ring attention's work per context rank: contiguous chunks vs the load-balanced layout.

    python bench/cp_balance.py [--seq 4096] [--heads 8] [--head-dim 64] [--reps 5]

Under a causal mask, contiguous chunks give rank r (r + 1) blocks of work: the last rank
does n times what rank 0 does, and every rank waits for it. The load-balanced layout (rank r
holds chunks r and 2n-1-r of 2n, meshplan's default for causal ring and all_gather context
parallelism) gives every rank the same. Two measures, each printed as max/min over ranks:

- score entries: the query x key scores each rank computes in one ring forward, summed from
  `runtime.ring_attention.visible`, the function the kernel itself asks which rectangle of
  each block pair to compute (so the count cannot drift from the kernel), for cp = 2, 4, 8
  (a rank's own block counts whole in the contiguous layout: the kernel computes it whole);
- time: the ring forward (RingAttention, gloo, one thread per rank) on cp = 2 processes,
  median of `--reps` per rank, each rep started together after a barrier: the CPU time of
  the rank's process (its work, whatever else runs on the machine) and the wall time (which
  on a machine with fewer free cores than ranks also measures who got a core).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshplan.runtime.launch import spawn
from meshplan.runtime.ring_attention import visible


def entries(n: int, t: int, balanced: bool) -> list[int]:
    """Score entries each of n ranks computes in a causal ring forward, t positions per rank."""
    out = []
    for rank in range(n):
        total = 0
        for step in range(n):
            for rows, cols, _ in visible(rank, (rank - step) % n, n, t, True, balanced):
                total += (rows.stop - rows.start) * (cols.stop - cols.start)
        out.append(total)
    return out


def worker(rank: int, world_size: int, seq: int, heads: int, head_dim: int, reps: int) -> dict:
    import torch.distributed as dist

    from meshplan.runtime.ring_attention import RingAttention

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    t = seq // world_size
    q, k, v = (torch.randn(1, heads, t, head_dim) for _ in range(3))
    times = {}
    for balanced in (False, True):
        ring = RingAttention(dist.group.WORLD, "cp", balanced=balanced)
        ring(q, k, v, True)  # warm-up
        cpu, wall = [], []
        for _ in range(reps):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            with torch.no_grad():
                ring(q, k, v, True)
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start)
        layout = "balanced" if balanced else "contiguous"
        times[layout] = (statistics.median(cpu), statistics.median(wall))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    print(f"score entries per rank, causal ring forward, T = {args.seq}:")
    print(f"{'cp':>4} {'layout':>11} {'per rank':>40} {'max/min':>8}")
    for n in (2, 4, 8):
        for balanced in (False, True):
            counts = entries(n, args.seq // n, balanced)
            text = " ".join(f"{c / 1e6:.2f}M" for c in counts)
            layout = "balanced" if balanced else "contiguous"
            print(f"{n:>4} {layout:>11} {text:>40} {max(counts) / min(counts):>8.2f}")

    results = spawn(worker, 2, (args.seq, args.heads, args.head_dim, args.reps))
    print(f"\nring forward time per rank, cp = 2, (1, {args.heads}, {args.seq}, {args.head_dim}), gloo CPU:")
    print(f"{'':>13} {'CPU per rank':>20} {'max/min':>8} {'wall per rank':>20} {'max/min':>8}")
    for layout in ("contiguous", "balanced"):
        cpu = [r[layout][0] for r in results]
        wall = [r[layout][1] for r in results]
        print(
            f"  {layout:>11} {' '.join(f'{s:.2f} s' for s in cpu):>20} {max(cpu) / min(cpu):>8.2f}"
            f" {' '.join(f'{s:.2f} s' for s in wall):>20} {max(wall) / min(wall):>8.2f}"
        )


if __name__ == "__main__":
    main()
