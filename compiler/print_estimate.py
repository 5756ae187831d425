"""`meshplan estimate`'s report: one block per class of ranks that hold the same bytes, a verdict
per class against `--memory`, and for a class that does not fit, what holds its bytes and which
plan changes would free them."""

from __future__ import annotations

from .engine_state import DISK_RESIDENT_FLATS
from .estimate import Estimate, RankMemory
from .step_time import StepTime


def size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3, 8'."""
    runs: list[tuple[int, int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def estimate_text(est: Estimate) -> str:
    a = est.assumptions
    mesh = " x ".join(f"{k}={v}" for k, v in a["mesh"].items()) or "one rank"
    lines = [
        f"{a['world_size']} ranks ({mesh}), inputs {a['batch']} per rank and microbatch, "
        f"engine {a['engine']}" + (f" (ZeRO-{a['zero']})" if a["zero"] else ""),
    ]
    if a["schedule"]:
        lines[0] += f", {a['schedule']} over {a['microbatches']} microbatches"
    for ranks, r in est.classes():
        lines.append("")
        head = f"ranks {ranks_text(ranks)}" + (
            f" (stages {', '.join(map(str, r.stages))})" if r.stages else ""
        )
        lines.append(head)
        for name, value in r.parts().items():
            lines.append(f"  {name:<12}{size(value):>12}")
        if r.host:
            lines.append(f"  {'host':<12}{size(r.host):>12}  (offloaded to CPU memory)")
        if r.disk:
            lines.append(
                f"  {'disk':<12}{size(r.disk):>12}  (optimizer:disk / params:disk files; `host` counts "
                f"what a step reads back at once: {DISK_RESIDENT_FLATS} flats' state, two units' shards)"
            )
        lines.append(f"  {'peak':<12}{size(r.peak):>12}  at {r.peak_op}")
        if r.time is not None:
            lines.extend("  " + line for line in time_lines(r.time))
        fits = est.fits_rank(r)
        if fits is not None and est.limit is not None:
            verdict = "fits" if fits else "does NOT fit"
            lines.append(f"  {verdict} in {size(est.limit)} ({r.peak / est.limit:.0%})")
            if not fits:
                lines.extend("  " + line for line in advice(r, est))
    lines.append("")
    if est.step_time is not None and est.hardware is not None:
        lines.append(step_line(est))
    lines.append("not counted: " + a["not_counted"])
    return "\n".join(lines) + "\n"


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def time_lines(t: StepTime) -> list[str]:
    """One rank's step: where the time goes."""
    issued = sum(t.issued.values())
    lines = [f"{'step':<12}{seconds(t.total):>12}"]
    lines.append(f"  {'compute':<10}{seconds(t.compute):>12}  {t.flops / 1e9:,.3g} GFLOP")
    hidden = issued - t.communication
    detail = ", ".join(f"{op} {seconds(v)}" for op, v in sorted(t.issued.items(), key=lambda kv: -kv[1]) if v)
    comm = f"  {'comm':<10}{seconds(t.communication):>12}  waited for"
    if issued:
        comm += f" ({seconds(max(hidden, 0.0))} more hidden); issued: {detail}"
    lines.append(comm)
    lines.append(f"  {'optimizer':<10}{seconds(t.optimizer):>12}")
    if t.idle:
        lines.append(
            f"  {'idle':<10}{seconds(t.idle):>12}  waiting for pipeline neighbours ({t.idle / t.total:.0%})"
        )
    return lines


def step_line(est: Estimate) -> str:
    """The job's step time on which hardware, and its FLOP utilization: the time the ranks'
    FLOPs would take at their dtype's peak over the step (recomputation counted as work)."""
    hw, step = est.hardware, est.step_time
    assert hw is not None and step is not None
    ideal = sum(r.time.ideal for r in est.ranks if r.time is not None)
    return (
        f"step {seconds(step)} on {hw.name} ({hw.source}); FLOP utilization "
        f"{ideal / (step * len(est.ranks)):.1%}\n"
    )


def advice(r: RankMemory, est: Estimate) -> list[str]:
    """What holds the bytes, largest first, and the plan changes that free each."""
    a = est.assumptions
    zero = a["zero"]
    mesh = a["mesh"]
    free = {
        "params": "shard parameters: `zero = 3` in data_parallel, or more `tp`/`pp`"
        if zero < 3
        else "more `tp` or `pp` (ZeRO-3 already shards them over the data axis)",
        "grads": "`zero = 2` shards gradients over the data axis" if zero < 2 else "more `tp` or `pp`",
        "optimizer": "`zero = 1` shards AdamW's state over the data axis"
        if zero < 1
        else "`offload = optimizer` moves it to CPU memory, or a larger data axis",
        "activations": "`checkpoint` rules on the layers (`layers.*: checkpoint`), a smaller --batch, "
        "`sequence over tp` on the norms, or more microbatches with fewer in flight",
        "buffers": "smaller ZeRO units or buckets (`bucket = ...`), fewer microbatches in flight",
    }
    if zero == 0 and not any(k for k in mesh if k == "dp"):
        free["optimizer"] = "a data axis with ZeRO (`data_parallel over dp { zero = 1 }`), or more `tp`/`pp`"
    over = r.peak - (est.limit or 0)
    lines = [
        f"{size(over)} over; what holds the bytes (each part against the peak: gradients and "
        "activations are not all live at once, so the shares add up to more):"
    ]
    for name, value in sorted(r.parts().items(), key=lambda kv: -kv[1]):
        if value:
            lines.append(f"  {name:<12}{size(value):>12}  {r.peak and value / r.peak:.0%}: {free[name]}")
    return lines
