"""Lark parse tree -> the frozen syntax tree of `dsl.ast`: one method per grammar rule.

A value the grammar admits but the AST cannot hold (a 13-digit number, a 200-character
name) raises `NodeError` with its diagnostic; `dsl.parser` reports it like a syntax error
and parses on.
"""

from __future__ import annotations

import re

from lark import Token, Transformer, v_args

from . import ast
from .errors import Diagnostic, Span
from .lalr import tok_span
from .limits import FP32_MAX, MAX_BUCKET_BYTES, MAX_INT, MAX_NAME


class NodeError(Exception):
    def __init__(self, diagnostic: Diagnostic):
        self.diagnostic = diagnostic


@v_args(inline=True, meta=True)
class ToAst(Transformer):
    """One method per grammar rule; each returns the AST node for that rule."""

    def __init__(self, path: str, text: str):
        super().__init__()
        self.path = path
        self.lines = text.split("\n")

    def _span(self, meta) -> Span:
        return Span(self.path, meta.line, meta.column, meta.end_line, meta.end_column)

    def _name(self, tok: Token) -> ast.Name:
        if len(tok) > MAX_NAME:
            raise NodeError(
                Diagnostic(
                    tok_span(self.path, tok),
                    f"name `{tok[:16]}...` is {len(tok):,} characters long",
                    hint=f"a name can be 1 to {MAX_NAME} characters",
                )
            )
        return ast.Name(str(tok), tok_span(self.path, tok))

    def _int(self, tok: Token, what: str, allowed: str) -> int:
        """An INT (all digits) of at most 12 digits; `allowed` names the whole range, for the hint.

        Lower bounds are the checker's; here only absurd sizes, a user mistake, not a crash.
        """
        if len(tok.lstrip("0")) > len(str(MAX_INT)):  # leading zeros are harmless
            raise NodeError(
                Diagnostic(
                    tok_span(self.path, tok),
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
            raise NodeError(
                Diagnostic(
                    tok_span(self.path, tok),
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
        return ast.Rule(ast.Pattern(str(pattern), tok_span(self.path, pattern)), action, self._span(meta))

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
        return ast.Cut(side, ast.Pattern(str(pattern), tok_span(self.path, pattern)), self._span(meta))

    def cut_side(self, meta, tok):
        return str(tok)

    # -- data parallel
    def data_parallel(self, meta, axis, *rest):
        more = tuple(self._name(t) for t in rest if isinstance(t, Token))
        items = tuple(i for i in rest if not isinstance(i, Token))
        return ast.DataParallelBlock(self._name(axis), items, self._span(meta), more)

    def zero(self, meta, tok, *over):
        stage = self._int(tok, "ZeRO stage", "0, 1, 2 or 3")
        if not over:
            return self._setting(meta, "zero", stage, str(tok))
        names = tuple(self._name(t) for t in over)
        text = f"{tok} over " + " x ".join(n.text for n in names)
        return self._setting(meta, "zero", ast.ZeroStage(stage, names), text)

    def bucket(self, meta, tok):
        size = parse_size(str(tok))
        if size > MAX_BUCKET_BYTES:
            raise NodeError(
                Diagnostic(
                    tok_span(self.path, tok),
                    f"bucket size {_shown(str(tok))} is too large",
                    hint="bucket size can be 1B to 1TiB",
                )
            )
        return self._setting(meta, "bucket", size, _normal_size(str(tok)))

    def offload(self, meta, *targets):
        if targets == (None,):
            return self._setting(meta, "offload", (), "none")
        return self._setting(meta, "offload", tuple(targets), ", ".join(targets))

    def offload_target(self, meta, what, colon=None, tier=None):
        # "optimizer" or "optimizer:disk": `:cpu` is the default, so it reads as no tier at all
        return str(what) if tier is None or str(tier) == "cpu" else f"{what}:{tier}"

    def offload_none(self, meta):
        return None

    def compress(self, meta, method, *args):
        value = ast.Compression(self._name(method), tuple(args))
        text = str(method) + (f"({', '.join(f'{a.name.text}={a.value}' for a in args)})" if args else "")
        return self._setting(meta, "compress", value, text)

    def compress_arg(self, meta, name, tok):
        value = self._int(tok, f"`{name}`", f"0 to {MAX_INT:,}")
        return ast.CompressArg(self._name(name), value, self._span(meta))

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

    def optimizer(self, meta, name, *args):
        value = ast.OptimizerChoice(self._name(name), tuple(args))
        text = str(name) + (f"({', '.join(f'{a.name.text}={a.text}' for a in args)})" if args else "")
        return self._setting(meta, "optimizer", value, text)

    def optimizer_arg(self, meta, name, number):
        unsigned = number.update(value=number.lstrip("-"))  # the limit is the magnitude's
        magnitude = self._number(unsigned, f"`{name}`", FP32_MAX, "fp32's largest, 3.4e38")
        value = -magnitude if number.startswith("-") else magnitude
        return ast.OptimizerArg(self._name(name), value, str(number), self._span(meta))

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
