"""The plan grammar's Lark parser, built once, and a parse that counts the tokens it reads.

LALR with the contextual lexer (`grammar/plan.lark`), a post-lexer that keeps adjacent
words apart, and positions on every node. `parse_counted` enforces the token bounds of
`dsl.limits` as it goes: `TooLong` at the first token past `MAX_PLAN_TOKENS`, `OutOfWork`
once the recovery of one file has parsed `MAX_PARSE_WORK` tokens.
"""

from __future__ import annotations

from functools import lru_cache

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedToken

from meshplan.grammar import grammar_text

from .errors import Diagnostic, Span
from .limits import MAX_PLAN_TOKENS


class _SeparateWords:
    """Lark post-lexer: adjacent words need a space, so `columnovertp` is not `column over tp`.

    The contextual lexer matches a keyword wherever the parser expects one, even as the
    start of a longer word (`meshdp=2`, `zero = 1x`); the rest of the word is an error.
    """

    always_accept = ()

    def process(self, stream):
        previous = None
        for tok in stream:
            if (
                previous is not None
                and tok.start_pos == previous.end_pos
                and is_word_char(str(previous)[-1:])
                and is_word_char(str(tok)[:1])
            ):
                raise UnexpectedToken(tok, set(), token_history=[previous])
            yield tok
            previous = tok


@lru_cache(maxsize=1)
def lark_parser() -> Lark:
    return Lark(
        grammar_text(),
        parser="lalr",
        lexer="contextual",
        postlex=_SeparateWords(),
        propagate_positions=True,
        maybe_placeholders=False,
    )


class TooLong(Exception):
    """The plan has more than `MAX_PLAN_TOKENS` tokens; raised at the first one too many."""

    def __init__(self, token: Token):
        self.token = token

    def diagnostic(self, path: str) -> Diagnostic:
        return Diagnostic(
            tok_span(path, self.token),
            f"plan is too long: more than {MAX_PLAN_TOKENS:,} words and symbols",
            hint="a plan describes a layout in a few dozen lines; one rule with `*` or `{0..31}` "
            "covers many modules",
        )


class OutOfWork(Exception):
    """Recovery has parsed `MAX_PARSE_WORK` tokens: report the errors found so far."""


class Budget:
    """Tokens left to parse, over every parse of one file."""

    def __init__(self, tokens: int):
        self.left = tokens


def parse_counted(text: str, budget: Budget) -> Tree:
    """`lark_parser().parse(text)`, counting tokens: at most `MAX_PLAN_TOKENS` in the text, and the
    budget of the whole recovery."""
    parser = lark_parser().parse_interactive(text)
    count, last = 0, None
    try:
        for last in parser.iter_parse():
            count += 1
            if count > MAX_PLAN_TOKENS:
                raise TooLong(last)
            if count > budget.left:
                raise OutOfWork
        return parser.feed_eof(last)
    finally:  # a parse that fails on a syntax error costs as much as one that succeeds
        budget.left -= count


def tok_span(path: str, tok: Token) -> Span:
    return Span(path, tok.line or 0, tok.column or 0, tok.end_line or 0, tok.end_column or 0)


def is_word_char(ch: str) -> bool:
    return len(ch) == 1 and (ch.isascii() and (ch.isalnum() or ch == "_"))
