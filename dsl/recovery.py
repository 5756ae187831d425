"""Repairing plan text after a syntax error, so that the next parse gets past it.

LALR stops at the first error. `dsl.parser` records it, repairs the text and parses again,
so one run reports every broken line (`repair`): blank the offending line (or, if that line
opens a block, the whole block), close a block the file leaves open, or close a block
before a statement that starts inside it. Repairs keep line and column numbers intact.
Blocks do not nest, which makes a missing or extra brace easy to tell apart from a
pattern's `{q,k,v}` (`block_openers`). The statements before the broken one are kept
(`prepend`), and the next parse starts at the broken statement (`blank_before`).
"""

from __future__ import annotations

import re

from lark.exceptions import UnexpectedEOF, UnexpectedInput, UnexpectedToken

from . import ast
from .errors import Span

# A line that starts a statement: a mesh, or a block header with its `{`.
MESH_LINE = re.compile(r"[ \t]*mesh[ \t]+\w+[ \t]*=")
BLOCK_HEADER = re.compile(r"[ \t]*(modules|pipeline|data_parallel|precision|train)\b[^{#]*\{")


def block_openers(lines: list[str], *, inside: tuple[int, int] | None = None) -> list[tuple[int, int] | None]:
    """For each line, where it starts: inside the block opened at (line, col), or at the top level (None).

    One entry per line and a last one for the end of the text. Blocks do not nest, so at the
    top level any `{` opens a block; inside one, a `{...}` on one line is a pattern's brace
    group and a lone `}` closes the block. Comments are skipped. `inside`: the lines start
    inside the block opened there.
    """
    state = inside
    out: list[tuple[int, int] | None] = []
    for lineno, line in enumerate(lines, 1):
        out.append(state)
        if "{" not in line and "}" not in line:
            continue
        code = line.split("#", 1)[0]
        col = 0
        while True:  # from brace to brace with `find`: a line can hold 1 MiB of them
            if state is None:
                opening = code.find("{", col)
                if opening < 0:
                    break
                state, col = (lineno, opening + 1), opening + 1
                continue
            closing = code.find("}", col)
            if closing < 0:
                break
            # `{` before the `}`: the last of them and the `}` are a brace group, and any
            # `{` before that has no `}` of its own; none: the `}` closes the block
            if code.rfind("{", col, closing) < 0:
                state = None
            col = closing + 1
    out.append(state)
    return out


def nested_block_end(lines: list[str], lineno: int) -> int | None:
    """For a block header on `lineno` inside another block: the last line of the inner block,
    if the outer block is closed after it (the user nested blocks), else None (a `}` is missing)."""
    inner = block_openers(lines[lineno - 1 :])
    end = next((j for j in range(1, len(inner)) if inner[j] is None), None)
    if end is None:
        return None
    last = lineno - 1 + end
    outer = block_openers(lines[last:], inside=(lineno, 1))
    for k in range(len(outer) - 1):
        if outer[k + 1] is None:
            return last  # the outer block closes on line last + k + 1
        if BLOCK_HEADER.match(lines[last + k]) or MESH_LINE.match(lines[last + k]):
            return None  # the next statement comes first: the outer block was never closed
    return None


def at_end(e: UnexpectedInput) -> bool:
    return isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END")


def error_line(e: UnexpectedInput, lines: list[str]) -> int:
    return e.line if isinstance(e.line, int) and 1 <= e.line <= len(lines) else len(lines)


def repair(text: str, e: UnexpectedInput, *, lines: list[str], openers: list[tuple[int, int] | None]) -> str:
    """Change the text so that the next parse gets past this error; line and column numbers stay.

    - The file ends inside a block: close it.
    - A block inside a block: blank it if the outer block is closed after it; otherwise a `}`
      is missing, so close the outer block on the line before.
    - Anything else: blank the line, or more, see `blank_statement_or_entry`.
    """
    if at_end(e):
        # only a block can be left open at the end, and blocks do not nest
        return text + "}\n" if openers[-1] is not None else text
    lineno = error_line(e, lines)
    if openers[lineno - 1] is not None and BLOCK_HEADER.match(lines[lineno - 1]):
        nested_end = nested_block_end(lines, lineno)
        if nested_end is not None:
            return _blank_lines(text, lineno, nested_end)
        lines = list(lines)
        lines[lineno - 2] = lines[lineno - 2].split("#", 1)[0].rstrip() + " }"
        return "\n".join(lines)
    return blank_statement_or_entry(text, lineno, lines=lines, openers=openers)


def blank_statement_or_entry(
    text: str,
    lineno: int,
    *,
    lines: list[str] | None = None,
    openers: list[tuple[int, int] | None] | None = None,
) -> str:
    """Blank a broken line so the next parse gets past it.

    A statement that opens a block is blanked with its whole block: the entries cannot be
    read without knowing what block they are in. A block entry whose line also closes the
    block keeps a `}`, so the block still ends where the user ended it.
    `lines` and `openers`: the text's, when the caller has them already.
    """
    lines = text.split("\n") if lines is None else list(lines)
    openers = block_openers(lines) if openers is None else openers
    if openers[lineno - 1] is None:
        last = next((j for j in range(lineno, len(lines) + 1) if openers[j] is None), len(lines))
        if last == lineno and lines[lineno - 1].split("#", 1)[0].strip().strip("}"):
            last = _orphaned_block_end(lines, lineno) or lineno
        return _blank_lines(text, lineno, last)
    closes_block = openers[lineno] is None
    lines[lineno - 1] = "}" if closes_block else ""
    return "\n".join(lines)


def _orphaned_block_end(lines: list[str], lineno: int) -> int | None:
    """After a broken top-level line that opens no block (`data_parallel over dp` without its
    `{`): if indented non-statement lines follow, up to a lone `}` or the end of the file, they
    were meant as its block; the last line of them. Reporting each of them would be noise."""
    for j in range(lineno, len(lines)):
        code = lines[j].split("#", 1)[0]
        if code.strip() == "}":
            return j + 1
        if code.strip() and (not code[0].isspace() or BLOCK_HEADER.match(code) or MESH_LINE.match(code)):
            return None
    return len(lines)


def _blank_lines(text: str, first: int, last: int) -> str:
    lines = text.split("\n")
    for i in range(first - 1, min(last, len(lines))):
        lines[i] = ""
    return "\n".join(lines)


def offset_of_line(text: str, line: int) -> int:
    """Where line `line` (from 1) starts in `text`."""
    offset = 0
    for _ in range(line - 1):
        offset = text.index("\n", offset) + 1
    return offset


def blank_before(text: str, line: int) -> str:
    """`text` with every line before `line` empty: parsed again, those lines cost nothing."""
    return "\n" * (line - 1) + text[offset_of_line(text, line) :]


def prepend(statements: list[ast.Statement], tree: ast.PlanFile) -> ast.PlanFile:
    if not statements:
        return tree
    first, last = statements[0].span, (tree.statements[-1] if tree.statements else statements[-1]).span
    span = Span(tree.path, first.line, first.col, last.end_line, last.end_col)
    return ast.PlanFile(tree.path, (*statements, *tree.statements), span)
