"""The plan language's grammar, shipped as data: `plan.lark` is the reference.

A leaf that every layer may import: `dsl` parses with the grammar and `runtime` builds the
schedules it names, and neither imports the other.
"""

from importlib.resources import files

# The pipeline schedules a plan can name (`schedule = 1f1b`), in the grammar's order: the
# checker and `runtime.schedules.build` read this list; `plan.lark` spells the names out
# too, and tests/dsl/test_schedule_names.py holds the two equal.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")


def grammar_text() -> str:
    """Return the text of `plan.lark`."""
    return files(__name__).joinpath("plan.lark").read_text(encoding="utf-8")
