"""Property tests of the plan front end.

- Plans generated from the grammar itself (`hypothesis.extra.lark`) either parse or raise
  `PlanSyntaxError`; those that parse survive formatting: `parse(format(tree)) == tree`, and
  formatting is idempotent.
- Random text, random bytes and mutated example plans only ever raise meshplan's own
  `PlanError`s, which render.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark

from meshplan.dsl import PlanError, PlanSyntaxError, check_text, parse
from meshplan.dsl.fmt import format_plan
from meshplan.dsl.lalr import lark_parser
from meshplan.dsl.limits import decode_plan_bytes

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.plan"))
EXAMPLE_TEXTS = [p.read_text(encoding="utf-8") for p in EXAMPLES]

# Sized so that the whole file runs in about 10 s on two cores (generating from the grammar
# costs the most per example). Hunting for bugs, run with far more: the properties hold at 6000.
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BROAD = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- plans from the grammar


def _grammar_terminals() -> dict[str, st.SearchStrategy[str]]:
    """Strategies for the grammar's terminals that produce plausible plan text.

    Keywords are padded with spaces: hypothesis joins terminals without separators, and
    `column` directly followed by `over` is one word, `columnover`, not two.
    """
    comment = st.text(st.characters(exclude_characters="\n", codec="utf-8"), max_size=12)
    segment = st.sampled_from(
        ["layers", "*", "**", "h", "mlp", "3", "{0..3}", "{q,k,v}_proj", "*_proj", "norm"]
    )
    explicit: dict[str, st.SearchStrategy[str]] = {
        "NAME": st.sampled_from(["dp", "tp", "pp", "ep", "cp", "top_k", "capacity_factor", "x"]),
        "INT": st.integers(0, 12).map(str) | st.sampled_from(["16", "0007", "1000000000000"]),
        "NUMBER": st.sampled_from(["1", "2", "0.5", "1.25", "1e3", "2.5E-1", "0"]),
        "SIZE": st.builds(
            lambda n, space, unit: f"{n}{space}{unit}",
            st.sampled_from(["0", "1", "25", "1.5", "16"]),
            st.sampled_from(["", " "]),
            st.sampled_from(["B", "KB", "MB", "GB", "KiB", "MiB", "GiB"]),
        ),
        "PATTERN": st.lists(segment, min_size=1, max_size=4).map(".".join),
        "_NL": st.lists(
            st.builds(
                lambda c, indent: c + "\n" + indent,
                st.sampled_from(["", "", "  "]) | comment.map(lambda t: "  #" + t),
                st.sampled_from(["", "    ", "\t", "  "]),
            ),
            min_size=1,
            max_size=3,
        ).map("".join),
        "WS_INLINE": st.sampled_from([" ", "  ", "\t"]),
    }
    for t in lark_parser().terminals:
        if t.pattern.type == "str" and t.name not in explicit:
            value = t.pattern.value
            explicit[t.name] = st.just(f" {value} " if value[-1:].isalnum() else value)
    return explicit


GRAMMAR_PLANS = from_lark(lark_parser(), explicit=_grammar_terminals())


@FAST
@given(GRAMMAR_PLANS)
def test_grammar_plans_parse_and_survive_formatting(text: str) -> None:
    try:
        tree = parse(text)
    except PlanSyntaxError as e:
        str(e)  # values the grammar admits but the AST refuses (`zero = 1000000000000`) are errors
        assume(False)
    formatted = format_plan(tree, text)
    assert parse(formatted) == tree, formatted
    assert format_plan(parse(formatted), formatted) == formatted


def test_grammar_plans_mostly_parse() -> None:
    """Guard the generator itself: if most generated plans failed to parse, the property above
    would be checking nothing."""
    parsed = 0

    @settings(max_examples=100, deadline=None, database=None)
    @given(GRAMMAR_PLANS)
    def count(text: str) -> None:
        nonlocal parsed
        try:
            parse(text)
            parsed += 1
        except PlanSyntaxError:
            pass

    count()
    assert parsed >= 50


# ---------------------------------------------------------------------------- anything else only raises PlanError


def _check_only_plan_errors(text: str) -> None:
    try:
        check_text(text, "fuzz.plan")
    except PlanError as e:
        assert e.diagnostics
        assert all(d.span.line >= 1 and d.span.col >= 1 for d in e.diagnostics)
        # recovery never reports one problem twice (the cascade of a stuck repair)
        assert len({(d.span, d.message) for d in e.diagnostics}) == len(e.diagnostics)
        assert str(e)
        e.render(color=True)
        return
    # it was a valid plan: then it also formats, and the formatted text means the same
    formatted = format_plan(parse(text, "fuzz.plan"), text)
    assert parse(formatted, "fuzz.plan") == parse(text, "fuzz.plan")


@BROAD
@given(st.text())
def test_random_text_only_raises_plan_errors(text: str) -> None:
    _check_only_plan_errors(text)


# characters that matter to the lexer, so random text reaches past the first token
_PLAN_CHARS = string.ascii_lowercase[:8] + "_0123456789*{}():=,.# \t\n\r" + "\x00\x0c\u2028\xe9"
_PLAN_WORDS = ["mesh ", "modules {\n", "}\n", "dp=*", "tp=2", ": ", "column over tp", "zero = 1", "\n"]


@BROAD
@given(st.lists(st.sampled_from(_PLAN_WORDS) | st.text(_PLAN_CHARS, max_size=6), max_size=20).map("".join))
def test_random_plan_like_text_only_raises_plan_errors(text: str) -> None:
    _check_only_plan_errors(text)


@BROAD
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_plan_errors(data: bytes) -> None:
    try:
        text = decode_plan_bytes(data, "fuzz.plan")
    except PlanError as e:
        assert str(e)
        return
    _check_only_plan_errors(text)


@st.composite
def mutated_examples(draw: st.DrawFn) -> str:
    lines = draw(st.sampled_from(EXAMPLE_TEXTS)).split("\n")
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "insert", "replace", "swap", "duplicate", "drop"]))
        line = lines[i]
        col = draw(st.integers(0, len(line)))
        char = draw(st.sampled_from(_PLAN_CHARS) | st.characters())
        if op == "delete" and line:
            lines[i] = line[: min(col, len(line) - 1)] + line[min(col, len(line) - 1) + 1 :]
        elif op == "insert":
            lines[i] = line[:col] + char + line[col:]
        elif op == "replace" and line:
            col = min(col, len(line) - 1)
            lines[i] = line[:col] + char + line[col + 1 :]
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "duplicate":
            lines.insert(i, line)
        elif op == "drop" and len(lines) > 1:
            del lines[i]
    return "\n".join(lines)


@BROAD
@given(mutated_examples())
def test_mutated_examples_only_raise_plan_errors(text: str) -> None:
    _check_only_plan_errors(text)


@pytest.mark.parametrize("text", EXAMPLE_TEXTS, ids=[p.stem for p in EXAMPLES])
def test_examples_reformat_to_themselves(text: str) -> None:
    assert format_plan(parse(text), text) == text
