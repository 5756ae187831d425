"""Plan text -> `PlanFile` syntax tree, with every syntax error of the file collected.

Lark (LALR, contextual lexer) parses; a Transformer with one method per grammar
rule builds the frozen AST while parsing, so no parse tree is kept. Lark's own
exceptions are converted here and never reach the user.

Recovery: LALR stops at the first error. We record it, blank the offending line
(or, if that line opens a block, the whole block) and parse again, so one run
reports every broken line. Blanking keeps line and column numbers intact.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError
from meshplan.grammar import grammar_text

from . import ast
from .errors import Diagnostic, PlanFileError, PlanSyntaxError, Span, did_you_mean, one_of

MAX_PLAN_BYTES = 1 << 20  # a plan is a page of text; 1 MiB is a mistake, not a plan
MAX_SYNTAX_ERRORS = 50


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
            ]
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
            ]
        ) from None
    return text.removeprefix("\ufeff")


def _span_of_offset(prefix: str, name: str, offset: int) -> Span:
    line = prefix.count("\n") + 1
    col = len(prefix) - (prefix.rfind("\n") + 1) + 1
    return Span(name, line, col, line, col + 1)


@lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(
        grammar_text(), parser="lalr", lexer="contextual", propagate_positions=True, maybe_placeholders=False
    )


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
    if not text.strip() or all(not line.split("#", 1)[0].strip() for line in text.splitlines()):
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
    diagnostics: list[Diagnostic] = []
    work = text
    if not work.endswith("\n"):
        work += "\n"  # every statement ends in a newline token; positions are unchanged
    for _ in range(MAX_SYNTAX_ERRORS):
        try:
            return _ToAst(path, work).transform(_lark().parse(work)), diagnostics
        except UnexpectedInput as e:
            diagnostics.append(_diagnose(e, work, path))
            work = _blank_broken_region(work, e)
        except VisitError as e:  # a value the grammar admits but the AST cannot hold
            if not isinstance(e.orig_exc, _NodeError):
                raise
            diagnostics.append(e.orig_exc.diagnostic)
            work = _blank_lines(work, e.orig_exc.diagnostic.span.line, e.orig_exc.diagnostic.span.line)
    diagnostics.append(
        Diagnostic(diagnostics[-1].span, f"too many errors; stopped after {MAX_SYNTAX_ERRORS}")
    )
    raise PlanSyntaxError(diagnostics, {path: text})


# ---------------------------------------------------------------------------- AST building


class _NodeError(Exception):
    def __init__(self, diagnostic: Diagnostic):
        self.diagnostic = diagnostic


def _tok_span(path: str, tok: Token) -> Span:
    return Span(path, tok.line or 0, tok.column or 0, tok.end_line or 0, tok.end_column or 0)


@v_args(inline=True, meta=True)
class _ToAst(Transformer):
    """One method per grammar rule; each returns the AST node for that rule."""

    def __init__(self, path: str, text: str):
        super().__init__()
        self.path = path
        self.lines = text.split("\n")

    def _span(self, meta) -> Span:
        return Span(self.path, meta.line, meta.column, meta.end_line, meta.end_column)

    def _name(self, tok: Token) -> ast.Name:
        return ast.Name(str(tok), _tok_span(self.path, tok))

    def _int(self, tok: Token, what: str) -> int:
        # INT is all digits; absurd sizes are a user mistake, not a crash
        if len(tok) > 12:
            raise _NodeError(Diagnostic(_tok_span(self.path, tok), f"{what} {tok[:16]}... is too large"))
        return int(tok)

    # -- file
    def start(self, meta, *statements):
        return ast.PlanFile(
            self.path, tuple(statements), self._span(meta) if not meta.empty else Span(self.path, 1, 1, 1, 1)
        )

    # -- mesh
    def mesh(self, meta, *axes):
        return ast.Mesh(tuple(axes), self._span(meta))

    def axis(self, meta, name, size):
        value = None if size.type == "AUTO" else self._int(size, "axis size")
        return ast.MeshAxis(self._name(name), value, self._span(meta))

    # -- modules
    def modules(self, meta, *rules):
        return ast.ModulesBlock(tuple(rules), self._span(meta))

    def rule(self, meta, pattern, action):
        return ast.Rule(ast.Pattern(str(pattern), _tok_span(self.path, pattern)), action, self._span(meta))

    def column(self, meta, axis):
        return ast.TensorParallel("column", self._name(axis), self._span(meta))

    def row(self, meta, axis):
        return ast.TensorParallel("row", self._name(axis), self._span(meta))

    def vocab(self, meta, axis):
        return ast.TensorParallel("vocab", self._name(axis), self._span(meta))

    def replicate(self, meta):
        return ast.Replicate(self._span(meta))

    def sequence(self, meta, axis):
        return ast.SequenceParallel(self._name(axis), self._span(meta))

    def context(self, meta, mode, axis):
        return ast.ContextParallel(mode, self._name(axis), self._span(meta))

    def context_mode(self, meta, tok):
        return str(tok)

    def experts(self, meta, axis, *args):
        return ast.ExpertParallel(self._name(axis), tuple(args), self._span(meta))

    def expert_arg(self, meta, name, number):
        return ast.ExpertArg(self._name(name), float(number), str(number), self._span(meta))

    def checkpoint(self, meta, *parts):
        mode = next((p for p in parts if isinstance(p, str) and not isinstance(p, Token)), None)
        every = next((self._int(p, "checkpoint interval") for p in parts if isinstance(p, Token)), None)
        return ast.Checkpoint(mode, every, self._span(meta))

    def checkpoint_mode(self, meta, tok):
        return str(tok)

    def device(self, meta, spec):
        return ast.Device(spec[0], spec[1], self._span(meta))

    def device_name(self, meta, *toks):
        index = self._int(toks[2], "device index") if len(toks) == 3 else None
        return (str(toks[0]), index)

    def dtype_override(self, meta, dtype):
        return ast.DtypeOverride(dtype, self._span(meta))

    def dtype(self, meta, tok):
        return str(tok)

    # -- pipeline
    def pipeline(self, meta, axis, *items):
        return ast.PipelineBlock(self._name(axis), tuple(items), self._span(meta))

    def schedule(self, meta, name):
        return self._setting(meta, "schedule", name, name)

    def schedule_name(self, meta, tok):
        return str(tok)

    def microbatches(self, meta, tok):
        return self._setting(meta, "microbatches", self._int(tok, "microbatch count"), str(tok))

    def virtual_stages(self, meta, tok):
        return self._setting(meta, "virtual_stages", self._int(tok, "virtual stage count"), str(tok))

    def cut(self, meta, side, pattern):
        return ast.Cut(side, ast.Pattern(str(pattern), _tok_span(self.path, pattern)), self._span(meta))

    def cut_side(self, meta, tok):
        return str(tok)

    # -- data parallel
    def data_parallel(self, meta, axis, *items):
        return ast.DataParallelBlock(self._name(axis), tuple(items), self._span(meta))

    def zero(self, meta, tok):
        return self._setting(meta, "zero", self._int(tok, "ZeRO stage"), str(tok))

    def bucket(self, meta, tok):
        return self._setting(meta, "bucket", parse_size(str(tok)), _normal_size(str(tok)))

    def offload(self, meta, *targets):
        if targets == (None,):
            return self._setting(meta, "offload", (), "none")
        return self._setting(meta, "offload", tuple(targets), ", ".join(targets))

    def offload_target(self, meta, tok):
        return str(tok)

    def offload_none(self, meta):
        return None

    # -- precision
    def precision(self, meta, *items):
        return ast.PrecisionBlock(tuple(items), self._span(meta))

    def compute(self, meta, dtype):
        return self._setting(meta, "compute", dtype, dtype)

    def params(self, meta, dtype):
        return self._setting(meta, "params", dtype, dtype)

    def grads(self, meta, dtype):
        return self._setting(meta, "grads", dtype, dtype)

    def reduce(self, meta, dtype):
        return self._setting(meta, "reduce", dtype, dtype)

    def loss_scale(self, meta, value):
        if isinstance(value, Token):
            return self._setting(meta, "loss_scale", float(value), str(value))
        return self._setting(meta, "loss_scale", value, value)

    def loss_scale_dynamic(self, meta):
        return "dynamic"

    def loss_scale_none(self, meta):
        return "none"

    # -- train
    def train(self, meta, *items):
        return ast.TrainBlock(tuple(items), self._span(meta))

    def gradient_accumulation(self, meta, tok):
        return self._setting(meta, "gradient_accumulation", self._int(tok, "accumulation count"), str(tok))

    def _setting(self, meta, key: str, value, text: str) -> ast.Setting:
        span = self._span(meta)
        # the value runs from the first non-blank after `=` to the end of the setting
        line = self.lines[span.line - 1]
        eq = line.index("=", span.col - 1)
        start = len(line) - len(line[eq + 1 :].lstrip()) + 1
        value_span = Span(self.path, span.end_line, start, span.end_line, span.end_col)
        return ast.Setting(key, value, text, span, value_span)


_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)[ \t]*(B|KB|MB|GB|KiB|MiB|GiB)")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_size(text: str) -> int:
    """`25MB` -> 25_000_000 bytes; `1.5GiB` -> 1_610_612_736."""
    m = _SIZE_RE.fullmatch(text.strip())
    assert m, text  # the grammar's SIZE terminal guarantees the shape
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _normal_size(text: str) -> str:
    m = _SIZE_RE.fullmatch(text.strip())
    assert m, text
    return f"{m.group(1)}{m.group(2)}"


# ---------------------------------------------------------------------------- errors

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


def _expected_words(expected: set[str]) -> list[str]:
    """Terminal names -> words a user recognizes: keywords as themselves, the rest described."""
    words = set()
    terminals = {t.name: t for t in _lark().terminals}
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
    terminals = {t.name: t for t in _lark().terminals}
    out = []
    for name in expected:
        t = terminals.get(name)
        if t is not None and t.pattern.type == "str" and t.pattern.value[-1:].isalnum():
            out.append(t.pattern.value)
    return out


def _word_at(text: str, pos: int) -> str:
    m = re.compile(r"[^\s:=,{}()#]+").match(text, pos)
    return m.group(0) if m else text[pos : pos + 1]


def _diagnose(e: UnexpectedInput, text: str, path: str) -> Diagnostic:
    """Turn a Lark exception into a located diagnostic with a useful hint."""
    if isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END"):
        opener = _unclosed_brace(text)
        if opener is not None:
            line, col = opener
            return Diagnostic(
                Span(path, line, col, line, col + 1),
                "block is never closed",
                hint="add a `}` on its own line at the end of the block",
            )
        line = text.count("\n") or 1
        return Diagnostic(Span(path, line, 1, line, 2), "unexpected end of file")

    expected = set(e.expected) if isinstance(e, UnexpectedToken) else set(getattr(e, "allowed", None) or ())
    if isinstance(e, UnexpectedToken):
        tok = e.token
        pos = tok.start_pos or 0
        found = str(tok) if tok.type != "_NL" else ""
    else:
        pos = e.pos_in_stream or 0
        found = _word_at(text, pos)
    line, col = e.line, e.column
    width = max(1, len(found.splitlines()[0]) if found.strip() else 1)
    span = Span(path, line, col, line, col + width)

    keywords = _keywords(expected)
    if not found.strip():
        message = "line ends too early"
        hint = f"expected {one_of(_expected_words(expected))}"
        return Diagnostic(span, message, hint=hint)

    shown = found if len(found) <= 40 else found[:37] + "..."
    message = f"unexpected `{shown}`"
    guess = did_you_mean(found, keywords) if keywords else None
    hint = f"did you mean `{guess}`?" if guess else f"expected {one_of(_expected_words(expected))}"
    if {"mesh", "modules"} <= set(keywords):
        message = f"unexpected `{shown}` at the start of a statement"
        if not guess:
            hint = f"a statement starts with {one_of(f'`{k}`' for k in _STATEMENT_KEYWORDS)}"
    if "{" in found and "PATTERN" in expected:
        message = f"malformed module pattern `{shown}`"
        hint = "braces hold alternatives `{a,b}` or a range `{0..3}`, and must be closed"
    return Diagnostic(span, message, hint=hint)


def _unclosed_brace(text: str) -> tuple[int, int] | None:
    """Line and column of the last `{` opening a block that is never closed."""
    stack: list[tuple[int, int]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        for m in re.finditer(r"\{[^{}\s:#]*\}|[{}]", code):  # pattern braces match whole
            tok = m.group(0)
            if tok == "{":
                stack.append((lineno, m.start() + 1))
            elif tok == "}" and stack:
                stack.pop()
    return stack[-1] if stack else None


def _blank_broken_region(text: str, e: UnexpectedInput) -> str:
    """Blank the line of the error so the next parse gets past it.

    A line that opens a block is blanked with the whole block: its entries cannot be
    read without knowing what block they are in. A line that closes a block keeps
    its `}` so the enclosing block still ends where the user ended it.
    """
    if isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END"):
        return text + "}\n" * 20  # close what is open; the loop stops on what comes next
    lines = text.split("\n")
    first = e.line if e.line and e.line > 0 else len(lines)
    if isinstance(e, UnexpectedToken) and e.token.type == "_NL":
        first = e.token.line  # a newline token starts at the end of the broken line
    net = _brace_balance(lines[first - 1])
    if net > 0:
        depth, last = 0, len(lines)
        for i in range(first - 1, len(lines)):
            depth += _brace_balance(lines[i])
            if depth <= 0:
                last = i + 1
                break
        return _blank_lines(text, first, last)
    blanked = _blank_lines(text, first, first).split("\n")
    if net < 0:
        blanked[first - 1] = "}" * -net
    return "\n".join(blanked)


def _brace_balance(line: str) -> int:
    """Block braces opened minus closed on a line; pattern braces like `{q,k}` do not count."""
    code = re.sub(_PATTERN_BRACES, "", line.split("#", 1)[0])
    return code.count("{") - code.count("}")


_PATTERN_BRACES = re.compile(r"\{[^{}\s:#]*\}")


def _blank_lines(text: str, first: int, last: int) -> str:
    lines = text.split("\n")
    for i in range(first - 1, min(last, len(lines))):
        lines[i] = ""
    return "\n".join(lines)
