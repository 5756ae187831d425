"""`meshplan suggest --measure K`: the estimate ranks, a run decides. The K fastest plans by the
estimate, each of another shape (`compiler.suggest.shape_of`: its mesh and a pipeline's chunks),
are trained here for a few steps with `meshplan run` (torchrun on this machine, as a user runs
them), and the fastest measured whose ranks stay under `--memory` is the one written.

    trials = measure(found, k=3, model="model.py:build", memory=80 * 2**30)
    best = pick(trials)          # None: no trial ran, or none fit

For ranks this machine can start (its GPUs; on a CPU, any number sharing its cores): a plan
for many nodes is measured on those nodes, not here. A step's time is the median of the steps
after the first two (a run's start-up and its first optimizer step), the slowest rank's;
its memory the most tensor bytes any rank held at once (`peak_tensor_bytes`: the CUDA
allocator's peak, or the CPU tracker's on the steps it measures).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from meshplan.compiler.suggest import Candidate, Suggestion, shape_of

STEPS = 10  # a trial's steps: two to start, the rest timed


@dataclass
class Trial:
    candidate: Candidate
    step_time: float | None = None  # s, the median step of the slowest rank
    peak: int | None = None  # bytes, the most any rank held at once
    error: str = ""  # why the run did not finish: its one line

    def fits(self, memory: int | None) -> bool:
        return self.step_time is not None and (memory is None or (self.peak or 0) <= memory)


def shortlist(found: Suggestion, k: int) -> list[Candidate]:
    """The `k` fastest that fit by the estimate, one of each shape."""
    out: list[Candidate] = []
    seen: set[tuple[str, int]] = set()
    for c in found.ranked:
        if c.fits and shape_of(c.layout) not in seen:
            seen.add(shape_of(c.layout))
            out.append(c)
    return out[:k]


def measure(
    found: Suggestion, k: int, model: str, memory: int | None, report: TextIO | None = None
) -> list[Trial]:
    """Train each of `shortlist(found, k)` for `STEPS` steps here; `report` hears of each."""
    trials = []
    with tempfile.TemporaryDirectory(prefix="meshplan-suggest-") as folder:
        for n, cand in enumerate(shortlist(found, k), 1):
            if report is not None:
                print(f"measuring {n}/{k}: mesh {cand.layout.mesh()} ...", file=report, flush=True)
            trials.append(_trial(cand, found, model, Path(folder) / str(n)))
    return trials


def pick(trials: list[Trial], memory: int | None) -> Trial | None:
    """The fastest measured that stayed under `memory`."""
    ran = [t for t in trials if t.fits(memory)]
    return min(ran, key=lambda t: t.step_time or 0.0) if ran else None


def _trial(cand: Candidate, found: Suggestion, model: str, folder: Path) -> Trial:
    folder.mkdir(parents=True)
    plan = folder / "suggested.plan"
    plan.write_text(cand.text)
    argv = [sys.executable, "-m", "meshplan", "run", str(plan), "--model", model, "--steps", str(STEPS)]
    argv += ["--batch", str(cand.layout.rows(found.batch)), "--out", str(folder / "run")]
    argv += ["--log-every", str(STEPS // 2)] + (["--seq", str(found.seq)] if found.seq else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
        return Trial(cand, error=(lines[-1] if lines else f"exit {done.returncode}").strip())
    return _measured(cand, folder / "run" / "metrics")


def _measured(cand: Candidate, metrics: Path) -> Trial:
    records = [json.loads(line) for f in metrics.glob("rank*.jsonl") for line in f.read_text().splitlines()]
    peak = max((r.get("peak_tensor_bytes") or 0 for r in records), default=0)
    # on a CPU the tracker measures a few steps, slowed by it (a Python call per op): those are
    # not timed; a GPU's allocator measures every step at no cost
    every = all(r.get("peak_tensor_bytes") is not None for r in records)
    slowest: dict[int, float] = {}
    for r in records:
        if r["step"] > 2 and (every or r.get("peak_tensor_bytes") is None):
            slowest[r["step"]] = max(slowest.get(r["step"], 0.0), r["time_s"])
    if not slowest:
        return Trial(cand, error="the run recorded no step after its second")
    return Trial(cand, statistics.median(slowest.values()), peak or None)


def table(trials: list[Trial], chosen: Trial | None, memory: int | None) -> str:
    from meshplan.compiler.print_suggest import aligned, layout_cells
    from meshplan.compiler.suggest_plan import gib, seconds

    rows: list[tuple[str, ...]] = [
        ("#", "mesh", "zero", "checkpoint", "pipeline", "estimated", "measured", "peak/rank", "")
    ]
    for n, t in enumerate(trials, 1):
        c = t.candidate
        est = seconds(c.estimated_time) if c.estimated_time is not None else "-"
        if t.step_time is None:
            rows.append((str(n), *layout_cells(c.layout), est, "-", "-", f"did not run: {t.error}"))
            continue
        note = "over --memory" if not t.fits(memory) else "<- written" if t is chosen else ""
        rows.append(
            (str(n), *layout_cells(c.layout), est, seconds(t.step_time), gib(t.peak) if t.peak else "-", note)
        )
    head = f"measured here (`meshplan run`, {STEPS} steps each; a step: the median of the slowest rank's):"
    return "\n".join([head, *aligned(rows)])


def annotated(trial: Trial) -> str:
    """The chosen plan's text with what its run measured, above its first rule."""
    from meshplan.compiler.suggest_plan import gib, seconds

    assert trial.step_time is not None
    peak = f", {gib(trial.peak)} per rank at most" if trial.peak else ""
    note = (
        f"# measured here: a step in {seconds(trial.step_time)}{peak} "
        f"(`meshplan run`, {STEPS} steps; `meshplan suggest --measure`)"
    )
    lines = trial.candidate.text.splitlines()
    at = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "\n".join([*lines[:at], note, *lines[at:]]) + "\n"
