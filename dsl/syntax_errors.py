"""A Lark exception -> a located diagnostic in the plan's words, with a hint the user can act on.

Lark's own exceptions never reach the user: `diagnose` names the word the parser tripped
over, what it expected there as a user knows it (`a whole number`, `` `}` ``), and the
mistakes behind the usual errors (a setting in the wrong block, a statement inside a block,
a block never closed, a character no plan can contain).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lark import Token
from lark.exceptions import UnexpectedInput, UnexpectedToken

from .errors import Diagnostic, Span, did_you_mean, one_of
from .lalr import is_word_char, lark_parser
from .recovery import BLOCK_HEADER, MESH_LINE, at_end, error_line, nested_block_end

# How the user knows each terminal, for "expected ..." lists.
_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "a whole number",
    "NUMBER": "a number",
    "SIZE": "a size such as 25MB",
    "AUTO": "`*`",
    "PATTERN": "a module pattern",
    "_NL": "end of line",
    "$END": "end of file",
    "COLON": "`:`",
    "COMMA": "`,`",
    "EQUAL": "`=`",
    "LBRACE": "`{`",
    "RBRACE": "`}`",
    "LPAR": "`(`",
    "RPAR": "`)`",
}

_STATEMENT_KEYWORDS = ("mesh", "modules", "pipeline", "data_parallel", "precision", "train")

# The block each setting belongs in, for "`microbatches` is a `pipeline` setting".
_SETTING_BLOCKS = {
    "schedule": "pipeline",
    "microbatches": "pipeline",
    "virtual_stages": "pipeline",
    "cut": "pipeline",
    "zero": "data_parallel",
    "bucket": "data_parallel",
    "offload": "data_parallel",
    "compute": "precision",
    "params": "precision",
    "grads": "precision",
    "reduce": "precision",
    "loss_scale": "precision",
    "gradient_accumulation": "train",
}


def _expected_words(expected: set[str]) -> list[str]:
    """Terminal names -> words a user recognizes: keywords as themselves, the rest described."""
    words = set()
    terminals = {t.name: t for t in lark_parser().terminals}
    for name in expected:
        if name in _TERMINAL_WORDS:
            words.add(_TERMINAL_WORDS[name])
        elif name in terminals and terminals[name].pattern.type == "str":
            words.add(f"`{terminals[name].pattern.value}`")
        else:
            words.add(name.lower())
    return sorted(words, key=lambda w: (not w.startswith("`"), w))


def _keywords(expected: set[str]) -> list[str]:
    """The keywords among the expected terminals, for did-you-mean suggestions."""
    terminals = {t.name: t for t in lark_parser().terminals}
    out = []
    for name in expected:
        t = terminals.get(name)
        if t is not None and t.pattern.type == "str" and t.pattern.value[-1:].isalnum():
            out.append(t.pattern.value)
    return out


_WORD = re.compile(r"[^\s:=,{}()#]+")


def _word_at(text: str, pos: int) -> str:
    m = _WORD.match(text, pos)
    return m.group(0) if m else text[pos : pos + 1]


def _expected_at(text: str, pos: int, context: _Context) -> set[str]:
    """The terminals the parser accepts at `pos`, on the line that `context` describes.

    Exact, unlike the `expected` of Lark's exception: LALR merges the lookaheads of states
    shared by several rules (`over NAME` ends a rule, a block header and `experts (...)`).
    What a line accepts depends only on the line and, for a block entry, on the block's
    header; so only those are parsed again, not the whole file.
    """
    try:
        parser = lark_parser().parse_interactive(context.header + text[context.line_start : pos])
        parser.exhaust_lexer()
        return set(parser.accepts())
    except UnexpectedInput:
        return set()


def _block_word(lines: list[str], opener: tuple[int, int]) -> str:
    m = re.match(r"[ \t]*(\w+)", lines[opener[0] - 1])
    return m.group(1) if m else "block"


def _describe_char(ch: str) -> str:
    return f"`{ch}` (U+{ord(ch):04X})" if ch.isprintable() else f"U+{ord(ch):04X}"


def diagnose(
    e: UnexpectedInput,
    text: str,
    path: str,
    *,
    lines: list[str],
    openers: list[tuple[int, int] | None],
) -> Diagnostic:
    """Turn a Lark exception into a located diagnostic with a useful hint.
    `lines`, `openers`: the text's, split and `block_openers`."""
    if at_end(e):
        return _end_of_file(path, lines, openers[-1])
    lineno = error_line(e, lines)
    opener = openers[lineno - 1]
    if opener is not None:
        misplaced = _statement_in_block(path, lines, lineno, opener) or _misplaced_setting(
            path, lines, lineno, opener
        )
        if misplaced is not None:
            return misplaced

    line_start = sum(len(t) + 1 for t in lines[: lineno - 1])
    header = lines[opener[0] - 1] + "\n" if opener is not None else ""
    word = _offending_word(e, text, _Context(line_start, header))
    bad_char = _bad_character(path, text, word)
    if bad_char is not None:
        return bad_char
    previous = word.previous
    group = _unclosed_group(str(previous)) if previous is not None and previous.type == "PATTERN" else None
    if previous is not None and group is not None:
        line, start = previous.line or 1, (previous.column or 1) + group
        return Diagnostic(
            Span(path, line, start, line, start + 1),
            "unclosed `{` in module pattern",
            hint="braces hold alternatives `{a,b}` or a range `{0..3}`, with no spaces inside",
        )

    found, expected = word.text, word.expected
    span = Span(path, word.line, word.col, word.line, word.col + max(1, len(found)))
    if not found.strip():
        return Diagnostic(span, "line ends too early", hint=f"expected {one_of(_expected_words(expected))}")
    keywords = _keywords(expected)
    shown = found if len(found) <= 40 else found[:37] + "..."
    message = f"unexpected `{shown}`"
    guess = did_you_mean(found, keywords) if keywords else None
    hint = f"did you mean `{guess}`?" if guess else f"expected {one_of(_expected_words(expected))}"
    if {"mesh", "modules"} <= set(keywords):  # at the start of a statement
        if found == "}":
            message, hint = "unmatched `}`", "no block is open here; delete it"
        else:
            message = f"unexpected `{shown}` at the start of a statement"
            if found in _SETTING_BLOCKS:
                hint = f"`{found}` is a setting: put it inside a `{_SETTING_BLOCKS[found]}` block"
            elif not guess:
                hint = f"a statement starts with {one_of(f'`{k}`' for k in _STATEMENT_KEYWORDS)}"
    return Diagnostic(span, message, hint=hint)


@dataclass(frozen=True)
class _Context:
    """Where the line of an error starts, and the header of the block it is in ("" at the top level)."""

    line_start: int
    header: str


@dataclass(frozen=True)
class _Word:
    """What the parser tripped over: a whole word where it can tell, and what it expected there."""

    pos: int
    line: int
    col: int
    text: str  # "" at the end of a line
    expected: set[str]
    previous: Token | None  # the token before, where Lark reports it


def _offending_word(e: UnexpectedInput, text: str, context: _Context) -> _Word:
    previous = (getattr(e, "token_history", None) or [None])[-1]
    if not isinstance(e, UnexpectedToken):  # the lexer found no token at all here
        pos = e.pos_in_stream or 0
        expected = _expected_at(text, pos, context) or set(getattr(e, "allowed", None) or ())
        return _Word(pos, e.line, e.column, _word_at(text, pos), expected, previous)
    tok = e.token
    pos = tok.start_pos or 0
    if tok.type == "_NL":
        return _Word(pos, e.line, e.column, "", _expected_at(text, pos, context) or set(e.expected), previous)
    if (
        previous is not None
        and previous.end_pos == pos
        and is_word_char(str(previous)[-1:])
        and is_word_char(str(tok)[:1])
    ):
        # a keyword or number glued to what follows (`1f1b_interleaved`, `zero = 1x`): the
        # whole word is wrong, so report it against what was expected where it starts
        pos = previous.start_pos or 0
        return _Word(
            pos, previous.line, previous.column, _word_at(text, pos), _expected_at(text, pos, context), None
        )
    # `2bucket` lexes as `2` then `bucket`; show the whole word
    found = _word_at(text, pos) if is_word_char(str(tok)[:1]) else str(tok)
    return _Word(pos, e.line, e.column, found, _expected_at(text, pos, context) or set(e.expected), previous)


def _bad_character(path: str, text: str, word: _Word) -> Diagnostic | None:
    """A character no plan can contain, in or right after the word the parser tripped over."""
    for offset in range(min(len(word.text), 200) + 1):
        ch = text[word.pos + offset : word.pos + offset + 1]
        col = word.col + offset
        span = Span(path, word.line, col, word.line, col + 1)
        if ch == "\r" and text[word.pos + offset + 1 : word.pos + offset + 2] != "\n":
            return Diagnostic(
                span,
                "unexpected carriage return (U+000D) without a line feed",
                hint="save the plan with LF (or CRLF) line endings",
            )
        if ch and not (ch.isascii() and ch.isprintable()) and ch not in " \t\r\n":
            return Diagnostic(
                span,
                f"unexpected character {_describe_char(ch)}",
                hint="outside comments a plan is ASCII: names and module paths are letters, digits and `_`",
            )
    return None


def _end_of_file(path: str, lines: list[str], opener: tuple[int, int] | None) -> Diagnostic:
    if opener is not None:
        line, col = opener
        return Diagnostic(
            Span(path, line, col, line, col + 1),
            f"`{_block_word(lines, opener)}` block is never closed",
            hint="add a `}` on its own line at the end of the block",
        )
    line = max(1, len(lines) - 1)
    return Diagnostic(Span(path, line, 1, line, 2), "unexpected end of file")


def _misplaced_setting(
    path: str, lines: list[str], lineno: int, opener: tuple[int, int]
) -> Diagnostic | None:
    """`microbatches = 4` inside `data_parallel`: name the block it belongs in."""
    m = re.match(r"[ \t]*(\w+)[ \t]*=", lines[lineno - 1])
    block = _block_word(lines, opener)
    if not m or m.group(1) not in _SETTING_BLOCKS or _SETTING_BLOCKS[m.group(1)] == block:
        return None
    key, col = m.group(1), m.start(1) + 1
    return Diagnostic(
        Span(path, lineno, col, lineno, col + len(key)),
        f"`{key}` does not belong in the `{block}` block",
        hint=f"`{key}` is a `{_SETTING_BLOCKS[key]}` setting",
    )


def _unclosed_group(pattern: str) -> int | None:
    """Index of a `{` in a pattern token that is never closed, if any."""
    depth_at = None
    for i, ch in enumerate(pattern):
        if ch == "{":
            depth_at = i
        elif ch == "}":
            depth_at = None
    return depth_at


def _statement_in_block(
    path: str, lines: list[str], lineno: int, opener: tuple[int, int]
) -> Diagnostic | None:
    """A statement on a line inside a block: blocks do not nest, so a `}` is missing or misplaced."""
    text = lines[lineno - 1]
    block = _block_word(lines, opener)
    opens_here = (
        Span(path, opener[0], opener[1], opener[0], opener[1] + 1),
        f"the `{block}` block opens here",
    )
    header = BLOCK_HEADER.match(text)
    if header:
        word = header.group(1)
        col = header.start(1) + 1
        span = Span(path, lineno, col, lineno, col + len(word))
        if nested_block_end(lines, lineno) is not None:
            return Diagnostic(
                span,
                f"`{word}` block is inside the `{block}` block",
                hint=f"blocks do not nest: move `{word}` out, after the `}}` that closes `{block}`",
                related=(opens_here,),
            )
        return Diagnostic(
            span,
            f"missing `}}` to close the `{block}` block before `{word}`",
            hint=f"add a `}}` on its own line before line {lineno}",
            related=(opens_here,),
        )
    if MESH_LINE.match(text):
        col = text.index("mesh") + 1
        return Diagnostic(
            Span(path, lineno, col, lineno, col + 4),
            f"`mesh` cannot appear inside the `{block}` block",
            hint="statements go at the top level; move it above the block",
        )
    return None
