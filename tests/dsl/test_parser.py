"""Parsing: every construct to its AST value, spans, the examples, error recovery, and the
promise that only meshplan's own errors leave `parse`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshplan.dsl import PlanError, PlanFileError, PlanSyntaxError, Span, check_text, load_plan, parse
from meshplan.dsl import ast as A
from meshplan.dsl.limits import MAX_PLAN_BYTES, MAX_SYNTAX_ERRORS, decode_plan_bytes
from meshplan.dsl.parser import parse_recovering

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.plan"))


def _statement(text: str, index: int = 1) -> A.Statement:
    return parse(text, "t.plan").statements[index]


def _rule_action(action: str) -> A.Action:
    block = _statement(f"mesh dp=*, tp=2\nmodules {{\n    layers.*: {action}\n}}\n")
    assert isinstance(block, A.ModulesBlock)
    return block.rules[0].action


def _setting(block: str, line: str) -> A.Setting:
    header = {"pipeline": "pipeline over pp", "data_parallel": "data_parallel over dp"}.get(block, block)
    stmt = _statement(f"mesh dp=*, pp=2\n{header} {{\n    {line}\n}}\n")
    item = stmt.items[0]  # type: ignore[union-attr]
    assert isinstance(item, A.Setting)
    return item


# ---------------------------------------------------------------------------- every construct


def test_mesh_axes_in_order_with_auto_size() -> None:
    mesh = _statement("mesh dp=*, pp=2, tp=4\n", 0)
    assert mesh == A.Mesh(
        (
            A.MeshAxis(A.Name("dp"), None),
            A.MeshAxis(A.Name("pp"), 2),
            A.MeshAxis(A.Name("tp"), 4),
        )
    )


@pytest.mark.parametrize(
    ("action", "node"),
    [
        ("column over tp", A.TensorParallel("column", A.Name("tp"))),
        ("row over tp", A.TensorParallel("row", A.Name("tp"))),
        ("vocab over tp", A.TensorParallel("vocab", A.Name("tp"))),
        ("replicate", A.Replicate()),
        ("sequence over tp", A.SequenceParallel(A.Name("tp"))),
        ("context ring over tp", A.ContextParallel("ring", A.Name("tp"))),
        ("context ulysses over tp", A.ContextParallel("ulysses", A.Name("tp"))),
        (
            "context ring over cp (layout=contiguous)",
            A.ContextParallel("ring", A.Name("cp"), layout="contiguous"),
        ),
        ("experts over dp", A.ExpertParallel(A.Name("dp"), ())),
        ("experts over dp x tp", A.ExpertParallel(A.Name("dp"), (), more=(A.Name("tp"),))),
        ("experts over x x y", A.ExpertParallel(A.Name("x"), (), more=(A.Name("y"),))),  # axes named x
        (
            "experts over dp (top_k=2, capacity_factor=1.25)",
            A.ExpertParallel(
                A.Name("dp"),
                (
                    A.ExpertArg(A.Name("top_k"), 2.0, "2"),
                    A.ExpertArg(A.Name("capacity_factor"), 1.25, "1.25"),
                ),
            ),
        ),
        ("checkpoint", A.Checkpoint(None, None)),
        ("checkpoint full", A.Checkpoint("full", None)),
        ("checkpoint selective every 2", A.Checkpoint("selective", 2)),
        ("checkpoint every 3", A.Checkpoint(None, 3)),
        ("on cpu", A.Device("cpu", None)),
        ("on cuda", A.Device("cuda", None)),
        ("on cuda:1", A.Device("cuda", 1)),
        ("precision fp32", A.DtypeOverride("fp32")),
        ("precision bf16", A.DtypeOverride("bf16")),
    ],
)
def test_rule_actions(action: str, node: A.Action) -> None:
    assert _rule_action(action) == node


@pytest.mark.parametrize(
    ("block", "line", "value", "text"),
    [
        ("pipeline", "schedule = gpipe", "gpipe", "gpipe"),
        ("pipeline", "schedule = 1f1b", "1f1b", "1f1b"),
        ("pipeline", "schedule = interleaved", "interleaved", "interleaved"),
        ("pipeline", "schedule = zero_bubble", "zero_bubble", "zero_bubble"),
        ("pipeline", "microbatches = 8", 8, "8"),
        ("pipeline", "virtual_stages = 2", 2, "2"),
        ("data_parallel", "zero = 3", 3, "3"),
        ("data_parallel", "bucket = 25MB", 25 * 10**6, "25MB"),
        ("data_parallel", "bucket = 25 MB", 25 * 10**6, "25MB"),
        ("data_parallel", "bucket = 1.5GiB", int(1.5 * 2**30), "1.5GiB"),
        ("data_parallel", "bucket = 512KiB", 512 * 2**10, "512KiB"),
        ("data_parallel", "bucket = 100B", 100, "100B"),
        ("data_parallel", "offload = optimizer", ("optimizer",), "optimizer"),
        ("data_parallel", "offload = optimizer, params", ("optimizer", "params"), "optimizer, params"),
        ("data_parallel", "offload = none", (), "none"),
        ("data_parallel", "offload = optimizer:disk", ("optimizer:disk",), "optimizer:disk"),
        ("data_parallel", "offload = optimizer:cpu, params", ("optimizer", "params"), "optimizer, params"),
        ("precision", "compute = bf16", "bf16", "bf16"),
        ("precision", "params = fp32", "fp32", "fp32"),
        ("precision", "grads = fp16", "fp16", "fp16"),
        ("precision", "reduce = fp32", "fp32", "fp32"),
        ("precision", "loss_scale = dynamic", "dynamic", "dynamic"),
        ("precision", "loss_scale = none", "none", "none"),
        ("precision", "loss_scale = 1024", 1024.0, "1024"),
        ("precision", "loss_scale = 6.5e4", 65000.0, "6.5e4"),
        ("train", "gradient_accumulation = 4", 4, "4"),
    ],
)
def test_settings(block: str, line: str, value: object, text: str) -> None:
    setting = _setting(block, line)
    assert (setting.key, setting.value, setting.text) == (line.split()[0], value, text)


def test_cuts() -> None:
    stmt = _statement("mesh pp=2\npipeline over pp {\n    cut before layers.1\n    cut after h.{2..3}\n}\n")
    assert stmt == A.PipelineBlock(
        A.Name("pp"),
        (A.Cut("before", A.Pattern("layers.1")), A.Cut("after", A.Pattern("h.{2..3}"))),
    )


def test_keywords_are_only_keywords_where_the_grammar_expects_them() -> None:
    """The contextual lexer: a module may be called `pipeline`, `row` or `mesh`."""
    stmt = _statement("mesh tp=2\nmodules {\n    pipeline.row: column over tp\n    mesh: replicate\n}\n")
    assert [r.pattern.text for r in stmt.rules] == ["pipeline.row", "mesh"]  # type: ignore[union-attr]


def test_one_line_block_and_no_trailing_newline() -> None:
    tree = parse("mesh dp=2\ndata_parallel over dp { zero = 1 }", "t.plan")
    assert tree.statements[1] == A.DataParallelBlock(A.Name("dp"), (A.Setting("zero", 1, "1"),))


def test_crlf_line_endings_parse_like_lf() -> None:
    text = "mesh dp=2\n\ndata_parallel over dp {\n    zero = 1  # c\n}\n"
    assert parse(text.replace("\n", "\r\n")) == parse(text)


def test_byte_order_mark_is_dropped() -> None:
    assert decode_plan_bytes(b"\xef\xbb\xbfmesh dp=2\n", "t.plan") == "mesh dp=2\n"


# ---------------------------------------------------------------------------- spans


def test_spans_point_at_the_source() -> None:
    text = "# header\nmesh dp=*, tp=2\n\nmodules {\n    layers.*.mlp.up_proj: column over tp\n}\n"
    tree = parse(text, "s.plan")
    mesh, modules = tree.statements
    assert mesh.span == Span("s.plan", 2, 1, 2, 16)
    assert mesh.axes[1].span == Span("s.plan", 2, 12, 2, 16)  # type: ignore[union-attr]
    assert mesh.axes[1].name.span == Span("s.plan", 2, 12, 2, 14)  # type: ignore[union-attr]
    assert modules.span == Span("s.plan", 4, 1, 6, 2)
    rule = modules.rules[0]  # type: ignore[union-attr]
    assert rule.span == Span("s.plan", 5, 5, 5, 41)
    assert rule.pattern.span == Span("s.plan", 5, 5, 5, 25)
    assert rule.action.span == Span("s.plan", 5, 27, 5, 41)
    assert rule.action.axis.span == Span("s.plan", 5, 39, 5, 41)


def test_setting_value_span_covers_the_value() -> None:
    setting = _setting("data_parallel", "offload = optimizer, params")
    assert setting.span == Span("t.plan", 3, 5, 3, 32)
    assert setting.value_span == Span("t.plan", 3, 15, 3, 32)


def test_spans_are_not_part_of_equality() -> None:
    assert parse("mesh dp=2\n", "a.plan").statements == parse("\n\n   mesh   dp = 2\n", "a.plan").statements


# ---------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_parse_and_check(path: Path) -> None:
    plan = load_plan(path)
    assert plan.mesh.axes
    assert not [w for w in plan.warnings if w.severity == "error"]


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 5


# ---------------------------------------------------------------------------- error recovery


def _errors(text: str) -> list[tuple[int, str]]:
    with pytest.raises(PlanError) as info:
        check_text(text, "r.plan")
    return [(d.span.line, d.message) for d in info.value.diagnostics]


def test_errors_after_a_broken_line_are_still_reported() -> None:
    text = (
        "mesh dp=*, tp=2\n"
        "modules {\n"
        "    a: colum over tp\n"  # syntax error
        "    b: row over tq\n"  # validation error after it, same block
        "}\n"
        "data_parallel over dp {\n"
        "    zero = 9\n"  # validation error in a later block
        "    bucket = 25\n"  # syntax error after it
        "}\n"
    )
    assert _errors(text) == [
        (3, "unexpected `colum`"),
        (4, "unknown mesh axis `tq`"),
        (7, "ZeRO stage 9 does not exist"),
        (8, "unexpected `25`"),
    ]


def test_a_broken_block_header_is_one_error() -> None:
    entries = "    schedule = 1f1b\n    microbatches = 1\n    what is this\n"
    for header in ["pipeline ovr pp {", "pipelin over pp {", "pipeline over {", "pipeline over pp"]:
        text = f"mesh pp=2\n{header}\n{entries}}}\n\nmesh pp=4\n"
        assert _errors(text) == [
            (2, _errors(f"mesh pp=2\n{header}\n}}\n")[0][1]),
            (8, "`mesh` appears twice"),  # the statement after the broken block is still read
        ], header


def test_a_missing_closing_brace_is_one_error() -> None:
    text = "mesh dp=*, tp=2\nmodules {\n    a: column over tp\n\ndata_parallel over dp {\n    zero = 5\n}\n"
    assert _errors(text) == [
        (5, "missing `}` to close the `modules` block before `data_parallel`"),
        (6, "ZeRO stage 5 does not exist"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "mesh tp=2\nmodules {\n    a: column over tp\n",
        "mesh tp=2\nmodules {\n",
        "mesh tp=2\nmodules {",
        "mesh tp=2\nmodules {\n    a.{q,k}: column over tp\n    # }\n",
    ],
)
def test_an_unclosed_block_at_the_end_is_one_error(text: str) -> None:
    assert _errors(text) == [(2, "`modules` block is never closed")]


@pytest.mark.parametrize("braces", ["}", "}\n}", "}}\n}}}\n"])
def test_stray_closing_braces_do_not_cascade(braces: str) -> None:
    errors = _errors(f"mesh tp=2\n{braces}\n")
    assert {m for _, m in errors} == {"unmatched `}`"}
    assert len(errors) == len(braces.split())  # one per line: the line is dropped whole


def test_a_syntax_error_hides_checks_that_depend_on_what_was_lost() -> None:
    """`zero = 3x` is broken, so `zero` is unknown; "offload needs zero = 3" would be noise."""
    text = "mesh dp=*\ndata_parallel over dp {\n    zero = 3x\n    offload = params\n}\n"
    assert _errors(text) == [(3, "unexpected `3x`")]


def test_no_warnings_for_axes_after_an_unknown_axis() -> None:
    with pytest.raises(PlanError) as info:
        check_text("mesh tp=2\nmodules {\n    a: column over tq\n}\n", "w.plan")
    assert [d.severity for d in info.value.diagnostics] == ["error"]


def test_too_many_errors_stop() -> None:
    text = "mesh dp=2\n" + "what\n" * (MAX_SYNTAX_ERRORS + 10)
    with pytest.raises(PlanSyntaxError) as info:
        parse(text)
    assert len(info.value.diagnostics) == MAX_SYNTAX_ERRORS
    assert info.value.stopped
    assert str(info.value).endswith(
        f"\n... stopped after {MAX_SYNTAX_ERRORS} errors: the rest of the file is not checked"
    )


def test_parse_recovering_returns_what_parsed() -> None:
    tree, errors = parse_recovering("mesh dp=2\nmodules {\n    a: replicat\n    b: replicate\n}\n")
    assert [d.message for d in errors] == ["unexpected `replicat`"]
    assert tree.statements[1] == A.ModulesBlock((A.Rule(A.Pattern("b"), A.Replicate()),))


@pytest.mark.parametrize(
    ("text", "message", "hint"),
    [
        ("meshdp=2\n", "unexpected `meshdp` at the start of a statement", "did you mean `mesh`?"),
        (
            "mesh tp=2\nmodules {\n    a: columnovertp\n}\n",
            "unexpected `columnovertp`",
            "did you mean `column`?",
        ),
        ("mesh tp=2\nmodules {\n    a: column overtp\n}\n", "unexpected `overtp`", "did you mean `over`?"),
        (
            "mesh dp=2\ndata_parallel over dp {\n    zero = 1x\n}\n",
            "unexpected `1x`",
            "expected a whole number",
        ),
        (
            "mesh pp=2\npipeline over pp {\n    schedule = 1f1bx\n}\n",
            "unexpected `1f1bx`",
            "did you mean `1f1b`?",
        ),
    ],
)
def test_words_must_be_separated(text: str, message: str, hint: str) -> None:
    """Lark's contextual lexer would read `columnovertp` as `column over tp`."""
    with pytest.raises(PlanSyntaxError) as info:
        parse(text)
    (d,) = info.value.diagnostics
    assert (d.message, d.hint) == (message, hint)


def test_expected_tokens_are_exact_not_lalr_merged() -> None:
    """`over tp` ends a rule here; `(` (experts) and `{` (block header) cannot follow."""
    with pytest.raises(PlanSyntaxError) as info:
        parse("mesh tp=2\nmodules {\n    a: column over tp tp\n}\n")
    assert info.value.diagnostics[0].hint == "expected `}` or end of line"


def test_excerpt_lines_are_counted_like_the_parser_counts_them() -> None:
    """A form feed or U+2028 in a comment is not a line break for the parser, nor for the excerpt."""
    for odd in ["\x0c", "\u2028", "\x85"]:
        with pytest.raises(PlanError) as info:
            check_text(f"mesh tp=2  # a{odd}b\nmodules {{\n    a: column over tq\n}}\n", "x.plan")
        rendered = str(info.value)
        assert "\n        a: column over tq\n" in rendered, repr(odd)


# ---------------------------------------------------------------------------- only PlanError leaves


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n\n",
        "#",
        "{",
        "}",
        "{}",
        "mesh",
        "mesh dp=",
        "mesh dp=*,",
        "mesh =2",
        "mesh dp=2\x00",
        "mesh dp=2\x0c",
        "mesh dp=2\r",
        "mesh dp=2\u2028modules {}",
        "\ufeffmesh dp=2",
        "mesh dp=2\nmodules { a: column over dp }",
        "mesh dp=2\nmodules {\n  {{}}: replicate\n}",
        "mesh dp=2\nmodules {\n  a.{: replicate\n}",
        "mesh dp=2\nmodules {\n  a}: replicate\n}",
        "mesh dp=2\nmodules {\n  .: replicate\n}",
        "mesh dp=2\nmodules {\n  a: experts over dp (top_k=1e999)\n}",
        "mesh dp=2\nmodules {\n  a: checkpoint every 99999999999999999999\n}",
        "mesh dp=2\nmodules {\n  a.{0..99999999999}: replicate\n}",
        "mesh dp=2\nprecision {\n  loss_scale = 1e999\n}",
        "mesh dp=2\ndata_parallel over dp {\n  bucket = 99999999999999999999999GiB\n}",
        "mesh dp=2" + "\n" * 10_000 + "}",
        "mesh dp=2\n" + "modules {\n" * 100,
        "mesh " + ", ".join(f"a{i}=1" for i in range(2000)),
        "x" * 100_000,
        "é" * 1000,
    ],
)
def test_weird_input_raises_only_plan_errors(text: str) -> None:
    for run in (lambda: parse(text, "w.plan"), lambda: check_text(text, "w.plan")):
        try:
            run()
        except PlanError as e:
            assert e.diagnostics
            str(e)


def test_lark_exceptions_do_not_chain_into_plan_errors() -> None:
    with pytest.raises(PlanSyntaxError) as info:
        parse("mesh dp=2\nmodules {\n    a: colum over dp\n}\n")
    assert info.value.__cause__ is None
    assert "lark" not in type(info.value).__module__


def test_text_larger_than_the_limit_is_refused() -> None:
    with pytest.raises(PlanFileError, match="larger than"):
        parse("#" * (MAX_PLAN_BYTES + 1))


@pytest.mark.parametrize(
    ("data", "message", "where"),
    [
        (b"mesh dp=2\n\x00", "NUL byte", (2, 1)),
        (b"mesh dp=2\n# \xff\n", "not UTF-8 text (byte 0xff)", (2, 3)),
        (b"mesh dp=2 # caf\xc3", "not UTF-8 text (byte 0xc3)", (1, 16)),
    ],
)
def test_undecodable_bytes(data: bytes, message: str, where: tuple[int, int]) -> None:
    with pytest.raises(PlanFileError, match=re.escape(message)) as info:
        decode_plan_bytes(data, "b.plan")
    span = info.value.diagnostics[0].span
    assert (span.line, span.col) == where
    assert "^" in str(info.value)  # the offending line is shown


def test_did_you_mean_short_names():
    from meshplan.dsl.errors import did_you_mean

    assert did_you_mean("tq", ["dp", "tp"]) == "tp"
    assert did_you_mean("pp", ["dp", "tp"]) is None  # one edit from both: no guess
    assert did_you_mean("colum", ["column", "row"]) == "column"
