"""Every bound the front end puts on a plan's input, and reading a plan file within them.

A plan is a page of text. The bounds make sure that no input of up to 1 MiB keeps the
checker busy for long: at most `MAX_PLAN_LINES` lines and `MAX_PLAN_TOKENS` tokens (words,
numbers and symbols; a real plan has a few hundred), `MAX_SYNTAX_ERRORS` errors, and
`MAX_PARSE_WORK` tokens parsed in all, counting the parses again after each error
(`dsl.lalr` counts the tokens, `dsl.parser` the errors). Numbers and names have bounds too,
so that an absurd value is a user mistake reported at its token, not a crash.
"""

from __future__ import annotations

from pathlib import Path

from .errors import Diagnostic, PlanFileError, Span

MAX_PLAN_BYTES = 1 << 20  # a plan is a page of text; 1 MiB is a mistake, not a plan
MAX_PLAN_LINES = 10_000
MAX_PLAN_TOKENS = 50_000  # the largest example plan has 119
MAX_PARSE_WORK = 3 * MAX_PLAN_TOKENS
MAX_SYNTAX_ERRORS = 50
MAX_INT = 10**12 - 1  # the largest number a plan holds: 12 digits
FP32_MAX = 3.4028234663852886e38  # but a loss scale multiplies an fp32 loss: up to fp32's largest
MAX_NAME = 100  # characters of an axis or setting name: `dp`, `capacity_factor`
MAX_BUCKET_BYTES = 1 << 40


def read_plan_text(path: str | Path) -> str:
    """Read a plan file as text, turning every way a file can be unreadable into a located error."""
    name = str(path)
    origin = Span(name, 1, 1, 1, 1)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except FileNotFoundError:
        raise PlanFileError([Diagnostic(origin, "no such plan file", hint="check the path")]) from None
    except IsADirectoryError:
        raise PlanFileError([Diagnostic(origin, "is a directory, not a plan file")]) from None
    except OSError as e:
        raise PlanFileError([Diagnostic(origin, f"cannot read plan file: {e.strerror}")]) from None
    if len(data) > MAX_PLAN_BYTES:
        raise PlanFileError(
            [
                Diagnostic(
                    origin,
                    f"plan file is larger than {MAX_PLAN_BYTES // 1024} KiB",
                    hint="a plan describes a layout in a few dozen lines; is this the right file?",
                )
            ]
        )
    return decode_plan_bytes(data, name)


def decode_plan_bytes(data: bytes, name: str) -> str:
    nul = data.find(b"\x00")
    if nul >= 0:
        span = _span_of_offset(data[:nul].decode("utf-8", "replace"), name, nul)
        raise PlanFileError(
            [
                Diagnostic(
                    span,
                    "plan file contains a NUL byte: this looks like a binary file",
                    hint="a plan is UTF-8 text",
                )
            ],
            {name: _excerpt_text(data, span.line)},
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        span = _span_of_offset(data[: e.start].decode("utf-8", "replace"), name, e.start)
        raise PlanFileError(
            [
                Diagnostic(
                    span,
                    f"plan file is not UTF-8 text (byte 0x{data[e.start]:02x})",
                    hint="save the plan as UTF-8",
                )
            ],
            {name: _excerpt_text(data, span.line)},
        ) from None
    return text.removeprefix("\ufeff")


def _excerpt_text(data: bytes, line: int) -> str:
    """Text in which line `line` is the offending line of undecodable bytes, decoded leniently."""
    offending = data.split(b"\n", line)[line - 1]
    return "\n" * (line - 1) + offending.decode("utf-8", "replace")


def _span_of_offset(prefix: str, name: str, offset: int) -> Span:
    line = prefix.count("\n") + 1
    col = len(prefix) - (prefix.rfind("\n") + 1) + 1
    return Span(name, line, col, line, col + 1)


def check_length(text: str, path: str) -> None:
    """A plan of more than `MAX_PLAN_LINES` lines is refused before parsing, at the first line too many."""
    if text.count("\n", 0, len(text) - 1) < MAX_PLAN_LINES:
        return
    line = MAX_PLAN_LINES + 1
    raise PlanFileError(
        [
            Diagnostic(
                Span(path, line, 1, line, 2),
                f"plan is too long: more than {MAX_PLAN_LINES:,} lines",
                hint="a plan describes a layout in a few dozen lines; is this the right file?",
            )
        ],
        {path: text},
    )
