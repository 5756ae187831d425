"""The canonical formatter: examples are canonical, formatting is idempotent, means the same
thing as the source, and keeps every comment where it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.dsl import parse
from meshplan.dsl.fmt import MAX_ALIGN, action_text, format_plan

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.plan"))


def fmt(text: str) -> str:
    out = format_plan(parse(text, "f.plan"), text)
    assert parse(out, "f.plan") == parse(text, "f.plan"), "formatting changed the meaning"
    assert format_plan(parse(out, "f.plan"), out) == out, "formatting is not idempotent"
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_canonical(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert fmt(text) == text


MESSY = """\
# A plan written in a hurry.


mesh   dp = * ,pp=2,\ttp=2   # trailing on mesh
modules{
layers.*.self_attn.{q,k,v}_proj :column   over tp
\tlayers.*.self_attn.o_proj:row over tp   # row
    layers.*.mlp.experts:experts over dp(top_k=2,capacity_factor=1.25)



    layers.*:checkpoint   selective   every 2
  norm: precision fp32}
pipeline over pp{schedule=1f1b
microbatches=8
    cut   before   layers.1 # cut
}
data_parallel   over dp {
    zero=1
    bucket = 25 MB
    offload=optimizer,params
}
precision {   # precision
compute=bf16
  }
train { gradient_accumulation = 2 }
# the end
"""

CANONICAL = """\
# A plan written in a hurry.

mesh dp=*, pp=2, tp=2  # trailing on mesh

modules {
    layers.*.self_attn.{q,k,v}_proj: column over tp
    layers.*.self_attn.o_proj:       row over tp  # row
    layers.*.mlp.experts:            experts over dp (top_k=2, capacity_factor=1.25)

    layers.*: checkpoint selective every 2
    norm:     precision fp32
}

pipeline over pp {
    schedule = 1f1b
    microbatches = 8
    cut before layers.1  # cut
}

data_parallel over dp {
    zero = 1
    bucket = 25MB
    offload = optimizer, params
}

precision {  # precision
    compute = bf16
}

train {
    gradient_accumulation = 2
}
# the end
"""


def test_messy_plan_formats_to_canonical_text() -> None:
    assert fmt(MESSY) == CANONICAL


# ---------------------------------------------------------------------------- comments


def test_comment_before_the_first_statement_keeps_its_blank_line() -> None:
    assert fmt("# header\n\nmesh dp=2\n") == "# header\n\nmesh dp=2\n"
    assert fmt("# attached\nmesh dp=2\n") == "# attached\nmesh dp=2\n"


def test_leading_blank_lines_are_dropped() -> None:
    assert fmt("\n\n\n# header\n\n\n\nmesh dp=2\n") == "# header\n\nmesh dp=2\n"


def test_trailing_comments_are_kept_two_spaces_after_the_code() -> None:
    assert fmt("mesh dp=2 # a # b\n") == "mesh dp=2  # a # b\n"
    text = "mesh dp=2\ndata_parallel over dp {   #   header\n    zero = 1#z\n}  # closing\n"
    assert fmt(text) == "mesh dp=2\n\ndata_parallel over dp {  #   header\n    zero = 1  #z\n}  # closing\n"


def test_comments_inside_blocks_stay_inside() -> None:
    text = (
        "mesh tp=2\n"
        "\n"
        "modules {\n"
        "    # first\n"
        "    a: column over tp\n"
        "    # between\n"
        "    bb: row over tp\n"
        "\n"
        "    # after a blank line\n"
        "    ccc: replicate\n"
        "    # last, before the brace\n"
        "}\n"
    )
    assert fmt(text) == text


def test_only_comments_in_a_block() -> None:
    assert fmt("mesh dp=2\ntrain {\n  # nothing yet\n}\n") == "mesh dp=2\n\ntrain {\n    # nothing yet\n}\n"


def test_comment_at_end_of_file() -> None:
    assert fmt("mesh dp=2\n# end") == "mesh dp=2\n# end\n"
    assert fmt("mesh dp=2\n\n\n# end\n\n\n") == "mesh dp=2\n\n# end\n"


def test_comment_above_a_statement_stays_attached_to_it() -> None:
    assert fmt("mesh dp=2\n# about train\ntrain {}\n") == "mesh dp=2\n\n# about train\ntrain {\n}\n"
    assert fmt("mesh dp=2\n# floating\n\ntrain {}\n") == "mesh dp=2\n\n# floating\n\ntrain {\n}\n"


def test_one_line_block_trailing_comment_is_not_duplicated() -> None:
    out = fmt("mesh dp=2\ntrain { gradient_accumulation = 2 }  # c\n")
    assert out == "mesh dp=2\n\ntrain {  # c\n    gradient_accumulation = 2\n}\n"


def test_closing_brace_on_an_entry_line_moves_down_and_keeps_the_comment() -> None:
    out = fmt("mesh dp=2\ntrain {\n    gradient_accumulation = 2 }  # c\n")
    assert out == "mesh dp=2\n\ntrain {\n    gradient_accumulation = 2  # c\n}\n"


def test_comments_with_unusual_characters_are_kept_whole() -> None:
    """`str.splitlines` splits at form feed and U+2028; the parser does not. Neither may fmt."""
    for odd in ["\x0c", "\u2028", "\x85", "\r", "\x1c"]:
        text = f"mesh dp=2  # a{odd}b\n\ndata_parallel over dp {{\n    zero = 1  # z\n}}\n"
        assert fmt(text) == text, repr(odd)


def test_crlf_becomes_lf() -> None:
    assert fmt("mesh dp=2  # c\r\n\r\ntrain {\r\n}\r\n") == "mesh dp=2  # c\n\ntrain {\n}\n"


# ---------------------------------------------------------------------------- blank lines and layout


def test_statements_are_separated_by_one_blank_line() -> None:
    assert fmt("mesh dp=2\ntrain {}\nprecision {}\n") == "mesh dp=2\n\ntrain {\n}\n\nprecision {\n}\n"
    assert fmt("mesh dp=2\n\n\n\ntrain {}\n") == "mesh dp=2\n\ntrain {\n}\n"


def test_blank_lines_inside_blocks_are_kept_at_most_one() -> None:
    text = "mesh pp=2\npipeline over pp {\n\n\n    schedule = gpipe\n\n\n\n    microbatches = 2\n\n}\n"
    assert fmt(text) == "mesh pp=2\n\npipeline over pp {\n    schedule = gpipe\n\n    microbatches = 2\n}\n"


def test_consecutive_rules_are_aligned_per_paragraph() -> None:
    text = "mesh tp=2\nmodules {\n  a: column over tp\n  long.name: row over tp\n\n  b: replicate\n}\n"
    assert fmt(text) == (
        "mesh tp=2\n\nmodules {\n    a:         column over tp\n    long.name: row over tp\n\n    b: replicate\n}\n"
    )


def test_a_huge_pattern_is_not_aligned_to() -> None:
    """Padding 3,000 rules to one 300 KB pattern wrote 1 GB; past MAX_ALIGN characters a
    pattern is neither padded nor pads the others, and the result is still canonical."""
    long = "a" * (MAX_ALIGN + 1)
    text = f"mesh tp=2\nmodules {{\n  b: row over tp\n  {long}: row over tp\n  cc: row over tp\n}}\n"
    out = fmt(text)
    assert f"\n    b:  row over tp\n    {long}: row over tp\n    cc: row over tp\n" in out
    assert fmt(out) == out
    huge = "mesh tp=2\nmodules {\n" + "a" * 300_000 + ": row over tp\n" + "b: row over tp\n" * 3000 + "}\n"
    assert len(fmt(huge)) < 2 * len(huge)


def test_sizes_and_numbers_keep_their_written_form() -> None:
    text = "mesh dp=2\ndata_parallel over dp {\n    bucket = 1.50 MiB\n}\nprecision {\n    loss_scale = 6.5E4\n}\n"
    out = fmt(text)
    assert "bucket = 1.50MiB\n" in out
    assert "loss_scale = 6.5E4\n" in out


def test_formatting_is_idempotent_on_every_action() -> None:
    actions = [
        "column over tp",
        "replicate",
        "context ulysses over tp",
        "experts over tp (top_k=1)",
        "experts over dp x ep x tp (top_k=2)",
        "checkpoint",
        "checkpoint full every 1",
        "checkpoint every 0",  # invalid, but the formatter must not drop it
        "on cuda:0",
        "on cpu",
        "precision bf16",
    ]
    for action in actions:
        out = fmt(f"mesh tp=2\nmodules {{\n    a: {action}\n}}\n")
        assert f"    a: {action}\n" in out
        block = parse(out).statements[1]
        assert action_text(block.rules[0].action) == action  # type: ignore[union-attr]
