"""One list of pipeline schedules, `meshplan.grammar.SCHEDULES`: the grammar admits exactly its
names, the checker accepts each, and the runtime builds each, so a name cannot be added to
one of them and forgotten in another."""

from __future__ import annotations

import pytest

from meshplan.dsl import PlanSyntaxError, check_text
from meshplan.dsl.lalr import lark_parser
from meshplan.grammar import SCHEDULES
from meshplan.runtime.schedules import build


def test_the_grammar_spells_out_exactly_the_schedules() -> None:
    parser = lark_parser()
    words = {t.name: t.pattern.value for t in parser.terminals}
    alternatives = [r.expansion for r in parser.rules if r.origin.name == "schedule_name"]
    assert all(len(symbols) == 1 for symbols in alternatives), alternatives
    assert tuple(words[symbols[0].name] for symbols in alternatives) == SCHEDULES


def _pipeline(schedule: str) -> str:
    return f"mesh pp=2\n\npipeline over pp {{\n    schedule = {schedule}\n}}\n"


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_checked_and_built(name: str) -> None:
    pipeline = check_text(_pipeline(name), "t.plan").pipeline
    assert pipeline is not None and pipeline.schedule == name
    built = build(name, ranks=2, microbatches=4, chunks=pipeline.virtual_stages)
    assert (built.ranks, built.microbatches) == (2, 4)


def test_a_schedule_outside_the_list_is_a_syntax_error() -> None:
    with pytest.raises(PlanSyntaxError, match="unexpected `pipedream`"):
        check_text(_pipeline("pipedream"), "t.plan")
