"""The plan language's grammar, shipped as data: `plan.lark` is the reference."""

from importlib.resources import files


def grammar_text() -> str:
    """Return the text of `plan.lark`."""
    return files(__name__).joinpath("plan.lark").read_text(encoding="utf-8")
