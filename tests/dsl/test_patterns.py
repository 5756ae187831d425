"""Module-path globs: what each form matches, how rules are ordered by specificity, and the
located errors of malformed patterns."""

from __future__ import annotations

import time

import pytest

from meshplan.dsl import PlanValidationError, check_text
from meshplan.dsl.patterns import MAX_RANGE, Glob, PatternSyntaxError

PATHS = [
    "embed_tokens",
    "layers.0.self_attn.q_proj",
    "layers.0.self_attn.k_proj",
    "layers.0.self_attn.v_proj",
    "layers.0.self_attn.o_proj",
    "layers.0.mlp.gate_proj",
    "layers.0.mlp.down_proj",
    "layers.3.mlp.down_proj",
    "layers.12.mlp.down_proj",
    "layers.0.mlp.experts.7.w1",
    "norm",
    "lm_head",
]


def matched(pattern: str) -> list[str]:
    glob = Glob.compile(pattern)
    return [p for p in PATHS if glob.matches(p)]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("norm", ["norm"]),
        ("layers", []),  # a pattern matches whole paths, not prefixes
        ("layers.*", []),  # `*` is exactly one segment
        (
            "layers.*.mlp.down_proj",
            ["layers.0.mlp.down_proj", "layers.3.mlp.down_proj", "layers.12.mlp.down_proj"],
        ),
        ("*", ["embed_tokens", "norm", "lm_head"]),
        ("**", PATHS),
        ("**.w1", ["layers.0.mlp.experts.7.w1"]),
        ("layers.**", [p for p in PATHS if p.startswith("layers.")]),
        ("layers.0.**.w1", ["layers.0.mlp.experts.7.w1"]),
        ("layers.0.mlp.**.down_proj", ["layers.0.mlp.down_proj"]),  # `**` may match no segment
        ("layers.0.self_attn.*_proj", [f"layers.0.self_attn.{x}_proj" for x in "qkvo"]),
        ("layers.0.self_attn.{q,k,v}_proj", [f"layers.0.self_attn.{x}_proj" for x in "qkv"]),
        ("layers.{0..3}.mlp.down_proj", ["layers.0.mlp.down_proj", "layers.3.mlp.down_proj"]),
        ("layers.{3..12}.mlp.down_proj", ["layers.3.mlp.down_proj", "layers.12.mlp.down_proj"]),
        ("layers.{1..2}.mlp.down_proj", []),
        (
            "layers.*.mlp.{gate,down}_proj",
            ["layers.0.mlp.gate_proj", *[f"layers.{i}.mlp.down_proj" for i in (0, 3, 12)]],
        ),
        ("*_head", ["lm_head"]),
        ("*e*", ["embed_tokens", "lm_head"]),
        ("{lm_head,norm}", ["norm", "lm_head"]),
    ],
)
def test_glob_matches(pattern: str, expected: list[str]) -> None:
    assert matched(pattern) == expected


def test_dots_and_regex_characters_are_literal() -> None:
    assert not Glob.compile("layers.0").matches("layersX0")
    assert not Glob.compile("a.b").matches("a.b.c")
    assert not Glob.compile("*").matches("a.b")
    assert Glob.compile("a_1.B2").matches("a_1.B2")


def test_range_matches_numbers_not_their_padding() -> None:
    glob = Glob.compile("h.{0..10}")
    assert glob.matches("h.10") and glob.matches("h.0")
    assert not glob.matches("h.010") and not glob.matches("h.11") and not glob.matches("h.1.0")


@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (0, 10), (7, 123), (95, 1005), (-12, 3), (-30, -7)])
def test_range_matches_exactly_its_numbers(lo: int, hi: int) -> None:
    """Ranges compare numbers rather than list them; `h.{lo..hi}` is still exactly the
    numbers `str` writes, with a suffix after them, in a segment of their own."""
    glob, suffixed = Glob.compile(f"h.{{{lo}..{hi}}}"), Glob.compile(f"h.{{{lo}..{hi}}}x")
    for n in range(lo - 40, hi + 40):
        assert glob.matches(f"h.{n}") == suffixed.matches(f"h.{n}x") == (lo <= n <= hi), n
    assert not glob.matches("h.-0") and not glob.matches("h.+1") and not glob.matches("h.")


def test_double_star_spans_no_empty_segment() -> None:
    """`**` is whole, named segments: the root module (path "") is not under it."""
    assert not Glob.compile("**").matches("")
    assert Glob.compile("**.norm").matches("norm") and Glob.compile("**").matches("a.b")
    assert not Glob.compile("a.**.b").matches("a..b")


def test_matching_does_not_backtrack() -> None:
    """Wildcards are matched by keeping positions, not by a backtracking regex: with one,
    `*a` x 10 + `x` against 40 `a`s took 14 s, and each `*a` more multiplied that."""
    start = time.perf_counter()
    assert not Glob.compile("*a" * 400 + "x").matches("a" * 900)
    assert not Glob.compile(".".join(["**", "a"] * 200)).matches(".".join(["a"] * 500) + ".b")
    assert Glob.compile("layers.{0..100000}.mlp").matches("layers.99999.mlp")
    assert time.perf_counter() - start < 10  # about 0.1 s; generous for a loaded machine


def test_literal_prefix() -> None:
    assert Glob.compile("layers.*.mlp").literal_prefix == "layers"
    assert Glob.compile("model.layers.{0..3}.mlp").literal_prefix == "model.layers"
    assert Glob.compile("*.mlp").literal_prefix == ""
    assert Glob.compile("lm_head").literal_prefix == "lm_head"


# ---------------------------------------------------------------------------- specificity


@pytest.mark.parametrize(
    ("more", "less"),
    [
        ("layers.0.mlp.down_proj", "layers.*.mlp.down_proj"),  # more literal segments
        ("layers.*.mlp.down_proj", "layers.*.*.down_proj"),
        ("layers.*.mlp.down_proj", "**.down_proj"),
        ("layers.*.self_attn.q_proj", "layers.*.self_attn.*_proj"),
        ("layers.*.self_attn.*_proj", "layers.*.self_attn.*"),  # more literal characters
        ("layers.*.self_attn.{q,k}_proj", "layers.*.self_attn.*"),
        ("layers.*.mlp", "layers.**.mlp"),  # fewer `**`
        ("**.mlp", "**.**.mlp"),
    ],
)
def test_specificity_orders_rules(more: str, less: str) -> None:
    assert Glob.compile(more).specificity > Glob.compile(less).specificity


def test_specificity_picks_the_most_specific_matching_rule() -> None:
    rules = ["**", "layers.**", "layers.*.mlp.*", "layers.*.mlp.down_proj", "layers.0.mlp.down_proj"]
    globs = [Glob.compile(r) for r in rules]
    for path, winner in [
        ("layers.0.mlp.down_proj", "layers.0.mlp.down_proj"),
        ("layers.3.mlp.down_proj", "layers.*.mlp.down_proj"),
        ("layers.3.mlp.gate_proj", "layers.*.mlp.*"),
        ("layers.3.self_attn", "layers.**"),
        ("norm", "**"),
    ]:
        best = max((g for g in globs if g.matches(path)), key=lambda g: g.specificity)
        assert best.text == winner, path


# ---------------------------------------------------------------------------- malformed patterns


@pytest.mark.parametrize(
    ("pattern", "message", "offset", "length"),
    [
        ("", "empty module pattern", 0, 1),
        ("layers..mlp", "empty path segment", 7, 1),
        (".layers", "empty path segment", 0, 1),
        ("layers.", "empty path segment", 7, 1),
        ("layers.{q,k", "unclosed `{`", 7, 1),
        ("a.{q,k}.{v", "unclosed `{`", 8, 1),
        ("layers.q}", "`}` without `{`", 8, 1),
        ("a.{q,{k}}", "braces cannot nest", 5, 1),
        ("layers.**_proj", "`**` must be a whole path segment", 7, 2),
        ("a.b**", "`**` must be a whole path segment", 3, 2),
        ("layers.{3..1}", "empty range {3..1}: 3 is greater than 1", 7, 6),
        (
            f"a.{{0..{MAX_RANGE + 1}}}",
            f"range {{0..{MAX_RANGE + 1}}} is too large",
            2,
            len(str(MAX_RANGE + 1)) + 5,
        ),
        ("a.{q,,k}", "empty alternative in braces", 2, 6),
        ("a.{}", "empty alternative in braces", 2, 2),
        ("a.{q,k-v}", "alternative `k-v` is not a plain name", 2, 7),
        ("a.{0..x}", "alternative `0..x` is not a plain name", 2, 6),
        ("a.b-c", "unexpected character `-` in module pattern", 3, 1),
    ],
)
def test_malformed_pattern_errors_have_offsets(pattern: str, message: str, offset: int, length: int) -> None:
    with pytest.raises(PatternSyntaxError) as info:
        Glob.compile(pattern)
    assert str(info.value) == message
    assert (info.value.offset, info.value.length) == (offset, length)
    assert isinstance(info.value, ValueError)


def test_pattern_errors_are_located_in_the_plan() -> None:
    """The checker turns a pattern's offset into a span in the file."""
    text = "mesh tp=2\nmodules {\n    layers.{3..1}.mlp: column over tp\n    a.b: row over tp\n}\n"
    with pytest.raises(PlanValidationError) as info:
        check_text(text, "p.plan")
    (d,) = info.value.diagnostics
    assert (d.span.line, d.span.col, d.span.end_col) == (3, 12, 18)
    assert d.hint == "write {1..3}"


def test_pattern_errors_in_cuts_are_located_too() -> None:
    text = "mesh pp=2\npipeline over pp {\n    cut after layers..3\n}\n"
    with pytest.raises(PlanValidationError) as info:
        check_text(text, "p.plan")
    (d,) = info.value.diagnostics
    assert (d.span.line, d.span.col, d.message) == (3, 22, "empty path segment")
