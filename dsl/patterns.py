"""Module-path globs: `layers.*.self_attn.{q,k,v}_proj`, `layers.{0..3}`, `**.experts`.

A pattern is a dotted path; each segment is matched against one module-path segment:

    *        any text within one segment (`*` alone: any one segment; `*_proj`: a suffix)
    **       any number of whole segments, including none (must be a segment by itself)
    {a,b}    one of the alternatives           {0..3}   an integer in the inclusive range

Precedence between rules that match the same module is by specificity (see `specificity`):
the most specific pattern wins; equally specific patterns that disagree are a conflict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

_WORD = re.compile(r"[A-Za-z0-9_]+")
_RANGE = re.compile(r"(-?[0-9]+)\.\.(-?[0-9]+)")
MAX_RANGE = 100_000


class PatternSyntaxError(ValueError):
    """A malformed pattern; `offset` is the character index of the problem within the pattern."""

    def __init__(self, message: str, offset: int, length: int = 1, hint: str | None = None):
        super().__init__(message)
        self.offset, self.length, self.hint = offset, length, hint


@dataclass(frozen=True)
class Glob:
    """A compiled pattern. Build with `Glob.compile(text)`."""

    text: str
    regex: re.Pattern[str]
    literal_segments: int
    literal_chars: int
    double_stars: int

    @staticmethod
    def compile(text: str) -> Glob:
        segments = _split_segments(text)
        parts: list[str] = []
        literal_segments = literal_chars = double_stars = 0
        for seg, offset in segments:
            if seg == "**":
                double_stars += 1
                parts.append(r"(?:\.[^.]+)*")
                continue
            if "**" in seg:
                i = seg.index("**")
                raise PatternSyntaxError(
                    "`**` must be a whole path segment",
                    offset + i,
                    2,
                    hint="write `a.**.b`, or `*` for part of a segment",
                )
            regex, literal, chars = _segment_regex(seg, offset)
            literal_segments += literal
            literal_chars += chars
            parts.append(r"\." + regex)
        return Glob(text, re.compile("".join(parts)), literal_segments, literal_chars, double_stars)

    def matches(self, path: str) -> bool:
        return self.regex.fullmatch("." + path) is not None

    @cached_property
    def specificity(self) -> tuple[int, int, int]:
        """Higher is more specific: literal segments, then literal characters, then fewer `**`."""
        return (self.literal_segments, self.literal_chars, -self.double_stars)

    @cached_property
    def literal_prefix(self) -> str:
        """The leading segments without any wildcard, e.g. `layers` for `layers.*.mlp`."""
        out = []
        for seg, _ in _split_segments(self.text):
            if not _WORD.fullmatch(seg):
                break
            out.append(seg)
        return ".".join(out)


def _split_segments(text: str) -> list[tuple[str, int]]:
    """Split on dots outside braces; returns (segment, offset) pairs."""
    if not text:
        raise PatternSyntaxError("empty module pattern", 0)
    segments, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth:
                raise PatternSyntaxError("braces cannot nest", i)
            depth = 1
        elif ch == "}":
            if not depth:
                raise PatternSyntaxError("`}` without `{`", i)
            depth = 0
        elif ch == "." and not depth:
            segments.append((text[start:i], start))
            start = i + 1
    if depth:
        raise PatternSyntaxError("unclosed `{`", text.rindex("{"), hint="close it: `{q,k,v}`")
    segments.append((text[start:], start))
    for seg, offset in segments:
        if not seg:
            raise PatternSyntaxError(
                "empty path segment", offset, hint="segments are separated by single dots"
            )
    return segments


def _segment_regex(seg: str, offset: int) -> tuple[str, int, int]:
    """Regex for one segment, whether it is fully literal, and its count of literal characters."""
    out, i, literal, chars = [], 0, True, 0
    while i < len(seg):
        ch = seg[i]
        if ch == "*":
            out.append(r"[^.]*")
            literal = False
            i += 1
        elif ch == "{":
            close = seg.index("}", i)
            out.append(_brace_regex(seg[i + 1 : close], offset + i))
            i = close + 1
        else:
            m = _WORD.match(seg, i)
            if not m:
                raise PatternSyntaxError(f"unexpected character `{ch}` in module pattern", offset + i)
            out.append(re.escape(m.group(0)))
            chars += len(m.group(0))
            i = m.end()
    return "".join(out), int(literal), chars


def _brace_regex(body: str, offset: int) -> str:
    """`q,k,v` -> `(?:q|k|v)`; `0..3` -> `(?:0|1|2|3)`."""
    m = _RANGE.fullmatch(body)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo > hi:
            raise PatternSyntaxError(
                f"empty range {{{body}}}: {lo} is greater than {hi}",
                offset,
                len(body) + 2,
                hint=f"write {{{hi}..{lo}}}",
            )
        if hi - lo > MAX_RANGE:
            raise PatternSyntaxError(f"range {{{body}}} is too large", offset, len(body) + 2)
        return "(?:" + "|".join(str(n) for n in range(lo, hi + 1)) + ")"
    alternatives = body.split(",")
    for alt in alternatives:
        if not alt:
            raise PatternSyntaxError(
                "empty alternative in braces", offset, len(body) + 2, hint="write alternatives as `{q,k,v}`"
            )
        if not _WORD.fullmatch(alt):
            raise PatternSyntaxError(
                f"alternative `{alt}` is not a plain name",
                offset,
                len(body) + 2,
                hint="braces hold names `{q,k,v}` or an integer range `{0..3}`",
            )
    return "(?:" + "|".join(re.escape(a) for a in alternatives) + ")"
