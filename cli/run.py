"""`meshplan run`: train a model under a plan, on real torchrun (importable as `meshplan.run`).

    meshplan run examples/tiny_dp.plan                       # tiny Llama, shipped corpus, 2 CPU processes
    meshplan run examples/tiny_dp.plan --steps 500 --data my.txt --batch 16 --seq 128 --out runs/mine
    meshplan run examples/tiny_dp.plan --save-every 50 --resume          # continue from the last checkpoint
    meshplan run plan.plan --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500   # multi-node
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

Restarts (`--max-restarts N`): a restarted attempt could read the previous attempt's keys
from torchrun's shared store (pytorch#135712) and fail to connect. The launcher sets
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`; a worker started by a user's own torchrun that
does share the agent's store namespaces its keys by `TORCHELASTIC_RESTART_COUNT`.

Failures: a worker whose collective times out (`--timeout`) or loses its peer prints one
line naming the collective and the ranks that never joined it (`runtime/watchdog.py`) and
exits with 3; torchrun stops the others, and the launcher's summary is that line when this
rank failed first, else the rank that died first and how. `MESHPLAN_FAULT` injects a dead
or stuck rank for tests (`injected_fault`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.args import DefaultInt, DefaultStr, non_negative_int, positive_int

if TYPE_CHECKING:
    from meshplan.runtime.train import Summary

DEFAULT_MODEL = "meshplan.examples.models.llama:build"
EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2  # 1: a bug in meshplan
EXIT_PEER = 3  # a rank died or hung; the others stopped

# torchrun's own options: passed to torchrun, never to the workers
TORCHRUN_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "max_restarts")
# (dest, flag) of every option the workers receive again
WORKER_FLAGS = (
    ("model", "--model"),
    ("program", "--program"),
    ("vocab_size", "--vocab-size"),
    ("steps", "--steps"),
    ("data", "--data"),
    ("batch", "--batch"),
    ("seq", "--seq"),
    ("lr", "--lr"),
    ("warmup", "--warmup"),
    ("min_lr_ratio", "--min-lr-ratio"),
    ("weight_decay", "--weight-decay"),
    ("grad_clip", "--grad-clip"),
    ("seed", "--seed"),
    ("save_every", "--save-every"),
    ("out", "--out"),
    ("log_every", "--log-every"),
    ("timeout", "--timeout"),
    ("peak_tflops", "--peak-tflops"),
    ("export", "--export"),
    ("between_steps", "--between-steps"),
)


class RunError(ValueError):
    """A user mistake found by `meshplan run` (one line, with a hint)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `meshplan run` (and of `python -m meshplan.run`)."""
    p.add_argument(
        "plan",
        metavar="PLAN",
        help="the plan file (its mesh gives the number of processes), or a `meshplan compile -o` folder",
    )
    p.add_argument(
        "--model",
        default=DefaultStr(DEFAULT_MODEL),
        metavar="SPEC",
        help=f"FILE.py:factory or module:factory (default: {DEFAULT_MODEL}, a tiny Llama; "
        "for a compile folder, the model it was compiled for)",
    )
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    p.add_argument(
        "--data",
        metavar="FILE",
        help="a text file (bytes are tokens) or FILE.py:factory (default: the shipped corpus)",
    )
    p.add_argument(
        "--between-steps",
        metavar="SPEC",
        help="FILE.py:function or module:function called with the model after each optimizer step "
        "(e.g. an aux-loss-free expert bias update), the buffers the model counts into summed over "
        "the data ranks first",
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        default=DefaultInt(8),
        metavar="B",
        help="sequences per micro-step per data-parallel rank (default 8; for a compile folder, its own)",
    )
    p.add_argument(
        "--seq",
        type=positive_int,
        default=DefaultInt(64),
        metavar="T",
        help="tokens per sequence (default 64; for a compile folder, its own)",
    )
    p.add_argument("--program", help=argparse.SUPPRESS)  # the launcher's compiled program.pt
    # the model's vocabulary, found by the launcher: every batch's token ids are checked against it
    p.add_argument("--vocab-size", type=positive_int, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument(
        "--warmup", type=non_negative_int, default=20, metavar="N", help="linear warmup steps (default 20)"
    )
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument(
        "--grad-clip", type=float, default=1.0, help="max global gradient norm, 0 disables (default 1.0)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--save-every",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="checkpoint every N steps (and at the end); 0: never",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest complete checkpoint in --out"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the checkpoints and metrics of a run already in --out (without it, `run` refuses)",
    )
    p.add_argument(
        "--export",
        metavar="FILE",
        help="after training, write the full (unpartitioned) weights: FILE.safetensors or FILE.pt",
    )
    p.add_argument(
        "--out", metavar="DIR", help="run folder for metrics and checkpoints (default: runs/<plan name>)"
    )
    p.add_argument(
        "--log-every",
        type=positive_int,
        default=10,
        metavar="N",
        help="print every N steps when not on a terminal",
    )
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=300,
        metavar="S",
        help="seconds a collective may wait for a peer (default 300)",
    )
    p.add_argument(
        "--peak-tflops", type=float, metavar="F", help="peak TFLOP/s per device, for the MFU estimate"
    )
    g = p.add_argument_group("torchrun (passed through)")
    g.add_argument(
        "--nproc-per-node",
        type=positive_int,
        metavar="N",
        help="processes per node (default: the mesh's world size / --nnodes)",
    )
    g.add_argument("--nnodes", default="1", metavar="N")
    g.add_argument("--node-rank", metavar="R")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT")
    g.add_argument("--rdzv-backend", metavar="NAME")
    g.add_argument("--rdzv-id", metavar="ID")
    g.add_argument("--max-restarts", metavar="N")


def cmd_run(args: argparse.Namespace) -> int:
    """Entry of `meshplan run`: launch torchrun, or be one of its workers."""
    from meshplan.launcher import launch

    try:
        return _worker(args) if under_torchrun() else launch(args)
    except RunError as e:
        print(f"meshplan: error: {e}", file=sys.stderr)
        return EXIT_USER


def restart_attempt() -> int:
    """How many times torchrun has restarted the workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@dataclass(frozen=True)
class Fault:
    """A fault injected into one rank when it starts step `step` (0-based: 3 is the fourth step)."""

    step: int
    hang: bool = False  # stay alive but silent (a stuck rank), instead of exiting as if killed

    def strike(self) -> None:
        """Exit with 137 (as SIGKILL would), or never return."""
        if not self.hang:
            os._exit(137)
        while True:  # stuck: the peers time out in their next collective; torchrun ends this process
            time.sleep(60)


def injected_fault(rank: int) -> Fault | None:
    """This rank's fault from MESHPLAN_FAULT="rank=R,step=S" or "rank=R,step=S,hang" (first attempt only).

    A testing hook for the failure paths: rank R exits abruptly at step S, as if killed,
    while its peers are inside the same step's collectives; with `hang` it stays alive and
    never joins them, as if stuck.
    """
    spec = os.environ.get("MESHPLAN_FAULT")
    if not spec or restart_attempt() > 0:
        return None
    fault_rank, fault = parse_fault(spec)
    return fault if fault_rank == rank else None


def parse_fault(spec: str) -> tuple[int, Fault]:
    """`rank=R,step=S[,hang]` -> (R, its fault); anything else is a `RunError` saying the form."""
    parts = spec.split(",")
    fields = dict(part.split("=", 1) for part in parts if "=" in part)
    extra = [p for p in parts if "=" not in p and p != "hang"] + sorted(set(fields) - {"rank", "step"})
    try:
        if extra:
            raise ValueError
        return int(fields["rank"]), Fault(int(fields["step"]), hang="hang" in parts)
    except (KeyError, ValueError):
        raise RunError(
            f"MESHPLAN_FAULT={spec!r} is not `rank=R,step=S` or `rank=R,step=S,hang` (a testing hook)"
        ) from None


def under_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def run_dir(args: argparse.Namespace) -> Path:
    """`--out`, else `runs/<plan name>` (for a compile folder, the name of the plan it compiled)."""
    if args.out:
        return Path(args.out)
    plan = Path(args.plan)
    if plan.is_dir():
        from meshplan.compiler.artifact import ArtifactError, read_artifact

        try:
            return Path("runs") / Path(read_artifact(plan)["plan"]).stem
        except (ArtifactError, KeyError, ValueError) as e:
            raise RunError(str(e)) from None
    return Path("runs") / plan.stem


# ---------------------------------------------------------------------------- worker


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from meshplan.compiler.errors import CompileError
    from meshplan.dsl import PlanError
    from meshplan.launcher import HINT
    from meshplan.runtime import watchdog
    from meshplan.runtime.checkpoint import CheckpointError
    from meshplan.runtime.data import DataError
    from meshplan.runtime.train import PeerFailure, is_peer_failure

    rank = int(os.environ["RANK"])
    if restart_attempt() > 0:
        args.resume = True  # torchrun restarted the workers: continue from the last complete checkpoint
        if rank == 0:
            print(
                f"meshplan: restart {restart_attempt()}: resuming from the last checkpoint", file=sys.stderr
            )
    _init_process_group(args.timeout)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        summary = train_rank(args, rank, dist.get_world_size())
        _teardown_in_order()
    except (PlanError, CompileError, DataError, CheckpointError, RunError) as e:
        _say_user_error(e, rank)
        return EXIT_USER
    except RuntimeError as e:  # a collective timed out or lost its peer: one line naming it and who
        if not isinstance(e, PeerFailure) and not is_peer_failure(e):
            raise
        failure = e if isinstance(e, PeerFailure) else PeerFailure(watchdog.diagnose(e))  # start-up, export
        print(
            f"meshplan: error: {failure}\n{HINT}continue with --resume from the last checkpoint in "
            f"{run_dir(args)} (collectives wait --timeout {args.timeout} s)",
            file=sys.stderr,
        )
        return EXIT_PEER
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return EXIT_OK if summary.steps_done >= args.steps else EXIT_USER


def train_rank(
    args: argparse.Namespace, rank: int, world_size: int, *, show_progress: bool | None = None
) -> Summary:
    """One worker's run, in a process group that is up: load the program and this rank's shards,
    train (resuming if asked), export if asked."""
    from meshplan.examples import CORPUS
    from meshplan.runtime.data import within_vocab
    from meshplan.session import export_weights, open_session, train_session

    prepared = open_session(args, rank, world_size)
    if args.vocab_size is not None:  # an id beyond it is a located DataError, not an IndexError
        spec = args.data or str(CORPUS)
        prepared = replace(prepared, batches=within_vocab(prepared.batches, args.vocab_size, spec))
    summary = train_session(args, prepared, show_progress=show_progress)
    if args.export:
        export_weights(args, prepared, rank)
    return summary


def _say_user_error(error: Exception, rank: int) -> None:
    """Leave the message for the launcher (every rank: whichever stops first is the one torchrun
    reports); under a user's own torchrun, rank 0 prints it."""
    import contextlib
    import io

    from meshplan.dsl import PlanError
    from meshplan.launcher import ERRORS_ENV
    from meshplan.main import _report

    text = io.StringIO()
    with contextlib.redirect_stderr(text):
        if isinstance(error, PlanError):
            _report(error)
        else:
            print(f"meshplan: error: {error}", file=sys.stderr)
    folder = os.environ.get(ERRORS_ENV)
    if folder is not None and Path(folder).is_dir():
        partial = Path(folder) / f".rank{rank}.txt"  # renamed when whole: torchrun may stop us mid-write
        partial.write_text(text.getvalue())
        partial.replace(partial.with_name(f"rank{rank}.txt"))
    elif rank == 0:
        sys.stderr.write(text.getvalue())


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshplan run", description="train a model under a plan on torchrun")
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from meshplan.main import main as meshplan_main

    # the same error handling as `meshplan run` (plan errors rendered, internal errors summarized)
    return meshplan_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    code = main()
    # The process group is gone; skip the interpreter's teardown of torch's C++ state, which is
    # where an abort at exit could still turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
