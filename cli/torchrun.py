"""torchrun as `meshplan run`'s launcher runs it: watched, so that a run ends on every node, and
ends with what happened, never a hang.

    ended = supervise(command, env, Watch(notes=Path(folder), workers=2, join_s=630, linger_s=10))
    ended.status, ended.held, ended.started, ended.ended_by

torchrun's agent can block where its workers cannot help it: on a rendezvous that never
completes (a lone node: torchrun's join timeout, 600 s, or a connection it retries), or, after
its workers have ended, on a c10d store it can no longer reach (a node cut off from the
rendezvous host), where it never reaps them. The launcher watches what it can see itself:

- each worker leaves its process id in the launcher's private folder when it starts
  (`announce_worker`, `WORKER_PID`) and its exit code when it ends (`record_exit`; a killed
  worker leaves none); so the launcher knows whether the rendezvous completed (a worker
  started) and whether every local worker has ended (each one's exit code, or its process
  gone or a zombie nobody reaps: read from /proc on Linux);
- no worker started `join_s` after torchrun did: the rendezvous did not complete, and the
  launcher ends torchrun (`ended_by="rendezvous"`);
- every local worker ended, one of them failed, and torchrun is still there `linger_s` later:
  the launcher ends torchrun and the workers' process groups (`ended_by="lingered"`); where
  every one succeeded, torchrun's exit barrier (waiting for the other nodes, 300 s) goes first.

torchrun and each worker are started to receive a signal when their parent dies (Linux's
`PR_SET_PDEATHSIG`): SIGKILL for torchrun when the launcher dies (its own shutdown can block on
the same unreachable store), SIGTERM for a worker when torchrun does, so that no process of a
run outlives its launcher. Signals sent to the launcher (`FORWARDED`) are passed on to torchrun.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshplan.errors import ERRORS_ENV

# Signals that end a run: passed on to torchrun, which stops its workers (a worker killed
# mid-save leaves the previous checkpoint: saves are atomic).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

WORKER_PID = "worker{rank}.pid"  # in the launcher's folder (`ERRORS_ENV`): a worker's process id
WORKER_EXIT = "worker{rank}.exit"  # its exit code, written as it exits
SUCCESS_LINGER_S = 330.0  # every local worker succeeded: torchrun's exit barrier waits up to 300 s
HOLD_S = 5.0  # a worker's failure report held this long without torchrun ending is shown as it is

# torchrun's own log lines: "E1122 03:54:31.754000 4560 .../torch/distributed/elastic/...] failed (exitcode: 2)"
TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
# a worker's report of a collective that failed (`PeerFailure`, runtime/watchdog.py)
PEER_FAILURE = re.compile(r"^meshplan: error: (rank (\d+) (?:waited|timed out|failed)\b.*)$", re.M)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In a child, before it runs: `signum` when its parent dies, even by SIGKILL (Linux; elsewhere
    nothing: the launcher's handlers only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)


def announce_worker(rank: int) -> None:
    """A worker under the launcher, starting: its process id for the launcher's watch, and a
    SIGTERM when torchrun dies (torchrun starts each worker in a session of its own, out of reach
    of the signals its own process group gets)."""
    die_with_parent(signal.SIGTERM)
    folder = os.environ.get(ERRORS_ENV)
    if folder is None or not Path(folder).is_dir():
        return  # under the user's own torchrun
    with contextlib.suppress(FileNotFoundError):  # a restarted worker's earlier attempt
        (Path(folder) / WORKER_EXIT.format(rank=rank)).unlink()
    _write(Path(folder) / WORKER_PID.format(rank=rank), str(os.getpid()))


def record_exit(rank: int, code: int) -> None:
    """A worker under the launcher, exiting with `code`."""
    folder = os.environ.get(ERRORS_ENV)
    if folder is not None and Path(folder).is_dir():
        _write(Path(folder) / WORKER_EXIT.format(rank=rank), str(code))


def _write(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}")  # renamed when whole: the launcher reads it any time
    partial.write_text(text)
    partial.replace(path)


@dataclass(frozen=True)
class Watch:
    """What the launcher watches torchrun for (see the module docstring)."""

    notes: Path  # the launcher's private folder (`ERRORS_ENV`): the workers' ids and exit codes
    workers: int  # local workers per attempt
    join_s: float  # no worker started this long after torchrun: the rendezvous did not complete
    linger_s: float  # every local worker ended, one failed, and torchrun still there this long after
    on_start: Callable[[tuple[int, ...]], None] | None = None  # told the local ranks once all started
    hold_s: float = HOLD_S  # a worker's failure report held this long is shown as it is


@dataclass
class Ended:
    """How torchrun ended, as the launcher saw it."""

    status: int  # torchrun's exit status (negative: the signal that ended it)
    held: list[str] = field(default_factory=list)  # failure reports (and all after them), not shown yet
    shown: set[str] = field(default_factory=set)  # the workers' reports shown as they came
    seen: dict[int, float] = field(default_factory=dict)  # when each rank's report came (time.time())
    started: bool = False  # a local worker started: the rendezvous completed
    ranks: tuple[int, ...] = ()  # the local workers' global ranks
    ended_by: str | None = None  # "rendezvous" or "lingered": the launcher ended torchrun itself
    received: int | None = None  # the first signal the launcher was sent (passed on to torchrun)
    waited_s: float = 0.0  # from torchrun's start to its end


def supervise(command: list[str], env: dict[str, str], watch: Watch) -> Ended:
    """Run torchrun, passing its stderr (and the workers') through live, except: everything before
    a local worker starts (torchrun's rendezvous: its traceback, when it fails, is not the message),
    and the failure reports (a worker's `PEER_FAILURE` line, torchrun's error log and report) and
    all after them, held for the launcher's summary; a worker's report is shown as it is once
    held `watch.hold_s` without torchrun ending."""
    started_at = time.monotonic()
    proc = subprocess.Popen(
        command,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        preexec_fn=lambda: die_with_parent(signal.SIGKILL),
    )
    assert proc.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stderr, lines), daemon=True).start()
    ended = Ended(status=0)

    def forward(signum: int, frame: object) -> None:
        if ended.received is None:
            ended.received = signum
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    before: list[str] = []  # torchrun's lines before any worker started
    checked = all_ended_at = held_since = None
    try:
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = "" if proc.poll() is None else _after_exit(lines)
            if line is None:
                break  # torchrun has ended, and the pipe is closed or quiet
            now = time.monotonic()
            if not ended.ranks:
                workers = _workers(watch.notes)
                if workers and not ended.started:
                    ended.started = True
                    sys.stderr.writelines(before)  # torchrun's warnings, once the rendezvous completed
                    before.clear()
                if len(workers) >= watch.workers:
                    ended.ranks = tuple(sorted(workers))
                    if watch.on_start is not None:
                        watch.on_start(ended.ranks)
            if line:
                _take(line, ended, before)
            held_since = held_since or (now if ended.held else None)
            if held_since is not None and now - held_since > watch.hold_s:
                _show_reports(ended)
            if ended.ended_by is not None or (checked is not None and now - checked < 0.5):
                continue
            checked = now
            if not ended.started and now - started_at > watch.join_s:
                ended.ended_by = "rendezvous"
                _end(proc, watch.notes)
                continue
            failed = _all_ended(watch) if ended.started else None
            all_ended_at = None if failed is None else (all_ended_at or now)
            if all_ended_at is not None and now - all_ended_at > (
                watch.linger_s if failed else SUCCESS_LINGER_S
            ):
                ended.ended_by = "lingered"
                _end(proc, watch.notes)
        ended.status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    ended.waited_s = time.monotonic() - started_at
    ended.ranks = ended.ranks or tuple(sorted(_workers(watch.notes)))
    if not ended.started:  # the rendezvous failed: its lines are the report
        ended.held = before + ended.held
    return ended


def _pump(stream, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _after_exit(lines: queue.Queue[str | None]) -> str | None:
    """torchrun has exited and the pipe is quiet: its last lines, or None once it is closed or
    stays quiet 2 s (a process that inherited torchrun's stderr may hold it open)."""
    try:
        return lines.get(timeout=2.0)
    except queue.Empty:
        return None


def _take(line: str, ended: Ended, before: list[str]) -> None:
    """One line of torchrun's stderr: shown, or held (see `supervise`)."""
    if not ended.started:
        before.append(line)
        return
    report = PEER_FAILURE.match(line)
    if report:
        ended.seen.setdefault(int(report.group(2)), time.time())
    if ended.held or is_failure(line):
        ended.held.append(line)
    else:
        sys.stderr.write(line)


def is_failure(line: str) -> bool:
    """Whether a line of torchrun's stderr starts a failure report: a worker's report of a failed
    collective, torchrun's error log or its stopping the workers."""
    if PEER_FAILURE.match(line):
        return True
    return TORCHRUN_LOG.match(line) is not None and ("closing signal" in line or line.startswith("E"))


def _show_reports(ended: Ended) -> None:
    """The workers' failure reports held so far, shown (torchrun is slow to end: say what is known)."""
    for line in ended.held:
        if PEER_FAILURE.match(line) and line not in ended.shown:
            sys.stderr.write(line)
            sys.stderr.flush()
            ended.shown.add(line)


def _workers(notes: Path) -> dict[int, int]:
    """The local workers that have started: rank -> process id."""
    found = {}
    for path in notes.glob(WORKER_PID.format(rank="*")):
        with contextlib.suppress(OSError, ValueError):
            found[int(path.name[len("worker") : -len(".pid")])] = int(path.read_text())
    return found


def _all_ended(watch: Watch) -> bool | None:
    """None while a local worker runs (or not all have started); once every one has ended,
    whether one of them failed (exit code not 0, or none: killed)."""
    workers = _workers(watch.notes)
    if len(workers) < watch.workers:
        return None
    failed = False
    for rank, pid in workers.items():
        try:
            code = (watch.notes / WORKER_EXIT.format(rank=rank)).read_text().strip()
        except OSError:
            code = None
        if code is None and _alive(pid):
            return None
        failed = failed or code != "0"
    return failed


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: not gone, and not a zombie its parent has not reaped."""
    stat = _stat(pid)
    if stat is not None:
        return stat[0] != "Z"
    if Path("/proc/self/stat").exists():
        return False  # gone
    try:  # no /proc: a zombie counts as running
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _stat(pid: int) -> list[str] | None:
    """Process `pid`'s state, parent, process group, ... from /proc (None: gone, or no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _end(proc: subprocess.Popen, notes: Path) -> None:
    """End each local worker's process group (torchrun starts every worker in a session of its
    own), then torchrun: SIGTERM, and SIGKILL after 5 s."""
    for pid in _workers(notes).values():
        stat = _stat(pid)
        if stat is not None and int(stat[1]) == proc.pid and int(stat[2]) == pid:  # still torchrun's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
