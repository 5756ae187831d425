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
