"""Pipeline schedules as action lists, checked by simulation before anything runs.

With unit costs (F=1, B=2) the simulated bubbles are the closed forms: GPipe and 1F1B
(p - 1) / (m + p - 1), interleaved 1F1B (p - 1) / (v m + p - 1). A list that cannot run
(a microbatch missing or run twice, an action on the wrong rank, microbatches numbered
from 1, an order that waits forever) is one `ScheduleError` naming the rank and the action.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.runtime.schedules import (
    Action,
    ScheduleError,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 8), (4, 4), (8, 16), (3, 5)])
def test_gpipe_and_1f1b_have_the_textbook_bubble(p: int, m: int) -> None:
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        assert simulate(schedule).bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (2, 4, 2), (2, 8, 4), (4, 16, 2)])
def test_interleaving_divides_the_bubble_by_the_chunks(p: int, m: int, v: int) -> None:
    assert simulate(interleaved_one_f_one_b(p, m, v)).bubble == pytest.approx((p - 1) / (v * m + p - 1))


def test_the_numbers_of_the_issue() -> None:
    assert round(simulate(gpipe(4, 8)).bubble, 3) == 0.273
    assert round(simulate(one_f_one_b(4, 8)).bubble, 3) == 0.273
    assert round(simulate(interleaved_one_f_one_b(4, 8, 2)).bubble, 3) == 0.158


def test_1f1b_keeps_at_most_p_minus_r_microbatches_in_flight() -> None:
    p, m = 4, 8
    schedule = one_f_one_b(p, m)
    for r, actions in enumerate(schedule.actions):
        alive = peak = 0
        for a in actions:
            alive += 1 if a.kind == "F" else -1
            peak = max(peak, alive)
        assert peak == p - r
    assert max(sum(a.kind == "F" for a in actions) for actions in gpipe(p, m).actions) == m


def broken(schedule, rank: int, actions: list[Action]):
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(schedule, actions=tuple(lists))


def test_lists_that_cannot_run_are_refused_with_the_rank_and_action() -> None:
    s = one_f_one_b(2, 4)
    last = list(s.actions[1])
    cases = {
        "runs F1.3 twice": broken(s, 1, [*last, Action("F", 1, 3)]),
        "stage 1, microbatch 2 never runs B": broken(s, 1, [a for a in last if a != Action("B", 1, 2)]),
        "stage 0 is on rank 0": broken(s, 1, [*last, Action("W", 0, 0)]),
        # the last stage's forwards numbered 1..m instead of 0..m-1
        "outside 2 stages x 4 microbatches": broken(
            s, 1, [dataclasses.replace(a, microbatch=a.microbatch + 1) if a.kind == "F" else a for a in last]
        ),
        # backward of microbatch 1 before its forward: waits on itself
        "rank 1 waits forever at B1.0 for F1.0": broken(s, 1, sorted(last, key=lambda a: a.kind)),
    }
    for message, schedule in cases.items():
        with pytest.raises(ScheduleError, match=message):
            simulate(schedule)


def test_interleaving_needs_whole_rounds_of_microbatches() -> None:
    with pytest.raises(ScheduleError, match="multiple of the pipeline ranks"):
        interleaved_one_f_one_b(4, 6, 2)
