"""Multi-node `meshplan run`: the rendezvous options, a shared run folder prepared by every node's
launcher at once, a lone node, and a rank lost on one node named by every node.

Three tiers: the launcher's own code, in this process; two nodes as two launchers on this
machine (127.0.0.1), each in a UTS namespace of its own so that it has a host name of its own
(`unshare --uts`, as root); and two nodes as network namespaces joined by a veth pair, whose
link the test cuts (`ip netns`, as root). A tier that cannot be set up here is skipped with the
reason; the traffic stays between the namespaces a test creates.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from runs import meshplan_command, meshplan_run

from meshplan.launcher import _check_run_folder, prepare, save_program, torchrun_command
from meshplan.main import main
from meshplan.options import RunOptions, parse

ROOT = Path(__file__).resolve().parents[2]
TINY_DP = str(ROOT / "examples" / "tiny_dp.plan")
SMALL = ("--batch", "2", "--seq", "16")


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel hands out (port 0) may be
    handed again, between this check and the rendezvous binding it, to a socket of another test
    running beside this one (gloo's connections take ephemeral ports), and the rendezvous then finds
    its endpoint in use. Below the range, only an explicit bind takes a port."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random(os.getpid() ^ time.monotonic_ns()).sample(range(10000, low), 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port in 10000..{low - 1}")


# ---------------------------------------------------------------------------- the launcher's code


def test_the_rendezvous_timeout_reaches_torchrun_as_each_backend_reads_it() -> None:
    def conf(*argv: str) -> str:
        cmd = torchrun_command(parse([TINY_DP, "--nnodes", "2", *argv]), world_size=2)
        assert not any(a.startswith("--rdzv-timeout") for a in cmd)  # not a torchrun option
        return next((a for a in cmd if a.startswith("--rdzv-conf=")), "")

    assert conf("--rdzv-timeout", "30") == "--rdzv-conf=timeout=30"  # static, torchrun's default
    c10d = conf("--rdzv-backend", "c10d", "--rdzv-timeout", "300")
    assert c10d == "--rdzv-conf=join_timeout=300,read_timeout=60"
    # the user's own keys pass through, and win
    mine = conf(
        "--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=900, is_host=1", "--rdzv-timeout", "30"
    )
    assert mine == "--rdzv-conf=join_timeout=900,is_host=1,read_timeout=30"
    cmd = torchrun_command(parse([TINY_DP, "--nnodes", "2", "--local-addr", "10.0.0.2"]), world_size=2)
    assert "--local-addr=10.0.0.2" in cmd and conf() == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rdzv-conf", "join_timeout"], "--rdzv-conf 'join_timeout': 'join_timeout' is not KEY=VALUE"),
        (["--rdzv-endpoint", "head:port"], "--rdzv-endpoint 'head:port' is not HOST:PORT"),
        (["--rdzv-timeout", "0"], "--rdzv-timeout: must be at least 1"),
    ],
)
def test_a_malformed_rendezvous_option_is_one_error_before_launch(tmp_path, capsys, argv, message) -> None:
    with contextlib.suppress(SystemExit):  # argparse's own: exit 2 too
        assert main(["run", TINY_DP, "--nnodes", "2", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def a_previous_run(folder: Path) -> None:
    (folder / "checkpoints" / "step00000004").mkdir(parents=True, exist_ok=True)
    (folder / "checkpoints" / "step00000004" / ".metadata").write_bytes(b"dcp")
    (folder / "metrics").mkdir(exist_ok=True)
    (folder / "metrics" / "rank0.jsonl").write_text('{"step": 4}\n')


def test_a_launchers_probe_file_is_not_a_run(tmp_path) -> None:
    """The other node's launcher checks that the folder can be written: its probe file is no run."""
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / ".meshplan-probe-x").touch()
    _check_run_folder(RunOptions(TINY_DP, out=str(tmp_path)))  # not "already holds a run (metrics)"
    (tmp_path / "metrics" / "rank0.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="already holds a run"):
        _check_run_folder(RunOptions(TINY_DP, out=str(tmp_path)))


def launch_together(folder: Path, executable, *, overwrite: bool, launchers: int = 10) -> list[str]:
    """`launchers` launchers' folder checks and `program.pt` into `folder`, released at once;
    what any of them raised."""
    start, failures = threading.Barrier(launchers), []

    def launcher() -> None:
        start.wait()
        try:
            _check_run_folder(RunOptions(TINY_DP, out=str(folder), overwrite=overwrite))
            save_program(executable, folder)
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=launcher) for _ in range(launchers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def test_launchers_preparing_one_shared_folder_at_once_are_never_refused(tmp_path) -> None:
    """Ten launchers (their checks, and their `program.pt`) start together into one folder, ten
    times: over a previous run with `--overwrite` (each removes it, the others' removals under
    way), or into a fresh folder; none is refused and the folder holds one whole program."""
    from meshplan.compiler.executable import load_executable

    options, _ = prepare(parse([TINY_DP, "--out", str(tmp_path / "compiled"), *SMALL]))
    executable = load_executable(Path(options.program))
    for attempt in range(10):
        folder = tmp_path / f"run{attempt}"
        folder.mkdir()
        if attempt % 2 == 0:
            a_previous_run(folder)
        assert launch_together(folder, executable, overwrite=attempt % 2 == 0) == []
        assert sorted(p.name for p in folder.iterdir()) == ["program.pt"]  # no run left, no temporary
        assert load_executable(folder / "program.pt").plan_text == executable.plan_text


def test_every_node_names_the_rank_that_died_first_and_its_host(tmp_path, capsys) -> None:
    """Rank 3 (node B) is killed: node A's own report blames rank 2, which never joined its
    collective; with node B's outcome in the shared folder, node A names rank 3 on nodeB, and gives
    its own command to resume from the last checkpoint."""
    from meshplan.outcome import NODES, Failure, NodeOutcome, summarize
    from meshplan.torchrun import Ended

    out = tmp_path / "run"
    a_previous_run(out)
    here = socket.gethostname()
    stuck = "rank 0 waited 5 s in all_reduce over dp (step 6); rank 2 did not join it (stuck or dead)"
    report = [
        f"meshplan: error: {stuck}\n",
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-22_05:39:57\n",
        f"  host      : {here}\n  rank      : 0 (local_rank: 0)\n  exitcode  : 3 (pid: 9028)\n",
    ]
    node_b = NodeOutcome("nodeB", (2, 3), (Failure(3, 137, 1.0), Failure(2, -15, 2.0)))
    (out / NODES).mkdir()
    (out / NODES / "nodeB-1.json").write_text(node_b.to_json())
    ended = Ended(status=1, held=report, started=True, ranks=(0, 1))
    options = parse([TINY_DP, "--out", str(out), "--nnodes", "2", "--node-rank", "0", "--save-every", "4"])
    (tmp_path / "notes").mkdir()
    assert summarize(ended, options, tmp_path / "notes") == 3
    err = capsys.readouterr().err.splitlines()
    assert err[-2] == (
        "meshplan: error: rank 3 on nodeB failed first (exit code 137: killed); torchrun stopped the "
        "other ranks (MESHPLAN_DEBUG=1 shows torchrun's report)"
    )
    assert err[-1] == (
        f"  hint: continue with --resume from step00000004 in {out} (on every node, each with its own "
        f"options): meshplan run {TINY_DP} --save-every 4 --out {out} --nnodes 2 --node-rank 0 --resume"
    )
    assert err[0] == f"meshplan: error: {stuck}"  # node A's own report, as the other ranks' are


# ---------------------------------------------------------------------------- a lone node


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "why"),
    [
        # the host waits its whole --rdzv-timeout for a node that never comes: 10 s is enough to
        # show the line (torchrun's read_timeout, min(S, 60), is then 10 s too: a local store)
        (["--rdzv-backend", "c10d", "--rdzv-timeout", "10"], "the other nodes did not join"),
        # node 1 of a static rendezvous whose host (node 0) never started
        (["--node-rank", "1", "--rdzv-timeout", "5"], "nothing answered at 127.0.0.1:{port}"),
    ],
    ids=["c10d_host", "static_node1"],
)
def test_a_lone_node_ends_with_one_line_naming_the_endpoint(tmp_path, capfd, argv, why) -> None:
    port = free_port()
    started = time.monotonic()
    done = meshplan_command(
        capfd, "run", TINY_DP, *SMALL, "--out", str(tmp_path), "--nnodes", "2",
        "--rdzv-endpoint", f"127.0.0.1:{port}", *argv,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    backend = "c10d" if "c10d" in argv else "static"
    assert re.fullmatch(
        rf"meshplan: error: the rendezvous of 2 nodes at 127\.0\.0\.1:{port} \({backend}\) did not "
        rf"complete after \d+ s: {re.escape(why.format(port=port))} \(check: are the other nodes started, "
        r"with the same --rdzv-endpoint, --rdzv-backend and --rdzv-id\? can this node reach "
        rf"127\.0\.0\.1:{port}\? --rdzv-timeout S waits longer\)",
        done.stderr.splitlines()[-1],
    ), done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 60


# ---------------------------------------------------------------------------- two nodes, one machine


def can_unshare_uts() -> str | None:
    """Why two launchers cannot have host names of their own here (None: they can)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) for a host name per node"
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare --uts fails here: {probe.stderr.strip()}"


def start_node(
    host: str, argv: list[str], env: dict[str, str], *, netns: str | None = None, hosts: Path | None = None
):
    """`meshplan run *argv` as node `host`: its own host name (and network namespace, with `hosts`
    as its /etc/hosts), its own process group (the test ends what is left)."""
    script = ""
    if hosts is not None:
        script += f"mount --bind {hosts} /etc/hosts; "
    script += f'hostname {host}; exec meshplan run "$@"'
    command = ["unshare", "--uts", *(["--mount"] if hosts else []), "bash", "-c", script, "--", *argv]
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def processes_of(out: Path) -> list[str]:
    """Every live process whose command line names this run's folder."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and str(out) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(proc.name)
    return found


def losses(out: Path, rank: int) -> list[float]:
    return [
        json.loads(line)["loss"] for line in (out / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
    ]


def two_nodes(argv: list[str], env: dict[str, str]):
    """Nodes A and B of a static rendezvous on 127.0.0.1 (A hosts it), started together."""
    argv = [*argv, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "120"]
    return [start_node(h, [*argv, "--node-rank", str(r)], env) for r, h in enumerate(("nodeA", "nodeB"))]


def end_all(nodes) -> None:
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(can_unshare_uts() is not None, reason=str(can_unshare_uts()))
def test_two_nodes_train_as_one_node_does_and_a_rank_killed_on_one_is_named_on_every_node(tmp_path) -> None:
    """dp=2 as two nodes of one process each, both launchers preparing one shared folder at the
    same moment: neither is refused, and the steps they make are one node's, bit for bit. Rank 1
    (node B) is killed at step 6: both launchers exit 3 naming rank 1 on nodeB and the command
    that resumes from step 4; rank 0's summary table is not printed as if the run had ended."""
    out = tmp_path / "run"
    # a static rendezvous: --node-rank 1 is node B, which holds rank 1
    steps = [TINY_DP, *SMALL, "--steps", "12", "--save-every", "4"]
    argv = [*steps, "--out", str(out), "--timeout", "20"]
    # one node: `meshplan run` minus torchrun (tests/runs.py), whose losses are torchrun's bit for
    # bit (tests/cli/test_run_compiled.py), on the session's kept processes
    meshplan_run(*steps, "--out", str(tmp_path / "one"))
    nodes = two_nodes(argv, dict(os.environ, MESHPLAN_FAULT="rank=1,step=5", NO_COLOR="1"))
    try:
        done = [node.communicate(timeout=400) for node in nodes]  # a ceiling: slow beside other tests
    finally:
        end_all(nodes)
    for node, (stdout, stderr) in zip(nodes, done, strict=True):
        assert node.returncode == 3, stderr
        lines = stderr.strip().splitlines()
        assert lines[-2] == (
            "meshplan: error: rank 1 on nodeB failed first (exit code 137: killed); torchrun stopped "
            "the other ranks (MESHPLAN_DEBUG=1 shows torchrun's report)"
        ), stderr
        assert lines[-1].startswith(
            f"  hint: continue with --resume from step00000004 in {out} (on every node"
        )
        assert lines[-1].endswith(" --resume") and "Traceback" not in stderr
        assert "summary" not in stdout
    for rank in (0, 1):
        made = losses(out, rank)
        assert len(made) >= 4 and made == losses(tmp_path / "one", rank)[: len(made)]
    assert processes_of(out) == []


@pytest.mark.slow
@pytest.mark.skipif(can_unshare_uts() is not None, reason=str(can_unshare_uts()))
def test_a_killed_launcher_takes_its_node_down_and_the_other_node_says_so(tmp_path) -> None:
    """Node B's launcher is killed (SIGKILL, no handler runs) mid-run: its torchrun and worker die
    with it, node A exits 3 naming rank 1 on nodeB, and no process of the run is left."""
    out = tmp_path / "run"
    argv = [TINY_DP, *SMALL, "--steps", "1000", "--save-every", "2", "--out", str(out), "--timeout", "10"]
    nodes = two_nodes([*argv, "--log-every", "1000"], dict(os.environ, NO_COLOR="1"))
    try:
        metrics = out / "metrics" / "rank0.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < 4
        ):
            assert all(node.poll() is None for node in nodes), [node.communicate() for node in nodes]
            time.sleep(0.2)
        nodes[1].kill()  # the launcher itself: `exec meshplan run` in node B's namespace
        killed = time.monotonic()
        _, stderr = nodes[0].communicate(timeout=60)
        elapsed = time.monotonic() - killed
    finally:
        end_all(nodes)
    assert nodes[0].returncode == 3, stderr
    lines = stderr.strip().splitlines()
    assert (
        re.match(r"meshplan: error: rank [01] on node[AB] ", lines[-2]) and "rank 1 on nodeB" in lines[-2]
    ), stderr
    assert "continue with --resume from step000000" in lines[-1]
    assert elapsed < 10 + 30
    deadline = time.monotonic() + 10
    while processes_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(out) == []


# ---------------------------------------------------------------------------- two nodes, two networks


def can_make_namespaces() -> str | None:
    """Why two network namespaces joined by a veth pair cannot be made here (None: they can)."""
    if can_unshare_uts() is not None:
        return can_unshare_uts()
    if shutil.which("ip") is None:
        return "needs ip(8) for network namespaces"
    name = f"mp-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None if made.returncode == 0 else f"ip netns add fails here: {made.stderr.strip()}"


@pytest.fixture
def two_networks(tmp_path):
    """Namespaces A (10.77.0.1, nodeA) and B (10.77.0.2, nodeB) joined by a veth pair; a hosts
    file naming both. Yields (namespace names, B's end of the link, the hosts file); removes them."""
    tag = uuid.uuid4().hex[:6]
    spaces, link = (f"mpa-{tag}", f"mpb-{tag}"), (f"mpva{tag}", f"mpvb{tag}")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.77.0.1 nodeA\n10.77.0.2 nodeB\n")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for space in spaces:
            ip("netns", "add", space)
        ip("link", "add", link[0], "type", "veth", "peer", "name", link[1])
        for space, end, addr in zip(spaces, link, ("10.77.0.1/24", "10.77.0.2/24"), strict=True):
            ip("link", "set", end, "netns", space)
            ip("-n", space, "addr", "add", addr, "dev", end)
            ip("-n", space, "link", "set", end, "up")
            ip("-n", space, "link", "set", "lo", "up")
        yield spaces, link[1], hosts
    finally:
        for space in spaces:
            subprocess.run(["ip", "netns", "del", space], capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(can_make_namespaces() is not None, reason=str(can_make_namespaces()))
def test_a_node_cut_off_from_the_rendezvous_host_ends_and_says_so(tmp_path, two_networks) -> None:
    """Node B's link goes down after step 6 (c10d rendezvous on node A). Both nodes exit 3 within
    --timeout + 30 s, each naming the collective that did not complete and the command that
    resumes, and no process of the run is left (node B's torchrun, blocked on the store it cannot
    reach, is ended by its launcher)."""
    spaces, b_link, hosts = two_networks
    out = tmp_path / "run"
    argv = [
        TINY_DP, *SMALL, "--steps", "1000", "--save-every", "2", "--out", str(out), "--nnodes", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "nodeA:29500", "--rdzv-timeout", "60",
        "--timeout", "10", "--log-every", "1000",
    ]  # fmt: skip
    env = dict(os.environ, NO_COLOR="1")
    nodes = [
        start_node(h, [*argv, "--node-rank", str(r)], env, netns=space, hosts=hosts)
        for r, (h, space) in enumerate(zip(("nodeA", "nodeB"), spaces, strict=True))
    ]
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics" / "rank0.jsonl"
        while time.monotonic() < deadline and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < 6
        ):
            assert all(node.poll() is None for node in nodes), [node.communicate() for node in nodes]
            time.sleep(0.2)
        subprocess.run(["ip", "-n", spaces[1], "link", "set", b_link, "down"], check=True)
        cut = time.monotonic()
        done = [node.communicate(timeout=90) for node in nodes]
        elapsed = time.monotonic() - cut
    finally:
        end_all(nodes)
    for node, (_, stderr) in zip(nodes, done, strict=True):
        assert node.returncode == 3, stderr
        lines = stderr.strip().splitlines()
        assert re.match(r"meshplan: error: rank \d on node[AB] waited \d+ s in ", lines[-2]), stderr
        assert "continue with --resume from step000000" in lines[-1] and "Traceback" not in stderr
    assert elapsed < 10 + 30
    deadline = time.monotonic() + 10
    while processes_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(out) == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
