"""Diagnostics: located errors and warnings, and how they are printed.

Every problem a user can cause is a `Diagnostic` with a `Span`. The front end
collects all of them for a file and raises one `PlanError` carrying the list,
sorted by position. Rendering looks like a compiler's:

    llama.plan:7:5: error: rule "layers.*.mlp.w4" matches no module
        layers.*.mlp.w4: column over tp
        ^~~~~~~~~~~~~~~
    hint: modules under layers.0.mlp are: gate_proj, up_proj, down_proj
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """A range of source text; lines and columns count from 1, `end_col` is exclusive."""

    path: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One located message. `hint` says what to do about it."""

    span: Span
    message: str
    hint: str | None = None
    severity: Severity = "error"
    # Other places worth showing, e.g. the first of two conflicting rules.
    related: tuple[tuple[Span, str], ...] = field(default=())

    def sort_key(self) -> tuple[str, int, int, str]:
        return (self.span.path, self.span.line, self.span.col, self.message)


class PlanError(ValueError):
    """A plan that cannot be used; carries every diagnostic of the file."""

    def __init__(self, diagnostics: Sequence[Diagnostic], sources: dict[str, str] | None = None):
        self.diagnostics = tuple(sorted(diagnostics, key=Diagnostic.sort_key))
        self.sources = dict(sources or {})
        super().__init__(self.render(color=False))

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")

    def render(self, *, color: bool = False) -> str:
        return render_diagnostics(self.diagnostics, self.sources, color=color)


class PlanSyntaxError(PlanError):
    """The text is not a plan: lexing or parsing failed."""


class PlanValidationError(PlanError):
    """The plan parses but says something impossible or contradictory."""


class PlanFileError(PlanError):
    """The file cannot be read as plan text: missing, binary, too large, not UTF-8."""


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """The closest choice to `word`, if one is close enough to be a likely typo.

    Short names (mesh axes: `tp`, `dp`) are too short for a similarity ratio, so the one
    choice a single edit away (`tq` for `tp`) also counts.
    """
    options = list(choices)
    matches = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if matches:
        return matches[0]
    near = [c for c in options if _one_edit(word, c)]
    return near[0] if len(near) == 1 else None  # `pp` is as close to `dp` as to `tp`: no guess


def _one_edit(a: str, b: str) -> bool:
    """True if one substitution, insertion or deletion turns `a` into `b`."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def one_of(choices: Iterable[str]) -> str:
    """`a, b or c`, for messages."""
    items = [str(c) for c in choices]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


_COLORS = {"error": "\x1b[1;31m", "warning": "\x1b[1;35m", "note": "\x1b[1;36m", "hint": "\x1b[1;32m"}
_BOLD, _RESET = "\x1b[1m", "\x1b[0m"


def render_diagnostics(
    diagnostics: Iterable[Diagnostic], sources: dict[str, str], *, color: bool = False
) -> str:
    """Render diagnostics in the compiler style, one block each, blocks joined by newlines."""
    blocks = [render_diagnostic(d, sources.get(d.span.path), color=color) for d in diagnostics]
    return "\n".join(blocks)


def render_diagnostic(d: Diagnostic, source: str | None, *, color: bool = False) -> str:
    def paint(text: str, kind: str) -> str:
        return f"{_COLORS.get(kind, _BOLD)}{text}{_RESET}" if color else text

    lines = [f"{paint(str(d.span) + ':', 'bold')} {paint(d.severity + ':', d.severity)} {d.message}"]
    lines += _excerpt(d.span, source)
    for span, note in d.related:
        lines.append(f"{paint(str(span) + ':', 'bold')} {paint('note:', 'note')} {note}")
        lines += _excerpt(span, source if span.path == d.span.path else None)
    if d.hint:
        lines.append(f"{paint('hint:', 'hint')} {d.hint}")
    return "\n".join(lines)


@lru_cache(maxsize=4)  # every diagnostic of a file shows a line of the same source
def _source_lines(source: str) -> tuple[str, ...]:
    # split as the parser counts lines: at `\n` only (`str.splitlines` also splits at `\f`, U+2028, ...)
    return tuple(line.removesuffix("\r") for line in source.split("\n"))


def _excerpt(span: Span, source: str | None) -> list[str]:
    """The span's first line, indented, with a caret and tildes under the span."""
    if source is None:
        return []
    text_lines = _source_lines(source)
    if not 1 <= span.line <= len(text_lines) or not text_lines[span.line - 1].strip():
        return []  # nothing to point at (an empty file)
    text = text_lines[span.line - 1].expandtabs(1)
    if len(text) > 200:  # keep huge single-line files readable
        start = max(0, span.col - 60)
        text, col = text[start : start + 160], span.col - start
    else:
        col = span.col
    end = span.end_col if span.end_line == span.line else len(text) + 1
    width = max(1, min(end, len(text) + 1) - col)
    caret = " " * (col - 1) + "^" + "~" * (width - 1)
    return ["    " + _printable(text), "    " + caret]


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c == " " else "?" for c in text)
