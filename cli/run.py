"""`meshplan run`: train a model under a plan, on real torchrun (importable as `meshplan.run`).

    meshplan run examples/tiny_dp.plan                       # tiny Llama, shipped corpus, 2 CPU processes
    meshplan run examples/tiny_dp.plan --steps 500 --data my.txt --batch 16 --seq 128 --out runs/mine
    meshplan run examples/tiny_dp.plan --save-every 50 --resume          # continue from the last checkpoint
    meshplan run plan.plan --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500   # multi-node
    torchrun --nproc-per-node 2 -m meshplan.run examples/tiny_dp.plan   # or call torchrun yourself

Outside torchrun, this re-launches itself as
`python -m torch.distributed.run --nproc-per-node <mesh world size> -m meshplan.run ...`
with the same options; inside (RANK/WORLD_SIZE/LOCAL_RANK set) it is one worker:
init the process group (gloo on CPU, NCCL on GPUs), load the plan for the world size,
build the model, compile it for the micro-batch each data-parallel rank runs
(`--batch` sequences of `--seq` tokens), bind this rank's shards, wrap them in data
parallel over the plan's data axis, and train (`runtime/train.py`).

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
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.args import non_negative_int, positive_int

DEFAULT_MODEL = "meshplan.examples.models.llama:build"
EXIT_OK, EXIT_USER = 0, 2
EXIT_PEER = 3  # a rank died or hung; the others stopped

# torchrun's own options: passed to torchrun, never to the workers
TORCHRUN_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "max_restarts")
# (dest, flag) of every option the workers receive again
WORKER_FLAGS = (
    ("model", "--model"),
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
)


class RunError(ValueError):
    """A user mistake found by `meshplan run` (one line, with a hint)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `meshplan run` (and of `python -m meshplan.run`)."""
    p.add_argument("plan", metavar="PLAN", help="the plan file; its mesh gives the number of processes")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="SPEC",
        help=f"FILE.py:factory or module:factory (default: {DEFAULT_MODEL}, a tiny Llama)",
    )
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    p.add_argument(
        "--data",
        metavar="FILE",
        help="a text file (bytes are tokens) or FILE.py:factory (default: the shipped corpus)",
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        default=8,
        metavar="B",
        help="sequences per micro-step per data-parallel rank (default 8)",
    )
    p.add_argument(
        "--seq", type=positive_int, default=64, metavar="T", help="tokens per sequence (default 64)"
    )
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
    try:
        return _worker(args) if under_torchrun() else _launch(args)
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
    parts = spec.split(",")
    fields = dict(part.split("=", 1) for part in parts if "=" in part)
    if int(fields["rank"]) != rank:
        return None
    return Fault(int(fields["step"]), hang="hang" in parts)


def under_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def run_dir(args: argparse.Namespace) -> Path:
    return Path(args.out) if args.out else Path("runs") / Path(args.plan).stem


# ---------------------------------------------------------------------------- launcher


def _launch(args: argparse.Namespace) -> int:
    """Check what can be checked before starting processes, then exec torchrun and return its status."""
    import tempfile

    world_size = _check_before_launch(args)
    command = torchrun_command(args, world_size)
    with tempfile.TemporaryDirectory(prefix="meshplan-errors-") as errors:
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **{_ERRORS_ENV: errors})
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            return _run_torchrun(command, env, Path(errors))
        except KeyboardInterrupt:
            return 130


# The folder where a worker that stops on a user mistake leaves its message (`rank<R>.txt`).
# Printing it from the worker races with torchrun, which may stop rank 0 before it prints,
# or print its failure report first: the launcher reads the files after torchrun is done.
_ERRORS_ENV = "MESHPLAN_ERRORS"


# torchrun's own log lines: "E1122 03:54:31.754000 4560 .../torch/distributed/elastic/...] failed (exitcode: 2)"
_TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
_USER_ERROR_EXIT = re.compile(r"exitcode\s*:\s*2\b")
# a worker's report of a collective that failed (`PeerFailure`, runtime/watchdog.py), and its hint line
_PEER_FAILURE = re.compile(r"^meshplan: error: (rank (\d+) (?:waited|timed out|failed)\b.*)$", re.M)
_HINT = "  hint: "


def _run_torchrun(command: list[str], env: dict[str, str], errors: Path) -> int:
    """Run torchrun, passing the workers' stderr through live. When a worker stopped on a user
    mistake (exit 2), its message (left in `errors`) is the report: torchrun's failure report
    and traceback are noise and are dropped; for any other failure they are shown. A worker's
    report of a failed collective is held back too: when that rank failed first it is the summary."""
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stderr is not None
    held: list[str] = []
    for line in proc.stderr:
        failing = _PEER_FAILURE.match(line) or (
            _TORCHRUN_LOG.match(line) and ("closing signal" in line or line.startswith("E"))
        )
        if held or failing:
            held.append(line)  # the failure reports (and all after them), kept for later
        else:
            sys.stderr.write(line)
    status = proc.wait()
    report = "".join(held)
    if status != 0 and _USER_ERROR_EXIT.search(report):
        said = sorted(errors.glob("rank*.txt"), key=lambda f: int(f.stem[4:]))
        sys.stderr.write(said[0].read_text() if said else report)
        return EXIT_USER
    culprit = first_failure(report)
    if status != 0 and culprit is not None and not os.environ.get("MESHPLAN_DEBUG"):
        reports = [line for line in held if _PEER_FAILURE.match(line) and culprit not in line]
        hints = [line for line in held if line.startswith(_HINT)]
        sys.stderr.writelines(reports)  # the other ranks' collectives
        print(
            f"meshplan: error: {culprit}; torchrun stopped the other ranks "
            "(MESHPLAN_DEBUG=1 shows torchrun's report)",
            file=sys.stderr,
        )
        sys.stderr.writelines(hints[:1])
        return status
    sys.stderr.writelines(held)
    return status


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def first_failure(report: str) -> str | None:
    """`rank 1 failed first (exit code 137: killed)`, from torchrun's failure report; when that
    rank gave up on a collective and said so in `report`, its own line: `rank 0 waited 10 s in
    all_reduce over dp (...); rank 1 did not join it (stuck or dead)`.

    torchrun's root cause is the failure it observed first, which can be a peer of a rank that
    died (both exit within milliseconds): a rank that died on its own (killed, crashed) is the
    cause whenever the root cause is only a collective that failed because of it."""
    m = _ROOT_CAUSE.search(report)
    if m is None:
        return None
    rank, code = int(m.group(1)), int(m.group(2))
    if code == EXIT_PEER:
        died = [(r, c) for r, c in _failures(report) if c not in (EXIT_PEER, -signal.SIGTERM)]
        rank, code = died[0] if died else (rank, code)
    said = {int(p.group(2)): p.group(1) for p in _PEER_FAILURE.finditer(report)}
    if code == EXIT_PEER and rank in said:
        return said[rank]
    if code < 0:
        how = f"killed by signal {-code}"
    elif code == 137:
        how = "exit code 137: killed"
    elif code == EXIT_PEER:
        how = "a collective failed"
    else:
        how = f"exit code {code}"
    return f"rank {rank} failed first ({how})"


_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _failures(report: str) -> list[tuple[int, int]]:
    """(rank, exit code) of every failed worker torchrun's report lists."""
    return [(int(m.group(1)), int(m.group(2))) for m in _FAILURE.finditer(report)]


def torchrun_command(args: argparse.Namespace, world_size: int) -> list[str]:
    """`python -m torch.distributed.run ... -m meshplan.run PLAN <worker options>`."""
    nnodes = str(args.nnodes)
    nproc = args.nproc_per_node or _per_node(world_size, nnodes)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if args.rdzv_endpoint is None and nnodes == "1":
        cmd.append("--standalone")  # a free local port: runs side by side never collide
    for dest in TORCHRUN_FLAGS[1:]:
        value = getattr(args, dest)
        if value is not None:
            cmd.append(f"--{dest.replace('_', '-')}={value}")
    return [*cmd, "-m", "meshplan.run", *worker_argv(args)]


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The options a worker gets: the user's, minus torchrun's."""
    out = [args.plan]
    for dest, flag in WORKER_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            out += [flag, str(value)]
    if args.resume:
        out.append("--resume")
    return out


def _per_node(world_size: int, nnodes: str) -> int:
    if not nnodes.isdigit() or int(nnodes) < 1:
        raise RunError(f"--nnodes {nnodes}: give a fixed number of nodes, or pass --nproc-per-node too")
    n = int(nnodes)
    if world_size % n:
        raise RunError(f"the mesh has {world_size} ranks, not divisible over --nnodes {n}")
    return world_size // n


def _check_before_launch(args: argparse.Namespace) -> int:
    """The plan, the features `run` supports, the data: errors here cost no process start-up."""
    from meshplan.dsl import PlanError, load_plan
    from meshplan.main import _report

    world = None
    if args.nproc_per_node is not None and str(args.nnodes).isdigit():
        world = args.nproc_per_node * int(args.nnodes)
    try:
        plan = load_plan(args.plan, world_size=world)
    except PlanError as e:
        _report(e)
        raise RunError(f"{args.plan} has errors (see above)") from None
    if plan.mesh.world_size is None:
        raise RunError(f"{args.plan}: the mesh has a `*` axis; pass --nproc-per-node N to size it")
    check_supported(plan)
    if args.data is not None and ":" not in args.data and not Path(args.data).is_file():
        raise RunError(f"data file {args.data!r} does not exist (hint: pass a text file or FILE.py:factory)")
    if args.resume and args.out is None and not run_dir(args).exists():
        raise RunError(f"--resume: no run folder {run_dir(args)} (hint: pass the --out of the run to resume)")
    return plan.mesh.world_size


def check_supported(plan: Any) -> None:
    """Plan features the compiler accepts but `meshplan run` does not execute yet: refuse, don't ignore."""
    missing = []
    if plan.pipeline is not None:
        missing.append("pipeline parallelism")
    dp = plan.data_parallel
    if dp is not None and dp.zero == 0 and dp.offload_optimizer:
        missing.append("optimizer offload without ZeRO (use zero = 1 or more)")
    pr = plan.precision
    if (pr.params, pr.grads) != ("fp32", "fp32"):
        missing.append(f"{pr.params} parameters / {pr.grads} gradients (master weights stay fp32)")
    kinds = sorted({r.kind for r in plan.rules} - {"tensor", "sequence", "dtype", "checkpoint"})
    missing += [f"`{kind}` rules" for kind in kinds]
    if missing:
        raise RunError(
            f"{plan.path}: meshplan run does not execute {', '.join(missing)} yet "
            "(hint: `meshplan check`/`explain` accept the plan; remove these for now to train)"
        )


# ---------------------------------------------------------------------------- worker


@dataclass(frozen=True)
class Prepared:
    """Everything one rank trains with."""

    program: Any  # the rank's fx.GraphModule
    loss_of: Any
    batches: Any
    groups: Any
    dp: Any
    sharded: set[str]
    accumulation: int
    loss_scale: str | float | None = None  # the plan's: "dynamic", a fixed scale, or None
    export_sharding: dict = field(default_factory=dict)  # param -> its Cut over tp, for --export
    export_names: frozenset = frozenset()  # the unpartitioned model's state_dict keys
    tied: tuple = ()  # the names of each weight the model holds under several (GPT-2's wte / lm_head)


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from meshplan.compiler.errors import CompileError
    from meshplan.dsl import PlanError
    from meshplan.runtime import watchdog
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
        prepared = _prepare(args, rank, dist.get_world_size())
        summary = _train(args, prepared)
        if args.export:
            _export(args, prepared, rank)
        _teardown_in_order()
    except (PlanError, CompileError, DataError, RunError) as e:
        _say_user_error(e, rank)
        return EXIT_USER
    except RuntimeError as e:  # a collective timed out or lost its peer: one line naming it and who
        if not isinstance(e, PeerFailure) and not is_peer_failure(e):
            raise
        failure = e if isinstance(e, PeerFailure) else PeerFailure(watchdog.diagnose(e))  # start-up, export
        print(
            f"meshplan: error: {failure}\n{_HINT}continue with --resume from the last checkpoint in "
            f"{run_dir(args)} (collectives wait --timeout {args.timeout} s)",
            file=sys.stderr,
        )
        return EXIT_PEER
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return EXIT_OK if summary.steps_done >= args.steps else EXIT_USER


def _say_user_error(error: Exception, rank: int) -> None:
    """Leave the message for the launcher (every rank: whichever stops first is the one torchrun
    reports); under a user's own torchrun, rank 0 prints it."""
    import contextlib
    import io

    from meshplan.dsl import PlanError
    from meshplan.main import _report

    text = io.StringIO()
    with contextlib.redirect_stderr(text):
        if isinstance(error, PlanError):
            _report(error)
        else:
            print(f"meshplan: error: {error}", file=sys.stderr)
    folder = os.environ.get(_ERRORS_ENV)
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


def _prepare(args: argparse.Namespace, rank: int, world_size: int) -> Prepared:
    import torch

    from meshplan.compiler.capture import bind_inputs, load_model, with_token_shape
    from meshplan.compiler.compile import build_rank_program, compile_plan
    from meshplan.compiler.placement import Shard
    from meshplan.dsl import load_plan
    from meshplan.examples import CORPUS
    from meshplan.runtime.checkpoint import TensorLayout
    from meshplan.runtime.data import make_batches
    from meshplan.runtime.data_parallel import DataParallel
    from meshplan.runtime.mesh import init_mesh
    from meshplan.runtime.shards import Cut
    from meshplan.runtime.train import Groups

    plan = load_plan(args.plan, world_size=world_size)
    check_supported(plan)
    torch.manual_seed(args.seed)
    # the graph bakes in its example shapes: compile for this rank's micro-batch
    source = with_token_shape(load_model(args.model), batch=args.batch, seq=args.seq)
    compiled = compile_plan(plan, source, world_size=world_size)
    layout = compiled.layout
    mesh = init_mesh(layout, "cuda" if torch.cuda.is_available() else "cpu")
    program = build_rank_program(compiled, source.model, rank, mesh)
    if torch.cuda.is_available():
        program = program.cuda()
    coords = layout.coords(rank)
    dp_spec = plan.data_parallel
    dp_axis = dp_spec.axis if dp_spec is not None and layout.size(dp_spec.axis) > 1 else None
    dp_group = mesh.get_group(dp_axis) if dp_axis else None
    tp_axis = compiled.tensor_axis
    dp = None
    if dp_group is not None and dp_spec is not None:
        reduce_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.precision.reduce]
        if dp_spec.zero > 0:
            dp = _shard_for_zero(args, program, dp_group, dp_spec, reduce_dtype)
        else:
            dp = DataParallel(
                program,
                dp_group,
                bucket_bytes=dp_spec.bucket_bytes,
                reduce_dtype=reduce_dtype,
                axis=dp_spec.axis,
            )
    cuts = {
        name: Cut(p.dim, p.blocks, p.padded)
        for name, placement in compiled.param_placements.items()
        for p in placement.values()
        if isinstance(p, Shard)
    }
    groups = Groups(
        dp=dp_group,
        tp=mesh.get_group(tp_axis) if tp_axis and layout.size(tp_axis) > 1 else None,
        layout=TensorLayout(
            mesh.get_group(tp_axis) if tp_axis and layout.size(tp_axis) > 1 else None,
            cuts,
        ),
    )
    sharded = {
        name
        for name, placement in compiled.param_placements.items()
        if any(isinstance(p, Shard) for p in placement.values())
    }
    dp_size = layout.size(dp_axis) if dp_axis else 1
    batches = make_batches(
        args.data or str(CORPUS),
        batch=args.batch,
        seq=args.seq,
        seed=args.seed,
        dp_rank=coords[dp_axis] if dp_axis else 0,
        dp_size=dp_size,
        accumulation=plan.train.gradient_accumulation,
    )
    fault = injected_fault(rank)
    if fault is not None:
        clean_batches = batches

        def batches(step: int, micro: int):  # the same batches, with a fault injected
            if step == fault.step:
                fault.strike()
            return clean_batches(step, micro)

    forward = dp if isinstance(dp, DataParallel) else program  # ZeRO works through hooks on `program`
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, graph, template = source.model, compiled.graph, source

    def loss_of(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        call_args, call_kwargs = call_inputs(
            template.args, template.kwargs, input_ids.to(device), labels.to(device)
        )
        outputs = forward(*bind_inputs(model, graph, call_args, call_kwargs))
        return outputs[0] if isinstance(outputs, (tuple, list)) else outputs

    return Prepared(
        program,
        loss_of,
        batches,
        groups,
        dp,
        sharded,
        plan.train.gradient_accumulation,
        plan.precision.loss_scale,
        cuts,
        frozenset(source.model.state_dict()),
        _tied_names(source.model),
    )


def _tied_names(model: Any) -> tuple[tuple[str, ...], ...]:
    """The names of each weight the model holds under several: the program holds it under one
    of them, an export writes all."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _shard_for_zero(args: argparse.Namespace, program: Any, dp_group: Any, dp_spec: Any, reduce_dtype: Any):
    """ZeRO over the dp group, from dp rank 0's initial params, with `train`'s AdamW settings.

    The engine binds itself to the compiled program's ZeRO nodes (`compiler/passes/zero.py`):
    ZeRO-3 gathers layer by layer, ZeRO-1/2 overlap the post-step all-gather with forward.
    """
    from meshplan.runtime.buckets import decays
    from meshplan.runtime.data_parallel import broadcast_parameters
    from meshplan.runtime.train import TrainConfig
    from meshplan.runtime.zero import ZeroConfig, shard_for_zero

    # every rank built the same seeded model, but only each rank's own shard survives sharding
    broadcast_parameters([p for p in program.parameters() if p.requires_grad], dp_group)
    config = ZeroConfig(
        stage=dp_spec.zero,
        bucket_bytes=dp_spec.bucket_bytes,
        offload_optimizer=dp_spec.offload_optimizer,
        offload_params=dp_spec.offload_params,
        reduce_dtype=reduce_dtype,
    )
    return shard_for_zero(
        program,
        dp_group,
        config,
        lr=args.lr,
        betas=TrainConfig.betas,
        weight_decay=args.weight_decay,
        decay=decays,
        axis=dp_spec.axis,
    )


def call_inputs(args: tuple, kwargs: dict, input_ids: Any, labels: Any) -> tuple[tuple, dict]:
    """A forward call shaped like the model's example inputs, with this micro-batch's tokens.

    Positional (input_ids, labels): labels as given (already shifted, like the built-in
    Llama). Keyword `input_ids`/`labels` (Hugging Face): labels = input_ids, because those
    models shift the labels themselves.
    """
    import torch

    if "input_ids" in kwargs:
        new = dict(kwargs, input_ids=input_ids)
        if "labels" in new:
            new["labels"] = input_ids
        return args, new
    tokens = iter((input_ids, labels))
    out = tuple(
        next(tokens, a) if isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_floating_point() else a
        for a in args
    )
    return out, kwargs


INITIAL_DYNAMIC_SCALE = 2.0**16  # fp16's usual starting point; overflows halve it within a few steps


def _export(args: argparse.Namespace, prepared: Prepared, rank: int) -> None:
    """Consolidate this rank's shards into full tensors; rank 0 writes them."""

    from meshplan.runtime.export import write_state_dict

    state = consolidated_state(prepared)
    if rank == 0:
        write_state_dict(state, Path(args.export))
        print(f"exported {len(state)} tensors to {args.export}")


def consolidated_state(prepared: Prepared) -> dict[str, Any]:
    """The trained weights as the unpartitioned model's `state_dict()` (every rank gets them):
    shards gathered over tp, ZeRO's gathered, and each tied weight under every name it has."""
    import contextlib

    from meshplan.runtime.export import consolidate
    from meshplan.runtime.zero import Zero

    gathered = prepared.dp.gathered() if isinstance(prepared.dp, Zero) else contextlib.nullcontext()
    with gathered:
        state = consolidate(
            prepared.program, prepared.export_sharding, prepared.groups.tp, set(prepared.export_names)
        )
    for group in prepared.tied:
        held = next((state[name] for name in group if name in state), None)
        if held is not None:
            state.update({name: held for name in group if name not in state})
    return state


def train_config(args: argparse.Namespace, prepared: Prepared):
    """The `TrainConfig` of a run: its command line, with the plan's accumulation and loss scale."""
    from meshplan.runtime.train import TrainConfig

    return TrainConfig(
        steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        accumulation=prepared.accumulation,
        seed=args.seed,
        tokens_per_micro_step=args.batch * args.seq,
        run_dir=run_dir(args),
        save_every=args.save_every,
        resume=args.resume,
        log_every=args.log_every,
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
        loss_scale=None
        if prepared.loss_scale is None
        else (INITIAL_DYNAMIC_SCALE if prepared.loss_scale == "dynamic" else float(prepared.loss_scale)),
        dynamic_loss_scale=prepared.loss_scale == "dynamic",
    )


def _train(args: argparse.Namespace, prepared: Prepared, *, show_progress: bool | None = None):
    from meshplan.runtime.train import train

    return train(
        prepared.program,
        prepared.loss_of,
        prepared.batches,
        train_config(args, prepared),
        groups=prepared.groups,
        dp=prepared.dp,
        sharded=prepared.sharded,
        show_progress=show_progress,
    )


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
