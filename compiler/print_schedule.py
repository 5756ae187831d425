"""A pipeline schedule in time, for `meshplan inspect --schedule`: each rank's actions as text
(`schedule_text`) or as an SVG picture (`schedule_svg`), with each rank's idle share and the
bubble at the unit costs `explain` quotes (`unit_costs`)."""

from __future__ import annotations

import html

from meshplan.runtime.schedules import Schedule, Timeline


def schedule_text(timeline: Timeline) -> str:
    """Each rank's actions on a time axis, one column per unit of cost (a forward is 1, a
    backward 2, its input and weight halves 1 each): `F3` starts the forward of microbatch 3 (`F2.3`: of stage 2, when a rank
    holds several), `==` continues it, `.` is idle. Ends with each rank's idle share and the
    schedule's bubble."""
    schedule = timeline.schedule
    several = schedule.stages > schedule.ranks
    label = {
        a: (f"{a.kind}{a.stage}.{a.microbatch}" if several else f"{a.kind}{a.microbatch}")
        for a in timeline.start
    }
    width = max(len(t) for t in label.values()) + 1
    columns = round(timeline.makespan)
    lines = [
        f"{schedule.name}: {schedule.ranks} ranks, {schedule.stages} stages, {schedule.microbatches} microbatches"
    ]
    for r in range(schedule.ranks):
        cells = ["." * (width - 1)] * columns
        for action in schedule.actions[r]:
            first, last = round(timeline.start[action]), round(timeline.end[action])
            cells[first] = label[action].ljust(width - 1)
            for c in range(first + 1, last):
                cells[c] = "=" * (width - 1)
        idle = 1 - timeline.busy[r] / timeline.makespan if timeline.makespan else 0.0
        lines.append(f"rank {r}  " + " ".join(cells) + f"   idle {idle:.3f}")
    lines.append(f"bubble {timeline.bubble:.3f} of the step (unit costs: {unit_costs(schedule)})")
    return "\n".join(lines) + "\n"


def unit_costs(schedule: Schedule) -> str:
    """The costs the bubble is computed at, in words."""
    if any(a.kind == "I" for actions in schedule.actions for a in actions):
        return "forward 1, input gradient 1, weight gradient 1"
    return "forward 1, backward 2"


_ACTION_COLORS = {"F": "#4e79a7", "B": "#59a14f", "I": "#76b7b2", "W": "#edc948"}


def schedule_svg(timeline: Timeline) -> str:
    """The same timeline as a picture: a row per rank, a box per action (forward blue,
    backward green, input gradient teal, weight gradient yellow), labelled with its microbatch."""
    schedule = timeline.schedule
    unit, row, left, top = 40, 30, 70, 40
    width = left + int(timeline.makespan * unit) + 20
    height = top + schedule.ranks * row + 40
    title = f"{schedule.name}: bubble {timeline.bubble:.3f}"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="system-ui, sans-serif" font-size="11">',
        f'<text x="{left}" y="20" font-size="13">{html.escape(title)}</text>',
    ]
    for r in range(schedule.ranks):
        y = top + r * row
        parts.append(f'<text x="8" y="{y + 18}">rank {r}</text>')
        for action in schedule.actions[r]:
            x = left + timeline.start[action] * unit
            w = (timeline.end[action] - timeline.start[action]) * unit
            text = f"{action.kind}{action.microbatch}" + (
                f" s{action.stage}" if schedule.stages > schedule.ranks else ""
            )
            parts.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w - 1:.1f}" height="{row - 4}" '
                f'fill="{_ACTION_COLORS[action.kind]}"><title>{action}</title></rect>'
                f'<text x="{x + 3:.1f}" y="{y + 17}" fill="white">{html.escape(text)}</text>'
            )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
