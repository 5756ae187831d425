"""Capture a model as an fx graph with torch.export.

Two steps, kept apart so that tests and the Python API can skip the first (`load.py`):

    source = load_model("examples/models/llama.py:build")
    captured = capture(source.model, source.args, source.kwargs)

`capture` uses `torch.export.export(..., strict=False)` with the token inputs' batch and
sequence dims dynamic (`Dim("batch")`, `Dim("seq")`, shared by every (B, T) integer input;
a model without token inputs, such as a vision model's `(pixels, labels)`, has dim 0 of every
batched input as `Dim("batch")` and no sequence):
sizes that follow from them are symbols in the graph (`s72*s38`), and view sizes read them
with `sym_size` nodes, so one graph serves every batch and sequence length. A model whose
code fixes them (a size compared with a constant) is captured with its example shapes
instead, and `Captured.static_reason` says why. Since PyTorch 2.6 it returns
the training IR: non-functional ATen before autograd and before decompositions, so
`aten.linear` and `aten.scaled_dot_product_attention` survive, the graph still reads
like the model, and `program.module()` trains (parameters stay `nn.Parameter`s).
Non-strict mode traces with real Python, which is what Hugging Face models need.

Plan rules name module paths (`layers.*.mlp.up_proj`), so each call_function node is
tagged with the module that produced it, spelled as `model.named_modules()` spells it:
`node.meta["meshplan.module"] == "layers.0.mlp.up_proj"`; "" is the root module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import math
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.export import ExportedProgram

from .errors import CaptureError, ModelLoadError
from .load import (
    ModelSource,
    _describe,
    _display,
    batch_rows,
    describe_inputs,
    is_batched,
    is_token_input,
    max_positions,
)
from .meta import module_tag, set_module_tag
from .passes.experts.units import experts_pattern


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """What the planner needs to know about a parameter or buffer without holding the tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    # Other names of the same tensor: tied weights (e.g. `lm_head.weight` for `wte.weight`).
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenDims:
    """The token inputs' batch and sequence length as symbols of the captured graph.

    Export names its symbols itself (`s72`, `s38`); `named` spells an expression over them with
    `batch` and `seq` (`s72*s38` -> `batch*seq`), the names messages and program.pt use. A model
    whose inputs have no sequence (images) has `seq` None, and 1 for it in `example`.
    """

    batch: sympy.Symbol
    seq: sympy.Symbol | None
    example: tuple[int, int]  # (batch, seq) of the inputs captured with: every symbol's hint
    max_seq: int | None  # the model's position limit, if its config has one

    def named(self, expr: sympy.Expr | int) -> sympy.Expr:
        names = {self.batch: BATCH} | ({self.seq: SEQ} if self.seq is not None else {})
        return sympy.sympify(expr).subs(names)

    def hint(self, expr: sympy.Expr | int) -> int:
        """`expr`'s value at the example shape."""
        values = {self.batch: self.example[0]} | ({self.seq: self.example[1]} if self.seq is not None else {})
        return int(sympy.sympify(expr).subs(values))


# The names of the token dims in expressions meshplan keeps (`TokenDims.named`, program.pt).
BATCH, SEQ = (
    sympy.Symbol("batch", integer=True, positive=True),
    sympy.Symbol("seq", integer=True, positive=True),
)


@dataclass(frozen=True)
class Divisibility:
    """A size that depends on the token shape and that the program cuts into `by` equal pieces
    (a sequence over the tensor-parallel ranks): a run's shapes must make it divide."""

    size: sympy.Expr  # over BATCH and SEQ: `seq`, `batch*seq`
    by: int
    why: str  # "`sequence over tp` cuts each sequence into 2 shards"
    where: str  # `file:line` of the plan rule behind it, or ""


@dataclass(frozen=True)
class TokenShapes:
    """The (batch, seq) a dynamic program serves: any within the model's limit for which every
    size it cuts divides. `example` is what it was captured with (the ledger's shapes)."""

    example: tuple[int, int]
    max_seq: int | None = None
    divisible: tuple[Divisibility, ...] = ()

    def problems(self, batch: int, seq: int) -> list[str]:
        """Why the program cannot run at (batch, seq), one sentence each; [] if it can."""
        out = []
        if batch < 1 or seq < 1:
            out.append(f"--batch {batch} --seq {seq}: sizes must be at least 1")
        if self.max_seq is not None and seq > self.max_seq:
            out.append(f"--seq {seq} is longer than the model's {self.max_seq} positions")
        for d in self.divisible:
            size = int(d.size.subs({BATCH: batch, SEQ: seq}))
            if size % d.by:
                what = f"--{d.size} {size}" if d.size in (BATCH, SEQ) else f"{d.size} = {size}"
                where = f" ({d.where})" if d.where else ""
                out.append(f"{what} does not divide by {d.by}: {d.why}{where}")
        return out

    def multiples(self) -> tuple[int, int]:
        """The smallest (batch, seq) steps every divisibility holds for (seq 2 under sp over 2)."""
        b = s = 1
        for d in self.divisible:
            if d.size == SEQ:
                s = math.lcm(s, d.by)
            elif d.size == BATCH:
                b = math.lcm(b, d.by)
        return b, s


@dataclass(frozen=True)
class Captured:
    """A captured model: the exported program plus the module facts that plan rules refer to."""

    program: ExportedProgram
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    # name of each call_function node of the top-level graph -> module path ("" is the root)
    node_modules: dict[str, str]
    # every `model.named_modules()` path, in that order, with the module's class
    modules: dict[str, type[nn.Module]]
    # parameters and buffers by canonical name (the first of `named_parameters()`)
    parameters: dict[str, ParamInfo]
    buffers: dict[str, ParamInfo]
    dims: TokenDims | None = None  # None: captured with the example's shapes
    static_reason: str = ""  # why the shapes are the example's, when `dynamic` was asked for

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.program.graph_module

    def parameter(self, name: str) -> ParamInfo:
        """The parameter called `name` or one of its tied aliases.

        Export gives each name of a tied weight its own placeholder (`p_wte_weight` and
        `p_lm_head_weight`), so a graph's parameter names can be aliases.
        """
        if name in self.parameters:
            return self.parameters[name]
        for info in self.parameters.values():
            if name in info.aliases:
                return info
        raise KeyError(name)

    def nodes_under(self, path: str) -> list[fx.Node]:
        """Top-level call_function nodes produced by module `path` or by modules inside it."""
        return [
            node
            for node in self.graph_module.graph.nodes
            if node.name in self.node_modules and _is_within(self.node_modules[node.name], path)
        ]


def capture(
    model: nn.Module,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic: bool = False,
) -> Captured:
    """Export `model` called as `model(*args, **kwargs)` and tag every node with its module path.

    With `dynamic`, the batch and sequence dims of the token inputs are symbols (see the
    module docstring); when export cannot keep them symbolic the capture is static and
    `static_reason` says why. The model's train/eval mode is kept: in train mode dropout is
    part of the graph, which is what a training program needs.
    """
    kwargs = dict(kwargs or {})
    program, dims, static_reason = None, None, ""
    with _cast_at_ops(model):
        if dynamic:
            program, dims, static_reason = _export_dynamic(model, tuple(args), kwargs)
        if program is None:
            program = _export(model, tuple(args), kwargs)
    paths = _ModulePaths.of(model)
    node_modules = _tag_nodes(program.graph_module, paths)
    return Captured(
        program=program,
        model=model,
        args=tuple(args),
        kwargs=kwargs,
        node_modules=node_modules,
        modules={path: type(module) for path, module in model.named_modules()},
        parameters=_tensor_infos(model.named_parameters(remove_duplicate=False)),
        buffers=_tensor_infos(model.named_buffers(remove_duplicate=False)),
        dims=dims,
        static_reason=static_reason,
    )


# The ops `torch.autocast` runs in the lower precision: their float32 operands are cast to it.
_AUTOCAST_OPS = {
    torch.nn.functional.linear,
    torch.conv1d,
    torch.conv2d,
    torch.conv3d,
    torch.conv_transpose1d,
    torch.conv_transpose2d,
    torch.conv_transpose3d,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    torch.nn.functional.scaled_dot_product_attention,
}


class _CastToCompute(torch.overrides.TorchFunctionMode):
    """Autocast's rule at the ops it runs in the lower precision, recorded in the graph: a
    float32 operand of a linear, a convolution, a matmul or attention is cast to `dtype` there.
    A model captured in a plan's compute dtype (its weights bf16) that makes float32
    activations itself (float images in, `pixels.float()`) then computes as it would under
    `torch.autocast`, instead of stopping at a dtype mismatch; the cast is a graph node."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _AUTOCAST_OPS:
            floats = [
                x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.is_floating_point()
            ]
            if any(x.dtype == self.dtype for x in floats) and any(x.dtype == torch.float32 for x in floats):

                def cast(x: Any) -> Any:
                    is_float32 = isinstance(x, torch.Tensor) and x.dtype == torch.float32
                    return x.to(self.dtype) if is_float32 else x

                args = tuple(cast(a) for a in args)
                kwargs = {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _cast_at_ops(model: nn.Module) -> contextlib.AbstractContextManager:
    """`_CastToCompute` for a model whose floating parameters are 16-bit (captured in a plan's
    compute dtype), else nothing."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    low = dtypes & {torch.bfloat16, torch.float16}
    return _CastToCompute(low.pop()) if len(low) == 1 else contextlib.nullcontext()


def token_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The (B, T) integer inputs of a call: token ids, labels, an attention mask."""
    return [x for x in [*args, *kwargs.values()] if is_token_input(x)]


def _export_dynamic(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[ExportedProgram | None, TokenDims | None, str]:
    """Export with the token inputs' (batch, seq) symbolic: the program and its symbols, or
    (None, None, why not) when the model fixes them (the caller exports statically)."""
    tokens = token_tensors(args, kwargs)
    if not tokens:
        return _export_batch_dynamic(model, args, kwargs)
    example = tuple(tokens[0].shape)
    if any(tuple(t.shape) != example for t in tokens):
        return None, None, "its token inputs differ in shape"
    if min(example) < 2:  # export specializes a size-1 example to 1
        return None, None, f"the example shape {example} has a size 1"
    limit = max_positions(model)
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("seq", min=1, max=limit[1]) if limit else torch.export.Dim("seq", min=1)
    shapes = torch.export.ShapesCollection()
    for t in tokens:
        shapes[t] = {0: batch, 1: seq}
    program, why = _export_shaped(model, args, kwargs, shapes)
    if program is None:  # a constraint violated (the model fixes a size), or anything else
        return None, None, why
    symbols = _token_symbols(program, example)
    if symbols is None:
        return None, None, "export kept the token shapes concrete"
    return program, TokenDims(*symbols, (int(example[0]), int(example[1])), limit[1] if limit else None), ""


def _export_shaped(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: torch.export.ShapesCollection
) -> tuple[ExportedProgram | None, str]:
    """Export with the dims `shapes` names symbolic: the program, or None and why not."""
    try:
        with _export_printing() as printed:
            program = torch.export.export(
                model,
                args,
                kwargs=kwargs,
                strict=False,
                dynamic_shapes=shapes.dynamic_shapes(model, args, kwargs),
            )
    except Exception as exc:
        return None, _describe(exc) + _stopped_at(printed)
    return program, ""


def _export_batch_dynamic(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[ExportedProgram | None, TokenDims | None, str]:
    """`_export_dynamic` for a model without token inputs: dim 0 of every batched input (images
    and their labels) is `Dim("batch")`; there is no sequence."""
    rows = batch_rows(args, kwargs)
    batched = [x for x in (*args, *kwargs.values()) if is_batched(x, rows)]
    if rows is None or not batched:
        return None, None, "the model has no batched tensor inputs"
    if rows < 2:  # export specializes a size-1 example to 1
        return None, None, f"the example batch is {rows}"
    batch = torch.export.Dim("batch", min=1)
    shapes = torch.export.ShapesCollection()
    for x in batched:
        shapes[x] = {0: batch}
    program, why = _export_shaped(model, args, kwargs, shapes)
    if program is None:  # the model fixes the batch, or anything else: captured static
        return None, None, why
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 1:
            size = val.shape[0]
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                return program, TokenDims(size.node.expr, None, (rows, 1), None), ""
    return None, None, "export kept the batch concrete"


def _token_symbols(
    program: ExportedProgram, example: tuple[int, ...]
) -> tuple[sympy.Symbol, sympy.Symbol] | None:
    """Export's symbols for batch and seq: the sizes of a (B, T) integer input placeholder."""
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor) or val.dim() != 2:
            continue
        b, t = val.shape
        if isinstance(b, torch.SymInt) and isinstance(t, torch.SymInt):
            eb, et = b.node.expr, t.node.expr
            if isinstance(eb, sympy.Symbol) and isinstance(et, sympy.Symbol) and eb != et:
                return eb, et
    return None


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ExportedProgram:
    # Before 2.6, `export` returned the inference IR and the training IR had its own name.
    export = torch.export.export
    if torch.__version__ < "2.6":  # pragma: no cover - the CI runs a newer torch
        export = torch.export.export_for_training  # type: ignore[attr-defined]
    try:
        with _export_printing() as printed:
            return export(model, args, kwargs=kwargs, strict=False)
    except Exception as exc:
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {_describe(exc)}{_stopped_at(printed)}",
            hint=_capture_hint(exc, model),
        ) from exc


@contextlib.contextmanager
def _export_printing() -> Iterator[io.StringIO]:
    """What export prints, held: on a data-dependent decision it prints the graph traced so far
    (hundreds of lines), of which the error keeps the line of the user's code it stopped at
    (`_stopped_at`); whatever it prints when it succeeds is passed on."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        yield printed
    sys.stderr.write(printed.getvalue())


def _stopped_at(printed: io.StringIO) -> str:
    """' at model.py:16 (`if rows.numel() == 0:`)': the last line of the model's code in the
    graph export printed before it stopped, or ''."""
    found = re.findall(r"# File: (.+?):(\d+) in \w+, code: (.*)", printed.getvalue())
    if not found:
        return ""
    file, line, code = found[-1]
    return f" at {_display(file)}:{line} (`{code.strip()}`)"


def _capture_hint(exc: Exception, model: nn.Module) -> str:
    if "Cache" in str(exc):
        return "the model returns a KV cache; call it with use_cache=False (a training graph has none)"
    if "data-dependent" in str(exc):
        hint = (
            "the model decides there on a value that depends on the data, which one graph cannot "
            "hold; write it without the decision (a loop over experts that skips those with no "
            "tokens, `if rows.numel() == 0: continue`, computes the same without the `if`)"
        )
        experts = experts_pattern(model)
        if experts:
            hint += (
                f"; if it is the loop of an experts module, a rule `{experts}: experts over AXIS` "
                "captures that module as one unit without reading its loop (over an axis of one "
                "rank its experts stay whole)"
            )
        return hint
    return (
        "meshplan captures with torch.export.export(model, args, kwargs, strict=False); "
        "run that by hand to see the full error"
    )


@dataclass(frozen=True)
class _ModulePaths:
    """Resolves the module paths export writes in `nn_module_stack` to `named_modules()` paths."""

    known: frozenset[str]
    by_mangled: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module) -> _ModulePaths:
        known = frozenset(path for path, _ in model.named_modules())
        return cls(known, {_mangle(path): path for path in known})

    def resolve(self, raw: str) -> str:
        path = dotted_module_path(raw)
        if path in self.known:
            return path
        # Dynamo sometimes leaves only an identifier such as "L__self___layers_0_mlp".
        mangled = re.sub(r"^(L__self___?|self_)", "", _mangle(raw))
        return self.by_mangled.get(mangled, path)


def dotted_module_path(raw: str) -> str:
    """Spell a module path from `nn_module_stack` as `named_modules()` does.

    Recent torch already writes "layers.0.mlp"; older versions and strict mode have written
    "L['self'].layers[0].mlp", "L['self']._modules['layers']._modules['0']" or
    "getattr(L['self'].layers, '0').mlp". All of these become "layers.0.mlp".
    """
    text = raw
    while (unwrapped := _GETATTR.sub(r"\1.\2", text)) != text:
        text = unwrapped
    text = _INDEX.sub(r".\1", text)
    parts = [part for part in text.split(".") if part and part != "_modules"]
    if parts[:2] == ["L", "self"]:
        parts = parts[2:]
    elif parts[:1] in (["L__self__"], ["self"]):
        parts = parts[1:]
    return ".".join(parts)


_GETATTR = re.compile(r"getattr\((.+?),\s*['\"]([^'\"]+)['\"]\)")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def _mangle(path: str) -> str:
    return re.sub(r"\W", "_", path)


def _tag_nodes(gm: fx.GraphModule, paths: _ModulePaths) -> dict[str, str]:
    """Tag call_function nodes with their module path, nested graphs included; map the top-level ones."""
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule):
            for node in sub.graph.nodes:
                if node.op == "call_function":
                    set_module_tag(node, _innermost_module(node, paths))
    return {node.name: module_tag(node) or "" for node in gm.graph.nodes if node.op == "call_function"}


def _innermost_module(node: fx.Node, paths: _ModulePaths) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        # Export gives every traced op a stack; an op it adds itself belongs to the whole model.
        return ""
    raw_path, _type = list(stack.values())[-1]
    return paths.resolve(raw_path)


def _tensor_infos(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, ParamInfo]:
    """Group names by tensor identity: the first name is canonical, the rest are its aliases."""
    names_by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in named:
        names_by_tensor.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    infos: dict[str, ParamInfo] = {}
    for key, (first, *aliases) in names_by_tensor.items():
        tensor = tensors[key]
        infos[first] = ParamInfo(
            name=first,
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
            requires_grad=tensor.requires_grad,
            aliases=tuple(aliases),
        )
    return infos


def _is_within(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def bind_inputs(model: torch.nn.Module, graph: fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The compiled graph's placeholders, filled from a call of the model's forward."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name, param in inspect.signature(model.forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            values.update(values.pop(name, {}))
    return [values[node.target] for node in graph.graph.nodes if node.op == "placeholder"]


def with_token_shape(
    source: ModelSource, *, batch: int | None = None, seq: int | None = None, seq_asked: bool = True
) -> ModelSource:
    """The same model with its token inputs reshaped to (batch, seq): the graph is compiled for
    the shapes it will run with (per data-parallel rank, per microbatch).

    Every integer tensor argument of shape (B, T) (input ids, labels) is replaced by fresh
    token ids in the range the original used; other arguments are kept. A `seq` beyond the
    positions the model's config allows is refused here, before capture fails on it or (a
    learned position table, which export does not bounds-check) training does.

    A model without token inputs (`model(pixels, labels)`) has no sequence: `batch` repeats the
    example's rows of every batched input (dim 0) up to `batch`, and a `seq` the user asked for
    (`seq_asked`; a default is ignored) is refused, located at its `example_inputs()`.
    """
    if batch is None and seq is None:
        return source
    if not token_tensors(source.args, source.kwargs):
        return _with_batch(source, batch, seq if seq_asked else None)
    limit = max_positions(source.model)
    if seq is not None and limit is not None and seq > limit[1]:
        field_name, positions = limit
        raise ModelLoadError(
            f"--seq {seq} is longer than {source.spec!r} allows: its config.{field_name} is {positions}",
            hint=f"pass --seq {positions} or less, or build the model with {field_name} >= {seq}",
        )

    def reshape(x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point()):
            return x
        b = batch if batch is not None else x.shape[0]
        t = seq if seq is not None else x.shape[1]
        high = int(x.max()) + 1 if x.numel() else 2
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, max(high, 2), (b, t), generator=generator, dtype=x.dtype)

    args = tuple(reshape(a) for a in source.args)
    kwargs = {k: reshape(v) for k, v in source.kwargs.items()}
    unchanged = all(a is b for a, b in zip(args, source.args, strict=True))
    if unchanged and all(kwargs[k] is source.kwargs[k] for k in kwargs):
        raise ModelLoadError(
            f"--batch/--seq: {source.spec!r} has no (batch, seq) token inputs to reshape",
            hint="define example_inputs() in the model file with the shapes you want",
        )
    return dataclasses.replace(source, args=args, kwargs=kwargs)


def _with_batch(source: ModelSource, batch: int | None, seq: int | None) -> ModelSource:
    """`with_token_shape` of a model whose inputs have no sequence: dim 0 of its batched inputs
    made `batch` by repeating the example's rows (their values are the example's own)."""
    where = f"{source.inputs_from}: " if source.inputs_from else ""
    inputs = describe_inputs(source.model, source.args, source.kwargs) or "none"
    if seq is not None:
        raise ModelLoadError(
            f"{where}--seq {seq}: the inputs of {source.spec!r} have no sequence to set ({inputs})",
            hint="leave out --seq; --batch sets dim 0 of every batched input",
        )
    rows = batch_rows(source.args, source.kwargs)
    if batch is None or batch == rows:
        return source
    if rows is None:
        raise ModelLoadError(
            f"{where}--batch {batch}: {source.spec!r} has no batched tensor inputs to reshape ({inputs})",
            hint="define example_inputs() in the model file with the shapes you want",
        )
    take = torch.arange(batch) % rows

    def repeat(x: Any) -> Any:
        if not is_batched(x, rows):
            return x
        return x.new_empty((batch, *x.shape[1:])) if x.device.type == "meta" else x[take]

    args = tuple(repeat(a) for a in source.args)
    kwargs = {k: repeat(v) for k, v in source.kwargs.items()}
    return dataclasses.replace(source, args=args, kwargs=kwargs)
