"""Plans that cannot hang the checker: hostile inputs of up to 1 MiB.

Each case runs what `meshplan check` and `meshplan fmt` run, in-process: decode the bytes,
`check_text`, `parse` + `format_plan`, render the diagnostics. Every case must finish in
bounded time and memory, with bounded output, and end in a located error with the right
line (or a valid plan); never an exception that is not a `PlanError`.

The inputs are sized so that an algorithm quadratic in the input takes minutes: the time
bound per input is generous (a loaded two-core machine runs this file), and what it
catches is a blow-up, not a slow day. Measured when the bounds went in, the worst input took
under 1 s of CPU (startup included) for `meshplan check` and `fmt`.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshplan.dsl import PlanError, check_text, parse
from meshplan.dsl.errors import MAX_KEPT, MAX_SHOWN, render_diagnostics
from meshplan.dsl.fmt import format_plan
from meshplan.dsl.limits import MAX_PLAN_BYTES, MAX_PLAN_LINES, decode_plan_bytes

NAME = "h.plan"
MIB = 1 << 20
SECONDS = 10.0  # CPU seconds per input, in-process: today's worst (8000 rules, re-parsed per error) is 2-4 s
MAX_OUTPUT = 64 * 1024  # rendered diagnostics: 50 blocks of a few lines
MAX_MEMORY = 120 * MIB  # peak Python allocations while checking and formatting


def _rules(n: int, action: str = "row over tp", pattern: str = "a{i}") -> str:
    return "mesh tp=2\nmodules {\n" + "".join(f"{pattern.format(i=i)}: {action}\n" for i in range(n)) + "}\n"


def _block(setting: str, body: str, mesh: str = "mesh dp=2, pp=2, ep=2") -> str:
    return f"{mesh}\n{setting} {{\n    {body}\n}}\n"


def _fill(unit: str, prefix: str = "", limit: int = MIB - 100) -> str:
    return prefix + unit * ((limit - len(prefix)) // len(unit))


@dataclass(frozen=True)
class Case:
    name: str
    text: Callable[[], str | bytes]  # built when the test runs: collecting stays cheap
    error: tuple[int, str] | None  # (line, part of the message) of the first error; None: valid
    errors: int | None = None  # every error found, where the count is the point
    stopped: bool = False  # the parser gives up before the end (the count is a lower bound)
    trace_memory: bool = False  # tracing allocations triples the time: only where memory was the bug


CASES = [
    # -- repeated mesh axes: 8,999 "declared twice" errors, rendered 50 and a count
    Case(
        "axes_repeated_64k",
        lambda: "mesh " + ",".join(["a=1"] * 9000),
        (1, "axis `a` is declared twice"),
        8999,
    ),
    Case("axes_repeated_1mib", lambda: _fill("a=1,", "mesh ") + "a=1", (1, "plan is too long: more than")),
    Case("axes_distinct_at_token_cap", lambda: "mesh " + ",".join(f"a{i}=1" for i in range(12_000)), None),
    Case(
        "axes_all_star",
        lambda: "mesh " + ",".join(f"a{i}=*" for i in range(9_000)),
        (1, "only one axis"),
        8999,
    ),
    Case(
        "axes_size_zero_3000_lines",
        lambda: "".join(f"mesh a{i}=0\n" for i in range(3000)),
        (1, "axis `a0` has size 0"),
        3000,  # one size, and 2,999 meshes too many
    ),
    Case(
        "axes_product_huge",
        lambda: "mesh " + ",".join(f"a{i}=999999999999" for i in range(2000)),
        (1, "multiply"),
    ),
    # -- long lines, long words, padding
    # a 1 MiB word took 470 MB in the regex engine (a record per repeated group)
    Case("one_line_1mib", lambda: _fill("x", "mesh tp=2 "), (1, "unexpected `xxxx"), trace_memory=True),
    Case("one_comment_1mib", lambda: _fill("x", "mesh tp=2  # "), None),
    Case("one_name_1mib", lambda: _fill("a", "mesh ") + "=2", (1, "characters long"), trace_memory=True),
    Case(
        "one_pattern_1mib",
        lambda: "mesh tp=2\nmodules {\n" + _fill("a.", limit=MIB - 200) + "b: row over tp\n}\n",
        (3, "longer than 1,000"),
        trace_memory=True,
    ),
    Case("braces_1mib", lambda: _fill("{", "mesh tp=2\nmodules "), (2, "unclosed `{`"), trace_memory=True),
    Case(
        "padding_300k",
        lambda: "mesh tp=2" + " " * 300_000 + "\nmodules {\n" + "\t" * 300_000 + "a: row over tp\n}\n",
        None,
    ),
    Case(
        "indentation_many_lines",
        lambda: (
            "mesh tp=2\nmodules {\n"
            + "".join(" " * 3000 + f"l{i}: row over tp\n" for i in range(300))
            + "}\n"
        ),
        None,
    ),
    Case(
        # one long pattern padded every other rule to its width: 1 GB from `fmt`
        "fmt_alignment_300k",
        lambda: "mesh tp=2\nmodules {\n" + "a" * 300_000 + ": row over tp\n" + _rules(3000)[20:],
        (3, "longer than 1,000"),
        trace_memory=True,
    ),
    # -- many lines, statements, blocks, rules
    Case(
        "lines_over_the_cap",
        lambda: "mesh tp=2\n" * (MAX_PLAN_LINES + 5),
        (MAX_PLAN_LINES + 1, "more than 10,000 lines"),
    ),
    Case("blank_lines_1mib", lambda: "\n" * (MIB - 10), (1, "empty plan"), trace_memory=True),
    Case("mesh_repeated_9999", lambda: "mesh tp=2\n" * 9999, (2, "`mesh` appears twice"), 9998),
    Case(
        "blocks_repeated",
        lambda: "mesh tp=2\n" + "modules {\n  a: row over tp\n}\n" * 3000,
        (5, "appears twice"),
        2999,
    ),
    Case(
        "blocks_never_closed", lambda: "mesh tp=2\n" + "modules {\n" * 9000, (3, "missing `}`"), stopped=True
    ),
    Case("braces_unmatched", lambda: "mesh tp=2\n" + "}\n" * 9000, (2, "unmatched `}`"), stopped=True),
    Case("garbage_lines", lambda: "%%%\n" * 9000, (1, "at the start of a statement"), stopped=True),
    Case("rules_over_the_caps", lambda: _rules(50_000), (MAX_PLAN_LINES + 1, "more than 10,000 lines")),
    Case("rules_8000", lambda: _rules(8000), None),
    Case("rules_8000_unknown_axis", lambda: _rules(8000, "row over tq"), (3, "unknown mesh axis `tq`"), 8000),
    Case(
        "rules_8000_conflicting",
        lambda: (
            "mesh tp=2\nmodules {\n"
            + "".join(f"a: {('row', 'column')[i % 2]} over tp\n" for i in range(8000))
            + "}\n"
        ),
        (4, "conflicting rules for `a`"),
        4000,
    ),
    Case(
        "rules_8000_broken_at_the_end",
        lambda: _rules(8000)[:-2] + "b: rowe over tp\n" * 60 + "}\n",
        (8003, "unexpected `rowe`"),
        stopped=True,  # each error parses the block again: recovery stops at its budget
    ),
    Case(
        "cuts_8000_same",
        lambda: "mesh pp=2\npipeline over pp {\n" + "    cut before l\n" * 8000 + "}\n",
        (4, "the same cut is given twice"),
        7999,
    ),
    Case(
        "settings_repeated",
        lambda: _block("train", "gradient_accumulation = 2\n    " * 8000),
        (4, "is set twice"),
        7999,
    ),
    Case(
        "expert_args_repeated",
        lambda: _block("modules", "m: experts over ep (" + ",".join(["top_k=2"] * 9000) + ")"),
        (3, "is given twice"),
        8999,
    ),
    # -- module pattern ranges
    Case("range_100000_x50", lambda: _rules(50, pattern="l{i}.{{0..100000}}"), None),
    Case(
        "range_12_digits",
        lambda: _rules(1, pattern="l.{{0..999999999999}}"),
        (3, "range {0..999999999999} is too large"),
    ),
    Case(
        "range_900_digits",
        lambda: _rules(1, pattern="l.{{0.." + "9" * 900 + "}}"),
        (3, "range bound 9999999999999999... is too large"),
    ),
    # -- numbers out of range
    Case(
        "axis_23_digits",
        lambda: "mesh tp=99999999999999999999999\n",
        (1, "axis size 9999999999999999... is too large"),
    ),
    Case(
        "axis_1mib_digits", lambda: _fill("9", "mesh tp="), (1, "axis size 9999999999999999... is too large")
    ),
    Case(
        "bucket_1e309", lambda: _block("data_parallel over dp", "bucket = 1e309B"), (3, "unexpected `1e309B`")
    ),
    Case(
        "bucket_400_digits",
        lambda: _block("data_parallel over dp", "bucket = " + "9" * 400 + "GB"),
        (3, "bucket size 9999999999999999... is too large"),
    ),
    Case(
        "microbatches_power",
        lambda: _block("pipeline over pp", "microbatches = 10**400"),
        (3, "unexpected `**400`"),
    ),
    Case(
        "microbatches_20_digits",
        lambda: _block("pipeline over pp", "microbatches = " + "9" * 20),
        (3, "microbatch count"),
    ),
    Case(
        "microbatches_zero", lambda: _block("pipeline over pp", "microbatches = 0"), (3, "must be at least 1")
    ),
    Case(
        "microbatches_negative",
        lambda: _block("pipeline over pp", "microbatches = -3"),
        (3, "unexpected `-3`"),
    ),
    Case(
        "capacity_factor_1e400",
        lambda: _block("modules", "m: experts over ep (capacity_factor = 1e400)"),
        (3, "`capacity_factor` 1e400 is too large"),
    ),
    Case(
        "top_k_23_digits",
        lambda: _block("modules", "m: experts over ep (top_k=" + "9" * 23 + ")"),
        (3, "`top_k` 9999999999999999... is too large"),
    ),
    Case(
        "loss_scale_1e400",
        lambda: _block("precision", "compute = fp16\n    loss_scale = 1e400"),
        (4, "loss scale 1e400 is too large"),
    ),
    Case(
        "zero_stage_20_digits",
        lambda: _block("data_parallel over dp", "zero = " + "9" * 20),
        (3, "ZeRO stage"),
    ),
    Case("device_20_digits", lambda: _block("modules", "m: on cuda:" + "9" * 20), (3, "device index")),
    # -- bytes that are not plan text
    Case("nul_byte", lambda: b"mesh tp=2\n" * 1000 + b"\x00", (1001, "NUL byte")),
    Case("invalid_utf8", lambda: b"mesh tp=2\n" * 1000 + b"# \xff\xfe\n", (1001, "not UTF-8")),
    Case("crlf", lambda: _rules(3000).replace("\n", "\r\n"), None),
    Case("lone_cr", lambda: "mesh tp=2\rmodules {\r a: row over tp\r}\r" * 20_000, (1, "carriage return")),
]


def _ids(case: Case) -> str:
    return case.name


@dataclass
class Outcome:
    error: PlanError | None
    rendered: str  # what `meshplan check` prints on stderr
    formatted: str | None  # what `meshplan fmt` prints; None when the plan does not parse
    seconds: float  # CPU time: the work done, whatever else the machine runs meanwhile
    peak_bytes: int


def _check_and_format(data: bytes, *, trace_memory: bool) -> Outcome:
    start = time.process_time()
    if not trace_memory:
        return Outcome(*_verbs(data), time.process_time() - start, 0)
    tracemalloc.start()
    try:
        error, rendered, formatted = _verbs(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return Outcome(error, rendered, formatted, time.process_time() - start, peak)


def _verbs(data: bytes) -> tuple[PlanError | None, str, str | None]:
    try:
        text = decode_plan_bytes(data, NAME)
    except PlanError as e:
        return e, e.render() + "\n" + e.summary(), None
    try:
        plan = check_text(text, NAME)
    except PlanError as e:
        error, rendered = e, e.render() + "\n" + e.summary()
    else:
        sources = {NAME: text}
        error, rendered = None, render_diagnostics(plan.warnings, sources, more_warnings=plan.more_warnings)
    try:
        formatted = format_plan(parse(text, NAME), text)
    except PlanError:
        formatted = None
    return error, rendered, formatted


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_hostile_plan(case: Case) -> None:
    raw = case.text()
    data = raw.encode() if isinstance(raw, str) else raw
    assert len(data) <= MAX_PLAN_BYTES, "the case is meant to be an input `meshplan` reads"

    outcome = _check_and_format(data, trace_memory=case.trace_memory)

    assert outcome.seconds < SECONDS
    assert outcome.peak_bytes < MAX_MEMORY, f"{outcome.peak_bytes / MIB:.0f} MiB"
    assert len(outcome.rendered) < MAX_OUTPUT
    if outcome.formatted is not None:  # the canonical form is about as long as the plan
        assert len(outcome.formatted) <= 2 * len(data) + 1000
    if case.error is None:
        assert outcome.error is None, outcome.rendered[:2000]
        return
    assert outcome.error is not None, "the plan is accepted"
    first = outcome.error.errors[0]  # by position
    line, message = case.error
    assert (first.span.line, message in first.message) == (line, True), first
    assert outcome.error.stopped == case.stopped
    assert len(outcome.error.errors) <= MAX_KEPT
    if case.errors is not None:
        assert outcome.error.num_errors == case.errors
        assert outcome.rendered.count(" error: ") == min(case.errors, MAX_SHOWN)
        if case.errors > MAX_SHOWN:
            assert f"\n... and {case.errors - MAX_SHOWN:,} more errors" in outcome.rendered
        assert outcome.rendered.endswith(f"{NAME}: {case.errors:,} errors" + _warnings(outcome.error))


def _warnings(error: PlanError) -> str:
    n = error.num_warnings
    return f", {n:,} warning{'s' * (n != 1)}" if n else ""


def test_the_cap_shows_errors_before_warnings() -> None:
    """8,000 rules for one module, alternately row and column: 4,000 conflicts and 3,999
    repeats. The first 50 shown are errors, and the count names both."""
    text = (
        "mesh tp=2\nmodules {\n"
        + "".join(f"a: {('row', 'column')[i % 2]} over tp\n" for i in range(8000))
        + "}\n"
    )
    with pytest.raises(PlanError) as info:
        check_text(text, NAME)
    rendered = info.value.render()
    assert rendered.count(" error: ") == MAX_SHOWN and " warning: " not in rendered
    assert rendered.endswith("\n... and 3,950 more errors and 3,999 more warnings (first 50 shown)")
    assert info.value.summary() == f"{NAME}: 4,000 errors, 3,999 warnings"


def test_meshplan_check_caps_its_output(tmp_path: Path) -> None:
    """End to end: 9,000 repeated axes print 50 errors, a count of the rest, the total; exit 2."""
    plan = tmp_path / "axes.plan"
    plan.write_text("mesh " + ",".join(["a=1"] * 9000) + "\n", encoding="utf-8")
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    done = subprocess.run(
        [sys.executable, "-m", "meshplan", "check", str(plan)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""
    assert len(done.stderr.encode()) < 50_000
    assert done.stderr.count(": error: axis `a` is declared twice\n") == MAX_SHOWN
    assert done.stderr.endswith(f"\n... and 8,949 more errors (first 50 shown)\n{plan}: 8,999 errors\n")


# ---------------------------------------------------------------------------- fuzzing, seeded

EXAMPLE_TEXTS = [
    p.read_text(encoding="utf-8")
    for p in sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.plan"))
]
HOSTILE_PIECES = [
    "{",
    "}",
    "{0..999999}",
    "*",
    "**",
    ",",
    "=",
    "a=1,",
    " ",
    "\t",
    "\n",
    "#",
    "9" * 14,
    "1e309",
    "\x00",
    "over tp",
    "cut before ",
    "mesh ",
    "modules {\n",
]


def _fuzzed(rng: random.Random) -> bytes:
    """An example plan with a random line or piece repeated to up to 256 KB, or random pieces
    spliced in: the shapes that made the checker quadratic, found by chance instead of by name."""
    text = rng.choice(EXAMPLE_TEXTS)
    lines = text.splitlines(keepends=True)
    kind = rng.randrange(3)
    if kind == 0:  # one line, repeated
        line = rng.choice(lines)
        text = text + line * (rng.randrange(1, 256 * 1024) // max(len(line), 1))
    elif kind == 1:  # one hostile piece, repeated in place
        piece = rng.choice(HOSTILE_PIECES)
        at = rng.randrange(len(text) + 1)
        text = text[:at] + piece * rng.randrange(1, 256 * 1024 // len(piece)) + text[at:]
    else:  # a few pieces spliced anywhere
        for _ in range(rng.randrange(1, 40)):
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(HOSTILE_PIECES) + text[at:]
    return text.encode("utf-8", "surrogatepass")[:MAX_PLAN_BYTES]


def test_seeded_fuzz_finishes_every_input_in_bounded_time_and_output() -> None:
    """120 inputs from a fixed seed (the same every run): each is checked and formatted within
    the per-input bound, ends in a PlanError or a valid plan, and renders at most MAX_OUTPUT."""
    rng = random.Random(20261125)
    slowest = (0.0, b"")
    for _ in range(120):
        data = _fuzzed(rng)
        start = time.process_time()
        error, rendered, _ = _verbs(data)
        spent = time.process_time() - start
        slowest = max(slowest, (spent, data[:80]))
        assert spent < SECONDS, (spent, data[:200])
        assert len(rendered) <= MAX_OUTPUT, data[:200]
        assert error is None or error.num_errors >= 1
    assert slowest[0] < SECONDS
