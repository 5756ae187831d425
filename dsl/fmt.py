"""Canonical formatting of plan files, keeping every comment.

    meshplan fmt llama.plan          # print the canonical form
    meshplan fmt --check llama.plan  # exit 1 if the file is not canonical

The canonical form: one blank line between top-level statements, four-space indents,
`key = value` settings, `pattern: action` rules with the actions of consecutive rules
aligned, comments where they were (full-line comments before the item that follows
them, trailing comments two spaces after the code). Blank lines inside a block are
kept, at most one in a row. Formatting is idempotent, and the formatted text parses
to the same syntax tree as the original.

Alignment pads to the longest pattern of at most `MAX_ALIGN` characters; a longer one is
not padded and pads no other, so one huge pattern cannot multiply the size of the file.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ast

INDENT = "    "
MAX_ALIGN = 60


@dataclass(frozen=True, slots=True)
class _Comment:
    line: int
    text: str  # from `#`, trailing spaces removed
    full_line: bool  # alone on its line, as opposed to after code


def format_plan(tree: ast.PlanFile, source: str) -> str:
    """Return the canonical text of a parsed plan; `source` supplies the comments."""
    return _Formatter(source).file(tree)


def action_text(action: ast.Action) -> str:
    """An action as the canonical plan text writes it: `column over tp`, `checkpoint every 2`."""
    match action:
        case ast.TensorParallel(style=style, axis=axis):
            return f"{style} over {axis.text}"
        case ast.Replicate():
            return "replicate"
        case ast.SequenceParallel(axis=axis):
            return f"sequence over {axis.text}"
        case ast.ContextParallel(mode=mode, axis=axis, layout=layout):
            return f"context {mode} over {axis.text}" + (f" (layout={layout})" if layout else "")
        case ast.ExpertParallel(args=args) as experts:
            inner = ", ".join(f"{a.name.text}={a.text}" for a in args)
            axes = " x ".join(a.text for a in experts.axes)
            return f"experts over {axes}" + (f" ({inner})" if args else "")
        case ast.Checkpoint(mode=mode, every=every):
            every_text = [f"every {every}"] if every is not None else []  # keep `every 0` for the checker
            return " ".join(["checkpoint"] + ([mode] if mode else []) + every_text)
        case ast.Device(kind=kind, index=index):
            return f"on {kind}" + (f":{index}" if index is not None else "")
        case ast.DtypeOverride(dtype=dtype):
            return f"precision {dtype}"
    raise AssertionError(f"unknown action {action!r}")


def _source_lines(source: str) -> list[str]:
    """The lines as the parser numbers them: split at line feeds only, not also at the form
    feeds and U+2028 that `str.splitlines` splits at (a comment may hold them); CR dropped."""
    return [line.removesuffix("\r") for line in source.split("\n")]


def _scan_comments(source: str) -> dict[int, _Comment]:
    # The language has no string literals, so `#` always starts a comment.
    out = {}
    for lineno, line in enumerate(_source_lines(source), 1):
        if "#" in line:
            code, _, rest = line.partition("#")
            out[lineno] = _Comment(lineno, "#" + rest.rstrip(), not code.strip())
    return out


class _Formatter:
    def __init__(self, source: str):
        self.lines = _source_lines(source)
        self.comments = _scan_comments(source)
        self.out: list[str] = []
        self.cursor = 0  # last source line already accounted for
        self.pending_blank = False  # the last gap ended in a blank line that is still to be written
        self.trailing_used: set[int] = set()  # a one-line block puts several items on one line

    # -- helpers
    def trailing(self, line: int) -> str:
        """The trailing comment of a source line, for the first item printed from that line."""
        c = self.comments.get(line)
        if not c or c.full_line or line in self.trailing_used:
            return ""
        self.trailing_used.add(line)
        return f"  {c.text}"

    def gap(self, upto: int, indent: str, *, at_block_start: bool) -> None:
        """Emit the full-line comments (and single blank lines) between the cursor and `upto`."""
        pending_blank = False
        for line in range(self.cursor + 1, upto):
            text = self.lines[line - 1].strip() if line - 1 < len(self.lines) else ""
            comment = self.comments.get(line)
            if comment and comment.full_line:
                if pending_blank and not at_block_start:
                    self.out.append("")
                self.out.append(indent + comment.text)
                pending_blank, at_block_start = False, False
            elif not text:
                pending_blank = True
        self.pending_blank = pending_blank and not at_block_start
        self.cursor = max(self.cursor, upto - 1)

    # -- file and statements
    def file(self, tree: ast.PlanFile) -> str:
        for i, stmt in enumerate(tree.statements):
            start = len(self.out)
            self.gap(stmt.span.line, "", at_block_start=(i == 0))
            if i > 0 and self.out[start : start + 1] != [""]:
                # statements are separated by one blank line, above the comments that lead into one
                self.out.insert(start, "")
            if self.pending_blank and self.out and self.out[-1] != "":
                self.out.append("")
            self.statement(stmt)
            self.cursor = stmt.span.end_line
        self.gap(len(self.lines) + 1, "", at_block_start=not tree.statements)
        while self.out and self.out[-1] == "":
            self.out.pop()
        return "\n".join(self.out) + "\n"

    def statement(self, stmt: ast.Statement) -> None:
        match stmt:
            case ast.Mesh(axes=axes):
                sizes = ", ".join(f"{a.name.text}={'*' if a.size is None else a.size}" for a in axes)
                self.out.append(f"mesh {sizes}" + self.trailing(stmt.span.line))
            case ast.ModulesBlock(rules=rules):
                self.block("modules", stmt, rules)
            case ast.PipelineBlock(axis=axis, items=items):
                self.block(f"pipeline over {axis.text}", stmt, items)
            case ast.DataParallelBlock(items=items) as data:
                self.block(f"data_parallel over {' x '.join(a.text for a in data.axes)}", stmt, items)
            case ast.PrecisionBlock(items=items):
                self.block("precision", stmt, items)
            case ast.TrainBlock(items=items):
                self.block("train", stmt, items)

    def block(self, header: str, stmt: ast.Statement, items) -> None:
        span = stmt.span
        self.out.append(f"{header} {{" + self.trailing(span.line))
        self.cursor = span.line
        paragraph: list[tuple[str, str, str]] = []  # (pattern, action, trailing) of aligned rules

        def flush() -> None:
            width = max((len(p) for p, _, _ in paragraph if len(p) <= MAX_ALIGN), default=0)
            for pattern, action, trail in paragraph:
                self.out.append(f"{INDENT}{(pattern + ':').ljust(width + 1)} {action}{trail}")
            paragraph.clear()

        first = True
        for item in items:
            start = len(self.out)
            self.gap(item.span.line, INDENT, at_block_start=first)
            broke = len(self.out) > start or self.pending_blank
            if broke and paragraph:
                # the comments just emitted belong after the paragraph so far
                emitted = self.out[start:]
                del self.out[start:]
                flush()
                self.out.extend(emitted)
            if self.pending_blank:
                flush()
                self.out.append("")
            trail = self.trailing(item.span.line)
            if isinstance(item, ast.Rule):
                paragraph.append((item.pattern.text, action_text(item.action), trail))
            else:
                flush()
                self.out.append(INDENT + _item_text(item) + trail)
            self.cursor = item.span.end_line
            first = False
        flush()
        # comments after the last entry stay inside the block; a `}` on an entry's line moves down
        if span.end_line > self.cursor:
            self.gap(span.end_line, INDENT, at_block_start=first)
        self.out.append("}" + (self.trailing(span.end_line) if span.end_line > self.cursor or first else ""))
        self.cursor = span.end_line


def _item_text(item: ast.Setting | ast.Cut) -> str:
    if isinstance(item, ast.Cut):
        return f"cut {item.side} {item.pattern.text}"
    return f"{item.key} = {item.text}"
