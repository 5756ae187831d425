"""`meshplan run`'s options: `RunOptions`, the one typed value the command line builds (or
`verify` writes directly) and every part of a run reads -- the launcher, the workers, the session.

    options = parse(["examples/tiny_dp.plan", "--steps", "20"])
    options = RunOptions("examples/tiny_dp.plan", steps=20)     # without a command line

Each option is declared once, as a field: its type, its default, and how the command line spells
it (`flag`: its help, and for torchrun's own options that they go to torchrun, never to the
workers). `--batch`, `--seq` and `--model` default to values marked as defaults
(`args.DefaultInt`, `DefaultStr`): `meshplan run DIR` takes a compile folder's own where the
command line is silent.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.args import DefaultInt, DefaultStr, non_negative_int, positive_int
from meshplan.errors import RunError

DEFAULT_MODEL = "meshplan.examples.models.llama:build"


def flag(
    help: str | None = argparse.SUPPRESS, *, default: Any = None, torchrun: bool = False, **argparse_kw: Any
) -> Any:
    """A field that is also a command-line option (`--name-with-dashes`); `argparse_kw` go to
    `add_argument` (type, metavar, action). Without `help` the option is hidden (the launcher
    passes it to the workers); `None` shows it without one."""
    return field(default=default, metadata={"help": help, "torchrun": torchrun, **argparse_kw})


@dataclass(frozen=True)
class RunOptions:
    """Everything `meshplan run` is told, typed; the defaults are the command line's."""

    plan: str  # a plan file, or a `meshplan compile -o` folder
    model: str = flag(
        f"FILE.py:factory or module:factory (default: {DEFAULT_MODEL}, a tiny Llama; "
        "for a compile folder, the model it was compiled for)",
        default=DefaultStr(DEFAULT_MODEL),
        metavar="SPEC",
    )
    steps: int = flag("optimizer steps (default 200)", default=200, type=positive_int)
    data: str | None = flag(
        "a text file (bytes are tokens) or FILE.py:factory (default: the shipped corpus)", metavar="FILE"
    )
    between_steps: str | None = flag(
        "FILE.py:function or module:function called with the model after each optimizer step "
        "(e.g. an aux-loss-free expert bias update), the buffers the model counts into summed over "
        "the data ranks first",
        metavar="SPEC",
    )
    batch: int = flag(
        "sequences per micro-step per data-parallel rank (default 8; for a compile folder, its own)",
        default=DefaultInt(8),
        type=positive_int,
        metavar="B",
    )
    seq: int = flag(
        "tokens per sequence (default 64; for a compile folder, its own)",
        default=DefaultInt(64),
        type=positive_int,
        metavar="T",
    )
    program: str | None = flag()  # the launcher's compiled program.pt (None: compile here)
    # the model's vocabulary, found by the launcher: every batch's token ids are checked against it
    vocab_size: int | None = flag(type=positive_int)
    lr: float = flag("peak learning rate (default 3e-3)", default=3e-3, type=float)
    warmup: int = flag("linear warmup steps (default 20)", default=20, type=non_negative_int, metavar="N")
    min_lr_ratio: float = flag("cosine decays to lr * this (default 0.1)", default=0.1, type=float)
    weight_decay: float = flag(None, default=0.1, type=float)
    grad_clip: float = flag("max global gradient norm, 0 disables (default 1.0)", default=1.0, type=float)
    seed: int = flag(None, default=0, type=int)
    init: str | None = flag(
        "start from these weights: a Hugging Face folder (model.safetensors, or shards with their "
        "index), a .safetensors or a .pt file; each rank reads only its own pieces",
        metavar="PATH",
    )
    save_every: int = flag(
        "checkpoint every N steps (and at the end); 0: never", default=0, type=non_negative_int, metavar="N"
    )
    resume: bool = flag(
        "continue from the latest complete checkpoint in --out", default=False, action="store_true"
    )
    overwrite: bool = flag(
        "replace the checkpoints and metrics of a run already in --out (without it, `run` refuses)",
        default=False,
        action="store_true",
    )
    export: str | None = flag(
        "after training, write the full (unpartitioned) weights: FILE.safetensors or FILE.pt, or a "
        "folder (any other path): safetensors shards with their index, and a Hugging Face model's "
        "config.json (from_pretrained loads it; another model's folder has no config)",
        metavar="PATH",
    )
    out: str | None = flag(
        "run folder for metrics and checkpoints (default: runs/<plan name>)", metavar="DIR"
    )
    offload_dir: str | None = flag(
        "folder for the files of `offload = optimizer:disk` and `params:disk` (default: OUT/offload); "
        "put it on a fast local disk",
        metavar="DIR",
    )
    tensorboard: str | None = flag(
        "also write the metrics as TensorBoard scalars into DIR (rank 0's curves, every rank's "
        "memory and pipeline idle, the plan and the ledger as text; needs the `tensorboard` extra)",
        metavar="DIR",
    )
    log_every: int = flag(
        "print every N steps when not on a terminal", default=10, type=positive_int, metavar="N"
    )
    timeout: int = flag(
        "seconds a collective may wait for a peer (default 300)", default=300, type=positive_int, metavar="S"
    )
    peak_tflops: float | None = flag("peak TFLOP/s per device, for the MFU estimate", type=float, metavar="F")
    nproc_per_node: int | None = flag(
        "processes per node (default: the mesh's world size / --nnodes)",
        torchrun=True,
        type=positive_int,
        metavar="N",
    )
    nnodes: str = flag(None, default="1", torchrun=True, metavar="N")
    node_rank: str | None = flag(None, torchrun=True, metavar="R")
    rdzv_endpoint: str | None = flag(None, torchrun=True, metavar="HOST:PORT")
    rdzv_backend: str | None = flag(None, torchrun=True, metavar="NAME")
    rdzv_id: str | None = flag(None, torchrun=True, metavar="ID")
    rdzv_conf: str | None = flag(None, torchrun=True, metavar="KEY=VALUE,...")
    rdzv_timeout: int | None = flag(
        "seconds to wait for every node to join the rendezvous, then end with one line saying what "
        "to check (default: torchrun's, 600)",
        torchrun=True,
        type=positive_int,
        metavar="S",
    )
    local_addr: str | None = flag(None, torchrun=True, metavar="ADDR")
    max_restarts: str | None = flag(None, torchrun=True, metavar="N")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **changes) -> RunOptions:
        return dataclasses.replace(self, **changes)

    def worker_argv(self) -> list[str]:
        """The options a worker gets: the user's, minus torchrun's (and `--overwrite`, which the
        launcher has carried out)."""
        out = [self.plan]
        for f in _flags():
            value = getattr(self, f.name)
            if f.metadata["torchrun"] or f.name == "overwrite" or value is None or value is False:
                continue
            out += [_spelling(f)] if value is True else [_spelling(f), str(value)]
        return out


# torchrun's own options: passed to torchrun, never to the workers
TORCHRUN_FLAGS = tuple(f.name for f in dataclasses.fields(RunOptions) if f.metadata.get("torchrun"))


def command_line(options: RunOptions, *, add: str) -> str:
    """`meshplan run PLAN ...` as the user gave it (every option that is not its default, this
    node's torchrun options included), without `--resume` and `--overwrite`, and with `add`: the
    command a failed run's last line gives to continue it (`add="--resume"`)."""
    import shlex

    from meshplan.args import given

    words = ["meshplan", "run", options.plan]
    for f in _flags():
        value = getattr(options, f.name)
        if f.metadata["help"] is argparse.SUPPRESS or f.name in ("resume", "overwrite"):
            continue  # the launcher's own additions (the program, the vocabulary)
        if value is False or not given(value) or (type(value) is type(f.default) and value == f.default):
            continue  # not given, or given as its default (a compile folder's 8 given is kept)
        words += [_spelling(f)] if value is True else [_spelling(f), str(value)]
    return shlex.join([*words, add])


def _flags() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(RunOptions) if f.metadata]


def _spelling(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def offload_dir(options: RunOptions) -> Path:
    """`--offload-dir`, else the run folder's `offload/`: where `optimizer:disk` and `params:disk`
    keep their files."""
    return Path(options.offload_dir) if options.offload_dir else run_dir(options) / "offload"


def run_dir(options: RunOptions) -> Path:
    """`--out`, else `runs/<plan name>` (for a compile folder, the name of the plan it compiled)."""
    if options.out:
        return Path(options.out)
    plan = Path(options.plan)
    if plan.is_dir():
        from meshplan.compiler.artifact import ArtifactError, read_artifact

        try:
            return Path("runs") / Path(read_artifact(plan)["plan"]).stem
        except (ArtifactError, KeyError, ValueError) as e:
            raise RunError(str(e)) from None
    return Path("runs") / plan.stem


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `meshplan run` (and of `python -m meshplan.run`), from `RunOptions`' fields."""
    p.add_argument(
        "plan",
        metavar="PLAN",
        help="the plan file (its mesh gives the number of processes), or a `meshplan compile -o` folder",
    )
    torchrun = p.add_argument_group("torchrun (passed through)")
    for f in _flags():
        kw = {k: v for k, v in f.metadata.items() if k != "torchrun"}
        if f.default is not None and kw.get("action") != "store_true":
            kw["default"] = f.default
        (torchrun if f.metadata["torchrun"] else p).add_argument(_spelling(f), **kw)


def build_parser() -> argparse.ArgumentParser:
    """`python -m meshplan.run`'s parser (`meshplan run`'s is a subcommand with the same options)."""
    p = argparse.ArgumentParser(prog="meshplan run", description="train a model under a plan on torchrun")
    add_arguments(p)
    return p


def parse(argv: list[str]) -> RunOptions:
    """`RunOptions` from `meshplan run`'s arguments (without the `run`)."""
    return RunOptions.from_args(build_parser().parse_args(argv))
