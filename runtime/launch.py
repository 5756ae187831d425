"""Start N local worker processes with a gloo (CPU) or NCCL (GPU) process group.

Used by `meshplan verify` and the multi-process tests; training goes through real torchrun.

    results = spawn(worker, world_size=2, args=(config,))   # worker(rank, world_size, *args)

Each worker's return value comes back in rank order. A worker that raises ends the
whole run with an error naming the rank and carrying its traceback text.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A worker process failed; the message names the rank."""


def _entry(
    rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, queue, timeout_s: float
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 120.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` processes; return their results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="meshplan-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_entry, args=(rank, world_size, init_file, fn, args, queue, timeout_s), daemon=True
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        failures: list[str] = []
        for _ in range(world_size):
            rank, ok, payload = queue.get()
            if ok:
                results[rank] = payload
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                break  # the others may be blocked in a collective with the dead rank
        for p in procs:
            p.join(timeout=5 if failures else timeout_s)
            if p.is_alive():
                p.kill()
        if failures:
            raise WorkerError("\n".join(failures))
    return [results[r] for r in range(world_size)]
