"""Start N local worker processes with a gloo (CPU) or NCCL (GPU) process group.

Used by `meshplan verify` and the multi-process tests; training goes through real torchrun.

    results = spawn(worker, world_size=2, args=(config,))   # worker(rank, world_size, *args)

Each worker's return value comes back in rank order. A worker that raises ends the
whole run with an error naming the rank and carrying its traceback text.
"""

from __future__ import annotations

import faulthandler
import os
import queue as queue_module
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
    faulthandler.enable()  # a crash in native code prints where it happened
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
    queue = ctx.Queue()
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
        results, failures = _collect(procs, queue)
        for p in procs:
            p.join(timeout=5 if failures else timeout_s)
            if p.is_alive():
                p.kill()
        if failures:
            raise WorkerError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def _collect(procs: list, queue) -> tuple[dict[int, Any], list[str]]:
    """Every rank's report, or the first failure: a raised error, or a process that died
    without a word (a crash, the out-of-memory killer), which would otherwise leave the
    parent waiting forever."""
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if not dead:
                continue
            try:  # a report written just before its process exited is in the pipe by now
                rank, ok, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                return results, [
                    f"rank {r} exited with code {procs[r].exitcode} without a report" for r in dead
                ]
        if not ok:
            return results, [f"rank {rank} failed:\n{payload}"]  # the others may be stuck in a collective
        results[rank] = payload
    return results, []
