"""`meshplan run`: train a model under a plan, on real torchrun (importable as `meshplan.run`).

    meshplan run examples/tiny_dp.plan                       # tiny Llama, shipped corpus, 2 CPU processes
    meshplan run examples/tiny_dp.plan --steps 500 --data my.txt --batch 16 --seq 128 --out runs/mine
    meshplan run examples/tiny_dp.plan --save-every 50 --resume          # continue from the last checkpoint
    meshplan run plan.plan --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 --rdzv-timeout 300  # multi-node
    torchrun --nproc-per-node 2 -m meshplan.run examples/tiny_dp.plan   # or call torchrun yourself

Outside torchrun (`cli/launcher.py`), the plan is compiled once for the micro-batch each
data-parallel rank runs (`--batch` sequences of `--seq` tokens) into `RUN_DIR/program.pt`,
and this re-launches itself as
`python -m torch.distributed.run --nproc-per-node <mesh world size> -m meshplan.run ...`
with the same options and `--program`; inside (RANK/WORLD_SIZE/LOCAL_RANK set) it is one
worker: init the process group (gloo on CPU, NCCL on GPUs), build the model from its
factory, load the program, bind this rank's shards and groups, wrap them in data parallel
over the plan's data axis, and train (`runtime/train.py`). `meshplan run DIR` runs a
`meshplan compile -o DIR` folder's program; a worker started by the user's own torchrun on
a plan (no `--program`) compiles it itself.

The workers' process group lives on torchrun's own store (the agent bound its port, so no
other process can take it between a free port's pick and a worker's bind, as it could when
each job's rank 0 hosted a store of its own). Restarts (`--max-restarts N`): a restarted
attempt could read the previous attempt's keys from that shared store (pytorch#135712) and
fail to connect, so each attempt's keys are namespaced by `TORCHELASTIC_RESTART_COUNT`.

Failures: a worker whose collective times out (`--timeout`) or loses its peer prints one
line naming the collective and the ranks that never joined it (`runtime/watchdog.py`) and
exits with 3; torchrun stops the others, and the launcher's summary is that line when this
rank failed first, else the rank that died first and how (`cli/outcome.py`). Under the
launcher a worker leaves its process id and exit code for it (`cli/torchrun.py`), and ends
when torchrun does. `MESHPLAN_FAULT` injects a dead or stuck rank for tests (`injected_fault`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from meshplan.errors import EXIT_OK, EXIT_PEER, EXIT_USER, HINT, RunError, guarded, leave_for_launcher
from meshplan.faults import restart_attempt
from meshplan.options import RunOptions, build_parser, run_dir

if TYPE_CHECKING:
    from meshplan.runtime.train import Summary


def cmd_run(args: argparse.Namespace) -> int:
    """Entry of `meshplan run`: launch torchrun, or be one of its workers."""
    from meshplan.launcher import launch

    options = RunOptions.from_args(args)
    try:
        return _worker(options) if under_torchrun() else launch(options)
    except RunError as e:
        print(f"meshplan: error: {e}", file=sys.stderr)
        return EXIT_USER


def under_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


# ---------------------------------------------------------------------------- worker


def _worker(options: RunOptions) -> int:
    from meshplan.torchrun import announce_worker

    announce_worker(int(os.environ["RANK"]))  # first: the launcher watches for it (cli/torchrun.py)
    import torch
    import torch.distributed as dist

    from meshplan.compiler.errors import CompileError
    from meshplan.dsl import PlanError
    from meshplan.runtime import watchdog
    from meshplan.runtime.checkpoint import CheckpointError
    from meshplan.runtime.data import DataError
    from meshplan.runtime.disk_offload import OffloadError
    from meshplan.runtime.train import PeerFailure, is_peer_failure

    rank = int(os.environ["RANK"])
    if restart_attempt() > 0:
        options = options.replace(
            resume=True
        )  # torchrun restarted the workers: continue from the last complete checkpoint
        if rank == 0:
            print(
                f"meshplan: restart {restart_attempt()}: resuming from the last checkpoint", file=sys.stderr
            )
    try:
        _init_process_group(options.timeout)
    except (dist.DistNetworkError, dist.DistStoreError) as e:  # the network's, not meshplan's
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        print(
            f"meshplan: error: rank {rank} failed to join the process group at {where}: "
            f"{watchdog.reason(e)} (check: can every node reach {where}? a node is reached at its "
            "host name unless --local-addr gives its address)",
            file=sys.stderr,
        )
        return EXIT_PEER
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        summary = train_rank(options, rank, dist.get_world_size())
        _teardown_in_order()
    except (PlanError, CompileError, DataError, CheckpointError, RunError, OffloadError) as e:
        # OffloadError: the offload folder failed (a full disk): the user's to fix, then --resume
        leave_for_launcher(e, rank)
        return EXIT_USER
    except RuntimeError as e:  # a collective timed out or lost its peer: one line naming it and who
        if not isinstance(e, PeerFailure) and not is_peer_failure(e):
            raise
        failure = e if isinstance(e, PeerFailure) else PeerFailure(watchdog.diagnose(e))  # start-up, export
        print(
            f"meshplan: error: {failure}\n{HINT}continue with --resume from the last checkpoint in "
            f"{run_dir(options)} (collectives wait --timeout {options.timeout} s)",
            file=sys.stderr,
        )
        return EXIT_PEER
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return EXIT_OK if summary.steps_done >= options.steps else EXIT_USER


def train_rank(
    options: RunOptions, rank: int, world_size: int, *, show_progress: bool | None = None
) -> Summary:
    """One worker's run, in a process group that is up: load the program and this rank's shards,
    train (resuming if asked), export if asked."""
    from meshplan.examples import CORPUS
    from meshplan.runtime.data import within_vocab
    from meshplan.session import export_weights, open_session, train_session

    prepared = open_session(options, rank, world_size)
    if options.vocab_size is not None:  # an id beyond it is a located DataError, not an IndexError
        spec = options.data or str(CORPUS)
        prepared = replace(prepared, batches=within_vocab(prepared.batches, options.vocab_size, spec))
    summary = train_session(prepared, show_progress=show_progress)
    if options.export:
        export_weights(prepared, rank)
    return summary


def _teardown_in_order() -> None:
    """Destroy the process group after a run that ended well, rank 0 last: its process serves the
    store the others' teardown still talks to (a rank torn down after the server was gone has
    aborted at exit, "terminate called without an active exception")."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        store.add("meshplan/torn_down", 1)
        return
    others, deadline = dist.get_world_size() - 1, time.monotonic() + 30
    while store.add("meshplan/torn_down", 0) < others and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.destroy_process_group()


def _init_process_group(timeout_s: int) -> None:
    """gloo on CPU, NCCL when this node has a GPU per local rank; keys namespaced per restart attempt."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    backend = "gloo"
    if torch.cuda.is_available() and torch.cuda.device_count() > local_rank:
        backend = "nccl"
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # the agent's store outlives worker restarts: keep each attempt's keys apart (pytorch#135712)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"meshplan/attempt{attempt}", base)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


# ---------------------------------------------------------------------------- python -m meshplan.run


def main(argv: Sequence[str] | None = None) -> int:
    # the same error handling as `meshplan run` (plan errors rendered, internal errors summarized)
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: cmd_run(args))


if __name__ == "__main__":
    code = main()
    if under_torchrun():
        from meshplan.torchrun import record_exit

        record_exit(int(os.environ["RANK"]), code)
    # The process group is gone; skip the interpreter's teardown of torch's C++ state, which is
    # where an abort at exit could still turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
