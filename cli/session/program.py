"""The program a rank runs, loaded or compiled: the launcher's `program.pt` (or a compile folder's),
checked against the model and the run's shapes, or under a user's own torchrun on a plan, compiled
by the rank itself for its micro-batch. Either is a `compiler.lower.Program`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.errors import RunError

if TYPE_CHECKING:
    from torch import nn

    from meshplan.compiler.executable import Executable
    from meshplan.compiler.load import ModelSource
    from meshplan.compiler.lower import Program
    from meshplan.dsl.check import Plan
    from meshplan.options import RunOptions


def with_folder(options: RunOptions) -> RunOptions:
    """A worker's options on a compile folder (started by the user's own torchrun, so no launcher
    gave it `--program`): the folder's program, and its model and shapes where the options are
    silent."""
    if options.program is not None or not Path(options.plan).is_dir():
        return options
    from meshplan.compiler.executable import PROGRAM

    _, options = compiled_folder(options)
    return options.replace(program=str(Path(options.plan) / PROGRAM))


def program_for(options: RunOptions, source: ModelSource, world_size: int) -> tuple[Program, Plan]:
    """The program and its plan: the compiled one (`--program`) checked against the model and
    shapes, else the plan compiled here for this run's shapes only (a rank that compiles for itself
    never runs other ones, and symbolic shapes cost a compile about 2.7 times as much)."""
    from meshplan.compiler.compile import compile_plan
    from meshplan.dsl import load_plan
    from meshplan.dsl.check import check_text

    if options.program:
        program = load_program(Path(options.program), source.model, batch=options.batch, seq=options.seq)
        return program, check_text(program.plan_text, program.plan_name, world_size=world_size)
    plan = load_plan(options.plan, world_size=world_size)
    check_supported(plan)
    return compile_plan(plan, source, world_size=world_size, dynamic=False), plan


def check_supported(plan: Plan) -> None:
    """Plan features the compiler accepts but `meshplan run` does not execute yet: refuse, don't ignore."""
    missing = []
    dp = plan.data_parallel
    if dp is not None and dp.zero == 0 and dp.offload_optimizer:
        missing.append("optimizer offload without ZeRO (use zero = 1 or more)")
    pr = plan.precision
    if (pr.params, pr.grads) != ("fp32", "fp32"):
        missing.append(f"{pr.params} parameters / {pr.grads} gradients (master weights stay fp32)")
    kinds = sorted(
        {r.kind for r in plan.rules}
        - {"tensor", "sequence", "dtype", "checkpoint", "context", "experts", "device"}
    )
    missing += [f"`{kind}` rules" for kind in kinds]
    if missing:
        raise RunError(
            f"{plan.path}: meshplan run does not execute {', '.join(missing)} yet "
            "(hint: `meshplan check`/`explain` accept the plan; remove these for now to train)"
        )


def compiled_folder(options: RunOptions) -> tuple[Executable, RunOptions]:
    """`meshplan run DIR` of a `meshplan compile -o DIR` folder: its program, and the options with
    those it was compiled for where the command line does not give them (the model, --batch, --seq)."""
    from meshplan.args import given
    from meshplan.compiler.artifact import ArtifactError, read_artifact
    from meshplan.compiler.executable import PROGRAM, ExecutableError, load_executable

    folder = Path(options.plan)
    try:
        manifest = read_artifact(folder)
        executable = load_executable(folder / PROGRAM)
    except (ArtifactError, ExecutableError) as e:
        raise RunError(str(e)) from None
    if not given(options.model) and manifest.get("model"):
        options = options.replace(model=manifest["model"])
    if executable.token_shape is not None:
        batch, seq = executable.token_shape
        options = options.replace(
            batch=options.batch if given(options.batch) else batch,
            seq=options.seq if given(options.seq) else seq,
        )
    return executable, options


def load_program(path: Path, model: nn.Module, *, batch: int, seq: int) -> Executable:
    """The compiled program at `path`, checked against the run: the same model structure and a
    (batch, seq) it serves (any its splits divide, for a program with symbolic shapes; else the
    one it was compiled for). A mismatch is the user's to fix (`RunError`)."""
    from meshplan.compiler.executable import ExecutableError, load_executable

    try:
        executable = load_executable(path, model)
    except ExecutableError as e:
        raise RunError(str(e)) from None
    if executable.shapes is None and executable.token_shape not in (None, (batch, seq)):
        b, t = executable.token_shape
        raise RunError(
            f"{path} was compiled for --batch {b} --seq {t}, not --batch {batch} --seq {seq} "
            f"(hint: run with --batch {b} --seq {t}, or compile again with the shapes you want)"
        )
    problems = executable.shape_problems(batch, seq)
    if problems:
        raise RunError(
            f"{path} cannot run --batch {batch} --seq {seq}: {'; '.join(problems)}{_shape_hint(executable)}"
        )
    return executable


def _shape_hint(executable: Executable) -> str:
    """` (hint: ...)` naming the steps of the shapes the program runs."""
    if executable.shapes is None:
        return ""
    b, s = executable.shapes.multiples()
    steps = [f"--seq a multiple of {s}"] * (s > 1) + [f"--batch a multiple of {b}"] * (b > 1)
    return f" (hint: pass {' and '.join(steps)})" if steps else ""
