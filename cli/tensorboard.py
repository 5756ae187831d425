"""`meshplan run --tensorboard DIR`: the run as TensorBoard shows it, beside the JSONL metrics.

    DIR/              rank 0: train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/mfu,
                      train/loss_scale, train/skipped_steps; the plan and the ledger as text
    DIR/rank{R}/      every rank: memory/peak, memory/state, memory/peak_tensors, memory/start,
                      pipeline/idle (a pipeline rank's share of the step spent waiting)

`tensorboard --logdir DIR` then shows the run's curves in one run (".") and each rank's memory
and idle time as runs of their own (`rank0`, `rank1`, ...), so a scalar plots one line per rank.
What TensorBoard gets is what `metrics/rank{R}.jsonl` gets, at the same steps: the JSONL stays
the record, TensorBoard is a view of it. The writer is torch's `SummaryWriter`, which needs the
`tensorboard` package: the `tensorboard` extra (`check_available` says so before launch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshplan.errors import RunError

if TYPE_CHECKING:
    from meshplan.runtime.train import Display, Summary, TrainConfig

EXTRA = 'pip install -e ".[tensorboard]"'  # or `pip install "meshplan[tensorboard]"`
# record key -> (scalar tag, whose: "run" for rank 0's curves, "rank" for every rank's own)
SCALARS = {
    "loss": ("train/loss", "run"),
    "lr": ("train/lr", "run"),
    "grad_norm": ("train/grad_norm", "run"),
    "tokens_per_s": ("train/tokens_per_s", "run"),
    "mfu": ("train/mfu", "run"),
    "loss_scale": ("train/loss_scale", "run"),
    "skipped_steps": ("train/skipped_steps", "run"),
    "peak_memory": ("memory/peak", "rank"),
    "state_bytes": ("memory/state", "rank"),
    "peak_tensor_bytes": ("memory/peak_tensors", "rank"),
    "start_memory": ("memory/start", "rank"),
    "pipeline_idle": ("pipeline/idle", "rank"),
}
LEDGER = "ledger.txt"  # beside the run's program.pt (the launcher writes it; so does `compile -o`)


def check_available() -> None:
    """Before launch: the writer can be imported, or one line naming the extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise RunError(
            f"--tensorboard needs the `tensorboard` package (hint: {EXTRA}, or drop --tensorboard; "
            "the JSONL metrics in the run folder are written either way)"
        ) from None


class TensorBoard:
    """A `runtime.train.Display` writing one rank's scalars (and on rank 0 the run's curves, its
    plan and its ledger) for TensorBoard."""

    def __init__(self, folder: Path, rank: int, *, plan_text: str, program: Path | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.rank = rank
        self.plan_text = plan_text
        self.program = program
        self.own = SummaryWriter(str(folder / f"rank{rank}"))
        self.run = SummaryWriter(str(folder)) if rank == 0 else None

    def begin(self, config: TrainConfig, start: int) -> None:
        if self.run is None:
            return
        # Markdown: four spaces keep the plan and the table as written
        self.run.add_text("plan", _verbatim(self.plan_text), start)
        ledger = self.program.parent / LEDGER if self.program is not None else None
        if ledger is not None and ledger.exists():
            self.run.add_text("ledger", _verbatim(ledger.read_text()), start)

    def update(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, (tag, whose) in SCALARS.items():
            value = record.get(key)
            writer = self.own if whose == "rank" else self.run
            if writer is not None and isinstance(value, int | float) and not isinstance(value, bool):
                writer.add_scalar(tag, value, step)

    def note(self, text: str) -> None:
        pass  # a saved checkpoint is news for the terminal, not a curve

    def close(self, summary: Summary) -> None:
        for writer in (self.own, self.run):
            if writer is not None:
                writer.close()


class Displays:
    """Several displays told the same things (rank 0: the progress bar and TensorBoard)."""

    def __init__(self, *displays: Display) -> None:
        self.displays = displays

    def begin(self, config: TrainConfig, start: int) -> None:
        for d in self.displays:
            d.begin(config, start)

    def update(self, record: dict[str, Any]) -> None:
        for d in self.displays:
            d.update(record)

    def note(self, text: str) -> None:
        for d in self.displays:
            d.note(text)

    def close(self, summary: Summary) -> None:
        for d in self.displays:
            d.close(summary)


def _verbatim(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())
