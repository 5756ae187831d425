"""The `meshplan` command line.

    meshplan check examples/llama_tp.plan --world-size 4
    meshplan fmt --check examples/*.plan

Exit codes: 0 success, 1 internal error (a bug in meshplan), 2 a problem with the
user's input (plan, model, arguments), reported with its location; `estimate --memory`: 3
when a rank's estimated peak does not fit; 141 when the reader of the output left (`| head`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from meshplan.args import DefaultInt, memory_size, positive_int
from meshplan.dsl import Plan, PlanError, load_plan, parse, read_plan_text
from meshplan.dsl.fmt import format_plan
from meshplan.errors import EXIT_OK, EXIT_USER, UsageError, guarded, report, use_color
from meshplan.for_model import compiled_for_model, print_warnings, this_machine

EXIT_NOT_CANONICAL = 1  # `fmt --check`, like other formatters' check modes


# ---------------------------------------------------------------------------- commands


def cmd_check(args: argparse.Namespace) -> int:
    status = EXIT_OK
    if args.model is not None:
        if len(args.plans) != 1:
            raise UsageError("--model checks one plan at a time")
        args.plan = args.plans[0]
        compiled = compiled_for_model(args)
        print(summarize(compiled.plan))
        print(
            f"  model      {args.model}: {len(compiled.resolution.placements)} modules placed, "
            f"{compiled.ledger.collectives().count()} collectives per step"
        )
        return EXIT_OK
    for path in args.plans:
        try:
            plan = load_plan(path, world_size=args.world_size)
        except PlanError as e:
            report(e)
            status = EXIT_USER
            continue
        print_warnings(plan)
        print(summarize(plan))
    return status


def cmd_fmt(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.plans:
        try:
            text = read_plan_text(path)
            formatted = format_plan(parse(text, str(path)), text)
        except PlanError as e:
            report(e)
            status = EXIT_USER
            continue
        if args.check:
            if formatted != text:
                print(f"{path}: not canonical (run `meshplan fmt --write {path}`)", file=sys.stderr)
                status = status or EXIT_NOT_CANONICAL
        elif args.write:
            if formatted != text:
                Path(path).write_text(formatted, encoding="utf-8")
                print(f"formatted {path}")
        else:
            sys.stdout.write(formatted)
    return status


def cmd_explain(args: argparse.Namespace) -> int:
    from meshplan.compiler.print_explain import explain
    from meshplan.compiler.print_ledger import ledger_table

    compiled = compiled_for_model(args)
    print(explain(compiled))
    print(ledger_table(compiled), end="")
    return EXIT_OK


EXIT_DOES_NOT_FIT = 3  # `estimate --memory`: some rank's estimated peak is over the limit


def cmd_estimate(args: argparse.Namespace) -> int:
    import json

    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.hardware import hardware
    from meshplan.compiler.print_estimate import estimate_text

    if args.calibrate:
        _calibrate()
        if args.plan is None:
            return EXIT_OK
    if args.plan is None or args.model is None:
        raise UsageError("estimate needs a PLAN and --model SPEC (or --calibrate alone)")
    hw = hardware(args.hardware or this_machine())
    compiled = compiled_for_model(args, dynamic=False)
    est = estimate(compiled, limit=args.memory, hw=hw, routing=args.routing)
    if args.json:
        print(json.dumps(est.to_json(), indent=2))
    else:
        print(estimate_text(est), end="")
    return EXIT_OK if est.fits else EXIT_DOES_NOT_FIT


def _calibrate() -> None:
    import dataclasses

    import torch

    from meshplan.compiler.hardware import calibrate, write_entry
    from meshplan.compiler.step_time import crowding, fit_block
    from meshplan.runtime.handoff_cost import CORES, can_share_cores
    from meshplan.runtime.handoff_cost import measure as handoff
    from meshplan.runtime.loop_cost import measure

    print("measuring this machine (about 50 s) ...", file=sys.stderr)
    result = calibrate(loop=measure)
    hw, measured = result.hardware, result.measured
    if hw.cores:  # a CPU: what a transformer block's ops reach, beside a copy and a square matmul
        hw, fitted = fit_block(hw, torch.device("cpu"))
        measured = {**measured, **fitted}
        # and what a pipeline's message between two ranks costs as the pipeline sends it: alone,
        # and with another pipeline's two ranks on its two cores (data-parallel replicas')
        latency, shared = handoff(), None
        figure = f"{latency * 1e6:.0f} us a message (through the pipeline)"
        if can_share_cores():
            two_cores = dataclasses.replace(hw, cores=CORES)
            shared = handoff(pipelines=CORES, crowded=crowding(two_cores, 2 * CORES, 2))  # two ranks a core
            figure += f", {shared * 1e6:.0f} us with another pipeline on its cores"
        link = dataclasses.replace(hw.intra, handoff=latency, shared_handoff=shared)
        hw = dataclasses.replace(hw, intra=link, inter=link)
        measured["pipeline hand-off"] = figure
    path = write_entry(hw)
    for what, figure in measured.items():
        print(f"  {what:<18}{figure}")
    print(f"kept as `--hardware {hw.name}` in {path}")


def cmd_compile(args: argparse.Namespace) -> int:
    out = Path(args.output)
    _check_output_folder(out)  # before torch is imported and the model compiled: seconds to minutes

    from meshplan.compiler.artifact import write_artifact

    compiled = compiled_for_model(args)
    try:
        files = write_artifact(compiled, out, model_spec=args.model)
    except OSError as e:  # the folder changed, or the disk filled up, since the check
        raise UsageError(f"-o {out}: cannot write {e.filename or out}: {e.strerror or e}") from None
    ledger = compiled.ledger
    print(f"compiled {args.plan} for {compiled.layout.world_size} ranks -> {out}/")
    print(f"  {len(files)} files: {', '.join(f.name for f in files[:6])}, ...")
    print(f"  {ledger.summary()}")
    return EXIT_OK


def _check_output_folder(out: Path) -> None:
    """That `compile -o` can write its files into `out`, found by creating a file there; folders
    made for the probe are removed again, so a compile that then fails leaves nothing behind."""
    import tempfile

    hint = "hint: pass -o a folder you can write to"
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking == out:
        raise UsageError(f"-o {out}: {out} is a file, not a folder ({hint})")
    if blocking is not None:
        raise UsageError(f"-o {out}: {blocking} is a file, so it cannot hold the folder {out} ({hint})")
    made = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".meshplan-probe-"):
            pass
    except OSError as e:
        raise UsageError(f"-o {out}: cannot create files there ({e.strerror or e}) ({hint})") from None
    finally:
        for folder in made:  # innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()


def _inspect_schedule(folder: Path, form: str) -> int:
    """The pipeline's schedule: each rank's actions in time, simulated at unit costs."""
    from meshplan.compiler.executable import PROGRAM, ExecutableError, load_executable
    from meshplan.compiler.print_schedule import schedule_svg, schedule_text
    from meshplan.dsl.check import check_text
    from meshplan.runtime.schedules import build, simulate

    try:
        executable = load_executable(folder / PROGRAM)
    except ExecutableError as e:
        raise UsageError(str(e)) from None
    plan = check_text(executable.plan_text, executable.plan_name, world_size=executable.layout.world_size)
    spec = plan.pipeline
    if spec is None:
        raise UsageError(f"{folder}: its plan ({executable.plan_name}) has no pipeline, so no schedule")
    ranks = executable.layout.size(spec.axis)
    timeline = simulate(build(spec.schedule, ranks, spec.microbatches or ranks, spec.virtual_stages))
    if form == "text":
        print(schedule_text(timeline), end="")
    elif form in ("svg", "html"):
        svg = schedule_svg(timeline)
        print(svg if form == "svg" else f"<!doctype html>\n<html><body>\n{svg}</body></html>\n", end="")
    else:
        raise UsageError("--schedule draws text, svg or html")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from meshplan.compiler.artifact import ArtifactError, read_artifact
    from meshplan.compiler.print_graph import to_dot
    from meshplan.compiler.print_program import to_html

    folder = Path(args.folder)
    try:
        manifest = read_artifact(folder)
    except ArtifactError as e:
        raise UsageError(str(e)) from None
    if args.schedule:
        return _inspect_schedule(folder, args.format)
    world = manifest["world_size"]
    if not 0 <= args.rank < world:
        raise UsageError(
            f"--rank {args.rank} is outside the compiled world of {world} ranks (0..{world - 1})"
        )
    from meshplan.compiler.print_program import rank_line

    program = folder / "program.py"
    if not program.is_file():
        raise UsageError(f"{folder} holds no program.py: compile it again with this meshplan")
    mesh = manifest["mesh"]
    code = rank_line(list(mesh), list(mesh.values()), args.rank) + "\n" + program.read_text(encoding="utf-8")
    title = f"{manifest['plan']}: rank {args.rank} of {world}"
    if args.format == "text":
        print(_highlight(code) if use_color(sys.stdout) else code, end="")
        print((folder / "ledger.txt").read_text(encoding="utf-8"), end="")
        return EXIT_OK
    records = json.loads((folder / "graph.json").read_text(encoding="utf-8"))
    if args.format == "dot":
        print(to_dot(records, title), end="")
    elif args.format == "html":
        print(to_html(code, (folder / "ledger.txt").read_text(encoding="utf-8"), title), end="")
    elif args.format == "svg":
        import shutil
        import subprocess

        dot = shutil.which("dot")
        if dot is None:
            raise UsageError(
                "--format svg needs Graphviz's `dot` program (apt-get install graphviz); "
                "--format dot prints the graph without it"
            )
        svg = subprocess.run(
            [dot, "-Tsvg"], input=to_dot(records, title), capture_output=True, text=True, check=True
        ).stdout
        print(svg, end="")
    return EXIT_OK


def _highlight(code: str) -> str:
    return (
        "\n".join(
            f"\x1b[1;31m{line}\x1b[0m" if "  # " in line and " over " in line else line
            for line in code.splitlines()
        )
        + "\n"
    )


def _size(nbytes: int) -> str:
    """25000000 -> 25MB, 16777216 -> 16MiB: the unit the plan most likely used."""
    for unit, scale in (
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
    ):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def summarize(plan: Plan) -> str:
    """A few lines saying what a checked plan does, for `meshplan check`."""
    mesh = " x ".join(f"{a.name}={'*' if a.size is None else a.size}" for a in plan.mesh.axes)
    world = plan.mesh.world_size
    lines = [f"{plan.path}: ok", f"  mesh       {mesh}" + (f"  ({world} ranks)" if world else "")]
    kinds: dict[str, int] = {}
    for rule in plan.rules:
        kinds[rule.kind] = kinds.get(rule.kind, 0) + 1
    if kinds:
        lines.append("  rules      " + ", ".join(f"{n} {k}" for k, n in kinds.items()))
    if p := plan.pipeline:
        stages = plan.mesh.size(p.axis)
        micro = p.microbatches if p.microbatches is not None else "one per stage"
        detail = f"{p.schedule} over {p.axis}"
        if stages:
            detail += f", {stages * p.virtual_stages} stages"
        detail += f", microbatches {micro}"
        detail += f", {len(p.cuts)} cuts" if p.cuts else ", balanced automatically"
        lines.append(f"  pipeline   {detail}")
    if d := plan.data_parallel:
        offload = [
            name
            for name, on in (
                ("optimizer:disk" if d.optimizer_on_disk else "optimizer", d.offload_optimizer),
                ("params:disk" if d.params_on_disk else "params", d.offload_params),
            )
            if on
        ]
        hsdp = f" over {d.shard} (HSDP: a copy per {' x '.join(d.replicated_over)})" if d.shard else ""
        detail = f"over {d.axis}, ZeRO-{d.zero}{hsdp}, bucket {_size(d.bucket_bytes)}"
        detail += f", offload {' + '.join(offload)}" if offload else ""
        detail += f", compress {d.compress.text}" if d.compress is not None else ""
        lines.append(f"  data       {detail}")
    pr = plan.precision
    scale = "" if pr.loss_scale is None else f", loss scale {pr.loss_scale}"
    lines.append(
        f"  precision  compute {pr.compute}, params {pr.params}, grads {pr.grads}, reduce {pr.reduce}{scale}"
    )
    if plan.train.gradient_accumulation > 1:
        lines.append(f"  train      gradient accumulation {plan.train.gradient_accumulation}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- parser


def _cmd_verify(args: argparse.Namespace) -> int:
    from meshplan.verify import cmd_verify  # with torch: imported when verify runs, not to parse

    return cmd_verify(args)


def _add(sub, name: str, func: Callable[[argparse.Namespace], int], help: str, example: str):
    p = sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(help, 88),
        epilog="example:\n" + textwrap.indent(textwrap.dedent(example).strip(), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=func)
    return p


def _add_plan_for_model(p: argparse.ArgumentParser, *, shapes: bool = True, required: bool = True) -> None:
    """A plan, the model it is compiled for, and (with `shapes`) the shapes to compile for."""
    p.add_argument("plan", metavar="PLAN", nargs=None if required else "?")
    p.add_argument(
        "--model",
        required=required,
        metavar="SPEC",
        help="the model: path/to/file.py:factory or package.module:factory",
    )
    p.add_argument("--world-size", type=positive_int, metavar="N", help="size a `*` mesh axis")
    if shapes:
        _add_shape_arguments(p)


def _add_shape_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch",
        type=positive_int,
        metavar="B",
        help="compile for this many sequences per step (default: the model's example inputs)",
    )
    p.add_argument("--seq", type=positive_int, metavar="T", help="compile for this sequence length")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan",
        description="A declarative model-partitioning compiler for PyTorch.",
        epilog="example:\n  meshplan check examples/llama_tp.plan --world-size 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from meshplan import __version__

    parser.add_argument("--version", action="version", version=f"meshplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = _add(
        sub,
        "check",
        cmd_check,
        "parse and check plans, reporting every problem with its location",
        """
             meshplan check examples/llama_tp.plan
             meshplan check examples/*.plan --world-size 8
             """,
    )
    p.add_argument("plans", nargs="+", metavar="PLAN", help="plan files")
    p.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="number of processes; resolves a `*` axis and checks the mesh product",
    )
    p.add_argument(
        "--model", metavar="SPEC", help="also check against a model: FILE.py:factory or module:factory"
    )
    _add_shape_arguments(p)

    p = _add(
        sub,
        "explain",
        cmd_explain,
        "show what each rule matched, local shapes, and where collectives come from",
        """
             meshplan explain examples/llama_tp.plan --model examples/models/llama.py:build
             """,
    )
    _add_plan_for_model(p)

    p = _add(
        sub,
        "estimate",
        cmd_estimate,
        "what each rank will hold (parameters, gradients, optimizer state, activations, buffers, "
        "peak), from the compiled program on meta tensors; exit 3 if a rank does not fit --memory",
        """
             meshplan estimate examples/llama_tp.plan --model examples/models/llama.py:build
             meshplan estimate my.plan --model hf.py:build --world-size 64 --batch 1 --seq 4096 --memory 80GiB
             meshplan estimate my.plan --model hf.py:build --json
             """,
    )
    _add_plan_for_model(p, required=False)
    p.add_argument(
        "--hardware",
        metavar="NAME",
        help="price the step on h100, h200, a100 or cpu (this machine once --calibrate has measured it), "
        "or a .json entry (default: this machine's kind)",
    )
    p.add_argument(
        "--routing",
        choices=("balanced", "worst"),
        default="balanced",
        help="how dropless experts' tokens are assumed to route: balanced (N k / E pairs an expert), "
        "or worst (every pair a rank sends on one rank's experts: the memory to provision)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (matmul rate, memory bandwidth, op cost, gloo links) and keep it as its entry",
    )
    p.add_argument(
        "--memory",
        type=memory_size,
        metavar="SIZE",
        help="each rank's device memory (80GiB, 141GB): a verdict per rank, exit 3 if one does not fit",
    )
    p.add_argument("--json", action="store_true", help="one JSON object, one entry per rank")

    p = _add(
        sub,
        "compile",
        cmd_compile,
        "compile a plan for a model: the program every rank runs, resolved plan, collective ledger",
        """
             meshplan compile examples/llama_tp.plan --model examples/models/llama.py:build -o build/llama_tp
             meshplan inspect build/llama_tp --rank 1
             """,
    )
    _add_plan_for_model(p)
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="folder to write the artifact to")

    p = _add(
        sub,
        "inspect",
        cmd_inspect,
        "show one rank's compiled program with its collectives highlighted",
        """
             meshplan inspect build/llama_tp --rank 0
             meshplan inspect build/llama_tp --rank 0 --format dot > rank0.dot
             meshplan inspect build/llama_tp --rank 0 --format html > rank0.html
             meshplan inspect build/llama_pipeline --schedule                # the timeline, as text
             meshplan inspect build/llama_pipeline --schedule --format svg > schedule.svg
             """,
    )
    p.add_argument("folder", metavar="DIR", help="a folder written by `meshplan compile`")
    p.add_argument("--rank", type=int, default=0, metavar="R")
    p.add_argument("--format", choices=("text", "dot", "svg", "html"), default="text")
    p.add_argument(
        "--schedule",
        action="store_true",
        help="the pipeline schedule instead: each rank's actions in time and the bubble",
    )

    from meshplan.diff import add_arguments as add_diff_arguments
    from meshplan.diff import cmd_diff

    p = _add(
        sub,
        "diff",
        cmd_diff,
        "what changes between two plans as the compiler reads them (order, braces, formatting and "
        "comments do not count): exit 0 equivalent, 1 different, 2 an error",
        """
             meshplan diff examples/llama_tp.plan examples/llama_3d.plan
             meshplan diff old.plan new.plan --json
             """,
    )
    add_diff_arguments(p)

    from meshplan.suggest import add_arguments as add_suggest_arguments
    from meshplan.suggest import cmd_suggest

    p = _add(
        sub,
        "suggest",
        cmd_suggest,
        "write the plan for a model on N ranks of a memory: every layout screened, the best "
        "estimated; the plan to stdout (or -o), exit 3 if none fits",
        """
             meshplan suggest --model examples/models/llama.py:build --world-size 4 --memory 1GiB
             meshplan suggest --model hf.py:build --world-size 64 --memory 80GiB --hardware h100 --seq 4096 -o my.plan
             """,
    )
    add_suggest_arguments(p)

    p = _add(
        sub,
        "verify",
        _cmd_verify,
        "train the compiled plan on its ranks beside the unpartitioned model; tell rounding from bugs",
        """
             meshplan verify examples/llama_tp.plan --model examples/models/llama.py:build
             meshplan verify my.plan --model hf.py:build --steps 3 --batch 2 --seq 32
             """,
    )
    _add_plan_for_model(p, shapes=False)  # verify's own --batch and --seq below
    p.add_argument("--steps", type=positive_int, default=3, help="optimizer steps (default 3)")
    p.add_argument(
        "--init",
        metavar="PATH",
        help="start from these weights, as `meshplan run --init` (a Hugging Face folder or a file)",
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        default=2,
        metavar="B",
        help="sequences per rank and micro-step (default 2)",
    )
    p.add_argument(
        "--seq",
        type=positive_int,
        default=DefaultInt(32),
        metavar="T",
        help="tokens per sequence (default 32; a model whose inputs have no sequence takes none)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="max global gradient norm, 0 disables, as for `run` (default 1.0)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the weights and the token ids (default 0)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=4.0,
        help="how many times the one-device run's own rounding the partitioned program may be off (default 4)",
    )
    p.add_argument(
        "--between-steps",
        metavar="SPEC",
        help="FILE.py:function called with the model after each step, as for `run` (all three trainings)",
    )

    from meshplan.options import add_arguments
    from meshplan.run import cmd_run

    p = _add(
        sub,
        "run",
        cmd_run,
        "train a model under a plan: the plan compiled once, one torchrun worker per rank of its "
        "mesh (gloo on CPU, NCCL on GPUs), every axis it names (data parallel and ZeRO 0-3, "
        "tensor and sequence parallel, pipelines, experts, context parallel, checkpointing, "
        "precision, module placement), with checkpoints, resume and one message when it fails",
        """
             meshplan run examples/tiny_dp.plan                           # data parallel, the built-in tiny Llama
             meshplan run examples/llama_tp.plan                          # tensor + sequence parallel
             meshplan run examples/llama_pipeline.plan --batch 2          # pipeline x tensor parallel
             meshplan run examples/llama_3d.plan --nproc-per-node 8       # data x pipeline x tensor, ZeRO-1, bf16
             meshplan run examples/gpt_zero3.plan --model examples/models/gpt.py:build --nproc-per-node 2
             meshplan run examples/moe_ep.plan --model examples/models/moe.py:build --nproc-per-node 4
             meshplan run examples/long_context.plan --seq 128             # context (ring) x pipeline x tensor
             meshplan run examples/llama_host_head.plan                   # embedding and head on the host
             meshplan run examples/tiny_dp.plan --steps 500 --save-every 100 --out runs/demo --resume
             meshplan run plan.plan --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500 --rdzv-timeout 300
             """,
    )
    add_arguments(p)

    p = _add(
        sub,
        "fmt",
        cmd_fmt,
        "print plans in canonical form, keeping comments",
        """
             meshplan fmt examples/llama_tp.plan
             meshplan fmt --check examples/*.plan      # exit 1 if any is not canonical
             meshplan fmt --write my.plan              # rewrite in place
             """,
    )
    p.add_argument("plans", nargs="+", metavar="PLAN", help="plan files")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report files that are not canonical")
    mode.add_argument("--write", action="store_true", help="rewrite files in place")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
