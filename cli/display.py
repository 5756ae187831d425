"""What `meshplan run` shows a person while it trains: the loop (`runtime/train.py`) reports its
steps to a `Display`; this one draws them with rich."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from meshplan.runtime.train import peak_memory_bytes

if TYPE_CHECKING:
    from meshplan.runtime.train import Summary, TrainConfig


class Progress:
    """A `runtime.train.Display` for a person at a terminal: a progress bar, or plain lines every
    `log_every` steps when the output is not a terminal; a summary table at the end (`report`)."""

    def begin(self, config: TrainConfig, start: int) -> None:
        self.config = config
        self.progress: RichProgress | None = None
        self.console = Console(stderr=False)
        if start:
            self.console.print(f"resumed at step {start}")
        if self.console.is_terminal:
            self.progress = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=config.steps, completed=start, status="")
            self.progress.start()

    def update(self, record: dict[str, Any]) -> None:
        status = f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s"
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=status)
        elif record["step"] % self.config.log_every == 0 or record["step"] in (1, self.config.steps):
            print(
                f"step {record['step']:>5}/{self.config.steps}  {status}  |g| {record['grad_norm']:.3f}",
                flush=True,
            )

    def note(self, text: str) -> None:
        (self.console if self.progress is None else self.progress.console).print(text)

    def close(self, summary: Summary) -> None:
        """The loop ended, or a failure stopped it: the bar stops. The table is `report`'s, which
        only a run that ended is given: a failed run's last lines are its failure, not a summary."""
        if self.progress is not None:
            self.progress.stop()

    def report(self, summary: Summary) -> None:
        """The summary table of a run whose loop ended."""
        table = Table(title="meshplan run: summary", show_header=False)
        ran = summary.steps_done - summary.start_step
        first = f"{summary.losses[0]:.4f}" if summary.losses else "-"
        last = f"{summary.losses[-1]:.4f}" if summary.losses else "-"
        table.add_row("steps", f"{summary.steps_done} (this run: {ran})")
        table.add_row("loss", f"{first} -> {last}")
        table.add_row(
            "time", f"{summary.elapsed_s:.1f} s ({summary.elapsed_s / max(ran, 1) * 1000:.0f} ms/step)"
        )
        table.add_row("tokens/s", f"{summary.tokens_per_s:,.0f} (all ranks)")
        table.add_row("peak memory", f"{peak_memory_bytes() / 2**20:.0f} MiB (rank 0)")
        table.add_row("skipped steps", str(summary.skipped_steps))
        table.add_row("metrics", str(self.config.run_dir / "metrics"))
        self.console.print(table)
