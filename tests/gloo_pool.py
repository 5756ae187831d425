"""Gloo processes kept for the test session's multi-process jobs, instead of new ones for each.

`meshplan verify` and the multi-process tests run each job on new processes
(`meshplan.runtime.launch.spawn`): start Python, import torch, meshplan and the model's
libraries, join a process group. On 2 cores that is most of a small job's cost, and a module
of `verify` tests pays it for every test. Inside `shared_processes()`, `spawn` hands each job
to processes kept from an earlier job of the same world size (of this module or another):

    @pytest.fixture(scope="module", autouse=True)
    def processes():
        with shared_processes():
            yield

`gloo_pool.spawn(fn, world_size, args)` does the same for one call. Each job still runs
`fn(rank, world_size, *args)` on every rank of a gloo group of its size and returns the
results by rank, as `spawn` does. A job that fails, or whose process dies, ends its processes
(the others may be stuck in a collective): the next job starts new ones. A job runs in a
process that earlier jobs ran in, so a job must undo what it patches. The processes end with
the session (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import capture_cache
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshplan.runtime import launch

TIMEOUT_S = 900.0  # the process group's: as long as `meshplan verify` waits for a job


@dataclass
class _Ranks:
    procs: list[Any]
    inboxes: list[Any]
    outbox: Any
    folder: tempfile.TemporaryDirectory


def _serve(rank: int, world_size: int, init_file: str, inbox, outbox) -> None:
    """One rank: join the process group once, then run each job sent to it until told to stop (None)."""
    faulthandler.enable()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend == "nccl":  # as `launch.spawn` chooses
        torch.cuda.set_device(rank)
    timeout = timedelta(seconds=TIMEOUT_S)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        with capture_cache.remembered():  # ranks that compile for themselves export the same models
            while (job := inbox.get()) is not None:
                fn, args = job
                try:
                    result = (rank, True, fn(rank, world_size, *args))
                except BaseException:
                    result = (rank, False, traceback.format_exc())
                _destroy_subgroups()
                outbox.put(result)
    finally:
        dist.destroy_process_group()


def _destroy_subgroups() -> None:
    """End the process groups a job made (its mesh's axes), as the end of a worker process would:
    each gloo group keeps three threads and its sockets, and a session's jobs made hundreds,
    whose threads woke to poll while the processes idled, taking CPU from the tests beside them.
    A group ends with its last reference: c10d's, and its job's program's (collected first)."""
    gc.collect()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


class _Pool:
    def __init__(self) -> None:
        self._ranks: dict[int, _Ranks] = {}

    def spawn(
        self, fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 0.0
    ) -> list:
        """`launch.spawn` on the kept processes of this world size; their collectives wait up to
        `TIMEOUT_S`, whatever `timeout_s` says."""
        ranks = self._ranks.get(world_size) or self._start(world_size)
        for inbox in ranks.inboxes:
            inbox.put((fn, args))
        results, failures = launch._collect(ranks.procs, ranks.outbox)
        if failures:
            self._stop(world_size, kill=True)
            raise launch.WorkerError("\n".join(failures))
        return [results[r] for r in range(world_size)]

    def _start(self, world_size: int) -> _Ranks:
        ctx = mp.get_context("spawn")
        folder = tempfile.TemporaryDirectory(prefix="meshplan-pool-")
        init_file = os.path.join(folder.name, "rendezvous")
        inboxes, outbox = [ctx.Queue() for _ in range(world_size)], ctx.Queue()
        procs = [
            ctx.Process(target=_serve, args=(rank, world_size, init_file, inboxes[rank], outbox), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        self._ranks[world_size] = _Ranks(procs, inboxes, outbox, folder)
        return self._ranks[world_size]

    def _stop(self, world_size: int, *, kill: bool = False) -> None:
        ranks = self._ranks.pop(world_size)
        if not kill:
            for inbox in ranks.inboxes:
                inbox.put(None)
        for p in ranks.procs:
            p.join(timeout=0 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join()
        ranks.folder.cleanup()

    def close(self) -> None:
        """End every kept process. They hold nothing worth a clean exit: killed, not asked."""
        for world_size in list(self._ranks):
            self._stop(world_size, kill=True)


_SESSION = _Pool()  # kept across the modules that share processes; `close_all` ends them


@contextlib.contextmanager
def shared_processes() -> Iterator[None]:
    """Within: `meshplan.runtime.launch.spawn` (as looked up when called, which is how `verify`
    calls it) runs on kept processes. They outlive the block, for the next module that shares
    processes, until `close_all()` (the test session's end)."""
    original = launch.spawn
    launch.spawn = _SESSION.spawn  # type: ignore[assignment]
    try:
        yield
    finally:
        launch.spawn = original


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 0.0) -> list:
    """`launch.spawn` on the session's kept processes (whose collectives wait up to `TIMEOUT_S`)."""
    return _SESSION.spawn(fn, world_size, args, timeout_s=timeout_s)


def close_all() -> None:
    _SESSION.close()
