"""Golden tests of rendered errors: each `invalid/NAME.plan` fails `meshplan check` with exactly
the text of `invalid/NAME.expect` on stderr, and exit code 2.

A plan whose first line is `# world-size: N` is checked with `--world-size N`.
Regenerate the .expect files on purpose only, then read the diff:

    MESHPLAN_ACCEPT=1 pytest tests/dsl/test_invalid_plans.py
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshplan.dsl.limits import MAX_PLAN_BYTES
from meshplan.main import main

REPO = Path(__file__).resolve().parents[2]
INVALID = Path(__file__).resolve().parent / "invalid"
PLANS = sorted(INVALID.glob("*.plan"))
ACCEPT = os.environ.get("MESHPLAN_ACCEPT") == "1"

_HEADER = re.compile(
    r"(?P<path>[^\s:]+):(?P<line>\d+):(?P<col>\d+): (?P<kind>error|warning|note): (?P<msg>.+)"
)
_SUMMARY = re.compile(r"(?P<path>[^\s:]+): (?P<errors>\d+) errors?(, (?P<warnings>\d+) warnings?)?")


@pytest.fixture(autouse=True)
def _plain_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("MESHPLAN_DEBUG", raising=False)
    monkeypatch.chdir(REPO)  # paths in the output are relative: tests/dsl/invalid/NAME.plan


def _world_size_args(plan: Path) -> list[str]:
    first = plan.read_bytes().split(b"\n", 1)[0]
    m = re.fullmatch(rb"# world-size: ([0-9]+)\s*", first)
    return ["--world-size", m.group(1).decode()] if m else []


def _check(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_there_are_enough_invalid_plans() -> None:
    assert len(PLANS) >= 30
    orphans = {p.stem for p in INVALID.glob("*.expect")} - {p.stem for p in PLANS}
    assert not orphans, f".expect files without a .plan: {sorted(orphans)}"


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.stem)
def test_invalid_plan_reports_expected_errors(plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rel = plan.relative_to(REPO).as_posix()
    code, out, err = _check(["check", rel, *_world_size_args(plan)], capsys)
    expect = plan.with_suffix(".expect")
    if ACCEPT:
        expect.write_text(err, encoding="utf-8", newline="\n")
    assert code == 2, err
    assert out == ""  # nothing is summarized for a plan that failed
    assert expect.exists(), f"no {expect.name}; run with MESHPLAN_ACCEPT=1 to write it, then read it"
    assert err == expect.read_text(encoding="utf-8")
    _assert_compiler_shape(err, plan, rel)


# ---------------------------------------------------------------------------- the shape of the output


@dataclass
class _Block:
    """One rendered diagnostic: its header, its excerpts (a header each), and its hint."""

    header: re.Match[str]
    lines: list[str]


def _blocks(err: str) -> tuple[list[_Block], str]:
    *body, summary = err.rstrip("\n").split("\n")
    blocks: list[_Block] = []
    for text in body:
        m = _HEADER.fullmatch(text)
        if m and m["kind"] != "note":
            blocks.append(_Block(m, [text]))
        else:
            assert blocks, f"output does not start with a `file:line:col: error:` line: {text!r}"
            blocks[-1].lines.append(text)
    return blocks, summary


def _assert_compiler_shape(err: str, plan: Path, rel: str) -> None:
    source = plan.read_bytes().decode("utf-8", "replace").split("\n")
    blocks, summary = _blocks(err)
    assert blocks, "no diagnostics"
    assert any(b.header["kind"] == "error" for b in blocks)

    # the summary line counts what was printed
    m = _SUMMARY.fullmatch(summary)
    assert m, summary
    assert m["path"] == rel
    assert int(m["errors"]) == sum(b.header["kind"] == "error" for b in blocks)
    assert int(m["warnings"] or 0) == sum(b.header["kind"] == "warning" for b in blocks)

    # sorted by position
    positions = [(int(b.header["line"]), int(b.header["col"])) for b in blocks]
    assert positions == sorted(positions)

    for block in blocks:
        assert block.header["path"] == rel
        lines = block.lines
        # the hint, if any, comes last and says something
        hints = [i for i, text in enumerate(lines) if text.startswith("hint: ")]
        assert hints in ([], [len(lines) - 1]), lines
        if hints:
            assert len(lines[-1]) > len("hint: ") + 3
        # "unexpected X" alone does not help: say what was expected, or what was meant
        if block.header["msg"].startswith(("unexpected", "line ends too early")):
            assert hints, f"a syntax error without a hint: {lines[0]}"
        # every located line (the error's and each note's) is shown with a caret under its column
        i = 0
        while i < len(lines) - len(hints):
            h = _HEADER.fullmatch(lines[i])
            assert h, f"expected a `file:line:col: kind:` line, got {lines[i]!r}"
            line, col = int(h["line"]), int(h["col"])
            assert 1 <= line <= len(source), lines[i]
            if not source[line - 1].strip():  # an empty file: nothing to point at
                i += 1
                continue
            excerpt, caret = lines[i + 1], lines[i + 2]
            assert excerpt.startswith("    ") and caret.startswith("    "), lines
            assert re.fullmatch(r" *\^~*", caret), caret
            shown = source[line - 1].removesuffix("\r").expandtabs(1)
            if len(shown) <= 200:
                assert caret.index("^") - 4 == col - 1, f"caret not under column {col}: {lines}"
            i += 3


# ---------------------------------------------------------------------------- files that are not plans


def test_huge_file_is_refused_without_reading_it_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "huge.plan"
    line = b"    layers.*.mlp.up_proj: column over tp\n"
    plan.write_bytes(b"mesh tp=2\nmodules {\n" + line * (MAX_PLAN_BYTES // len(line) + 1) + b"}\n")
    assert plan.stat().st_size > MAX_PLAN_BYTES
    code, _, err = _check(["check", str(plan)], capsys)
    assert code == 2
    assert err.startswith(f"{plan}:1:1: error: plan file is larger than 1024 KiB\n")
    assert "hint: a plan describes a layout in a few dozen lines" in err


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _check(["check", "tests/dsl/invalid/no_such.plan"], capsys)
    assert code == 2
    assert err == (
        "tests/dsl/invalid/no_such.plan:1:1: error: no such plan file\n"
        "hint: check the path\n"
        "tests/dsl/invalid/no_such.plan: 1 error\n"
    )


def test_directory_is_not_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _check(["check", "tests/dsl/invalid"], capsys)
    assert code == 2
    assert err.startswith("tests/dsl/invalid:1:1: error: is a directory, not a plan file\n")


def test_every_plan_of_several_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    plans = ["tests/dsl/invalid/unknown_axis.plan", "examples/tiny_dp.plan", "tests/dsl/invalid/empty.plan"]
    code, out, err = _check(["check", *plans], capsys)
    assert code == 2
    assert "examples/tiny_dp.plan: ok" in out
    assert "tests/dsl/invalid/unknown_axis.plan: 1 error\n" in err
    assert err.endswith("tests/dsl/invalid/empty.plan: 1 error\n")
