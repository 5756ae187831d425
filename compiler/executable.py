"""The compiled program as it runs: what `meshplan compile -o DIR` writes as `DIR/program.pt`,
and what every rank of `meshplan run` loads instead of capturing the model again.

    executable = to_executable(compiled)                       # compiled for --batch/--seq
    save_executable(executable, out / "program.pt")
    executable = load_executable(out / "program.pt", model)   # refuses another model
    program = build_rank_program(executable, model, rank, mesh)

It holds the one SPMD graph (with its checkpoint regions and group-less collective modules),
each parameter's placement per axis, the mesh layout, the plan's text and the shapes the
graph serves: captured with symbolic batch and sequence length, every (batch, seq) the
plan's splits divide (`TokenShapes`), else only those it was compiled for. It holds no
weights: parameters and buffers are stored as shapes only, and each rank binds its shards
from the model the factory builds (seeded, the same on every rank). Constants the graph
made itself (not the model's) are kept.

The format is a pickle, with two twists: ATen operators are stored by name
(`aten::linear.default`), since torch's operator objects cannot be pickled, and graph modules
are stored as their `fx.Graph` (node names, arguments and the facts meshplan needs at run
time: checkpoint regions, collectives), not as generated code to trace again. Node facts
that only the compiler uses (export's fake tensors) are dropped. Like any pickle, and like a
checkpoint, the file is trusted input: load only artifacts you made.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import fx, nn

from meshplan.runtime.expert_list import ExpertList, stack_lists
from meshplan.runtime.mesh import MeshLayout

from .capture import TokenShapes
from .load import ModelSource
from .meta import RUNTIME_FACTS
from .placement import Placement

if TYPE_CHECKING:
    from .compile import Compiled

FORMAT = 2  # 2: a checkpoint region's node fact is a `meta.CheckpointRegion`, not a dict
PROGRAM = "program.pt"  # its name in a compile folder and in a run folder


class ExecutableError(ValueError):
    """A `program.pt` that cannot run here: missing, damaged, another format, or another model."""


@dataclass
class Executable:
    graph: fx.GraphModule  # parameters and buffers as meta tensors: shapes only
    param_placements: dict[str, dict[str, Placement]]
    layout: MeshLayout
    plan_name: str
    plan_text: str
    model_sha256: str  # the structure of the model it was compiled for (`model_fingerprint`)
    token_shape: tuple[int, int] | None = None  # (batch, seq) per rank and micro-step it was captured with
    stage_cuts: tuple[tuple[str, str], ...] = ()  # the pipeline's cuts: (side, module path)
    torch_version: str = field(default_factory=lambda: torch.__version__)
    # the (batch, seq) it serves when captured with symbolic token dims; None: `token_shape` only
    shapes: TokenShapes | None = None
    # parameter -> the axes its gradient is summed over by the gradient sync (`Compiled.grad_sums`)
    grad_sums: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # lists of experts it holds stacked (`Compiled.expert_lists`): a rank's model is stacked alike
    expert_lists: tuple[str, ...] = ()

    def shape_problems(self, batch: int, seq: int) -> list[str]:
        """Why this program cannot run micro-batches of (batch, seq); [] if it can."""
        if self.shapes is not None:
            return self.shapes.problems(batch, seq)
        if self.token_shape is not None and self.token_shape != (batch, seq):
            b, t = self.token_shape
            return [f"it was compiled for --batch {b} --seq {t} only, not --batch {batch} --seq {seq}"]
        return []

    @property
    def plan_sha256(self) -> str:
        return hashlib.sha256(self.plan_text.encode()).hexdigest()


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's structure: every module's path and type, every parameter's and
    buffer's name, shape and dtype (not the values: a retrained model is the same structure)."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__qualname__}\n".encode())
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\n".encode())
    return digest.hexdigest()


def to_executable(compiled: Compiled) -> Executable:
    """The runnable part of a `Compiled`, without the model's values."""
    assert compiled.source is not None, "compile_plan records its source"
    model = compiled.source.model
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return Executable(
        graph=_shapes_only(compiled.graph, names),
        param_placements=compiled.param_placements,
        layout=compiled.layout,
        plan_name=Path(compiled.plan.path).name,
        plan_text=compiled.plan.source,
        model_sha256=model_fingerprint(model),
        token_shape=_token_shape(compiled.source),
        shapes=compiled.shapes,
        stage_cuts=compiled.stage_cuts,
        grad_sums=compiled.grad_sums,
        expert_lists=compiled.expert_lists,
    )


def _token_shape(source: ModelSource) -> tuple[int, int] | None:
    """(batch, seq) of the token inputs the graph was compiled for (see `with_token_shape`)."""
    for x in [*source.args, *source.kwargs.values()]:
        if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point():
            return (int(x.shape[0]), int(x.shape[1]))
    return None


def save_executable(executable: Executable, path: Path) -> None:
    buffer = io.BytesIO()
    _Pickler(buffer).dump((FORMAT, executable))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)


def load_executable(path: Path, model: nn.Module | None = None) -> Executable:
    """Read `path`; with `model`, refuse a program compiled for another model structure (its
    lists of experts stacked first, as the program holds them)."""
    if not path.is_file():
        raise ExecutableError(f"{path} does not exist: compile the plan with `meshplan compile ... -o DIR`")
    try:
        with path.open("rb") as f:
            version, executable = pickle.load(f)
    except Exception as e:  # truncated, not a pickle, a class that moved
        raise ExecutableError(
            f"{path} cannot be read ({type(e).__name__}: {e}); compile the plan again"
        ) from e
    if version != FORMAT or not isinstance(executable, Executable):
        raise ExecutableError(f"{path} was written by another meshplan version; compile the plan again")
    if model is not None:
        stack_lists(model, [p for p in getattr(executable, "expert_lists", ()) if _is_list(model, p)])
    if model is not None and model_fingerprint(model) != executable.model_sha256:
        raise ExecutableError(
            f"{path} was compiled for another model (its structure differs from this one's); "
            "compile the plan again for this model"
        )
    return executable


def _is_list(model: nn.Module, path: str) -> bool:
    try:
        return isinstance(model.get_submodule(path), nn.ModuleList | ExpertList)
    except AttributeError:  # another model: the fingerprint says so
        return False


# ---------------------------------------------------------------------------- pickling


def _shapes_only(gm: fx.GraphModule, names: set[str]) -> fx.GraphModule:
    """A copy of `gm` whose model parameters and buffers are meta tensors (no values)."""
    root: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            target = str(node.target)
            attr = _get_attr(gm, target)
            if target in names and isinstance(attr, torch.Tensor):
                meta = torch.empty_like(attr, device="meta")
                attr = nn.Parameter(meta, attr.requires_grad) if isinstance(attr, nn.Parameter) else meta
            root[target] = attr
        elif node.op == "call_module":
            root[str(node.target)] = gm.get_submodule(str(node.target))
    return fx.GraphModule(root, gm.graph, class_name="Program")


def _get_attr(module: nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _operator(qualified: str) -> Any:
    """`aten::linear.default` -> torch.ops.aten.linear.default."""
    namespace, _, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace), name)
    return getattr(packet, overload or "default")


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


class _Ref(NamedTuple):
    """A node argument in the flat record: the index of the node it names."""

    position: int


def _flat_graph(gm: fx.GraphModule) -> list[tuple]:
    """`gm.graph` as a flat list of node records, arguments naming earlier nodes by index, only
    the run-time node facts kept. Flat on purpose: a `fx.Graph` pickles as a linked list, which
    recurses once per node and overflows Python's stack on a real model's graph."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    records = []
    for node in gm.graph.nodes:
        args = fx.node.map_arg(node.args, lambda n: _Ref(index[n]))  # type: ignore[arg-type,return-value]
        kwargs = fx.node.map_arg(node.kwargs, lambda n: _Ref(index[n]))  # type: ignore[arg-type,return-value]
        # the facts a rank program reads: export's fake tensors and stack traces are compile-time
        facts = {k: v for k, v in node.meta.items() if k in RUNTIME_FACTS}
        records.append((node.op, node.name, node.target, args, kwargs, facts))
    return records


def _rebuild(attrs: dict[str, Any], records: list[tuple], class_name: str) -> fx.GraphModule:
    graph = fx.Graph()
    nodes: list[fx.Node] = []

    def resolve(a: Any) -> Any:
        if isinstance(a, _Ref):
            return nodes[a.position]
        if isinstance(a, (tuple, list)):
            return type(a)(resolve(x) for x in a)
        if isinstance(a, dict):
            return {k: resolve(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(resolve(a.start), resolve(a.stop), resolve(a.step))
        return a

    for op, name, target, args, kwargs, facts in records:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
        node.meta.update(facts)
        nodes.append(node)
    return fx.GraphModule(attrs, graph, class_name=class_name)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return _operator, (f"{obj._schema.name}.{obj._overloadname}",)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, fx.GraphModule):
            attrs: dict[str, Any] = {}
            for node in obj.graph.nodes:
                if node.op == "get_attr":
                    attrs[str(node.target)] = _get_attr(obj, str(node.target))
                elif node.op == "call_module":
                    attrs[str(node.target)] = obj.get_submodule(str(node.target))
            return _rebuild, (attrs, _flat_graph(obj), type(obj).__name__)
        return NotImplemented
