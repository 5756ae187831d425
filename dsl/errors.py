"""Diagnostics: located errors and warnings, and how they are printed.

Every problem a user can cause is a `Diagnostic` with a `Span`. The front end
collects all of them for a file and raises one `PlanError` carrying the list,
sorted by position. Rendering looks like a compiler's:

    llama.plan:7:5: error: rule "layers.*.mlp.w4" matches no module
        layers.*.mlp.w4: column over tp
        ^~~~~~~~~~~~~~~
    hint: modules under layers.0.mlp are: gate_proj, up_proj, down_proj

A file can hold thousands of mistakes (a generated plan, the wrong file): rendering shows
the first `MAX_SHOWN` and one line counting the rest, and every printed line is cut at
`MAX_LINE` characters, so the output stays a screenful whatever the input.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

Severity = Literal["error", "warning"]

MAX_SHOWN = 50  # diagnostics rendered; the rest are counted in one line
MAX_LINE = 300  # characters of a message, hint or note line; user text in them can be long


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
    """A plan that cannot be used; carries the diagnostics of the file.

    `more_errors`, `more_warnings`: found but not kept (a checker keeps the first `MAX_KEPT`
    of each by position and counts the rest). `stopped`: the parser gave up before the end
    of the file, so there may be more errors than anyone counted.
    """

    def __init__(
        self,
        diagnostics: Sequence[Diagnostic],
        sources: dict[str, str] | None = None,
        *,
        more_errors: int = 0,
        more_warnings: int = 0,
        stopped: bool = False,
    ):
        self.diagnostics = tuple(sorted(diagnostics, key=Diagnostic.sort_key))
        self.sources = dict(sources or {})
        self.more_errors = more_errors
        self.more_warnings = more_warnings
        self.stopped = stopped
        super().__init__(self.render(color=False))

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")

    @property
    def num_errors(self) -> int:
        """Every error found, kept or only counted."""
        return len(self.errors) + self.more_errors

    @property
    def num_warnings(self) -> int:
        return len(self.diagnostics) - len(self.errors) + self.more_warnings

    def render(self, *, color: bool = False) -> str:
        return render_diagnostics(
            self.diagnostics,
            self.sources,
            color=color,
            more_errors=self.more_errors,
            more_warnings=self.more_warnings,
            stopped=self.stopped,
        )

    def summary(self) -> str:
        """`llama.plan: 3 errors, 1 warning`: the line that ends the rendered diagnostics."""
        n_err, n_warn = self.num_errors, self.num_warnings
        paths = sorted({d.span.path for d in self.diagnostics})
        counts = ("at least " if self.stopped else "") + f"{n_err:,} error{'s' * (n_err != 1)}"
        if n_warn:
            counts += f", {n_warn:,} warning{'s' * (n_warn != 1)}"
        return f"{', '.join(paths)}: {counts}"


class PlanSyntaxError(PlanError):
    """The text is not a plan: lexing or parsing failed."""


class PlanValidationError(PlanError):
    """The plan parses but says something impossible or contradictory."""


class PlanFileError(PlanError):
    """The file cannot be read as plan text: missing, binary, too large, not UTF-8."""


MAX_KEPT = 1000  # diagnostics of each severity a checker keeps; far more than anyone reads


class Collector:
    """Diagnostics as a checker finds them, keeping the first `MAX_KEPT` of each severity by
    position and counting the rest, so a file with a mistake on every line costs bounded
    memory and sorting time.
    """

    def __init__(self) -> None:
        self._kept: dict[str, list[Diagnostic]] = {"error": [], "warning": []}
        self.more: dict[str, int] = {"error": 0, "warning": 0}

    def add(self, d: Diagnostic) -> None:
        kept = self._kept[d.severity]
        kept.append(d)
        if len(kept) >= 2 * MAX_KEPT:  # amortized: sort and cut once per MAX_KEPT additions
            kept.sort(key=Diagnostic.sort_key)
            self.more[d.severity] += len(kept) - MAX_KEPT
            del kept[MAX_KEPT:]

    def of(self, severity: Severity) -> list[Diagnostic]:
        """The kept diagnostics of one severity, by position; `more[severity]` counts the others."""
        kept = self._kept[severity]
        kept.sort(key=Diagnostic.sort_key)
        if len(kept) > MAX_KEPT:
            self.more[severity] += len(kept) - MAX_KEPT
            del kept[MAX_KEPT:]
        return list(kept)


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
    diagnostics: Iterable[Diagnostic],
    sources: dict[str, str],
    *,
    color: bool = False,
    limit: int = MAX_SHOWN,
    more_errors: int = 0,
    more_warnings: int = 0,
    stopped: bool = False,
) -> str:
    """Render diagnostics in the compiler style, one block each, blocks joined by newlines.

    At most `limit` are shown, in position order; when some must go, errors are kept before
    warnings. One last line counts what is not shown: those cut here and `more_errors` /
    `more_warnings` that were found but not kept. `stopped`: the parser gave up early, so
    the count is a lower bound.
    """
    items = sorted(diagnostics, key=Diagnostic.sort_key)
    errors = [d for d in items if d.severity == "error"]
    warnings = [d for d in items if d.severity != "error"]
    shown_errors = errors[:limit]
    shown_warnings = warnings[: limit - len(shown_errors)]
    shown = items
    if len(items) > limit:
        shown = sorted(shown_errors + shown_warnings, key=Diagnostic.sort_key)
    blocks = [render_diagnostic(d, sources.get(d.span.path), color=color) for d in shown]
    hidden_errors = len(errors) - len(shown_errors) + more_errors
    hidden_warnings = len(warnings) - len(shown_warnings) + more_warnings
    found = len(errors) + more_errors if stopped else None
    tail = _tail_line(hidden_errors, hidden_warnings, len(shown), stopped_after=found)
    if tail:
        blocks.append(tail)
    return "\n".join(blocks)


def _tail_line(errors: int, warnings: int, shown: int, *, stopped_after: int | None) -> str:
    """`... and 8,949 more errors (first 50 shown)`: what the rendering leaves out.
    `stopped_after`: the number of errors after which the parser gave up, if it did."""
    counts = [
        f"{n:,} more {word}{'s' * (n != 1)}" for n, word in ((errors, "error"), (warnings, "warning")) if n
    ]
    line = f"... and {' and '.join(counts)} (first {shown:,} shown)" if counts else ""
    if stopped_after is not None:
        stop = f"stopped after {stopped_after:,} error{'s' * (stopped_after != 1)}: the rest of the file is not checked"
        line = f"{line}; {stop}" if line else f"... {stop}"
    return line


def render_diagnostic(d: Diagnostic, source: str | None, *, color: bool = False) -> str:
    def paint(text: str, kind: str) -> str:
        return f"{_COLORS.get(kind, _BOLD)}{text}{_RESET}" if color else text

    lines = [f"{paint(str(d.span) + ':', 'bold')} {paint(d.severity + ':', d.severity)} {_cut(d.message)}"]
    lines += _excerpt(d.span, source)
    for span, note in d.related:
        lines.append(f"{paint(str(span) + ':', 'bold')} {paint('note:', 'note')} {_cut(note)}")
        lines += _excerpt(span, source if span.path == d.span.path else None)
    if d.hint:
        lines.append(f"{paint('hint:', 'hint')} {_cut(d.hint)}")
    return "\n".join(lines)


def _cut(text: str) -> str:
    """A message, note or hint cut to `MAX_LINE` characters: a name or list in it can be huge."""
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


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
    text = text_lines[span.line - 1]
    start = 0
    if len(text) > 200:  # keep huge single-line files readable (and cut before copying)
        start = max(0, span.col - 60)
        text = text[start : start + 160]
    text = text.expandtabs(1)  # one column per tab, as the parser counts them
    col = span.col - start
    end = span.end_col - start if span.end_line == span.line else len(text) + 1
    width = max(1, min(end, len(text) + 1) - col)
    caret = " " * (col - 1) + "^" + "~" * (width - 1)
    return ["    " + _printable(text), "    " + caret]


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c == " " else "?" for c in text)
