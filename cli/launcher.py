"""The `meshplan run` launcher: check what can be checked before any process starts, start
torchrun with one worker per rank of the mesh, and turn its outcome into one message and an
exit code (0 success, 2 the user's input, 3 a rank lost or stuck, 1 a meshplan bug).

Workers that stop on a user mistake leave their message in a folder (`ERRORS_ENV`), read
after torchrun is done: printing from the worker races with torchrun stopping it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.errors import ERRORS_ENV, EXIT_INTERNAL, EXIT_PEER, EXIT_USER, HINT, RunError, report
from meshplan.faults import parse_fault
from meshplan.options import TORCHRUN_FLAGS, RunOptions, run_dir

if TYPE_CHECKING:  # torch stays unimported until the checks that need it
    from meshplan.compiler.load import ModelSource
    from meshplan.dsl.check import Plan


def launch(options: RunOptions) -> int:
    """Check what can be checked before starting processes, then exec torchrun and return its status."""
    import tempfile

    command = torchrun_command(*prepare(options))
    with tempfile.TemporaryDirectory(prefix="meshplan-errors-") as errors:
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **{ERRORS_ENV: errors})
        env.setdefault("OMP_NUM_THREADS", "1")
        return _run_torchrun(command, env, Path(errors))


def prepare(options: RunOptions) -> tuple[RunOptions, int]:
    """Everything before the workers start: check the plan, the model, the data and the run folder,
    compile the program once. Returns the options the workers get (the program and the model's
    vocabulary added; a compile folder's model and shapes where the command line is silent) and
    the number of workers the mesh needs."""
    options, plan = _check_before_launch(options)
    world_size = plan.mesh.world_size
    assert world_size is not None  # `_check_before_launch` refuses a mesh it cannot size
    source = _model_source(options)
    if options.init:  # every key and shape from the files' headers, before any worker starts
        from meshplan.compiler.pretrained import InitError
        from meshplan.pretrained import open_init

        try:
            weights = open_init(options.init)
            weights.check(source.model)
        except InitError as e:
            raise RunError(str(e)) from None
        print(f"meshplan: starting from the weights in {weights.path}", file=sys.stderr)
    options = options.replace(vocab_size=_check_data(options, plan, source))
    if options.between_steps and plan.pipeline is not None:
        from meshplan.session import PIPELINE_BETWEEN_STEPS

        raise RunError(PIPELINE_BETWEEN_STEPS)
    if options.between_steps:  # a missing function is the user's mistake: before any worker starts
        from meshplan.compiler.errors import CompileError
        from meshplan.compiler.load import load_function

        try:
            load_function(options.between_steps, "--between-steps")
        except CompileError as e:
            raise RunError(str(e)) from None
    return options.replace(program=str(_compile_once(options, world_size, source))), world_size


# Signals that end a run: passed on to torchrun, which stops its workers (a worker killed
# mid-save leaves the previous checkpoint: saves are atomic). The launcher then exits with
# 128 + the signal's number, as a shell reports a process ended by it.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _die_with_parent() -> None:
    """In torchrun's process, before it starts: a SIGTERM when the launcher dies, even by SIGKILL,
    so torchrun never trains on as an orphan (Linux; elsewhere the launcher's handlers only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# torchrun's own log lines: "E1122 03:54:31.754000 4560 .../torch/distributed/elastic/...] failed (exitcode: 2)"
_TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
_USER_ERROR_EXIT = re.compile(r"exitcode\s*:\s*2\b")
# a worker's report of a collective that failed (`PeerFailure`, runtime/watchdog.py), and its hint line
_PEER_FAILURE = re.compile(r"^meshplan: error: (rank (\d+) (?:waited|timed out|failed)\b.*)$", re.M)


def _run_torchrun(command: list[str], env: dict[str, str], errors: Path) -> int:
    """Run torchrun, passing the workers' stderr through live. When a worker stopped on a user
    mistake (exit 2), its message (left in `errors`) is the report: torchrun's failure report
    and traceback are noise and are dropped; for any other failure they are shown. A worker's
    report of a failed collective is held back too: when that rank failed first it is the summary."""
    proc = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1, preexec_fn=_die_with_parent
    )
    assert proc.stderr is not None
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    held: list[str] = []
    try:
        for line in proc.stderr:
            failing = _PEER_FAILURE.match(line) or (
                _TORCHRUN_LOG.match(line) and ("closing signal" in line or line.startswith("E"))
            )
            if held or failing:
                held.append(line)  # the failure reports (and all after them), kept for later
            else:
                sys.stderr.write(line)
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        name = signal.Signals(received[0]).name
        print(
            f"meshplan: stopped by {name}: every worker has ended; checkpoints already written are "
            "complete (continue with --resume)",
            file=sys.stderr,
        )
        return 128 + received[0]
    report = "".join(held)
    if status != 0 and _USER_ERROR_EXIT.search(report):
        said = sorted(errors.glob("rank*.txt"), key=lambda f: int(f.stem[4:]))
        sys.stderr.write(said[0].read_text() if said else report)
        return EXIT_USER
    found = _first_failure(report) if status != 0 else None
    if found is None:
        sys.stderr.writelines(held)
        return status
    culprit, code = found
    if os.environ.get("MESHPLAN_DEBUG"):
        sys.stderr.writelines(held)
    else:
        reports = [line for line in held if _PEER_FAILURE.match(line) and culprit not in line]
        hints = [line for line in held if line.startswith(HINT)]
        sys.stderr.writelines(reports)  # the other ranks' collectives
        print(
            f"meshplan: error: {culprit}; torchrun stopped the other ranks "
            "(MESHPLAN_DEBUG=1 shows torchrun's report)",
            file=sys.stderr,
        )
        sys.stderr.writelines(hints[:1])
    # torchrun itself exits 1 whatever failed: a worker that exited 1 hit a meshplan bug (and said
    # so); one killed, crashed or stopped in a collective is a rank lost or stuck
    return EXIT_INTERNAL if code == EXIT_INTERNAL else EXIT_PEER


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def first_failure(report: str) -> str | None:
    """`rank 1 failed first (exit code 137: killed)`, from torchrun's failure report; when that
    rank gave up on a collective and said so in `report`, its own line: `rank 0 waited 10 s in
    all_reduce over dp (...); rank 1 did not join it (stuck or dead)`.

    torchrun's root cause is the failure it observed first, which can be a peer of a rank that
    died (both exit within milliseconds): a rank that died on its own (killed, crashed) is the
    cause whenever the root cause is only a collective that failed because of it."""
    found = _first_failure(report)
    return found[0] if found is not None else None


def _first_failure(report: str) -> tuple[str, int] | None:
    """`first_failure`'s line and the exit code of the rank it names."""
    m = _ROOT_CAUSE.search(report)
    if m is None:
        return None
    rank, code = int(m.group(1)), int(m.group(2))
    if code == EXIT_PEER:
        died = [(r, c) for r, c in _failures(report) if c not in (EXIT_PEER, -signal.SIGTERM)]
        rank, code = died[0] if died else (rank, code)
    said = {int(p.group(2)): p.group(1) for p in _PEER_FAILURE.finditer(report)}
    if code == EXIT_PEER and rank in said:
        return said[rank], code
    if code < 0:
        how = f"killed by signal {-code}"
    elif code == 137:
        how = "exit code 137: killed"
    elif code == EXIT_PEER:
        how = "a collective failed"
    else:
        how = f"exit code {code}"
    return f"rank {rank} failed first ({how})", code


_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _failures(report: str) -> list[tuple[int, int]]:
    """(rank, exit code) of every failed worker torchrun's report lists."""
    return [(int(m.group(1)), int(m.group(2))) for m in _FAILURE.finditer(report)]


def most_processes_per_node() -> int:
    """The most workers `run` starts on one node: a few per core (CPU runs oversubscribe on
    purpose: tests run 4 ranks on 2 cores), never thousands by a typo in a mesh size."""
    return max(64, 8 * (os.cpu_count() or 1))


def torchrun_command(options: RunOptions, world_size: int) -> list[str]:
    """`python -m torch.distributed.run ... -m meshplan.run PLAN <worker options>`."""
    nnodes = str(options.nnodes)
    nproc = options.nproc_per_node or _per_node(world_size, nnodes)
    if nproc > most_processes_per_node():
        raise RunError(
            f"the mesh needs {world_size:,} processes, {nproc:,} on this node, which has "
            f"{os.cpu_count()} CPUs; meshplan starts at most {most_processes_per_node()} per node "
            "(hint: check the mesh sizes, or spread the run over nodes with --nnodes)"
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if options.rdzv_endpoint is None and nnodes == "1":
        cmd.append("--standalone")  # a free local port: runs side by side never collide
    for dest in TORCHRUN_FLAGS:
        value = getattr(options, dest)
        if dest in ("nproc_per_node", "nnodes"):  # given above
            continue
        if value is not None:
            cmd.append(f"--{dest.replace('_', '-')}={value}")
    return [*cmd, "-m", "meshplan.run", *options.worker_argv()]


def _per_node(world_size: int, nnodes: str) -> int:
    if not nnodes.isdigit() or int(nnodes) < 1:
        raise RunError(f"--nnodes {nnodes}: give a fixed number of nodes, or pass --nproc-per-node too")
    n = int(nnodes)
    if world_size % n:
        raise RunError(f"the mesh has {world_size} ranks, not divisible over --nnodes {n}")
    return world_size // n


def _check_before_launch(options: RunOptions) -> tuple[RunOptions, Plan]:
    """The plan, the features `run` supports, the paths: errors here cost no process start-up.
    For a compile folder, the options with its model and shapes where the command line is silent."""
    from meshplan.dsl import PlanError, check_text, load_plan
    from meshplan.session import check_supported, compiled_folder

    world = None
    if options.nproc_per_node is not None and str(options.nnodes).isdigit():
        world = options.nproc_per_node * int(options.nnodes)
    try:
        if Path(options.plan).is_dir():
            executable, options = compiled_folder(options)
            world = executable.layout.world_size
            plan = check_text(executable.plan_text, executable.plan_name, world_size=world)
        else:
            plan = load_plan(options.plan, world_size=world)
    except PlanError as e:
        report(e)
        raise RunError(f"{options.plan} has errors (see above)") from None
    if plan.mesh.world_size is None:
        raise RunError(f"{options.plan}: the mesh has a `*` axis; pass --nproc-per-node N to size it")
    check_supported(plan)
    if options.data is not None and ":" not in options.data and not Path(options.data).is_file():
        raise RunError(
            f"data file {options.data!r} does not exist (hint: pass a text file or FILE.py:factory)"
        )
    if options.init and options.resume:
        raise RunError(
            "--init and --resume: a resumed run continues from its own checkpoint (hint: drop --init)"
        )
    _check_run_folder(options)
    if os.environ.get("MESHPLAN_FAULT"):
        parse_fault(os.environ["MESHPLAN_FAULT"])
    if options.export:
        _check_export(Path(options.export), overwrite=options.overwrite)
    return options, plan


def _model_source(options: RunOptions) -> ModelSource:
    """The model from its factory (on the meta device where it builds there), with token inputs
    of the run's micro-batch: a factory that fails, or a `--seq` beyond the positions the model's
    config allows, is said here."""
    from meshplan.args import given
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.errors import CompileError
    from meshplan.compiler.load import load_model, on_meta_inputs

    try:
        # the launcher checks and compiles: shapes suffice, the ranks build the weights; a --seq
        # the user gave for a model whose inputs have no sequence is refused
        source = with_token_shape(
            load_model(options.model, shapes_only=True),
            batch=options.batch,
            seq=options.seq,
            seq_asked=given(options.seq),
        )
        return on_meta_inputs(source)
    except CompileError as e:
        raise RunError(str(e)) from None


def _check_data(options: RunOptions, plan: Plan, source: ModelSource) -> int | None:
    """The run's data as the first rank of the data axis sees it, before any process starts: the
    file exists, a factory runs, its first batch has the run's shapes (or the program's inputs,
    for a model that takes no token ids), and the token ids (every byte of a text file) are ids
    the model embeds. Returns that vocabulary size: the workers check every later batch against
    it (`--vocab-size`). A model that takes no token ids trains on random batches without
    `--data`, which is said here."""
    from meshplan.batches import drawn_note, example_batch, run_batches
    from meshplan.compiler.load import vocab_size
    from meshplan.examples import CORPUS
    from meshplan.runtime.data import DataError

    dp, pipeline = plan.data_parallel, plan.pipeline
    vocab = vocab_size(source.model)
    # a pipeline's micro-step is `microbatches` batches of --batch sequences
    microbatches = (pipeline.microbatches or plan.mesh.size(pipeline.axis) or 1) if pipeline else 1
    if options.data is None and example_batch(source) is not None:
        print(f"meshplan: {drawn_note(source, options.batch * microbatches)}", file=sys.stderr)
        return vocab
    try:
        batches = run_batches(
            source,
            options.data,
            corpus=str(CORPUS),
            batch=options.batch * microbatches,
            seq=options.seq,
            seed=options.seed,
            dp_rank=0,
            dp_size=(plan.mesh.size(dp.axis) or 1) if dp is not None else 1,
            accumulation=plan.train.gradient_accumulation,
            vocab_size=vocab,
        )
        batches(0, 0)
    except DataError as e:
        raise RunError(str(e)) from None
    return vocab


def _compile_once(options: RunOptions, world_size: int, source: ModelSource) -> Path:
    """The program every worker runs, compiled here before any process starts: plan and model
    problems cost no start-up, and each rank loads it instead of capturing the model again.
    A compile folder's program is only checked against the model; a plan's is compiled for the
    run's micro-batch and kept in the run folder (`program.pt`)."""
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.errors import CompileError
    from meshplan.compiler.executable import PROGRAM, save_executable, to_executable
    from meshplan.dsl import PlanError, load_plan
    from meshplan.session import load_program

    try:
        if Path(options.plan).is_dir():
            program = Path(options.plan) / PROGRAM
            load_program(program, source.model, batch=options.batch, seq=options.seq)
            return program
        plan = load_plan(options.plan, world_size=world_size)
        # for the run's micro-batch only (the workers run no other): symbolic shapes would cost
        # the start-up about 2.7 times the compile
        compiled = compile_plan(plan, source, world_size=world_size, dynamic=False)
    except PlanError as e:
        report(e)
        raise RunError(f"{options.plan} does not fit the model (see above)") from None
    except CompileError as e:
        raise RunError(str(e)) from None
    out = run_dir(options)
    out.mkdir(parents=True, exist_ok=True)
    save_executable(to_executable(compiled), out / PROGRAM)
    return out / PROGRAM


# what a run leaves in its folder: `--overwrite` removes these, and only these
RUN_PARTS = ("checkpoints", "metrics")


def _check_run_folder(options: RunOptions) -> None:
    """Never lose a run: a folder that holds one is continued (`--resume`) or replaced on request
    (`--overwrite`), not trained over; `--resume` with nothing to resume is said, not ignored."""
    import shutil

    folder = run_dir(options)
    if folder.exists() and not folder.is_dir():
        raise RunError(f"--out {folder} is a file, not a folder (hint: pass a folder for the run)")
    checkpoints = sorted(folder.glob("checkpoints/step*/.metadata"))
    if options.resume and options.overwrite:
        raise RunError("--resume continues the run in --out and --overwrite replaces it: pass one")
    if options.resume:
        if not checkpoints:
            where = "no run folder" if not folder.exists() else "no complete checkpoint in"
            raise RunError(
                f"--resume: {where} {folder} (hint: pass the --out of the run to resume, or leave "
                "out --resume to start from step 0)"
            )
        return
    held = [part for part in RUN_PARTS if any((folder / part).glob("*"))]
    if held and not options.overwrite:
        what = f"{len(checkpoints)} checkpoint{'s' * (len(checkpoints) != 1)}" if checkpoints else "metrics"
        raise RunError(
            f"{folder} already holds a run ({what}) (hint: continue it with --resume, pick another "
            "--out, or pass --overwrite to replace it)"
        )
    for part in held:
        shutil.rmtree(folder / part)
    _check_writable(folder / "metrics" / "rank0.jsonl")


def _check_export(export: Path, *, overwrite: bool) -> None:
    """That `--export` can be written and replaces nothing unasked: a file (`.safetensors`, `.pt`,
    ...) or a folder (`exports_a_folder`: any other path), refused where it already holds
    something unless `--overwrite`."""
    from meshplan.runtime.export import exports_a_folder

    if not exports_a_folder(export):
        if export.is_file() and not overwrite:
            raise RunError(
                f"--export {export} exists (hint: name another file, or pass --overwrite to replace it)"
            )
        _check_writable(export)
        return
    if export.is_dir() and any(export.iterdir()) and not overwrite:
        raise RunError(
            f"--export {export} is a folder that is not empty (hint: name another folder, or pass "
            "--overwrite to replace the weights in it)"
        )
    _check_writable(export / "model.safetensors")


def _check_writable(path: Path) -> None:
    """That a file can be created at `path` (its folder made if needed), before hours of training."""
    import tempfile

    if path.is_dir():
        raise RunError(f"{path} is a folder; name a file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".meshplan-probe-"):
            pass
    except OSError as e:
        raise RunError(f"cannot write {path}: {e.strerror or e} (hint: pick a writable place)") from None
