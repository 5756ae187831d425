"""Module-path globs: `layers.*.self_attn.{q,k,v}_proj`, `layers.{0..3}`, `**.experts`.

A pattern is a dotted path; each segment is matched against one module-path segment:

    *        any text within one segment (`*` alone: any one segment; `*_proj`: a suffix)
    **       any number of whole segments, including none (must be a segment by itself)
    {a,b}    one of the alternatives           {0..3}   an integer in the inclusive range

Precedence between rules that match the same module is by specificity (see `specificity`):
the most specific pattern wins; equally specific patterns that disagree are a conflict.

Matching keeps the set of positions a pattern can have reached, one part at a time, instead
of handing a regex to a backtracking engine: `*a*a*a*a*a*a*a*a*a*ax` against a long name of
`a`s takes steps in proportion to the pattern times the name, not minutes; and a range
compares numbers instead of listing them, so `{0..100000}` costs what `{0..3}` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

_WORD = re.compile(r"[A-Za-z0-9_]+")
_RANGE = re.compile(r"(-?[0-9]+)\.\.(-?[0-9]+)")
_DIGITS = re.compile(r"-?[0-9]{1,13}")  # 13 digits are more than any range bound has
_NUMBER = re.compile(r"0|-?[1-9][0-9]*")  # as `str(int)` writes it: `h.010` is not `h.10`
MAX_RANGE = 100_000
MAX_RANGE_BOUND = 10**12 - 1  # 12 digits, like every number in a plan
MAX_PATTERN = 1000  # characters; a module path is a few dozen


class PatternSyntaxError(ValueError):
    """A malformed pattern; `offset` is the character index of the problem within the pattern."""

    def __init__(self, message: str, offset: int, length: int = 1, hint: str | None = None):
        super().__init__(message)
        self.offset, self.length, self.hint = offset, length, hint


# The parts of one segment: literal text, `*`, `{a,b}` alternatives, an inclusive `{lo..hi}`.
@dataclass(frozen=True, slots=True)
class _Star:
    pass


@dataclass(frozen=True, slots=True)
class _Range:
    lo: int
    hi: int


_Part = str | _Star | tuple[str, ...] | _Range


@dataclass(frozen=True)
class Glob:
    """A compiled pattern. Build with `Glob.compile(text)`."""

    text: str
    segments: tuple[tuple[_Part, ...] | None, ...]  # None for `**`
    literal_segments: int
    literal_chars: int
    double_stars: int

    @staticmethod
    def compile(text: str) -> Glob:
        if len(text) > MAX_PATTERN:
            raise PatternSyntaxError(
                f"module pattern is longer than {MAX_PATTERN:,} characters",
                MAX_PATTERN,
                hint="a pattern is a dotted module path such as `layers.*.mlp`",
            )
        segments: list[tuple[_Part, ...] | None] = []
        literal_segments = literal_chars = double_stars = 0
        for seg, offset in _split_segments(text):
            if seg == "**":
                double_stars += 1
                segments.append(None)
                continue
            if "**" in seg:
                i = seg.index("**")
                raise PatternSyntaxError(
                    "`**` must be a whole path segment",
                    offset + i,
                    2,
                    hint="write `a.**.b`, or `*` for part of a segment",
                )
            parts, literal, chars = _segment_parts(seg, offset)
            literal_segments += literal
            literal_chars += chars
            segments.append(parts)
        return Glob(text, tuple(segments), literal_segments, literal_chars, double_stars)

    def matches(self, path: str) -> bool:
        names = path.split(".")
        reached = {0}  # how many path segments the pattern so far can have matched
        for seg in self.segments:
            if seg is None:  # `**`: any number of segments, none of them empty (`""` is the root)
                reached = _across(reached, names)
            else:
                reached = {i + 1 for i in reached if i < len(names) and _segment_matches(seg, names[i])}
            if not reached:
                return False
        return len(names) in reached

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


def _across(reached: set[int], names: list[str]) -> set[int]:
    """Where `**` can end, starting at any of `reached`."""
    out, going = set(), False
    for j in range(min(reached), len(names) + 1):
        going = going or j in reached
        if going:
            out.add(j)
        if j < len(names) and not names[j]:
            going = False
    return out


def _segment_matches(parts: tuple[_Part, ...], name: str) -> bool:
    """Whether one segment's parts match all of `name`: the set of positions in `name` each
    prefix of the parts can end at, part by part."""
    reached = {0}
    for part in parts:
        if isinstance(part, str):
            reached = {i + len(part) for i in reached if name.startswith(part, i)}
        elif isinstance(part, _Star):
            reached = set(range(min(reached), len(name) + 1))
        elif isinstance(part, tuple):
            reached = {i + len(a) for i in reached for a in part if name.startswith(a, i)}
        else:
            reached = {
                m.end() for i in reached for m in _numbers_at(name, i) if part.lo <= int(m[0]) <= part.hi
            }
        if not reached:
            return False
    return len(name) in reached


def _numbers_at(name: str, i: int) -> list[re.Match[str]]:
    """Every number written at `name[i:]`, shortest first: `-12` at 0 gives `-1`, `-12`."""
    m = _DIGITS.match(name, i)
    if not m:
        return []
    return [n for end in range(i + 1, m.end() + 1) if (n := _NUMBER.fullmatch(name, i, end))]


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


def _segment_parts(seg: str, offset: int) -> tuple[tuple[_Part, ...], int, int]:
    """The parts of one segment, whether it is fully literal, and its count of literal characters."""
    out: list[_Part] = []
    i, literal, chars = 0, True, 0
    while i < len(seg):
        ch = seg[i]
        if ch == "*":
            out.append(_Star())
            literal = False
            i += 1
        elif ch == "{":
            close = seg.index("}", i)
            out.append(_brace_part(seg[i + 1 : close], offset + i))
            i = close + 1
        else:
            m = _WORD.match(seg, i)
            if not m:
                raise PatternSyntaxError(f"unexpected character `{ch}` in module pattern", offset + i)
            out.append(m.group(0))
            chars += len(m.group(0))
            i = m.end()
    return tuple(out), int(literal), chars


def _brace_part(body: str, offset: int) -> tuple[str, ...] | _Range:
    """`q,k,v` -> ("q", "k", "v"); `0..3` -> _Range(0, 3)."""
    m = _RANGE.fullmatch(body)
    if m:
        for bound in m.group(1), m.group(2):
            if len(bound.lstrip("-").lstrip("0")) > len(str(MAX_RANGE_BOUND)):
                raise PatternSyntaxError(
                    f"range bound {bound if len(bound) <= 16 else bound[:16] + '...'} is too large",
                    offset,
                    len(body) + 2,
                    hint=f"range bounds can be {-MAX_RANGE_BOUND:,} to {MAX_RANGE_BOUND:,}",
                )
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo > hi:
            raise PatternSyntaxError(
                f"empty range {{{body}}}: {lo} is greater than {hi}",
                offset,
                len(body) + 2,
                hint=f"write {{{hi}..{lo}}}",
            )
        if hi - lo > MAX_RANGE:
            raise PatternSyntaxError(
                f"range {{{body}}} is too large",
                offset,
                len(body) + 2,
                hint=f"a range holds at most {MAX_RANGE + 1:,} numbers, e.g. {{0..{MAX_RANGE}}}",
            )
        return _Range(lo, hi)
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
    return tuple(alternatives)
