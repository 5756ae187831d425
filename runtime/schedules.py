"""Pipeline schedules as action lists, and the simulation that checks them before they run.

A schedule says, for each rank, the order in which it runs its stages' work on each
microbatch. Stages are virtual (`v` chunks per rank under interleaving); stage `s` runs on
rank `owner[s]`. The actions:

    F(s, i)   forward of stage s on microbatch i (its output goes to stage s + 1)
    B(s, i)   backward of stage s on microbatch i: input and weight gradients
    I(s, i)   input gradient only (zero-bubble schedules split B into I and W)
    W(s, i)   weight gradient of stage s on microbatch i, any time after I(s, i)

Sends and receives are implied by the owners: F(s, i) on another rank than stage s + 1
means a send and its matching receive, and likewise backward. Dependencies:

    F(s, i)        after F(s - 1, i)
    B/I(s, i)      after F(s, i) and B/I(s + 1, i) (the last stage: after its own F)
    W(s, i)        after I(s, i)

`simulate` runs the lists with a cost per action kind (unit costs F=1, B=2, I=W=1 give the
textbook bubbles) and checks them on the way: every (stage, microbatch) runs each of its
actions exactly once, on the rank that owns the stage, and nothing waits forever. A list
that breaks one of these is a `ScheduleError` naming the rank and action, never a hang.

    schedule = one_f_one_b(ranks=4, microbatches=8)
    timeline = simulate(schedule)
    timeline.bubble          # 0.273 = (p - 1) / (m + p - 1)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from meshplan.grammar import SCHEDULES

Kind = Literal["F", "B", "I", "W"]
UNIT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True, order=True)
class Action:
    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    name: str
    ranks: int
    microbatches: int
    owner: tuple[int, ...]  # virtual stage -> the rank that runs it
    actions: tuple[tuple[Action, ...], ...]  # per rank, in the order it runs them

    @property
    def stages(self) -> int:
        return len(self.owner)

    def in_flight(self, stage: int) -> int:
        """The most microbatches of `stage` whose forward has run and whose activations are not
        yet freed (by its full backward `B`, or its weight half `W` under a split backward), in
        its owner's action list: how many microbatches' activations the stage keeps at once."""
        live = most = 0
        for a in self.actions[self.owner[stage]]:
            if a.stage != stage:
                continue
            if a.kind == "F":
                live += 1
                most = max(most, live)
            elif a.kind in ("B", "W"):
                live -= 1
        return max(most, 1)


class ScheduleError(ValueError):
    """An action list that cannot run as written (one line naming the rank and the action)."""


@dataclass(frozen=True)
class Timeline:
    schedule: Schedule
    start: Mapping[Action, float]
    end: Mapping[Action, float]
    makespan: float
    busy: tuple[float, ...]  # per rank

    @property
    def bubble(self) -> float:
        """The fraction of rank-time spent idle, over the whole step."""
        total = self.makespan * self.schedule.ranks
        return 1.0 - sum(self.busy) / total if total else 0.0


# ---------------------------------------------------------------------------- schedules


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """Every forward, then every backward (all microbatches' activations are alive at once)."""
    lists = tuple(
        tuple(Action("F", r, i) for i in range(microbatches))
        + tuple(Action("B", r, i) for i in range(microbatches))
        for r in range(ranks)
    )
    return Schedule("gpipe", ranks, microbatches, tuple(range(ranks)), lists)


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B: rank r runs p - r - 1 forwards ahead, then alternates one forward and one backward,
    so at most p - r microbatches are in flight on it."""
    lists = []
    for r in range(ranks):
        warmup = min(ranks - r - 1, microbatches)
        order = [Action("F", r, i) for i in range(warmup)]
        backward = 0
        for i in range(warmup, microbatches):
            order += [Action("F", r, i), Action("B", r, backward)]
            backward += 1
        order += [Action("B", r, i) for i in range(backward, microbatches)]
        lists.append(tuple(order))
    return Schedule("1f1b", ranks, microbatches, tuple(range(ranks)), tuple(lists))


def interleaved_one_f_one_b(ranks: int, microbatches: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: `chunks` virtual stages per rank (stage s on rank s % p),
    microbatches taken in groups of p through each chunk in turn. Needs m divisible by p."""
    if microbatches % ranks:
        raise ScheduleError(
            f"interleaved 1F1B needs the microbatches ({microbatches}) to be a multiple of the "
            f"pipeline ranks ({ranks})"
        )
    total = microbatches * chunks

    def forward(r: int, k: int) -> Action:
        chunk = (k // ranks) % chunks
        return Action("F", chunk * ranks + r, (k // (ranks * chunks)) * ranks + k % ranks)

    def backward(r: int, k: int) -> Action:
        chunk = chunks - 1 - (k // ranks) % chunks
        return Action("B", chunk * ranks + r, (k // (ranks * chunks)) * ranks + k % ranks)

    lists = []
    for r in range(ranks):
        warmup = min((ranks - r - 1) * 2 + (chunks - 1) * ranks, total)
        order = [forward(r, k) for k in range(warmup)]
        done = 0
        for k in range(warmup, total):
            order += [forward(r, k), backward(r, done)]
            done += 1
        order += [backward(r, k) for k in range(done, total)]
        lists.append(tuple(order))
    owner = tuple(s % ranks for s in range(ranks * chunks))
    return Schedule(f"interleaved-1f1b(v={chunks})", ranks, microbatches, owner, tuple(lists))


def zero_bubble(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into I and W. The input gradient, on the critical
    path, runs as early as it can; the weight gradients fill what would have been the bubble.
    As in 1F1B, at most p - r microbatches await their input gradient on rank r, and at most
    p more wait for their weight gradient (which keeps only the weights' operands)."""
    return _list_schedule(
        "zero-bubble",
        ranks,
        microbatches,
        owner=tuple(range(ranks)),
        in_flight=lambda r: ranks - r,
        freed_by="I",
        deferred=ranks,
    )


def zbv(ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """ZBV: chunks placed in Vs (with 2 chunks, rank r holds stages r and 2p - 1 - r, so the
    first rank also holds the loss), backward split into I and W. Every rank keeps at most
    `chunks` * p chunk activations (the first rank's memory under 1F1B), and the bubble nearly
    vanishes. Needs an even number of chunks per rank."""
    if chunks < 2 or chunks % 2:
        raise ScheduleError(f"zbv needs an even number of chunks per rank, not {chunks}")

    def owner(s: int) -> int:
        chunk, k = divmod(s, ranks)
        return ranks - 1 - k if chunk % 2 else k

    return _list_schedule(
        f"zbv(v={chunks})" if chunks != 2 else "zbv",
        ranks,
        microbatches,
        owner=tuple(owner(s) for s in range(chunks * ranks)),
        in_flight=lambda r: chunks * ranks,
        freed_by="W",
    )


def _list_schedule(
    name: str,
    ranks: int,
    microbatches: int,
    *,
    owner: tuple[int, ...],
    in_flight: Callable[[int], int],
    freed_by: Kind,
    deferred: int | None = None,
) -> Schedule:
    """Split-backward action lists made by list scheduling at unit costs: whenever a rank is
    free, it runs a ready input gradient (oldest microbatch first), else the oldest weight
    gradient if `deferred` of them wait, else a ready forward (latest stage first, so
    microbatches reach the loss) while fewer than `in_flight(rank)` microbatches are in flight
    (forwarded, not yet `freed_by` I or W), else the oldest weight gradient. The result is
    checked by `simulate` like any other list."""
    stages, m = len(owner), microbatches
    end: dict[Action, float] = {}
    clock = [0.0] * ranks
    lists: list[list[Action]] = [[] for _ in range(ranks)]
    alive = [0] * ranks
    forwarded = [0] * stages  # microbatches each stage has run forward
    mine = [[s for s in range(stages) if owner[s] == r] for r in range(ranks)]

    def done(a: Action, t: float) -> bool:
        return end.get(a, float("inf")) <= t

    def choose(r: int, t: float) -> Action | None:
        inputs = [
            Action("I", s, i)
            for s in mine[r]
            for i in range(forwarded[s])
            if Action("I", s, i) not in end
            and done(Action("F", s, i), t)
            and (s == stages - 1 or done(Action("I", s + 1, i), t))
        ]
        if inputs:
            return min(inputs, key=lambda a: (a.microbatch, -a.stage))
        weights = [
            Action("W", s, i)
            for s in mine[r]
            for i in range(forwarded[s])
            if Action("W", s, i) not in end and done(Action("I", s, i), t)
        ]
        oldest = min(weights, key=lambda a: (end[Action("I", a.stage, a.microbatch)], a.stage), default=None)
        if deferred is not None and len(weights) >= deferred:
            return oldest
        forwards = [
            Action("F", s, forwarded[s])
            for s in mine[r]
            if forwarded[s] < m and (s == 0 or done(Action("F", s - 1, forwarded[s]), t))
        ]
        if forwards and alive[r] < in_flight(r):
            return min(forwards, key=lambda a: (-a.stage, a.microbatch))
        return oldest

    total = [3 * m * len(mine[r]) for r in range(ranks)]
    while any(len(lists[r]) < total[r] for r in range(ranks)):
        live = [r for r in range(ranks) if len(lists[r]) < total[r]]
        now = min(clock[r] for r in live)
        picked = next(((r, a) for r in live if clock[r] == now and (a := choose(r, now))), None)
        if picked is None:  # nobody can start now: move the idle ranks to the next event
            later = [e for e in end.values() if e > now] + [clock[r] for r in live if clock[r] > now]
            if not later:
                raise ScheduleError(f"{name}: no order fits p={ranks}, m={m} within its memory bound")
            for r in live:
                clock[r] = max(clock[r], min(later))
            continue
        r, action = picked
        end[action] = now + UNIT_COSTS[action.kind]
        clock[r] = end[action]
        lists[r].append(action)
        if action.kind == "F":
            forwarded[action.stage] += 1
            alive[r] += 1
        elif action.kind == freed_by:
            alive[r] -= 1
    return Schedule(name, ranks, m, owner, tuple(tuple(a) for a in lists))


def build(name: str, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule a plan names (one of `SCHEDULES`, the plan language's list; `chunks` per rank
    for `interleaved` and `zbv`), checked by simulation: a list that cannot run is a
    `ScheduleError` here, never a hang later."""
    if name not in SCHEDULES:
        raise ScheduleError(f"no schedule called {name!r} is built yet")
    if name == "gpipe":
        schedule = gpipe(ranks, microbatches)
    elif name == "1f1b":
        schedule = one_f_one_b(ranks, microbatches)
    elif name == "interleaved":
        schedule = interleaved_one_f_one_b(ranks, microbatches, chunks)
    elif name == "zero_bubble":
        schedule = zero_bubble(ranks, microbatches)
    elif name == "zbv":
        schedule = zbv(ranks, microbatches, chunks)
    simulate(schedule)
    return schedule


# ---------------------------------------------------------------------------- simulation


def simulate(
    schedule: Schedule,
    costs: Mapping[str, float] | Callable[[Action], float] = UNIT_COSTS,
    handoff: Callable[[Action], float] | None = None,
    crowded: Callable[[int], float] | None = None,
) -> Timeline:
    """Run the action lists in dependency order with the given costs (per action kind, or a
    function of the action: a cost per stage, say); raise `ScheduleError` if an action is
    missing, repeated, on the wrong rank, or waits forever. `handoff(a)`: how long what `a`
    sends takes to reach another rank's action that needs it (its sender goes on meanwhile:
    sends are asynchronous); none: at once. `crowded(n)`: how much longer every action takes
    while `n` ranks run one at once (ranks sharing a CPU's cores, the costs then each action's
    time alone); none: each action takes its cost."""
    cost = costs if callable(costs) else lambda a: costs[a.kind]
    owner = schedule.owner

    def ready(dep: Action, action: Action) -> float:
        if handoff is None or owner[dep.stage] == owner[action.stage]:
            return end[dep]
        return end[dep] + handoff(dep)

    _check_coverage(schedule)
    split = {(a.stage, a.microbatch) for rank in schedule.actions for a in rank if a.kind == "I"}
    if crowded is not None:
        return _simulate_crowded(schedule, cost, handoff, crowded, split)
    end: dict[Action, float] = {}
    start: dict[Action, float] = {}
    position = [0] * schedule.ranks
    clock = [0.0] * schedule.ranks
    busy = [0.0] * schedule.ranks
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for r, actions in enumerate(schedule.actions):
            while position[r] < len(actions):
                action = actions[position[r]]
                deps = _dependencies(action, schedule.stages, split)
                if any(d not in end for d in deps):
                    break
                start[action] = max([clock[r], *(ready(d, action) for d in deps)])
                spent = cost(action)
                end[action] = start[action] + spent
                clock[r] = end[action]
                busy[r] += spent
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise _waits_forever(schedule, position, end, split)
    return Timeline(schedule, start, end, max(clock, default=0.0), tuple(busy))


def _simulate_crowded(
    schedule: Schedule,
    cost: Callable[[Action], float],
    handoff: Callable[[Action], float] | None,
    crowded: Callable[[int], float],
    split: set[tuple[int, int]],
) -> Timeline:
    """`simulate` with ranks that share the cores: from event to event (an action ends, a
    message arrives), every running action advances at 1 / crowded(how many run)."""
    owner, stages = schedule.owner, schedule.stages
    end: dict[Action, float] = {}
    start: dict[Action, float] = {}
    position = [0] * schedule.ranks
    busy = [0.0] * schedule.ranks
    free_at = [0.0] * schedule.ranks  # when each rank's last action ended
    running: dict[int, float] = {}  # rank -> the work left of its action, in seconds alone
    now, remaining = 0.0, sum(len(a) for a in schedule.actions)
    while remaining:
        arrivals = []  # when the next action of an idle rank may start, its inputs all in
        for r, actions in enumerate(schedule.actions):
            if r in running or position[r] == len(actions):
                continue
            action = actions[position[r]]
            deps = _dependencies(action, stages, split)
            if any(d not in end for d in deps):
                continue
            at = max(
                [free_at[r]]
                + [end[d] + (handoff(d) if handoff and owner[d.stage] != r else 0.0) for d in deps]
            )
            if at <= now:
                start[action], running[r] = now, cost(action)
            else:
                arrivals.append(at)
        if not running and not arrivals:
            raise _waits_forever(schedule, position, end, split)
        slow = crowded(len(running)) if running else 1.0
        step = min([left * slow for left in running.values()] + [at - now for at in arrivals])
        now += step
        for r in list(running):
            busy[r] += step
            running[r] -= step / slow
            if running[r] <= 1e-12 * max(now, 1.0):
                action = schedule.actions[r][position[r]]
                end[action], free_at[r] = now, now
                del running[r]
                position[r] += 1
                remaining -= 1
    return Timeline(schedule, start, end, max(free_at, default=0.0), tuple(busy))


def _waits_forever(
    schedule: Schedule, position: list[int], end: Mapping[Action, float], split: set[tuple[int, int]]
) -> ScheduleError:
    stuck = []
    for r, actions in enumerate(schedule.actions):
        if position[r] < len(actions):
            waiting = actions[position[r]]
            missing = [d for d in _dependencies(waiting, schedule.stages, split) if d not in end]
            stuck.append(f"rank {r} waits forever at {waiting} for {', '.join(map(str, missing))}")
    return ScheduleError(f"{schedule.name}: {'; '.join(stuck)}")


def _dependencies(action: Action, stages: int, split: set[tuple[int, int]]) -> list[Action]:
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        return [Action("F", s - 1, i)] if s > 0 else []
    if action.kind == "W":
        return [Action("I", s, i)]
    deps = [Action("F", s, i)]
    if s < stages - 1:
        deps.append(Action("I" if (s + 1, i) in split else "B", s + 1, i))
    return deps


def _check_coverage(schedule: Schedule) -> None:
    """Each (stage, microbatch) runs F once, and B once or I and W once each, on its owner."""
    seen: dict[Action, int] = {}
    for r, actions in enumerate(schedule.actions):
        for a in actions:
            if not (0 <= a.stage < schedule.stages and 0 <= a.microbatch < schedule.microbatches):
                raise ScheduleError(
                    f"{schedule.name}: rank {r} runs {a}, outside {schedule.stages} stages x "
                    f"{schedule.microbatches} microbatches (numbered from 0)"
                )
            if schedule.owner[a.stage] != r:
                raise ScheduleError(
                    f"{schedule.name}: rank {r} runs {a}, but stage {a.stage} is on rank {schedule.owner[a.stage]}"
                )
            if a in seen:
                raise ScheduleError(f"{schedule.name}: rank {r} runs {a} twice")
            seen[a] = r
    for s in range(schedule.stages):
        for i in range(schedule.microbatches):
            kinds = {k for k in ("F", "B", "I", "W") if Action(k, s, i) in seen}  # type: ignore[arg-type]
            if kinds not in ({"F", "B"}, {"F", "I", "W"}):
                lacking = sorted({"F", "B"} - kinds) if "I" not in kinds else sorted({"F", "I", "W"} - kinds)
                raise ScheduleError(
                    f"{schedule.name}: stage {s}, microbatch {i} never runs {', '.join(lacking) or 'consistently'}"
                    + (" (both B and I/W)" if "B" in kinds and "I" in kinds else "")
                )
