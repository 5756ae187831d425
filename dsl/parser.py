"""Plan text -> `PlanFile` syntax tree, with every syntax error of the file collected.

Lark (LALR, contextual lexer: `dsl.lalr`) parses; a Transformer with one method per grammar
rule (`dsl.transformer`) turns the parse tree into the frozen AST. Lark's own exceptions are
converted here (`dsl.syntax_errors`) and never reach the user.

Recovery: LALR stops at the first error. We record it, repair the text (`dsl.recovery`:
blank the broken line or block, or close a block) and parse again, so one run reports every
broken line. The statements before the broken one are kept, and the next parse starts at
the broken statement. The bounds of `dsl.limits` hold over the whole run: at most
`MAX_SYNTAX_ERRORS` errors, and `MAX_PARSE_WORK` tokens parsed in all.
"""

from __future__ import annotations

from lark.exceptions import UnexpectedInput, VisitError

from . import ast
from .errors import Diagnostic, PlanFileError, PlanSyntaxError, Span
from .lalr import Budget, OutOfWork, TooLong, parse_counted
from .limits import MAX_PARSE_WORK, MAX_PLAN_BYTES, MAX_SYNTAX_ERRORS, check_length
from .recovery import (
    at_end,
    blank_before,
    blank_statement_or_entry,
    block_openers,
    error_line,
    offset_of_line,
    prepend,
    repair,
)
from .syntax_errors import diagnose
from .transformer import NodeError, ToAst


def parse(text: str, path: str = "<plan>") -> ast.PlanFile:
    """Parse plan text. Raises `PlanSyntaxError` with every syntax error found."""
    tree, diagnostics = parse_recovering(text, path)
    if diagnostics:
        raise PlanSyntaxError(diagnostics, {path: text})
    return tree


def parse_recovering(text: str, path: str = "<plan>") -> tuple[ast.PlanFile, list[Diagnostic]]:
    """Parse as much as possible: the tree of every statement that parsed, and every syntax error.

    The tree lets the checker report the rest of the file's problems in the same run.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_PLAN_BYTES:
        span = Span(path, 1, 1, 1, 1)
        raise PlanFileError([Diagnostic(span, f"plan text is larger than {MAX_PLAN_BYTES // 1024} KiB")])
    if not text.strip() or all(not line.split("#", 1)[0].strip() for line in text.split("\n")):
        raise PlanSyntaxError(
            [
                Diagnostic(
                    Span(path, 1, 1, 1, 1),
                    "empty plan",
                    hint="a plan needs at least a mesh, e.g. `mesh dp=*, tp=2`",
                )
            ],
            {path: text},
        )
    check_length(text, path)
    diagnostics: list[Diagnostic] = []
    work = text
    if not work.endswith("\n"):
        work += "\n"  # every statement ends in a newline token; positions are unchanged
    budget = Budget(MAX_PARSE_WORK)
    done: list[ast.Statement] = []  # the statements before line `resume`, parsed for good
    resume = 1  # `work` is blank before this line
    try:
        for _ in range(MAX_SYNTAX_ERRORS):
            try:
                tree = ToAst(path, work).transform(parse_counted(work, budget))
                return prepend(done, tree), diagnostics
            except UnexpectedInput as e:
                lines = work.split("\n")
                openers = block_openers(lines)  # once per error: a line can hold 1 MiB of braces
                diagnostics.append(diagnose(e, work, path, lines=lines, openers=openers))
                line = len(lines) if at_end(e) else error_line(e, lines)
                repaired = repair(work, e, lines=lines, openers=openers)
            except VisitError as e:  # a value the grammar admits but the AST cannot hold
                if not isinstance(e.orig_exc, NodeError):
                    raise
                diagnostics.append(e.orig_exc.diagnostic)
                line = e.orig_exc.diagnostic.span.line
                lines = work.split("\n")
                openers = block_openers(lines)
                repaired = blank_statement_or_entry(work, line, lines=lines, openers=openers)
            if repaired == work:  # recovery made no progress: report what was found rather than repeat it
                raise PlanSyntaxError(diagnostics, {path: text})
            # Repairs change only the broken statement and what follows it: the statements
            # before it are parsed once more, kept, and blanked, and parsing goes on from it.
            opener = openers[min(line, len(openers)) - 1]
            start = line if opener is None else opener[0]
            if start > resume:
                head = work[: offset_of_line(work, start)]
                done += ToAst(path, head).transform(parse_counted(head, budget)).statements
                resume = start
            work = blank_before(repaired, resume)
    except TooLong as e:
        raise PlanFileError([*diagnostics, e.diagnostic(path)], {path: text}) from None
    except OutOfWork:
        raise PlanSyntaxError(diagnostics, {path: text}, stopped=True) from None
    raise PlanSyntaxError(diagnostics, {path: text}, stopped=True)
