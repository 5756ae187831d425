"""Plan text -> `PlanFile` syntax tree, with every syntax error of the file collected.

Lark (LALR, contextual lexer) parses; a Transformer with one method per grammar
rule turns the parse tree into the frozen AST. Lark's own exceptions are converted
here and never reach the user.

Recovery: LALR stops at the first error. We record it, repair the text and parse
again, so one run reports every broken line (`_repair`): blank the offending line
(or, if that line opens a block, the whole block), close a block the file leaves
open, or close a block before a statement that starts inside it. Repairs keep line
and column numbers intact. Blocks do not nest, which makes a missing or extra brace
easy to tell apart from a pattern's `{q,k,v}` (`_block_openers`). The statements
before the broken one are kept, and the next parse starts at the broken statement.

Bounds, so that no input of up to 1 MiB keeps the checker busy for long: at most
`MAX_PLAN_LINES` lines and `MAX_PLAN_TOKENS` tokens (words, numbers and symbols; a
real plan has a few hundred), `MAX_SYNTAX_ERRORS` errors, and `MAX_PARSE_WORK` tokens
parsed in all, counting the parses again after each error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from meshplan.grammar import grammar_text

from . import ast
from .errors import Diagnostic, PlanFileError, PlanSyntaxError, Span, did_you_mean, one_of

MAX_PLAN_BYTES = 1 << 20  # a plan is a page of text; 1 MiB is a mistake, not a plan
MAX_PLAN_LINES = 10_000
MAX_PLAN_TOKENS = 50_000  # the largest example plan has 119
MAX_PARSE_WORK = 3 * MAX_PLAN_TOKENS
MAX_SYNTAX_ERRORS = 50
MAX_INT = 10**12 - 1  # the largest number a plan holds: 12 digits
FP32_MAX = 3.4028234663852886e38  # but a loss scale multiplies an fp32 loss: up to fp32's largest
MAX_NAME = 100  # characters of an axis or setting name: `dp`, `capacity_factor`
MAX_BUCKET_BYTES = 1 << 40


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
            ],
            {name: _excerpt_text(data, span.line)},
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
            ],
            {name: _excerpt_text(data, span.line)},
        ) from None
    return text.removeprefix("\ufeff")


def _excerpt_text(data: bytes, line: int) -> str:
    """Text in which line `line` is the offending line of undecodable bytes, decoded leniently."""
    offending = data.split(b"\n", line)[line - 1]
    return "\n" * (line - 1) + offending.decode("utf-8", "replace")


def _span_of_offset(prefix: str, name: str, offset: int) -> Span:
    line = prefix.count("\n") + 1
    col = len(prefix) - (prefix.rfind("\n") + 1) + 1
    return Span(name, line, col, line, col + 1)


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
                and _is_word_char(str(previous)[-1:])
                and _is_word_char(str(tok)[:1])
            ):
                raise UnexpectedToken(tok, set(), token_history=[previous])
            yield tok
            previous = tok


@lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(
        grammar_text(),
        parser="lalr",
        lexer="contextual",
        postlex=_SeparateWords(),
        propagate_positions=True,
        maybe_placeholders=False,
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
    _check_length(text, path)
    diagnostics: list[Diagnostic] = []
    work = text
    if not work.endswith("\n"):
        work += "\n"  # every statement ends in a newline token; positions are unchanged
    budget = _Budget(MAX_PARSE_WORK)
    done: list[ast.Statement] = []  # the statements before line `resume`, parsed for good
    resume = 1  # `work` is blank before this line
    try:
        for _ in range(MAX_SYNTAX_ERRORS):
            try:
                tree = _ToAst(path, work).transform(_parse(work, budget))
                return _prepend(done, tree), diagnostics
            except UnexpectedInput as e:
                lines = work.split("\n")
                openers = _block_openers(lines)  # once per error: a line can hold 1 MiB of braces
                diagnostics.append(_diagnose(e, work, path, lines=lines, openers=openers))
                line = len(lines) if _at_end(e) else _error_line(e, lines)
                repaired = _repair(work, e, lines=lines, openers=openers)
            except VisitError as e:  # a value the grammar admits but the AST cannot hold
                if not isinstance(e.orig_exc, _NodeError):
                    raise
                diagnostics.append(e.orig_exc.diagnostic)
                line = e.orig_exc.diagnostic.span.line
                lines = work.split("\n")
                openers = _block_openers(lines)
                repaired = _blank_statement_or_entry(work, line, lines=lines, openers=openers)
            if repaired == work:  # recovery made no progress: report what was found rather than repeat it
                raise PlanSyntaxError(diagnostics, {path: text})
            # Repairs change only the broken statement and what follows it: the statements
            # before it are parsed once more, kept, and blanked, and parsing goes on from it.
            opener = openers[min(line, len(openers)) - 1]
            start = line if opener is None else opener[0]
            if start > resume:
                head = work[: _offset_of_line(work, start)]
                done += _ToAst(path, head).transform(_parse(head, budget)).statements
                resume = start
            work = _blank_before(repaired, resume)
    except _TooLong as e:
        raise PlanFileError([*diagnostics, e.diagnostic(path)], {path: text}) from None
    except _OutOfWork:
        raise PlanSyntaxError(diagnostics, {path: text}, stopped=True) from None
    raise PlanSyntaxError(diagnostics, {path: text}, stopped=True)


def _check_length(text: str, path: str) -> None:
    """A plan of more than `MAX_PLAN_LINES` lines is refused before parsing, at the first line too many."""
    if text.count("\n", 0, len(text) - 1) < MAX_PLAN_LINES:
        return
    line = MAX_PLAN_LINES + 1
    raise PlanFileError(
        [
            Diagnostic(
                Span(path, line, 1, line, 2),
                f"plan is too long: more than {MAX_PLAN_LINES:,} lines",
                hint="a plan describes a layout in a few dozen lines; is this the right file?",
            )
        ],
        {path: text},
    )


class _TooLong(Exception):
    """The plan has more than `MAX_PLAN_TOKENS` tokens; raised at the first one too many."""

    def __init__(self, token: Token):
        self.token = token

    def diagnostic(self, path: str) -> Diagnostic:
        return Diagnostic(
            _tok_span(path, self.token),
            f"plan is too long: more than {MAX_PLAN_TOKENS:,} words and symbols",
            hint="a plan describes a layout in a few dozen lines; one rule with `*` or `{0..31}` "
            "covers many modules",
        )


class _OutOfWork(Exception):
    """Recovery has parsed `MAX_PARSE_WORK` tokens: report the errors found so far."""


class _Budget:
    """Tokens left to parse, over every parse of one file."""

    def __init__(self, tokens: int):
        self.left = tokens


def _parse(text: str, budget: _Budget) -> Tree:
    """`_lark().parse(text)`, counting tokens: at most `MAX_PLAN_TOKENS` in the text, and the
    budget of the whole recovery."""
    parser = _lark().parse_interactive(text)
    count, last = 0, None
    try:
        for last in parser.iter_parse():
            count += 1
            if count > MAX_PLAN_TOKENS:
                raise _TooLong(last)
            if count > budget.left:
                raise _OutOfWork
        return parser.feed_eof(last)
    finally:  # a parse that fails on a syntax error costs as much as one that succeeds
        budget.left -= count


def _offset_of_line(text: str, line: int) -> int:
    """Where line `line` (from 1) starts in `text`."""
    offset = 0
    for _ in range(line - 1):
        offset = text.index("\n", offset) + 1
    return offset


def _blank_before(text: str, line: int) -> str:
    """`text` with every line before `line` empty: parsed again, those lines cost nothing."""
    return "\n" * (line - 1) + text[_offset_of_line(text, line) :]


def _prepend(statements: list[ast.Statement], tree: ast.PlanFile) -> ast.PlanFile:
    if not statements:
        return tree
    first, last = statements[0].span, (tree.statements[-1] if tree.statements else statements[-1]).span
    span = Span(tree.path, first.line, first.col, last.end_line, last.end_col)
    return ast.PlanFile(tree.path, (*statements, *tree.statements), span)


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
        if len(tok) > MAX_NAME:
            raise _NodeError(
                Diagnostic(
                    _tok_span(self.path, tok),
                    f"name `{tok[:16]}...` is {len(tok):,} characters long",
                    hint=f"a name can be 1 to {MAX_NAME} characters",
                )
            )
        return ast.Name(str(tok), _tok_span(self.path, tok))

    def _int(self, tok: Token, what: str, allowed: str) -> int:
        """An INT (all digits) of at most 12 digits; `allowed` names the whole range, for the hint.

        Lower bounds are the checker's; here only absurd sizes, a user mistake, not a crash.
        """
        if len(tok.lstrip("0")) > len(str(MAX_INT)):  # leading zeros are harmless
            raise _NodeError(
                Diagnostic(
                    _tok_span(self.path, tok),
                    f"{what} {_shown(tok)} is too large",
                    hint=f"{what} can be {allowed}",
                )
            )
        return int(tok)

    def _number(
        self, tok: Token, what: str, limit: float = MAX_INT, limit_text: str = f"{MAX_INT:,}"
    ) -> float:
        value = float(tok)  # NUMBER is digits with an optional fraction and exponent: never NaN
        if value > limit:  # 1e400 is infinite
            raise _NodeError(
                Diagnostic(
                    _tok_span(self.path, tok),
                    f"{what} {_shown(tok)} is too large",
                    hint=f"{what} can be at most {limit_text}",
                )
            )
        return value

    # -- file
    def start(self, meta, *statements):
        return ast.PlanFile(
            self.path, tuple(statements), self._span(meta) if not meta.empty else Span(self.path, 1, 1, 1, 1)
        )

    # -- mesh
    def mesh(self, meta, *axes):
        return ast.Mesh(tuple(axes), self._span(meta))

    def axis(self, meta, name, size):
        value = None if size.type == "AUTO" else self._int(size, "axis size", _ONE_UP)
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

    def context(self, meta, mode, axis, layout=None):
        return ast.ContextParallel(mode, self._name(axis), self._span(meta), layout)

    def context_mode(self, meta, tok):
        return str(tok)

    def context_layout(self, meta, name):
        return name

    def layout_name(self, meta, tok):
        return str(tok)

    def experts(self, meta, axis, *rest):
        more = tuple(self._name(t) for t in rest if isinstance(t, Token))
        args = tuple(a for a in rest if not isinstance(a, Token))
        return ast.ExpertParallel(self._name(axis), args, self._span(meta), more)

    def expert_arg(self, meta, name, number):
        value = self._number(number, f"`{name}`")
        return ast.ExpertArg(self._name(name), value, str(number), self._span(meta))

    def checkpoint(self, meta, *parts):
        mode = next((p for p in parts if isinstance(p, str) and not isinstance(p, Token)), None)
        every = next(
            (self._int(p, "checkpoint interval", _ONE_UP) for p in parts if isinstance(p, Token)), None
        )
        return ast.Checkpoint(mode, every, self._span(meta))

    def checkpoint_mode(self, meta, tok):
        return str(tok)

    def device(self, meta, spec):
        return ast.Device(spec[0], spec[1], self._span(meta))

    def device_name(self, meta, *toks):
        index = self._int(toks[2], "device index", f"0 to {MAX_INT:,}") if len(toks) == 3 else None
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
        return self._setting(meta, "microbatches", self._int(tok, "microbatch count", _ONE_UP), str(tok))

    def virtual_stages(self, meta, tok):
        count = self._int(tok, "virtual stage count", _ONE_UP)
        return self._setting(meta, "virtual_stages", count, str(tok))

    def cut(self, meta, side, pattern):
        return ast.Cut(side, ast.Pattern(str(pattern), _tok_span(self.path, pattern)), self._span(meta))

    def cut_side(self, meta, tok):
        return str(tok)

    # -- data parallel
    def data_parallel(self, meta, axis, *items):
        return ast.DataParallelBlock(self._name(axis), tuple(items), self._span(meta))

    def zero(self, meta, tok):
        return self._setting(meta, "zero", self._int(tok, "ZeRO stage", "0, 1, 2 or 3"), str(tok))

    def bucket(self, meta, tok):
        size = parse_size(str(tok))
        if size > MAX_BUCKET_BYTES:
            raise _NodeError(
                Diagnostic(
                    _tok_span(self.path, tok),
                    f"bucket size {_shown(str(tok))} is too large",
                    hint="bucket size can be 1B to 1TiB",
                )
            )
        return self._setting(meta, "bucket", size, _normal_size(str(tok)))

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
            return self._setting(
                meta,
                "loss_scale",
                self._number(value, "loss scale", FP32_MAX, "fp32's largest, 3.4e38"),
                str(value),
            )
        return self._setting(meta, "loss_scale", value, value)

    def loss_scale_dynamic(self, meta):
        return "dynamic"

    def loss_scale_none(self, meta):
        return "none"

    # -- train
    def train(self, meta, *items):
        return ast.TrainBlock(tuple(items), self._span(meta))

    def gradient_accumulation(self, meta, tok):
        count = self._int(tok, "accumulation count", _ONE_UP)
        return self._setting(meta, "gradient_accumulation", count, str(tok))

    def _setting(self, meta, key: str, value, text: str) -> ast.Setting:
        span = self._span(meta)
        # the value runs from the first non-blank after `=` to the end of the setting
        line = self.lines[span.line - 1]
        eq = line.index("=", span.col - 1)
        start = len(line) - len(line[eq + 1 :].lstrip()) + 1
        value_span = Span(self.path, span.end_line, start, span.end_line, span.end_col)
        return ast.Setting(key, value, text, span, value_span)


_ONE_UP = f"1 to {MAX_INT:,}"
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)[ \t]*(B|KB|MB|GB|KiB|MiB|GiB)")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_size(text: str) -> int:
    """`25MB` -> 25_000_000 bytes; `1.5GiB` -> 1_610_612_736. Sizes beyond `MAX_BUCKET_BYTES`
    (400 nines are an infinite float) come back as `MAX_BUCKET_BYTES + 1`."""
    m = _SIZE_RE.fullmatch(text.strip())
    assert m, text  # the grammar's SIZE terminal guarantees the shape
    size = float(m.group(1)) * _UNITS[m.group(2)]
    return int(size) if size <= MAX_BUCKET_BYTES else MAX_BUCKET_BYTES + 1


def _shown(text: str) -> str:
    """A number as messages show it: a long one cut, marked with `...`."""
    return text if len(text) <= 16 else text[:16] + "..."


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

# A line that starts a statement: a mesh, or a block header with its `{`.
_MESH_LINE = re.compile(r"[ \t]*mesh[ \t]+\w+[ \t]*=")
_BLOCK_HEADER = re.compile(r"[ \t]*(modules|pipeline|data_parallel|precision|train)\b[^{#]*\{")


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
        parser = _lark().parse_interactive(context.header + text[context.line_start : pos])
        parser.exhaust_lexer()
        return set(parser.accepts())
    except UnexpectedInput:
        return set()


def _at_end(e: UnexpectedInput) -> bool:
    return isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END")


def _error_line(e: UnexpectedInput, lines: list[str]) -> int:
    return e.line if isinstance(e.line, int) and 1 <= e.line <= len(lines) else len(lines)


def _block_word(lines: list[str], opener: tuple[int, int]) -> str:
    m = re.match(r"[ \t]*(\w+)", lines[opener[0] - 1])
    return m.group(1) if m else "block"


def _describe_char(ch: str) -> str:
    return f"`{ch}` (U+{ord(ch):04X})" if ch.isprintable() else f"U+{ord(ch):04X}"


def _diagnose(
    e: UnexpectedInput,
    text: str,
    path: str,
    *,
    lines: list[str],
    openers: list[tuple[int, int] | None],
) -> Diagnostic:
    """Turn a Lark exception into a located diagnostic with a useful hint.
    `lines`, `openers`: the text's, split and `_block_openers`."""
    if _at_end(e):
        return _end_of_file(path, lines, openers[-1])
    lineno = _error_line(e, lines)
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
        and _is_word_char(str(previous)[-1:])
        and _is_word_char(str(tok)[:1])
    ):
        # a keyword or number glued to what follows (`1f1b_interleaved`, `zero = 1x`): the
        # whole word is wrong, so report it against what was expected where it starts
        pos = previous.start_pos or 0
        return _Word(
            pos, previous.line, previous.column, _word_at(text, pos), _expected_at(text, pos, context), None
        )
    # `2bucket` lexes as `2` then `bucket`; show the whole word
    found = _word_at(text, pos) if _is_word_char(str(tok)[:1]) else str(tok)
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


def _is_word_char(ch: str) -> bool:
    return len(ch) == 1 and (ch.isascii() and (ch.isalnum() or ch == "_"))


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
    header = _BLOCK_HEADER.match(text)
    if header:
        word = header.group(1)
        col = header.start(1) + 1
        span = Span(path, lineno, col, lineno, col + len(word))
        if _nested_block_end(lines, lineno) is not None:
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
    if _MESH_LINE.match(text):
        col = text.index("mesh") + 1
        return Diagnostic(
            Span(path, lineno, col, lineno, col + 4),
            f"`mesh` cannot appear inside the `{block}` block",
            hint="statements go at the top level; move it above the block",
        )
    return None


def _nested_block_end(lines: list[str], lineno: int) -> int | None:
    """For a block header on `lineno` inside another block: the last line of the inner block,
    if the outer block is closed after it (the user nested blocks), else None (a `}` is missing)."""
    inner = _block_openers(lines[lineno - 1 :])
    end = next((j for j in range(1, len(inner)) if inner[j] is None), None)
    if end is None:
        return None
    last = lineno - 1 + end
    outer = _block_openers(lines[last:], inside=(lineno, 1))
    for k in range(len(outer) - 1):
        if outer[k + 1] is None:
            return last  # the outer block closes on line last + k + 1
        if _BLOCK_HEADER.match(lines[last + k]) or _MESH_LINE.match(lines[last + k]):
            return None  # the next statement comes first: the outer block was never closed
    return None


# ---------------------------------------------------------------------------- recovery


def _block_openers(
    lines: list[str], *, inside: tuple[int, int] | None = None
) -> list[tuple[int, int] | None]:
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


def _repair(text: str, e: UnexpectedInput, *, lines: list[str], openers: list[tuple[int, int] | None]) -> str:
    """Change the text so that the next parse gets past this error; line and column numbers stay.

    - The file ends inside a block: close it.
    - A block inside a block: blank it if the outer block is closed after it; otherwise a `}`
      is missing, so close the outer block on the line before.
    - Anything else: blank the line, or more, see `_blank_statement_or_entry`.
    """
    if _at_end(e):
        # only a block can be left open at the end, and blocks do not nest
        return text + "}\n" if openers[-1] is not None else text
    lineno = _error_line(e, lines)
    if openers[lineno - 1] is not None and _BLOCK_HEADER.match(lines[lineno - 1]):
        nested_end = _nested_block_end(lines, lineno)
        if nested_end is not None:
            return _blank_lines(text, lineno, nested_end)
        lines = list(lines)
        lines[lineno - 2] = lines[lineno - 2].split("#", 1)[0].rstrip() + " }"
        return "\n".join(lines)
    return _blank_statement_or_entry(text, lineno, lines=lines, openers=openers)


def _blank_statement_or_entry(
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
    openers = _block_openers(lines) if openers is None else openers
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
        if code.strip() and (not code[0].isspace() or _BLOCK_HEADER.match(code) or _MESH_LINE.match(code)):
            return None
    return len(lines)


def _blank_lines(text: str, first: int, last: int) -> str:
    lines = text.split("\n")
    for i in range(first - 1, min(last, len(lines))):
        lines[i] = ""
    return "\n".join(lines)
