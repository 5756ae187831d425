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


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def share(text: str) -> float:
    """A share of something, from 0 to below 1: `0.08` is 8%."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share from 0 to below 1 (0.08 is 8%)")
    return value


def memory_size(text: str) -> int:
    """`80GiB`, `141GB`, `512MiB`, `1.5TiB` or a count of bytes -> bytes."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GiB, 141GB or 512MiB, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value
