"""Which collective each rank is in, so a stuck or dead peer ends the job with its name, not a hang.

    watchdog.note("all_reduce", "tp", "all_reduce_tp_3", group)  # right before a blocking collective
    watchdog.progress(step)                                      # once per optimizer step
    ...
    except RuntimeError as e:                                    # a collective timed out or lost a peer
        raise PeerFailure(watchdog.diagnose(e)) from e

    rank 0 waited 10 s in all_reduce over tp (all_reduce_tp_3, step 4); rank 1 did not join it (stuck or dead)

Finding the culprit. Collectives run in lockstep: when rank 0 gives up on a collective,
every other member of its group is either inside the same collective (and gives up too,
about as long after it started waiting) or never arrived: stuck in its own code, dead, or
blocked somewhere else first. So the rank that failed (`diagnose`):

1. appends its rank to `meshplan/watchdog/waiting` on the c10d store (the default group's
   TCPStore, served by its own thread: it answers while a rank's Python is stuck);
2. after a timeout, gives the others `GRACE_S` to append theirs (after a broken connection
   it does not wait: the peer is gone and torchrun is about to stop the job);
3. names the members of its collective's group that did not: stuck or dead. Their
   `meshplan/watchdog/step/{rank}` key (`progress`) says how far they got: behind this
   rank's step, or in it but not in the collective. If every member did (they wait on
   someone else), it names the ranks outside the group that did not.

Store access on that path runs in a daemon thread joined with a deadline: an unreachable
store costs a few seconds at most, and the collective is reported all the same.

Cost on the healthy path: `note` stores one tuple (no I/O, no lock, well under a
microsecond); `progress` writes one store key per optimizer step. The state is per process
(module level): a process runs one training loop.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch.distributed as dist

KEY = "meshplan/watchdog"
GRACE_S = 2.0  # how long a timed-out rank waits for the others of its collective to time out too
DEADLINE_S = 5.0  # store access on the failure path, beyond the grace: then the store counts as unreachable
_POLL_S = 0.1

# (op, axis, detail, group, time.monotonic()) of the collective this rank entered last; None: none this step
_last: tuple[str, str, str, dist.ProcessGroup | None, float] | None = None
_step = 0  # the optimizer step this rank is in (1-based); 0: outside the training loop


def note(op: str, axis: str, detail: str = "", group: dist.ProcessGroup | None = None) -> None:
    """This rank enters `op` over `axis` (`group`'s ranks; None: all): call it right before the call
    that blocks (for an async collective, before `work.wait()`). `detail` tells it apart: a graph
    node, a bucket, a size (`size_text`)."""
    global _last
    _last = (op, axis, detail, group, time.monotonic())


def progress(step: int) -> None:
    """This rank starts optimizer step `step` (1-based): remember it, and tell the other ranks."""
    global _step, _last
    _step, _last = step, None  # a collective noted in an earlier step is not this step's
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):  # best effort: a broken store is reported by `diagnose`
            store.set(f"{KEY}/step/{dist.get_rank()}", str(step))


def size_text(nbytes: int) -> str:
    """`1.6 MB`, `12 KB`, `512 B` (decimal units), for `note`'s detail."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class Collective:
    """A collective as `note` saw this rank enter it."""

    op: str  # all_reduce, all_gather, reduce_scatter, ...
    axis: str  # the mesh axis it runs over ("tp", "dp"); "": not one axis
    detail: str = ""
    group: dist.ProcessGroup | None = None  # its ranks; None: every rank
    since: float = 0.0  # time.monotonic() when this rank entered it


@dataclass(frozen=True)
class Stall:
    """What a rank whose collective failed knows, and what the other ranks told it; `str()` is the
    one-line report (see the module docstring)."""

    rank: int
    step: int  # 1-based optimizer step; 0: outside the training loop
    collective: Collective | None  # None: no collective was noted in this step
    waited_s: float = 0.0  # since this rank entered the collective
    cause: str = ""  # the backend's reason, for failures other than a timeout
    missing: dict[int, int] = field(default_factory=dict)  # ranks of its group not waiting -> last step
    elsewhere: dict[int, int] = field(default_factory=dict)  # none missing: the other ranks not waiting
    waiting: tuple[int, ...] = ()  # the other ranks that failed in a collective too
    unasked: str = ""  # why the other ranks could not be asked ("": they were)

    def __str__(self) -> str:
        who = self._who()
        return f"{self._what()}; {who}" if who else self._what()

    def _what(self) -> str:
        c = self.collective
        if c is None:
            where = f"a collective (step {self.step})" if self.step else "a collective"
        else:
            where = f"{c.op} over {c.axis}" if c.axis else c.op
            facts = [fact for fact in (c.detail, f"step {self.step}" if self.step else "") if fact]
            where += f" ({', '.join(facts)})" if facts else ""
        if self.cause:
            return f"rank {self.rank} failed in {where}: {self.cause}"
        if c is None:
            return f"rank {self.rank} timed out in {where}"
        return f"rank {self.rank} waited {_seconds(self.waited_s)} in {where}"

    def _who(self) -> str:
        if self.unasked:
            return f"could not ask the other ranks which one is missing ({self.unasked})"
        if self.missing:
            return self._absent(self.missing, "did not join it")
        if self.elsewhere:
            return f"its group waits too; {self._absent(self.elsewhere, 'did not join any collective')}"
        if self.waiting:
            return "every other rank failed in a collective too (do all ranks issue the same collectives?)"
        return ""

    def _absent(self, ranks: dict[int, int], verb: str) -> str:
        """`rank 1 did not reach step 4 (stuck or dead)` for ranks behind, else `rank 1 {verb} (...)`."""
        behind = [r for r, step in ranks.items() if step < self.step]
        level = [r for r, step in ranks.items() if step >= self.step]
        clauses = [f"{_ranks(behind)} did not reach step {self.step}"] if behind else []
        clauses += [f"{_ranks(level)} {verb}"] if level else []
        return "; ".join(f"{clause} (stuck or dead)" for clause in clauses)


def diagnose(cause: BaseException, *, grace_s: float = GRACE_S) -> Stall:
    """The report of this rank after `cause`, a collective that timed out or lost its peer: the
    collective noted last, and the ranks that did not join it, asked on the store (see the module
    docstring). Never raises; takes about `grace_s` after a timeout, at most `DEADLINE_S` more."""
    now = time.monotonic()
    collective = Collective(*_last) if _last is not None else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    timed_out = is_timeout(cause)
    stall = Stall(
        rank=rank,
        step=_step,
        collective=collective,
        waited_s=now - collective.since if collective is not None else 0.0,
        cause="" if timed_out else reason(cause),
    )
    store = _store()
    if store is None:
        return replace(stall, unasked="no c10d store")
    try:
        group = _members(collective.group if collective else None)
        grace = grace_s if timed_out else 0.0
        missing, elsewhere, waiting = _bounded(
            lambda: _ask(store, rank, group, dist.get_world_size(), grace), grace + DEADLINE_S
        )
    except Exception as e:
        return replace(stall, unasked=reason(e))
    return replace(stall, missing=missing, elsewhere=elsewhere, waiting=waiting)


def is_timeout(e: BaseException) -> bool:
    return re.search(r"timed? ?out", str(e), re.IGNORECASE) is not None


def reason(e: BaseException) -> str:
    """The first sentence of an error, without gloo's `[.../pair.cc:537] ` source location."""
    lines = str(e).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
    return text.split(". ")[0].rstrip(".") or type(e).__name__


# ---------------------------------------------------------------------------- the store


def _store() -> Any:
    """The default group's c10d store, or None (no process group, or a torch without the accessor)."""
    if not dist.is_initialized():
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:
        return None


def _members(group: dist.ProcessGroup | None) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _ask(
    store: Any, rank: int, group: list[int], world: int, grace_s: float
) -> tuple[dict[int, int], dict[int, int], tuple[int, ...]]:
    """Add this rank to the ranks whose collective failed; give the others `grace_s` to do the same
    (stop early if all have). Returns the ranks of `group` not among them, with the last step each
    began (0: none), or if there are none the other ranks not among them; and the ranks among them."""
    key = f"{KEY}/waiting"
    store.append(key, f"{rank} ")  # one key for all: reading it is one round trip, whatever the world size
    deadline = time.monotonic() + grace_s
    while True:
        waiting = {int(r) for r in store.get(key).split()}
        if len(waiting) >= world or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    missing = [r for r in group if r not in waiting]
    elsewhere = [] if missing else [r for r in range(world) if r not in waiting]
    return (
        {r: _read_step(store, r) for r in missing},
        {r: _read_step(store, r) for r in elsewhere},
        tuple(sorted(waiting - {rank})),
    )


def _read_step(store: Any, rank: int) -> int:
    key = f"{KEY}/step/{rank}"
    return int(store.get(key)) if store.check([key]) else 0  # `get` of a missing key would block


T = TypeVar("T")


def _bounded(fn: Callable[[], T], seconds: float) -> T:
    """`fn()` in a daemon thread, given up after `seconds` (a store that does not answer)."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(("ok", fn()))
        except Exception as e:
            result.append(("error", e))

    thread = threading.Thread(target=run, name="meshplan-watchdog", daemon=True)
    thread.start()
    thread.join(seconds)
    if not result:
        raise TimeoutError(f"the store did not answer within {seconds:.0f} s")
    kind, value = result[0]
    if kind == "error":
        raise value
    return value


# ---------------------------------------------------------------------------- text


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 1 else f"{s:.1f} s"


def _ranks(ranks: Iterable[int], limit: int = 8) -> str:
    """`rank 1`, `ranks 1 and 3`, `ranks 1, 3 and 5`, `ranks 1, 2, 3, 4, 5, 6 and 10 more`."""
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if len(rs) > limit:
        return f"ranks {', '.join(map(str, rs[: limit - 2]))} and {len(rs) - limit + 2} more"
    return f"ranks {', '.join(map(str, rs[:-1]))} and {rs[-1]}"
