"""The `meshplan run` launcher: check what can be checked before any process starts, start
torchrun with one worker per rank of the mesh, and turn its outcome into one message and an
exit code (0 success, 2 the user's input, 3 a run lost to something outside it: a rank killed
or stuck, a node unreachable, a rendezvous that never completed; 1 a meshplan bug).

torchrun runs watched (`torchrun.py`: a run that cannot end by itself is ended) and its outcome
is said by `outcome.py`. Workers that stop on a user mistake leave their message in the
launcher's private folder (`ERRORS_ENV`), read after torchrun is done: printing from the
worker races with torchrun stopping it.

A multi-node run's nodes share the run folder, and each node's launcher prepares it: every
write is one no other node's can break (a probe file of its own name, `program.pt` written under
a name of its own and renamed into place, a removal that tolerates the other's), and a
launcher's probe file is never taken for a run.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.errors import ERRORS_ENV, RunError, report
from meshplan.faults import parse_fault
from meshplan.options import TORCHRUN_FLAGS, RunOptions, offload_dir, run_dir

if TYPE_CHECKING:  # torch stays unimported until the checks that need it
    from meshplan.compiler.executable import Executable
    from meshplan.compiler.load import ModelSource
    from meshplan.dsl.check import Plan

DEFAULT_JOIN_S = 600  # torchrun's own rendezvous timeout (static and c10d)
# torchrun's join timeout -> when the launcher ends a torchrun whose workers never started
JOIN_MARGIN_S = 60
# every local worker ended, one failed: how long torchrun may take to end before the launcher ends it
LINGER_S = 10.0


def launch(options: RunOptions) -> int:
    """Check what can be checked before starting processes, then run torchrun, watched, and
    return the exit code of its outcome."""
    import tempfile

    from meshplan.outcome import announce_node, summarize
    from meshplan.torchrun import Watch, supervise

    prepared, world_size = prepare(options)
    command = torchrun_command(prepared, world_size)
    join_s = join_seconds(options)
    restarts = int(options.max_restarts) if str(options.max_restarts).isdigit() else 0
    # with restarts, torchrun's agent waits for a new rendezvous once its workers have ended
    linger_s = LINGER_S + restarts * (join_s + JOIN_MARGIN_S)
    with tempfile.TemporaryDirectory(prefix="meshplan-errors-") as errors:
        watch = Watch(Path(errors), nproc_per_node(prepared, world_size), join_s + JOIN_MARGIN_S, linger_s)
        if str(options.nnodes) != "1":
            where = options.rdzv_endpoint or "127.0.0.1:29500"
            print(
                f"meshplan: waiting up to {join_s} s for {options.nnodes} nodes at {where}", file=sys.stderr
            )
            watch = replace(watch, on_start=lambda ranks: announce_node(run_dir(options), ranks))
        env = dict(os.environ, **{ERRORS_ENV: errors})
        env.setdefault("OMP_NUM_THREADS", "1")
        return summarize(supervise(command, env, watch), options, Path(errors))


def prepare(options: RunOptions) -> tuple[RunOptions, int]:
    """Everything before the workers start: check the plan, the model, the data and the run folder,
    compile the program once. Returns the options the workers get (the program and the model's
    vocabulary added; a compile folder's model and shapes where the command line is silent) and
    the number of workers the mesh needs."""
    options, plan = _check_before_launch(options)
    world_size = plan.mesh.world_size
    assert world_size is not None  # `_check_before_launch` refuses a mesh it cannot size
    if options.resume:  # the checkpoint holds the state of the plan's optimizer
        _check_resumable(options, plan)
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
    if options.between_steps:  # a missing function is the user's mistake: before any worker starts
        from meshplan.compiler.errors import CompileError
        from meshplan.compiler.load import load_function

        try:
            load_function(options.between_steps, "--between-steps")
        except CompileError as e:
            raise RunError(str(e)) from None
    dp = plan.data_parallel
    if dp is not None and (dp.optimizer_on_disk or dp.params_on_disk):
        _check_offload_dir(options, plan, source, world_size)
    return options.replace(program=str(_compile_once(options, world_size, source))), world_size


def _check_resumable(options: RunOptions, plan: Plan) -> None:
    """The newest checkpoint's optimizer state is the plan's optimizer's (`_check_run_folder`
    found one): said here, before any worker starts, instead of by every worker on loading."""
    from meshplan.runtime.checkpoint import latest, optimizer_mismatch

    newest = latest(run_dir(options) / "checkpoints")
    mismatch = optimizer_mismatch(newest, plan.train.optimizer.kind) if newest is not None else ""
    if mismatch:
        raise RunError(mismatch)


def most_processes_per_node() -> int:
    """The most workers `run` starts on one node: a few per core (CPU runs oversubscribe on
    purpose: tests run 4 ranks on 2 cores), never thousands by a typo in a mesh size."""
    return max(64, 8 * (os.cpu_count() or 1))


def nproc_per_node(options: RunOptions, world_size: int) -> int:
    """How many workers torchrun starts on this node: `--nproc-per-node`, else the mesh's ranks
    over `--nnodes`; refused past `most_processes_per_node`."""
    nproc = options.nproc_per_node or _per_node(world_size, str(options.nnodes))
    if nproc > most_processes_per_node():
        raise RunError(
            f"the mesh needs {world_size:,} processes, {nproc:,} on this node, which has "
            f"{os.cpu_count()} CPUs; meshplan starts at most {most_processes_per_node()} per node "
            "(hint: check the mesh sizes, or spread the run over nodes with --nnodes)"
        )
    return nproc


def torchrun_command(options: RunOptions, world_size: int) -> list[str]:
    """`python -m torch.distributed.run ... -m meshplan.run PLAN <worker options>`."""
    nnodes = str(options.nnodes)
    nproc = nproc_per_node(options, world_size)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if options.rdzv_endpoint is None and nnodes == "1":
        cmd.append("--standalone")  # a free local port: runs side by side never collide
    for dest in TORCHRUN_FLAGS:
        value = getattr(options, dest)
        if dest in ("nproc_per_node", "nnodes", "rdzv_conf", "rdzv_timeout"):  # given above, or below
            continue
        if value is not None:
            cmd.append(f"--{dest.replace('_', '-')}={value}")
    conf = rendezvous_conf(options)
    if conf:
        cmd.append(f"--rdzv-conf={conf}")
    return [*cmd, "-m", "meshplan.run", *options.worker_argv()]


def rendezvous_conf(options: RunOptions) -> str:
    """torchrun's `--rdzv-conf`: the user's, with `--rdzv-timeout S` as the keys the rendezvous
    backend reads (a key the user gave wins): a static rendezvous's `timeout`; c10d's
    `join_timeout`, and its `read_timeout` (how long connecting to the store may take, and each
    store call after) at most 60 s, torchrun's default."""
    pairs = _conf_pairs(options.rdzv_conf)
    if options.rdzv_timeout is not None:
        s = options.rdzv_timeout
        if options.rdzv_backend in (None, "static"):
            pairs.setdefault("timeout", str(s))
        else:
            pairs.setdefault("join_timeout", str(s))
            if options.rdzv_backend == "c10d":
                pairs.setdefault("read_timeout", str(min(s, 60)))
    return ",".join(f"{key}={value}" for key, value in pairs.items())


def join_seconds(options: RunOptions) -> int:
    """How long torchrun waits for the nodes to join: `--rdzv-timeout`, else a timeout in
    `--rdzv-conf`, else torchrun's own."""
    if options.rdzv_timeout is not None:
        return options.rdzv_timeout
    pairs = _conf_pairs(options.rdzv_conf)
    for key in ("join_timeout", "timeout"):
        if pairs.get(key, "").isdigit():
            return int(pairs[key])
    return DEFAULT_JOIN_S


def _conf_pairs(text: str | None) -> dict[str, str]:
    """`key=value,key=value` -> a dict; anything else is the user's mistake, said before launch."""
    pairs: dict[str, str] = {}
    for part in (text or "").split(","):
        key, eq, value = part.partition("=")
        if not part.strip():
            continue
        if not eq or not key.strip() or not value.strip():
            raise RunError(
                f"--rdzv-conf {text!r}: {part!r} is not KEY=VALUE (hint: pairs separated by commas, "
                "e.g. join_timeout=900,read_timeout=120)"
            )
        pairs[key.strip()] = value.strip()
    return pairs


def _check_endpoint(endpoint: str) -> None:
    """`--rdzv-endpoint HOST[:PORT]`: a port that is a port (the host is torchrun's to find)."""
    host, colon, port = endpoint.rpartition(":")
    if not colon:
        host, port = endpoint, ""
    if not host.strip("[]") or (colon and not (port.isdigit() and 0 < int(port) < 65536)):
        raise RunError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (hint: the address of the node that "
            "hosts the rendezvous, e.g. node0:29500)"
        )


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
    if options.tensorboard:
        from meshplan.tensorboard import check_available

        check_available()
    _conf_pairs(options.rdzv_conf)
    if options.rdzv_endpoint is not None:
        _check_endpoint(options.rdzv_endpoint)
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
    from meshplan.compiler.executable import PROGRAM, to_executable
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
    from meshplan.compiler.print_ledger import ledger_table
    from meshplan.tensorboard import LEDGER

    program = save_program(to_executable(compiled), run_dir(options))
    _replace(program.parent / LEDGER, ledger_table(compiled).encode())  # for `--tensorboard`, and a reader
    return program


def save_program(executable: Executable, folder: Path) -> Path:
    """`folder/program.pt`, written under a name of this launcher's own and renamed into place:
    the launchers of a multi-node run write the same program into the shared folder at once."""
    from meshplan.compiler.executable import PROGRAM, save_executable

    folder.mkdir(parents=True, exist_ok=True)
    own = _own_name(folder / PROGRAM)
    save_executable(executable, own)
    own.replace(folder / PROGRAM)
    return folder / PROGRAM


def _own_name(path: Path) -> Path:
    """A temporary name beside `path` that no other launcher (of this node or another) uses."""
    import secrets

    return path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def _replace(path: Path, data: bytes) -> None:
    """`path` written whole under a name of this launcher's own, then renamed into place."""
    own = _own_name(path)
    own.write_bytes(data)
    own.replace(path)


# what a run leaves in its folder: `--overwrite` removes these, and only these
RUN_PARTS = ("checkpoints", "metrics")
PROBE = ".meshplan-probe-"  # a launcher's short-lived file, that a folder can be written: not a run


def _check_run_folder(options: RunOptions) -> None:
    """Never lose a run: a folder that holds one is continued (`--resume`) or replaced on request
    (`--overwrite`), not trained over; `--resume` with nothing to resume is said, not ignored.
    Every node of a multi-node run checks the shared folder (see the module docstring)."""
    from meshplan.outcome import clear_outcomes

    folder = run_dir(options)
    if folder.exists() and not folder.is_dir():
        raise RunError(f"--out {folder} is a file, not a folder (hint: pass a folder for the run)")
    checkpoints = _found(folder, "checkpoints/step*/.metadata")
    if options.resume and options.overwrite:
        raise RunError("--resume continues the run in --out and --overwrite replaces it: pass one")
    if options.resume:
        if not checkpoints:
            where = "no run folder" if not folder.exists() else "no complete checkpoint in"
            raise RunError(
                f"--resume: {where} {folder} (hint: pass the --out of the run to resume, or leave "
                "out --resume to start from step 0)"
            )
        clear_outcomes(folder)
        return
    held = [part for part in RUN_PARTS if _holds_a_run(folder / part)]
    if held and not options.overwrite:
        what = f"{len(checkpoints)} checkpoint{'s' * (len(checkpoints) != 1)}" if checkpoints else "metrics"
        raise RunError(
            f"{folder} already holds a run ({what}) (hint: continue it with --resume, pick another "
            "--out, or pass --overwrite to replace it)"
        )
    for part in held:
        _remove(folder / part)
    _check_writable(folder / "program.pt")  # a probe beside the parts, which another node may remove
    clear_outcomes(folder)


def _holds_a_run(part: Path) -> bool:
    """Whether a part of a run folder holds anything but a launcher's probe files."""
    return any(not p.name.startswith(PROBE) for p in _found(part, "*"))


def _found(folder: Path, pattern: str) -> list[Path]:
    """`folder.glob(pattern)`, sorted; what another node's launcher removes meanwhile is not found."""
    for _ in range(10):
        try:
            return sorted(folder.glob(pattern))
        except FileNotFoundError:
            continue
    return []


def _remove(part: Path) -> None:
    """Remove a part of a run (`--overwrite`), which another node's launcher may be removing too."""
    import shutil

    for _ in range(10):
        if not part.exists():
            return
        try:
            shutil.rmtree(part)
        except FileNotFoundError:
            continue  # removed meanwhile, in part: look again
        except OSError as e:
            raise RunError(f"--overwrite: cannot remove {part}: {e.strerror or e}") from None
    if part.exists():
        raise RunError(f"--overwrite: cannot remove {part}: it keeps changing (is a run writing it?)")


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


OFFLOAD_MARGIN = 1.1  # free space asked of the offload folder, over what its files take


def _check_offload_dir(options: RunOptions, plan: Plan, source: ModelSource, world_size: int) -> None:
    """`offload = optimizer:disk` or `params:disk`: that its folder can be written and holds this
    node's ranks' files (`runtime/disk_offload.py`), with `OFFLOAD_MARGIN`, before any worker
    starts. The bytes are an upper bound: the trainable parameters over the data-parallel size,
    as if no other axis cut them, times an fp32 master and two moments (AdamW's; no optimizer has
    more) and the parameters' own bytes. Files a resumed run left there are overwritten in place,
    so they count as free."""
    import shutil
    import tempfile

    from meshplan.runtime.disk_offload import state_bytes

    folder = offload_dir(options)
    assert plan.data_parallel is not None
    dp_spec = plan.data_parallel
    target = "optimizer:disk" if dp_spec.optimizer_on_disk else "params:disk"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=PROBE):
            pass
    except OSError as e:
        raise RunError(
            f"`offload = {target}` cannot write its files in {folder}: {e.strerror or e} "
            "(hint: pass --offload-dir with a writable folder)"
        ) from None
    dp = plan.mesh.size(dp_spec.axis) or 1
    trainable = [p for p in source.model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    per_rank = state_bytes(-(-numel // dp), 2) if dp_spec.optimizer_on_disk else 0
    if dp_spec.params_on_disk:  # each rank's shards, in the parameters' dtype
        per_rank += sum(-(-p.numel() // dp) * p.element_size() for p in trainable)
    need = nproc_per_node(options, world_size) * per_rank
    need -= sum(
        f.stat().st_size for f in [*folder.glob("rank*/flat*.bin"), *folder.glob("rank*/params*.bin")]
    )
    free = shutil.disk_usage(folder).free
    if free < need * OFFLOAD_MARGIN:
        raise RunError(
            f"--offload-dir {folder} has {free / 2**20:,.0f} MiB free, but `offload = {target}` "
            f"needs up to {need * OFFLOAD_MARGIN / 2**20:,.0f} MiB there for this node's ranks "
            "(hint: free space, or pass --offload-dir on a larger disk)"
        )


def _check_writable(path: Path) -> None:
    """That a file can be created at `path` (its folder made if needed), before hours of training."""
    import tempfile

    if path.is_dir():
        raise RunError(f"{path} is a folder; name a file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=PROBE):
            pass
    except OSError as e:
        raise RunError(f"cannot write {path}: {e.strerror or e} (hint: pick a writable place)") from None
