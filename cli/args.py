"""Argument types shared by the `meshplan` commands."""

import argparse


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "must be at least 1")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "must be 0 or more")


def _int_at_least(text: str, low: int, message: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{message}, got {value}")
    return value


class DefaultInt(int):
    """An option's default value, told apart from the same number given on the command line
    (`meshplan run DIR` takes the shapes it was compiled for unless they are given)."""


class DefaultStr(str):
    """An option's default text, told apart from the same text given on the command line."""


def given(value: object) -> bool:
    """Whether an option's value came from the command line rather than its default."""
    return value is not None and not isinstance(value, (DefaultInt, DefaultStr))
