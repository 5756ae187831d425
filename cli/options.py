"""`meshplan run`'s options: `RunOptions`, the one typed value the command line builds (or
`verify` writes directly) and every part of a run reads -- the launcher, the workers, the session.

    options = RunOptions.from_args(build_parser().parse_args(argv))
    options = RunOptions("examples/tiny_dp.plan", steps=20)     # without a command line

`--batch`, `--seq` and `--model` default to values marked as defaults (`args.DefaultInt`,
`DefaultStr`): `meshplan run DIR` takes a compile folder's own where the command line is silent.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from meshplan.args import DefaultInt, DefaultStr, non_negative_int, positive_int
from meshplan.errors import RunError

DEFAULT_MODEL = "meshplan.examples.models.llama:build"

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


@dataclass(frozen=True)
class RunOptions:
    """Everything `meshplan run` is told, typed; the defaults are the command line's."""

    plan: str  # a plan file, or a `meshplan compile -o` folder
    model: str = DefaultStr(DEFAULT_MODEL)  # FILE.py:factory or module:factory
    steps: int = 200
    data: str | None = None  # a text file or FILE.py:factory; None: the shipped corpus
    between_steps: str | None = None  # FILE.py:function called with the model after each step
    batch: int = DefaultInt(8)  # sequences per micro-step per data-parallel rank
    seq: int = DefaultInt(64)
    program: str | None = None  # the launcher's compiled program.pt (None: compile here)
    vocab_size: int | None = None  # the model's, found by the launcher: batches are checked against it
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping
    seed: int = 0
    save_every: int = 0  # 0: never
    resume: bool = False
    overwrite: bool = False
    export: str | None = None  # FILE.safetensors or FILE.pt
    out: str | None = None  # None: runs/<plan name>
    log_every: int = 10
    timeout: int = 300  # seconds a collective may wait for a peer
    peak_tflops: float | None = None
    # torchrun's own (`TORCHRUN_FLAGS`), never passed to the workers
    nproc_per_node: int | None = None
    nnodes: str = "1"
    node_rank: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    max_restarts: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunOptions:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **changes) -> RunOptions:
        return dataclasses.replace(self, **changes)

    def worker_argv(self) -> list[str]:
        """The options a worker gets: the user's, minus torchrun's."""
        out = [self.plan]
        for dest, flag in WORKER_FLAGS:
            value = getattr(self, dest)
            if value is not None:
                out += [flag, str(value)]
        if self.resume:
            out.append("--resume")
        return out


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
    """The options of `meshplan run` (and of `python -m meshplan.run`)."""
    p.add_argument(
        "plan",
        metavar="PLAN",
        help="the plan file (its mesh gives the number of processes), or a `meshplan compile -o` folder",
    )
    p.add_argument(
        "--model",
        default=RunOptions.model,
        metavar="SPEC",
        help=f"FILE.py:factory or module:factory (default: {DEFAULT_MODEL}, a tiny Llama; "
        "for a compile folder, the model it was compiled for)",
    )
    p.add_argument(
        "--steps", type=positive_int, default=RunOptions.steps, help="optimizer steps (default 200)"
    )
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
        default=RunOptions.batch,
        metavar="B",
        help="sequences per micro-step per data-parallel rank (default 8; for a compile folder, its own)",
    )
    p.add_argument(
        "--seq",
        type=positive_int,
        default=RunOptions.seq,
        metavar="T",
        help="tokens per sequence (default 64; for a compile folder, its own)",
    )
    p.add_argument("--program", help=argparse.SUPPRESS)  # the launcher's compiled program.pt
    # the model's vocabulary, found by the launcher: every batch's token ids are checked against it
    p.add_argument("--vocab-size", type=positive_int, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=RunOptions.lr, help="peak learning rate (default 3e-3)")
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=RunOptions.warmup,
        metavar="N",
        help="linear warmup steps (default 20)",
    )
    p.add_argument(
        "--min-lr-ratio",
        type=float,
        default=RunOptions.min_lr_ratio,
        help="cosine decays to lr * this (default 0.1)",
    )
    p.add_argument("--weight-decay", type=float, default=RunOptions.weight_decay)
    p.add_argument(
        "--grad-clip",
        type=float,
        default=RunOptions.grad_clip,
        help="max global gradient norm, 0 disables (default 1.0)",
    )
    p.add_argument("--seed", type=int, default=RunOptions.seed)
    p.add_argument(
        "--save-every",
        type=non_negative_int,
        default=RunOptions.save_every,
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
        default=RunOptions.log_every,
        metavar="N",
        help="print every N steps when not on a terminal",
    )
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=RunOptions.timeout,
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
    g.add_argument("--nnodes", default=RunOptions.nnodes, metavar="N")
    g.add_argument("--node-rank", metavar="R")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT")
    g.add_argument("--rdzv-backend", metavar="NAME")
    g.add_argument("--rdzv-id", metavar="ID")
    g.add_argument("--max-restarts", metavar="N")


def build_parser() -> argparse.ArgumentParser:
    """`python -m meshplan.run`'s parser (`meshplan run`'s is a subcommand with the same options)."""
    p = argparse.ArgumentParser(prog="meshplan run", description="train a model under a plan on torchrun")
    add_arguments(p)
    return p


def parse(argv: list[str]) -> RunOptions:
    """`RunOptions` from `meshplan run`'s arguments (without the `run`)."""
    return RunOptions.from_args(build_parser().parse_args(argv))
