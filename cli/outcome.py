"""How a `meshplan run` ended, said in one message and one exit code, on every node.

    code = summarize(ended, options, Path(errors))   # `torchrun.supervise`'s `Ended`

Sources, from the nearest: torchrun's failure report (each failed local worker's rank and exit
code, the first one observed), the workers' own reports of a collective that failed (a line
each, `torchrun.PEER_FAILURE`), the exit codes the workers left in the launcher's folder (when
the launcher had to end torchrun itself, there is no report), and, for a multi-node run, what
the other nodes' launchers found: each one leaves a `NodeOutcome` in the shared run folder
(`NODES`) and reads the others', so that every node names the same rank, and its host.

The rank that failed first is the one that died on its own (killed, crashed, a meshplan bug)
whenever there is one: its peers' collectives fail because of it, and torchrun's "first
observed failure" can be one of them (they exit within milliseconds). Else it is the first
report of a collective that failed: the rank that gave up first says which rank never joined.

    meshplan: error: rank 3 on node1 failed first (exit code 137: killed); torchrun stopped the other ranks (...)
      hint: continue with --resume from step00000008 in runs/demo: meshplan run demo.plan ... --resume
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.errors import EXIT_INTERNAL, EXIT_PEER, EXIT_USER
from meshplan.options import RunOptions, command_line, run_dir
from meshplan.torchrun import PEER_FAILURE, WORKER_EXIT, is_failure

if TYPE_CHECKING:
    from meshplan.torchrun import Ended

NODES = ".meshplan-nodes"  # in the run folder: each node's `NodeOutcome`, `<host>-<pid>.json`
NODES_WAIT_S = 10.0  # how long a node's launcher waits for the other nodes' outcomes

_ROOT_CAUSE = re.compile(
    r"Root Cause.*?(?:time\s*:\s*(\S+).*?)?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S
)
_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass(frozen=True)
class Failure:
    """A worker that failed: its rank, exit code (None: it left none, killed) and when (time.time())."""

    rank: int
    code: int | None
    when: float

    def died_on_its_own(self) -> bool:
        """Killed, crashed or a meshplan bug: not a collective that failed because of a peer, not
        stopped by torchrun (SIGTERM) after another rank failed."""
        return self.code not in (EXIT_PEER, -signal.SIGTERM, EXIT_USER)

    def how(self) -> str:
        if self.code is None:
            return "it ended without an exit code: killed"
        if self.code < 0:
            return f"killed by signal {-self.code}"
        if self.code == 137:
            return "exit code 137: killed"
        if self.code == EXIT_PEER:
            return "a collective failed"
        return f"exit code {self.code}"


@dataclass(frozen=True)
class NodeOutcome:
    """What one node's launcher knows of how its workers ended: left for the other nodes."""

    host: str
    ranks: tuple[int, ...]  # its workers' global ranks
    failures: tuple[Failure, ...]  # torchrun's first observed failure first
    said: tuple[tuple[int, str, float], ...] = ()  # (rank, its report of a failed collective, when)
    user_error: str = ""  # a worker's message about the user's input (exit 2), as the launcher prints it
    ended: bool = True  # False: left when its workers started (its ranks' host known to every node)

    @classmethod
    def from_json(cls, text: str) -> NodeOutcome:
        data = json.loads(text)
        return cls(
            host=data["host"],
            ranks=tuple(data["ranks"]),
            failures=tuple(Failure(*f) for f in data["failures"]),
            said=tuple((r, line, when) for r, line, when in data["said"]),
            user_error=data.get("user_error", ""),
            ended=data.get("ended", True),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                **asdict(self),
                "failures": [[f.rank, f.code, f.when] for f in self.failures],
                "said": [list(s) for s in self.said],
            }
        )


def summarize(ended: Ended, options: RunOptions, errors: Path) -> int:
    """Say how the run ended (stderr) and return the launcher's exit code: 0, 2 for the user's
    input, 3 for a run lost to something outside it (a rank killed or stuck, a node unreachable,
    a rendezvous that never completed), 1 for a meshplan bug, 128 + N for a signal."""
    if ended.received is not None:
        name = signal.Signals(ended.received).name
        print(
            f"meshplan: stopped by {name}: every worker has ended; checkpoints already written are "
            "complete (continue with --resume)",
            file=sys.stderr,
        )
        return 128 + ended.received
    held = ended.held
    started = ended.started or _ROOT_CAUSE.search("".join(held)) is not None
    if not started and (ended.status != 0 or ended.ended_by is not None):
        if os.environ.get("MESHPLAN_DEBUG"):
            sys.stderr.writelines(held)
        print(f"meshplan: error: {rendezvous_failure(ended, options)}", file=sys.stderr)
        return EXIT_PEER
    if not ended.started:  # no worker left its id: what they said is in torchrun's lines
        ahead = next((i for i, line in enumerate(held) if is_failure(line)), len(held))
        sys.stderr.writelines(held[:ahead])
        held = held[ahead:]
    mine = _this_node(ended, errors)
    if (ended.status == 0 and ended.ended_by is None) or (ended.ended_by and not mine.failures):
        sys.stderr.writelines(held)
        return 0
    across_nodes = str(options.nnodes) != "1"
    outcomes = _exchange(mine, run_dir(options), str(options.nnodes)) if across_nodes else [mine]
    user_error = next((o.user_error for o in outcomes if o.user_error), "")
    if user_error:
        sys.stderr.write(user_error)
        return EXIT_USER
    found = _culprit(outcomes, across_nodes=across_nodes)
    if found is None:  # torchrun failed on its own (its agent, not a worker)
        sys.stderr.writelines(held)
        last = next((line.strip() for line in reversed(held) if line.strip()), "no report")
        print(f"meshplan: error: torchrun failed: {last}", file=sys.stderr)
        return EXIT_PEER
    culprit, code = found
    if os.environ.get("MESHPLAN_DEBUG"):
        sys.stderr.writelines(held)
    else:
        sys.stderr.writelines(  # the other ranks' collectives
            line
            for line in held
            if (m := PEER_FAILURE.match(line)) and m.group(1) != culprit and line not in ended.shown
        )
    if ended.ended_by == "lingered":
        tail = (
            "torchrun did not end once every worker here had (its rendezvous store unreachable?): "
            "meshplan ended it"
        )
    else:
        tail = "torchrun stopped the other ranks (MESHPLAN_DEBUG=1 shows torchrun's report)"
    if across_nodes:
        culprit = _with_hosts(culprit, _hosts(outcomes))
    print(f"meshplan: error: {culprit}; {tail}", file=sys.stderr)
    print(resume_hint(options), file=sys.stderr)
    # torchrun itself exits 1 whatever failed: a worker that exited 1 hit a meshplan bug (and said
    # so); one killed, crashed or stopped in a collective is a rank lost or stuck
    return EXIT_INTERNAL if code == EXIT_INTERNAL else EXIT_PEER


def first_failure(report: str) -> str | None:
    """`rank 1 failed first (exit code 137: killed)`, from torchrun's failure report; when that
    rank gave up on a collective and said so in `report`, its own line: `rank 0 waited 10 s in
    all_reduce over dp (...); rank 1 did not join it (stuck or dead)`."""
    found = _culprit([_from_report(report, ranks=(), when=0.0)], across_nodes=False)
    return found[0] if found is not None else None


def resume_hint(options: RunOptions) -> str:
    """The hint under a failed run's summary: the command that continues it from its last
    checkpoint, or (none saved) the one that starts it again."""
    folder = run_dir(options)
    saved = sorted(p.parent.name for p in folder.glob("checkpoints/step*/.metadata"))
    every = " (on every node, each with its own options)" if str(options.nnodes) != "1" else ""
    if saved:
        return (
            f"  hint: continue with --resume from {saved[-1]} in {folder}{every}: "
            f"{command_line(options, add='--resume')}"
        )
    return (
        f"  hint: {folder} has no checkpoint to continue with --resume from (--save-every N saves "
        f"them); start again{every}: {command_line(options, add='--overwrite')}"
    )


def rendezvous_failure(ended: Ended, options: RunOptions) -> str:
    """The one line for a rendezvous that did not complete: where, how long, why, what to check."""
    report = "".join(ended.held)
    endpoint = options.rdzv_endpoint or "127.0.0.1:29500 (torchrun's default)"
    host = (options.rdzv_endpoint or "").rpartition(":")[0] or options.rdzv_endpoint
    here = socket.gethostname()
    if host and not _resolves(host):
        why = f"the host name {host} does not resolve"
    elif "gaierror" in report and not _resolves(here):
        why = (
            f"this node's host name {here} does not resolve (torchrun looks it up: add it to the "
            "name service, or give this node's address with --local-addr and, for c10d, "
            "--rdzv-conf is_host=1 on the node that hosts the rendezvous, is_host=0 on the others)"
        )
    elif re.search(r"Address already in use|EADDRINUSE", report):
        why = f"{endpoint} is in use (another run on the same port?)"
    elif re.search(r"failed to connect|[Cc]onnection refused|ECONNREFUSED|RendezvousConnectionError", report):
        why = f"nothing answered at {endpoint}"
    elif ended.ended_by == "rendezvous" or re.search(r"RendezvousTimeoutError|[Tt]imed? ?out", report):
        why = "the other nodes did not join"
    else:
        last = next((line.strip() for line in reversed(ended.held) if line.strip()), "no report")
        why = f"torchrun said: {last}"
    waited = f"after {ended.waited_s:.0f} s"
    if str(options.nnodes) == "1":
        return f"torchrun's rendezvous failed {waited}: {why} (MESHPLAN_DEBUG=1 shows its report)"
    return (
        f"the rendezvous of {options.nnodes} nodes at {endpoint} ({options.rdzv_backend or 'static'}) "
        f"did not complete {waited}: {why} (check: are the other nodes started, with the same "
        f"--rdzv-endpoint, --rdzv-backend and --rdzv-id? can this node reach {endpoint}? "
        "--rdzv-timeout S waits longer)"
    )


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host.strip("[]"), None)
    except (OSError, UnicodeError):
        return False
    return True


# ---------------------------------------------------------------------------- this node


def _this_node(ended: Ended, errors: Path) -> NodeOutcome:
    """This node's outcome: torchrun's report where there is one, else the exit codes the
    workers left (the launcher ended torchrun)."""
    report = "".join(ended.held)
    outcome = _from_report(report, ranks=ended.ranks, when=time.time())
    failures = list(outcome.failures)
    listed = {f.rank for f in failures}
    for rank in ended.ranks:  # the workers torchrun's report does not list (or there is none)
        try:
            code: int | None = int((errors / WORKER_EXIT.format(rank=rank)).read_text())
        except (OSError, ValueError):
            code = None
        if rank not in listed and code != 0:
            failures.append(Failure(rank, code, ended.seen.get(rank, time.time())))
    said = tuple((rank, line, ended.seen.get(rank, time.time())) for rank, line, _ in outcome.said)
    user_error = ""
    if any(f.code == EXIT_USER for f in failures):  # the lowest rank's message, else torchrun's report
        messages = sorted(errors.glob("rank*.txt"), key=lambda f: int(f.stem[4:]))
        user_error = messages[0].read_text() if messages else report
    return NodeOutcome(socket.gethostname(), ended.ranks, tuple(failures), said, user_error)


def _from_report(report: str, *, ranks: tuple[int, ...], when: float) -> NodeOutcome:
    """The failures torchrun's report lists (its first observed one first) and the workers' lines."""
    failures: list[Failure] = []
    root = _ROOT_CAUSE.search(report)
    if root is not None:
        failures.append(Failure(int(root.group(2)), int(root.group(3)), _when(root.group(1), when)))
    for m in _FAILURE.finditer(report):
        rank, code = int(m.group(1)), int(m.group(2))
        if all(f.rank != rank for f in failures):
            failures.append(Failure(rank, code, when))
    said = tuple((int(p.group(2)), p.group(1), when) for p in PEER_FAILURE.finditer(report))
    return NodeOutcome(socket.gethostname(), ranks, tuple(failures), said)


def _when(stamp: str | None, default: float) -> float:
    """torchrun's `2026-11-22_05:39:56` (local time) as time.time() would have said it."""
    try:
        return datetime.strptime(stamp or "", "%Y-%m-%d_%H:%M:%S").timestamp()
    except ValueError:
        return default


# ---------------------------------------------------------------------------- every node


def announce_node(folder: Path, ranks: tuple[int, ...]) -> None:
    """When this node's workers have started: its host and ranks, for the other nodes' messages
    (a node cut off from them is still named by them)."""
    _leave(NodeOutcome(socket.gethostname(), ranks, (), ended=False), folder)


def _leave(outcome: NodeOutcome, folder: Path) -> None:
    path = folder / NODES / f"{outcome.host}-{os.getpid()}.json"
    with contextlib.suppress(OSError):  # a folder that cannot be written: this node's own only
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}")
        partial.write_text(outcome.to_json())
        partial.replace(path)


def _exchange(mine: NodeOutcome, folder: Path, nnodes: str) -> list[NodeOutcome]:
    """Leave this node's outcome in the run folder and read the others': every node's launcher
    names the same rank. Waits `NODES_WAIT_S` at most for the nodes that have not ended yet."""
    _leave(mine, folder)
    own = f"{mine.host}-{os.getpid()}.json"
    expected = int(nnodes.rpartition(":")[2]) if nnodes.rpartition(":")[2].isdigit() else 0
    deadline = time.monotonic() + NODES_WAIT_S
    while True:
        others = _read_outcomes(folder / NODES, but=own)
        if sum(o.ended for o in others) + 1 >= expected or time.monotonic() > deadline:
            return [mine, *others]
        time.sleep(0.2)


def _read_outcomes(notes: Path, *, but: str) -> list[NodeOutcome]:
    found = []
    for path in sorted(notes.glob("*.json")):
        if path.name == but:
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found.append(NodeOutcome.from_json(path.read_text()))
    return found


def clear_outcomes(folder: Path) -> None:
    """Before a run: the outcomes an earlier run's nodes left (every node's launcher clears them
    before its torchrun starts, so before any worker of this run can fail)."""
    import shutil

    shutil.rmtree(folder / NODES, ignore_errors=True)


def _culprit(outcomes: list[NodeOutcome], *, across_nodes: bool) -> tuple[str, int | None] | None:
    """The line naming the rank that failed first (see the module docstring) and its exit code.
    Within one node, a collective's report is that of torchrun's first observed failure; across
    nodes, the report that came first (every node's launcher picks the same)."""
    died = [f for o in outcomes for f in o.failures if f.died_on_its_own()]
    said = sorted((when, rank, line) for o in outcomes for rank, line, when in o.said)
    first = outcomes[0].failures[0] if outcomes[0].failures else None
    if died:
        culprit = min(died, key=lambda f: (f.when, f.rank))  # torchrun's first observed: the oldest stamp
        return f"rank {culprit.rank} failed first ({culprit.how()})", culprit.code
    if not across_nodes and first is not None:
        own = [line for _, rank, line in said if rank == first.rank]
        return (
            (own[0], first.code) if own else (f"rank {first.rank} failed first ({first.how()})", first.code)
        )
    if said:
        return said[0][2], EXIT_PEER
    if first is not None:
        return f"rank {first.rank} failed first ({first.how()})", first.code
    return None


def _hosts(outcomes: list[NodeOutcome]) -> dict[int, str]:
    """Each rank the outcomes know of, and its node's host."""
    hosts = {rank: o.host for o in outcomes for rank in o.ranks}
    hosts.update({f.rank: o.host for o in outcomes for f in o.failures})
    return hosts


def _with_hosts(line: str, hosts: dict[int, str]) -> str:
    """`rank 3 failed first` -> `rank 3 on node1 failed first`, for every rank with a known host."""
    return re.sub(
        r"\brank (\d+)\b",
        lambda m: f"{m.group(0)} on {hosts[int(m.group(1))]}" if int(m.group(1)) in hosts else m.group(0),
        line,
    )
