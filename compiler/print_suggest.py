"""`meshplan suggest`'s report: what it found in the model, what it searched, the runners-up."""

from __future__ import annotations

from typing import Any

from .screen import Layout
from .structure import ModelShape
from .suggest import Candidate, Suggestion
from .suggest_plan import gib, seconds


def suggest_text(found: Suggestion, *, top: int) -> str:
    lines = []
    if found.shape is not None:
        lines.append(f"model: {parts_line(found.shape)}")
    s = found.seconds
    estimated = [c for c in found.ranked if c.estimate is not None]
    over = sum(1 for c in estimated if not c.fits)
    lines.append(
        f"searched {found.searched} layouts in {seconds(s.get('screen'))} "
        f"({found.screened_fit} under the limit by the screen); estimated {len(estimated)}"
        f"{f' ({over} over the limit)' if over else ''} in {seconds(s.get('estimate'))} "
        f"(capture and profile {seconds(s.get('capture'))})"
    )
    for feature, why in sorted(found.refusals.items()):
        lines.append(f"the compiler refused {feature}: {why}")
    shown = found.runners_up(max(top, 1))
    rows: list[tuple[str, ...]] = [("#", "mesh", "zero", "checkpoint", "pipeline", "peak/rank", "step", "")]
    for i, c in enumerate(shown, 1):
        rows.append(_row(i, c))
    lines += ["", *aligned(rows)]
    return "\n".join(lines) + "\n"


def layout_cells(lay: Layout) -> tuple[str, str, str, str]:
    """A layout's mesh, ZeRO stage, checkpointing and pipeline, as the tables show them."""
    zero = str(lay.zero) + (" +offload" if lay.offload else "")
    schedule = f"interleaved x{lay.virtual}" if lay.virtual > 1 else "1f1b"
    pipeline = f"{schedule}, {lay.microbatches} microbatches" if lay.pp > 1 else "-"
    checkpoint = {"full": "every block", "selective": "selective"}.get(lay.checkpoint, "-")
    mesh = (
        lay.mesh()
        + (" (ulysses)" if lay.cp > 1 and lay.context == "ulysses" else "")
        + (" +sp" if lay.sp else "")
    )
    return mesh, zero, checkpoint, pipeline


def aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells in columns as wide as their widest cell, two spaces apart."""
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _row(i: int, c: Candidate) -> tuple[str, ...]:
    if c.estimate is not None:
        peak, step, how = (
            c.estimated_peak,
            c.estimated_time,
            "estimated" + ("" if c.fits else ", does not fit"),
        )
    else:
        peak, step, how = c.peak, c.time, "screened" + (f", refused: {c.refused}" if c.refused else "")
    return (str(i), *layout_cells(c.layout), gib(peak), seconds(step), how)


def parts_line(shape: ModelShape) -> str:
    if shape.blocks is None:
        return "no repeated blocks found (data parallel only)"
    pairs = "; ".join(f"{'/'.join(p.columns)} -> {p.row}" for p in shape.pairs) or "none"
    ends = ", ".join(p for p in (shape.embedding, shape.head) if p) or "none"
    experts = (
        f"; experts {shape.block(shape.experts)} ({shape.num_experts}, top {shape.top_k})"
        if shape.experts
        else ""
    )
    tied = " (tied)" if shape.tied else ""
    attention = f"; attention {shape.block(shape.attention)}" if shape.attention else ""
    return f"{shape.layers} blocks `{shape.block()}`; pairs {pairs}; ends {ends}{tied}{attention}{experts}"


def suggest_json(found: Suggestion) -> dict[str, Any]:
    def entry(c: Candidate) -> dict[str, Any]:
        lay = c.layout
        out: dict[str, Any] = {
            "mesh": dict(lay.sizes()),
            "virtual_stages": lay.virtual,
            "zero": lay.zero,
            "offload": lay.offload,
            "checkpoint": lay.checkpoint or None,  # "full", "selective" (every block's) or none
            "microbatches": lay.microbatches,
            "context": lay.context if lay.cp > 1 else None,  # "ring" or "ulysses" under a cp axis
            "sequence_parallel": lay.sp,
            "vocab_parallel": lay.vocab,
            "screened": {"peak": c.peak, "step_time_s": c.time},
            "estimated": None,
            "refused": c.refused or None,
        }
        if c.estimate is not None:
            out["estimated"] = {"peak": c.estimated_peak, "step_time_s": c.estimated_time, "fits": c.fits}
        return out

    best = found.best
    return {
        "plan": best.text if best is not None else None,
        "best": entry(best) if best is not None else None,
        "ranked": [entry(c) for c in found.ranked[:20]],
        "searched": found.searched,
        "screened_fit": found.screened_fit,
        "seconds": found.seconds,
        "refused": found.refusals,
        "assumptions": list(found.assumed),
    }
