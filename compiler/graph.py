"""Helpers over captured fx graphs: cleaning what export leaves behind, and reading node facts.

Facts the compiler adds live in `node.meta` under namespaced keys:

    meshplan.placement   {axis: Placement} of the node's output (tensor parallel pass)
    meshplan.rule        the PlanRule that decided it (for messages and `explain`)
    meshplan.collective  on inserted collective nodes: kind, axis, dim, and the rule behind it
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TypeGuard, TypeVar

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true

try:
    from torch.fx.experimental.symbolic_shapes import _ShapeEnvGuardError
except ImportError:  # torch before `ShapeEnv.error_on_new_guards`: `_error_on_new_guards` below raises it

    class _ShapeEnvGuardError(RuntimeError):  # type: ignore[no-redef]
        pass


from torch.fx.node import Argument

from .causal import causal_masks
from .meta import module_tag

_NOISE = {
    torch.ops.aten._assert_tensor_metadata.default,
}


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Make an exported module's graph plain: flat inputs and outputs, no guard or assert nodes.

    `ExportedProgram.module()` wraps the graph in pytree (un)flattening and calls a guard
    function on the inputs; the compiled per-rank program is called with flat tensors and
    returns a flat tuple, so its printed code is just the computation. A GQA repeat is written as
    the `repeat_interleave` it computes, and an attention mask that is the causal mask as
    `is_causal=True` (`causal.py`).
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if (node.op == "call_module" and node.target == "_guards_fn") or (
            node.op == "call_function" and node.target in _NOISE and not node.users
        ):
            graph.erase_node(node)
    _repeats_as_repeat_interleave(graph)
    causal_masks(gm)
    graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    return gm


def _repeats_as_repeat_interleave(graph: fx.Graph) -> None:
    """Write each `x.unsqueeze(d).expand(..., r, ...).reshape(...)` that merges the new dim into
    dim d-1 as the `x.repeat_interleave(r, d - 1)` it computes. Hugging Face's eager attention
    repeats its key/value heads for GQA this way (`repeat_kv`); the passes then see one GQA
    repeat however the model wrote it (context parallelism moves the heads unrepeated)."""
    aten = torch.ops.aten
    for reshape in list(graph.nodes):
        if reshape.target not in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
            continue
        expand = reshape.args[0]
        if not (
            isinstance(expand, fx.Node) and expand.target is aten.expand.default and len(expand.users) == 1
        ):
            continue
        unsqueeze = expand.args[0]
        if not (
            isinstance(unsqueeze, fx.Node)
            and unsqueeze.target is aten.unsqueeze.default
            and len(unsqueeze.users) == 1
        ):
            continue
        x = unsqueeze.args[0]
        if not isinstance(x, fx.Node) or not isinstance(value(x), torch.Tensor):
            continue
        sizes, d = list(value(x).shape), as_int(unsqueeze.args[1])
        d = d + len(sizes) + 1 if d < 0 else d
        expanded, merged = list(value(expand).shape), list(value(reshape).shape)
        r = expanded[d] if 0 < d < len(expanded) else None
        if not isinstance(r, int) or r < 1 or len(merged) != len(sizes):
            continue
        want = [*sizes[: d - 1], sizes[d - 1] * r, *sizes[d:]]
        if not all(known_equal(a, b) for a, b in zip(expanded[:d] + expanded[d + 1 :], sizes, strict=True)):
            continue
        if not all(known_equal(a, b) for a, b in zip(merged, want, strict=True)):
            continue
        with graph.inserting_before(reshape):
            repeat = graph.call_function(aten.repeat_interleave.self_int, (x, r, d - 1))
        repeat.meta.update(reshape.meta)
        reshape.replace_all_uses_with(repeat)
        for dead in (reshape, expand, unsqueeze):
            graph.erase_node(dead)


def module_path(node: fx.Node) -> str:
    """The dotted path of the innermost module the node was traced in ('' for the root)."""
    tag = module_tag(node)
    if tag is not None:  # tagged by capture, normalized to named_modules() spelling
        return tag
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


V = TypeVar("V")


def innermost(path: str, by_path: Mapping[str, V]) -> V | None:
    """The value `by_path` has for the innermost module enclosing `path` (itself included, up
    to the root, ''): the rule of a module a node runs in, its region's dtype."""
    while True:
        if path in by_path:
            return by_path[path]
        if not path:
            return None
        path = path.rpartition(".")[0]


def value(node: fx.Node):
    """The FakeTensor (or tuple of them) export recorded for the node's output, if any."""
    return node.meta.get("val")


def as_node(arg: Argument, *, of: fx.Node | None = None) -> fx.Node:
    """`arg`, an argument the op's schema makes a tensor: a node of the graph. Anything else is
    a bug in meshplan (a pass broke the graph), not a user error; `of` names the node for it."""
    if not isinstance(arg, fx.Node):
        raise AssertionError(f"{_where(of)}expected a graph node as a tensor argument, got {arg!r}")
    return arg


def arg_node(node: fx.Node, i: int) -> fx.Node:
    """`node.args[i]`, a tensor argument: a node of the graph."""
    return as_node(node.args[i], of=node)


def optional_arg_node(node: fx.Node, i: int) -> fx.Node | None:
    """`node.args[i]`, an optional tensor argument (`Tensor?`, a bias): None if absent or None."""
    arg = node.args[i] if len(node.args) > i else None
    return None if arg is None else as_node(arg, of=node)


def as_int(arg: Argument, *, of: fx.Node | None = None) -> int:
    """`arg`, an argument the op's schema makes an `int` (a dim, a count)."""
    if not isinstance(arg, int):
        raise AssertionError(f"{_where(of)}expected an int argument, got {arg!r}")
    return arg


def as_list(arg: Argument, *, of: fx.Node | None = None) -> list[Argument]:
    """`arg`, an argument the op's schema makes a list (`int[]`, `SymInt[]` sizes, `Tensor[]`)."""
    if not isinstance(arg, (list, tuple)):
        raise AssertionError(f"{_where(of)}expected a list argument, got {arg!r}")
    return list(arg)


def _where(node: fx.Node | None) -> str:
    return f"{describe(node)}: " if node is not None else ""


def is_tensor_node(node: object) -> TypeGuard[fx.Node]:
    return isinstance(node, fx.Node) and isinstance(value(node), torch.Tensor)


def shape(node: fx.Node) -> tuple[int | torch.SymInt, ...]:
    """The node's sizes: ints, except data-dependent ones (a token count per expert), which
    stay symbolic. Passes never guard on those: a size used in arithmetic must be an int."""
    return tuple(size_of(s) for s in value(node).shape)


def size_of(s: int | torch.SymInt) -> int | torch.SymInt:
    if isinstance(s, int):
        return s
    known = s.node.maybe_as_int()
    return s if known is None else known


def is_static(node: fx.Node) -> bool:
    """Whether every size of the node's output is known at compile time."""
    return all(isinstance(s, int) for s in shape(node))


# Sizes that follow from the batch and sequence length are backed `SymInt`s (captured with
# dynamic shapes): comparing one with `==` or `%` would quietly decide for the example shape
# (a guard). Passes compare sizes with these instead, and run under `no_new_guards`, which
# makes any comparison they missed an error (`ShapeGuardError`) rather than a specialization.


def known_equal(a: int | torch.SymInt, b: int | torch.SymInt) -> bool:
    """Whether two sizes are equal for every batch and sequence length."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def divides(n: int, size: int | torch.SymInt) -> bool | None:
    """Whether `n` divides `size`: True or False when that holds for every batch and sequence
    length, None when it depends on them (a sequence length over a tensor-parallel size)."""
    if isinstance(size, int):
        return size % n == 0
    if statically_known_true(size % n == 0):
        return True
    if statically_known_true(size % n != 0):
        return False
    return None


def hint(size: int | torch.SymInt) -> int | None:
    """A size's value at the example inputs (None for a data-dependent size)."""
    if isinstance(size, int):
        return size
    return size.node.hint if size.node.has_hint() else None


def size_text(size: int | torch.SymInt) -> str:
    """A size as messages and printed programs show it: `64`, `seq`, `batch*seq`, `u0`."""
    if isinstance(size, int):
        return str(size)
    env = size.node.shape_env
    names = {
        symbol: sympy.Symbol(env.source_name_to_debug_name[source.name])
        for symbol, sources in env.var_to_sources.items()
        for source in sources
        if source.name in env.source_name_to_debug_name
    }
    return str(size.node.expr.xreplace(names))


def shape_text(node: fx.Node) -> str:
    """`(batch, seq, 64)`: the node's shape with the token dims named."""
    sizes = [size_text(s) for s in shape(node)]
    return f"({sizes[0]},)" if len(sizes) == 1 else f"({', '.join(sizes)})"


def shape_env(gm: fx.GraphModule) -> ShapeEnv | None:
    """The symbolic shape environment of a captured graph, if any of its sizes are symbols."""
    for node in gm.graph.nodes:
        val = value(node)
        if isinstance(val, torch.Tensor):
            for s in val.shape:
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
    return None


class ShapeGuardError(Exception):
    """A pass needed a size that depends on the batch or sequence length to be a constant."""

    def __init__(self, where: str, guard: str):
        super().__init__(f"{where} needs {guard}")
        self.where, self.guard = where, guard


@contextlib.contextmanager
def no_new_guards(gm: fx.GraphModule) -> Iterator[None]:
    """Inside, a decision on a symbolic size that would hold only for the example shape raises
    `ShapeGuardError` (from `torch`'s own guard machinery) instead of specializing the graph."""
    env = shape_env(gm)
    if env is None:
        yield
        return
    try:
        with _error_on_new_guards(env):
            yield
    except _ShapeEnvGuardError as e:
        raise ShapeGuardError("a pass", _guard_text(e)) from e


@contextlib.contextmanager
def _error_on_new_guards(env: ShapeEnv) -> Iterator[None]:
    """`env.error_on_new_guards()`, or on a torch without it the same through the hook a frozen
    ShapeEnv calls on each new guard (`_check_frozen`, which there only counts it)."""
    if hasattr(env, "error_on_new_guards"):
        with env.error_on_new_guards():
            yield
        return

    def refuse(expr, concrete_val) -> None:
        raise _ShapeEnvGuardError(
            f"Guard attempted while ShapeEnv guards are frozen: {expr} == {concrete_val}"
        )

    frozen = env.frozen
    env.frozen, env._check_frozen = True, refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        env.frozen = frozen
        del env._check_frozen


def _guard_text(e: Exception) -> str:
    text = str(e)
    return text.split(": ", 1)[1] if ": " in text else text


def guard_error(node: fx.Node, e: Exception) -> ShapeGuardError:
    """`ShapeGuardError` for a guard attempted while deciding `node`."""
    return ShapeGuardError(describe(node), _guard_text(e))


def is_guard_error(e: BaseException) -> bool:
    return isinstance(e, _ShapeEnvGuardError)


def describe(node: fx.Node) -> str:
    """`aten.view` in `layers.0.self_attn`, for messages."""
    target = node.target
    name = (
        getattr(target, "__name__", str(target)).split(".")[0] if node.op == "call_function" else str(target)
    )
    path = module_path(node)
    return f"`{name}` in `{path}`" if path else f"`{name}` at the top level"


def is_loss(t: object) -> bool:
    """The rule for which of a model's outputs is its training loss: a floating-point scalar."""
    return isinstance(t, torch.Tensor) and t.ndim == 0 and t.is_floating_point()


def find_loss(outputs: object) -> torch.Tensor:
    """The loss among what a model's forward returned: the output itself when it is a scalar,
    else the one scalar among its tensors (nanoGPT's `(logits, loss)`, a Hugging Face output).
    Raises `CompileError` when there is none, or more than one, to train on."""
    from .errors import CompileError

    named = outputs.get("loss") if isinstance(outputs, dict) else None  # a Hugging Face output's
    if is_loss(named):
        assert isinstance(named, torch.Tensor)
        return named
    leaves = _tensor_leaves(outputs)
    scalars = [t for t in leaves if is_loss(t)]
    if len(scalars) == 1:
        return scalars[0]
    found = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in leaves[:4]) or "none"
    raise CompileError(
        f"the model's forward returns {'no' if not scalars else len(scalars)} scalar losses "
        f"to train on (its tensors: {found})",
        hint="return the loss (a floating-point scalar), alone or beside the logits, "
        "e.g. pass `labels` to a Hugging Face model",
    )


def _tensor_leaves(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):  # a Hugging Face ModelOutput is an OrderedDict
        return [t for v in value.values() for t in _tensor_leaves(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensor_leaves(v)]
    return []


def keep_loss_output(gm: fx.GraphModule, out_spec: pytree.TreeSpec | None = None) -> fx.GraphModule:
    """Return only the scalar loss from a training graph (a Hugging Face output also has logits).

    Other outputs would force their tensors to be made whole on every rank (an all-gather
    of vocab-sharded logits) for nothing: training needs the loss (`is_loss`). With several
    scalars (Mixtral's `loss` and `aux_loss`, which `loss` includes) the one the output's
    `out_spec` names `loss`, as `find_loss` picks it.
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    scalars = [o for o in flat if is_tensor_node(o) and is_loss(value(o))]
    named = _loss_leaf(out_spec) if out_spec is not None and len(scalars) > 1 else None
    if named is not None and named < len(flat) and flat[named] in scalars:
        scalars = [flat[named]]
    if len(scalars) == 1 and len(flat) > 1:
        output.args = ((scalars[0],),)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _loss_leaf(spec: pytree.TreeSpec) -> int | None:
    """The position among the flat outputs of the leaf a dict-like output calls `loss`."""
    keys = spec.context if isinstance(spec.context, (list, tuple)) else ()
    if "loss" not in keys:
        return None
    children = list(spec.children()) if hasattr(spec, "children") else spec.children_specs
    return sum(child.num_leaves for child in children[: list(keys).index("loss")])


def mutated_buffers(gm: fx.GraphModule) -> list[str]:
    """The buffers the program writes in place while it runs, in graph order (a router's token
    counts under aux-loss-free balancing: `self.tokens_per_expert += counts`)."""
    buffers = {name for name, _ in gm.named_buffers()}
    return list(dict.fromkeys(b for node in gm.graph.nodes if (b := written_buffer(node, buffers))))


def written_buffer(node: fx.Node, buffers: set[str]) -> str | None:
    """The buffer (of `buffers`, by name) that `node` writes in place, or None: an op whose
    schema marks an argument written (`add_`, `copy_`, `index_put_`) given a `get_attr`."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    for arg, formal in zip(node.args, schema.arguments if schema is not None else (), strict=False):
        written = formal.alias_info is not None and formal.alias_info.is_write
        if written and isinstance(arg, fx.Node) and arg.op == "get_attr" and str(arg.target) in buffers:
            return str(arg.target)
    return None
