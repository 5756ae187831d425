"""Pipeline schedules as action lists, checked by simulation before anything runs.

With unit costs (F=1, B=2) the simulated bubbles are the closed forms: GPipe and 1F1B
(p - 1) / (m + p - 1), interleaved 1F1B (p - 1) / (v m + p - 1); with the backward split
(I=W=1), ZB-H1 (p - 1) / (3m + p - 1), and ZBV below half of 1F1B's. A list that cannot run
(a microbatch missing or run twice, an action on the wrong rank, microbatches numbered
from 1, an order that waits forever) is one `ScheduleError` naming the rank and the action.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.runtime.schedules import (
    Action,
    ScheduleError,
    build,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
    zbv,
    zero_bubble,
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
    assert round(simulate(zero_bubble(4, 8)).bubble, 3) == 0.111
    assert round(simulate(zbv(4, 8)).bubble, 3) == 0.059


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_schedules_shrink_the_bubble_within_1f1b_memory(p: int, m: int) -> None:
    """ZB-H1 reaches its closed form with at most p - r microbatches awaiting their input
    gradient on rank r (1F1B's bound) and fewer than 2p holding anything; ZBV's idle is below
    half of 1F1B's with at most 2p chunk activations (p stages' worth) on every rank."""
    h1, v, base = zero_bubble(p, m), zbv(p, m), simulate(one_f_one_b(p, m)).bubble
    assert simulate(h1).bubble == pytest.approx((p - 1) / (3 * m + p - 1))
    assert simulate(v).bubble < base / 2
    for r in range(p):
        assert _peak(h1.actions[r], "I") <= p - r
        assert _peak(h1.actions[r], "W") < 2 * p
        assert _peak(v.actions[r], "W") <= 2 * p
    assert v.owner[:p] == tuple(range(p)) and v.owner[p:] == tuple(reversed(range(p)))  # the V


def _peak(actions, freed_by: str) -> int:
    """The most microbatches forwarded and not yet `freed_by` at any point of a rank's list."""
    alive = peak = 0
    for a in actions:
        alive += (a.kind == "F") - (a.kind == freed_by)
        peak = max(peak, alive)
    return peak


def test_every_small_pipeline_has_a_zero_bubble_order() -> None:
    """The list scheduling never paints itself into a corner, down to fewer microbatches than
    ranks (every list is checked by `simulate` inside `build`)."""
    for p in range(1, 7):
        for m in range(1, 13):
            build("zero_bubble", p, m)
            build("zbv", p, m, 2)
    with pytest.raises(ScheduleError, match="even number of chunks"):
        zbv(2, 4, 3)


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


def test_a_hand_off_delays_the_receiver_not_the_sender() -> None:
    """A message between ranks arrives `handoff` after its action ends; the sender goes on (its
    sends are asynchronous): GPipe over 2 ranks waits for it once on the way forward and once
    back, and rank 0's forwards run back to back whatever the latency."""
    schedule = gpipe(2, 3)
    plain = simulate(schedule)
    late = simulate(schedule, handoff=lambda a: 0.5)
    assert late.makespan == pytest.approx(plain.makespan + 2 * 0.5)
    forwards = [late.start[Action("F", 0, i)] for i in range(3)]
    assert forwards == [0.0, 1.0, 2.0]  # unit forwards, no wait for what they send
    assert late.start[Action("F", 1, 0)] == pytest.approx(1.5)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zbv", "zero_bubble"])
def test_ranks_sharing_one_core_take_the_work_of_every_action_and_no_bubble(name: str) -> None:
    """Ranks crowded onto one core (each of n running actions at 1/n of its speed) leave it
    idle only when no rank can run: without hand-offs never, so the step is the sum of every
    action's cost; ranks that do not crowd run the list schedule, start for start."""
    schedule = build(name, 2, 4, 2 if name in ("interleaved", "zbv") else 1)
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    work = sum(cost[a.kind] for rank in schedule.actions for a in rank)
    shared = simulate(schedule, cost, crowded=lambda running: running)
    assert shared.makespan == pytest.approx(work)
    assert sum(shared.busy) > work  # each rank's wall time, stretched by the others beside it
    alone = simulate(schedule, cost, handoff=lambda a: 0.25, crowded=lambda running: 1.0)
    listed = simulate(schedule, cost, handoff=lambda a: 0.25)
    assert alone.start == pytest.approx(listed.start) and alone.makespan == pytest.approx(listed.makespan)
    assert simulate(schedule, cost).makespan < work  # the bubble's parts run side by side


def test_the_hand_off_latency_is_what_makes_the_simulation_take_the_measured_step() -> None:
    """`handoff_cost.fit` inverts the simulation: the makespan at a known latency gives that
    latency back; a step no slower than the simulation without one gives 0."""
    from meshplan.runtime.handoff_cost import CHUNKS, MICROBATCHES, fit

    schedule = build("interleaved", 2, MICROBATCHES, CHUNKS)
    costs = {(k, s): (1e-3 if k == "F" else 2e-3) * (1 + s / 10) for k in ("F", "B") for s in range(4)}
    step = simulate(schedule, lambda a: costs[(a.kind, a.stage)], lambda a: 7e-4).makespan
    assert fit(costs, [step * 0.99, step, step * 1.01]) == pytest.approx(7e-4, rel=1e-3)
    assert fit(costs, [simulate(schedule, lambda a: costs[(a.kind, a.stage)]).makespan * 0.9]) == 0.0
    # two pipelines' ranks on two cores: the actions running at once slowed as they share them
    crowded = lambda n: max(1.0, n)  # noqa: E731
    step = simulate(schedule, lambda a: costs[(a.kind, a.stage)], lambda a: 3e-3, crowded=crowded).makespan
    assert fit(costs, [step], crowded) == pytest.approx(3e-3, rel=1e-3)
