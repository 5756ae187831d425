"""Lowering: the compiled program + the model + a rank + the mesh -> the program that rank runs.

    program = build_rank_program(compiled, model, rank, mesh)     # shards bound, collectives on groups
    stages = rank_stages(compiled, program, rank, mesh, axis="pp", schedule=schedule)  # under a pipeline

Every rank runs one SPMD graph (`Compiled.graph`, or a loaded `Executable`'s); lowering makes it
this rank's: each parameter and buffer replaced by its local shard (`local_shard`; tied weights
stay one parameter), each communication module bound to this rank's process group of its axis
(`for_rank`), checkpoint regions rebound to those same modules (`bind_regions`), and under a
pipeline the graph cut into its stages, of which the schedule gives this rank some
(`rank_stages`). This is the one place that turns a compiled program into a rank's; the
compiler's passes before it never see a rank, and the runtime after it never sees a plan.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import fx, nn

from meshplan.runtime.device_copy import DeviceCopy
from meshplan.runtime.hollow import defer as deferred
from meshplan.runtime.hollow import hollow, is_hollow, moved
from meshplan.runtime.mesh import MeshLayout
from meshplan.runtime.shards import Cut, shard_of

from . import meta
from .materialize import MetaWeights, is_meta
from .passes.checkpoint import region_modules
from .placement import Placement, Shard
from .pretrained import names_by_tensor
from .stages import compiled_cuts, cut_stages

if TYPE_CHECKING:
    import torch.distributed as dist

    from meshplan.runtime.schedules import Schedule

    from .pretrained import Pretrained


class Program(Protocol):
    """What lowering and a run read of a compiled program, fresh (`compile.Compiled`) or loaded
    from disk (`executable.Executable`)."""

    @property
    def graph(self) -> fx.GraphModule: ...  # the SPMD graph every rank shares

    @property
    def layout(self) -> MeshLayout: ...

    @property
    def param_placements(self) -> dict[str, dict[str, Placement]]: ...  # name -> {axis: placement}

    @property
    def grad_sums(self) -> dict[str, tuple[str, ...]]: ...  # weight -> axes its gradient is summed over

    @property
    def stage_cuts(self) -> tuple[tuple[str, str], ...]: ...  # the pipeline's cuts: (side, module path)

    @property
    def expert_lists(self) -> tuple[str, ...]: ...  # lists of experts held stacked, by path


def build_rank_program(
    program: Program,
    model: nn.Module,
    rank: int,
    mesh=None,
    *,
    seed: int = 0,
    pretrained: Pretrained | None = None,
    keep: Collection[str] | None = None,
    defer: bool = False,
) -> fx.GraphModule:
    """The program rank `rank` runs: the shared graph with this rank's shards and process groups.

    `model` holds the full (unpartitioned) parameters and buffers, or is built on the meta
    device: then each tensor is initialized by the model's own code under `seed`, one module at
    a time, and only this rank's piece of it is kept (`materialize.py`). With `pretrained`, the
    tensors it holds are read from it instead, this rank's piece alone (`pretrained.py`). `keep`:
    the tensors this rank will run (a pipeline rank's stages, `stage_names`); the others are
    given their local shapes on the meta device, neither initialized nor read. `defer` (under
    ZeRO-3): each trainable parameter whose value is initialized or read here is left hollow
    (`runtime/hollow.py`), made only when the engine lays it into the flat it shards, so the
    rank never holds its whole local model. `mesh` is the DeviceMesh (None for an axis-free
    plan). Tied parameters stay tied.
    """
    state: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    coords = program.layout.coords(rank)
    graph = program.graph.graph
    names = [str(n.target) for n in graph.nodes if n.op == "get_attr" and str(n.target) in state]
    weights = MetaWeights(model, seed) if is_meta(model) else None
    # this rank's copy of each tensor, made as soon as its full value is at hand (a meta model's
    # modules are initialized one at a time: a view would keep every one of them alive)
    local_of: dict[int, torch.Tensor] = {}  # id(full tensor) -> its local copy, keeps ties
    names_of = names_by_tensor(state.items())
    kept = {id(state[name]) for name in keep if name in state} if keep is not None else None

    def key_of(name: str) -> str | None:
        """`name`'s key in the pretrained weights (None: not read from them)."""
        return pretrained.key(names_of[id(state[name])]) if pretrained is not None else None

    def value(name: str) -> torch.Tensor:
        """This rank's piece of `name`, initialized or read."""
        placement = program.param_placements.get(name, {})
        if pretrained is not None and (key := key_of(name)) is not None:
            return pretrained.piece(key, placement, coords, program.layout, state[name].dtype)
        full = weights.full(name) if weights is not None and state[name].is_meta else state[name]
        return local_shard(full, placement, coords, program.layout).detach().clone()

    for name in weights.grouped(names) if weights is not None else names:
        if id(state[name]) in local_of:
            continue
        tensor = state[name]
        shape = local_shard(tensor.to("meta"), program.param_placements.get(name, {}), coords, program.layout)
        trainable = isinstance(tensor, nn.Parameter) and tensor.requires_grad
        # from the seed and its path, or from the file: the same on every rank by construction
        made_here = tensor.is_meta or key_of(name) is not None
        if kept is not None and id(tensor) not in kept:  # another pipeline rank's
            local = shape
        elif defer and trainable and made_here:
            local = hollow(shape.shape, shape.dtype)
        else:
            local = value(name)
        if isinstance(tensor, nn.Parameter):
            local = nn.Parameter(local, requires_grad=tensor.requires_grad)
        if is_hollow(local):
            deferred(local, functools.partial(value, name))
        local_of[id(tensor)] = local
    root: dict[str, object] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            name = str(node.target)
            # a nested graph (e.g. a set_grad_enabled region) is shared as is
            root[name] = local_of[id(state[name])] if name in state else _get_attr(program.graph, name)
        elif node.op == "call_module":
            root[str(node.target)] = for_rank(program.graph.get_submodule(str(node.target)), mesh, model)
    return bind_regions(fx.GraphModule(root, graph), mesh, model)


def place(program: fx.GraphModule, device: str | torch.device) -> fx.GraphModule:
    """`program` (a rank's, from `build_rank_program`) on `device`: its parameters and buffers
    moved, and every device its graphs name made `device`. A capture bakes the device it ran on
    into the graph (`arange(..., device=cpu)` for positions and masks, a buffer's `.to(cpu)`; the
    meta device for a model built on it), so a program moved as modules alone would compute
    those elsewhere and mix devices. Each graph is copied before it is changed: the compiled
    program is left as it was.

    What a device rule placed elsewhere (`on cpu`, `on cuda:N`: `passes/devices.py`) goes
    there instead, tensors and the devices its nodes name; its `DeviceCopy` nodes learn the
    rank's device (`"device"`). On the meta device (the estimate's walk) everything goes there."""
    device = _indexed(torch.device(device))
    placed = _placed_tensors(program) if device.type != "meta" else {}
    for module in list(program.modules()):
        if isinstance(module, DeviceCopy):
            module.bind(device)
        if not isinstance(module, fx.GraphModule) or not any(
            _names_another(n, _node_device(n, device)) for n in module.graph.nodes
        ):
            continue
        graph = copy.deepcopy(module.graph)
        for node in graph.nodes:
            where = _node_device(node, device)
            node.args, node.kwargs = _on(node.args, where), _on(node.kwargs, where)
        module.graph = graph
        module.recompile()

    def to(t: torch.Tensor) -> torch.Tensor:
        # another pipeline rank's tensors stay shapes (`keep` of `build_rank_program`); a hollow
        # parameter moves without bytes, its value still to be made
        where = placed.get(id(t), device)
        return t if t.is_meta else moved(t, where) if is_hollow(t) else t.to(where)

    return program._apply(to)


def _indexed(device: torch.device) -> torch.device:
    """`cuda` as the device it means now (`cuda:0`): what the tensors moved there report."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _node_device(node: fx.Node, device: torch.device) -> torch.device:
    """Where a node of a rank's program runs: where a device rule placed it, else `device`."""
    where = meta.device(node)
    return torch.device(where) if where is not None and device.type != "meta" else device


def _placed_tensors(program: fx.GraphModule) -> dict[int, torch.device]:
    """The tensors (by id) a device rule placed off the rank's device, and where."""
    return {
        id(_get_attr(program, name)): torch.device(where) for name, where in placed_names(program).items()
    }


def placed_names(program: fx.GraphModule) -> dict[str, str]:
    """The parameters and buffers of a rank's program (by the names its graph reads them by) that
    a device rule placed off the rank's device (`passes/devices.py`), and where: `"cpu"`, `"cuda:N"`."""
    return {
        str(node.target): where
        for node in program.graph.nodes
        if node.op == "get_attr" and (where := meta.device(node)) is not None
    }


def _names_another(node: fx.Node, device: torch.device) -> bool:
    return _on(node.args, device) is not node.args or _on(node.kwargs, device) is not node.kwargs


def _on(value, device: torch.device):
    """`value` (a node's args or kwargs) with each capture device in it (the host, meta)
    replaced by `device`; the same object where it names none."""
    if isinstance(value, torch.device):
        return device if value.type in ("cpu", "meta") and value != device else value
    if isinstance(value, (tuple, list)):
        items = [_on(v, device) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else type(value)(items)
    if isinstance(value, dict):
        pairs = {k: _on(v, device) for k, v in value.items()}
        return value if all(pairs[k] is v for k, v in value.items()) else type(value)(pairs)
    return value


def _get_attr(module: nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def local_shard(
    full: torch.Tensor, placement: dict[str, Placement], coords: dict[str, int], layout: MeshLayout
) -> torch.Tensor:
    """This rank's piece of a full tensor: for `Shard(d, blocks=sizes)`, its chunk of each block."""
    local = full
    for axis, p in placement.items():
        if isinstance(p, Shard):
            local = shard_of(local, Cut(p.dim, p.blocks, p.padded), coords[axis], layout.size(axis))
    return local


def for_rank(template: nn.Module, mesh=None, model: nn.Module | None = None) -> nn.Module:
    """A rank's own instance of one of the graph's communication modules: a collective bound
    to this rank's process group of its axis (an experts unit also to `model`'s experts module,
    whose code it runs), or a fresh ZeRO node for the engine to bind."""
    from meshplan.runtime.collectives import AxisCollective  # runtime imports torch.distributed
    from meshplan.runtime.experts import ExpertParallel
    from meshplan.runtime.mesh import axis_group

    if isinstance(template, ExpertParallel):  # over an axis or a group of axes (`dp x tp`)
        assert model is not None, "an experts unit runs the model's experts module"
        if mesh is None:
            return template.bind(None, model)
        shared = template.shared_axis()  # the subgroup whose ranks share the tokens, if any
        share = axis_group(mesh, shared) if shared and shared != template.axis else None
        return template.bind(axis_group(mesh, template.axis), model, share)
    if isinstance(template, AxisCollective):
        group = mesh.get_group(template.axis) if mesh is not None else None
        return type(template)(group, template.axis, balanced=template.balanced)
    return copy.copy(template)


def bind_regions(program: fx.GraphModule, mesh=None, model: nn.Module | None = None) -> fx.GraphModule:
    """Give the checkpoint regions of a rank program this rank's collective modules.

    `build_rank_program` copies attributes it does not know as they are, so a region
    would still call the compiled graph's group-less collectives. This rebuilds each
    region around the program's own collective modules (those its outer graph calls),
    creating the others for `mesh` as `build_rank_program` does. Parameters need
    nothing: they enter regions as inputs from the outer graph's `get_attr` nodes.
    """
    made: dict[str, nn.Module] = {}

    def collective(region: fx.GraphModule, target: str) -> nn.Module:
        if hasattr(program, target):
            return program.get_submodule(target)
        if target not in made:
            made[target] = for_rank(region.get_submodule(target), mesh, model)
        return made[target]

    for node, region in list(region_modules(program)):
        targets = {str(n.target) for n in region.graph.nodes if n.op == "call_module"}
        if not targets:  # nothing rank-specific inside: the compiled region is shared as is
            continue
        modules = {t: collective(region, t) for t in sorted(targets)}
        rebound = fx.GraphModule(modules, region.graph, class_name=type(region).__name__)
        region_info = meta.checkpoint_region(node)
        assert region_info is not None, "region_modules yields checkpoint call nodes"
        setattr(program, region_info.target, rebound)
    return program


@dataclass(frozen=True)
class RankStages:
    """One pipeline rank's part of a program: the stages its schedule gives it, and the module
    holding their parameters under the model's names (what the optimizer, data parallelism,
    checkpoints and export see)."""

    held: fx.GraphModule
    stages: dict[int, fx.GraphModule]  # stage index -> its program, this rank's only
    schedule: Schedule  # checked by simulation
    axis: str
    position: int  # this rank's coordinate on the pipeline axis
    ranks: list[int]  # the global ranks of its pipeline group, by position
    group: dist.ProcessGroup | None  # None: a pipeline of one rank
    # weights tied across pipeline ranks: name -> (shape, the positions holding a copy)
    tied: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    # weights several of this rank's stages read (the tied embedding and LM head in a V):
    # complete only after both stages' last backwards
    shared_here: frozenset[str]


def rank_stages(
    program: Program, rank_program: fx.GraphModule, rank: int, mesh, *, axis: str, schedule: Schedule
) -> RankStages:
    """Cut `rank_program` (this rank's, from `build_rank_program`) into the compiled stages and
    keep the ones `schedule` gives this rank."""
    import torch.distributed as dist

    from meshplan.runtime.collectives import label_collectives

    layout = program.layout
    cut = cut_stages(program.graph, compiled_cuts(program.graph, program.stage_cuts))
    assert cut.count == schedule.stages, f"{cut.count} stages for a schedule of {schedule.stages}"
    position = layout.coords(rank)[axis]
    # a weight's cast made once a step, not once per microbatch in flight (`runtime/shared_cast.py`)
    programs = cut.programs(rank_program, share_casts=shared_cast_stages(schedule))
    mine = {s: programs[s] for s in range(cut.count) if schedule.owner[s] == position}
    for stage in mine.values():
        label_collectives(stage)
    names = {str(n.target) for st in mine.values() for n in st.graph.nodes if n.op == "get_attr"}
    # and every other name of the parameters held (a tied weight read under one name: its
    # checkpoint keys and export names are the model's, whatever layout loads them)
    held_ids = {id(p) for n in names if (p := _parameter(rank_program, n)) is not None}
    attrs = [str(n.target) for n in rank_program.graph.nodes if n.op == "get_attr"]
    names |= {name for name in attrs if id(_parameter(rank_program, name)) in held_ids}
    graph = fx.Graph()
    # in the program's order, so that a tied weight's first name (its optimizer state's key) is
    # the one every layout gives it
    for name in dict.fromkeys(attrs):
        if name in names:
            graph.get_attr(name)
    graph.output(None)
    held = fx.GraphModule(rank_program, graph, class_name="PipelineRank")
    group = mesh.get_group(axis) if layout.size(axis) > 1 else None
    members = dist.get_process_group_ranks(group) if group is not None else [rank]
    # a weight by its first name in the program, as every rank and `held` name it
    first = {id(p): n for n, p in reversed(list(rank_program.named_parameters(remove_duplicate=False)))}
    tied = {}
    for name, used in cut.shared.items():
        holders = tuple(sorted({schedule.owner[s] for s in used}))
        if len(holders) > 1:  # on one rank the copies are one parameter: autograd sums them
            param = rank_program.get_parameter(name)
            tied[first[id(param)]] = (tuple(param.shape), holders)
    here = frozenset(
        first[id(rank_program.get_parameter(n))]
        for n, used in cut.shared.items()
        if sum(s in mine for s in used) > 1
    )
    return RankStages(held, mine, schedule, axis, position, members, group, tied, here)


def shared_cast_stages(schedule: Schedule) -> frozenset[int]:
    """The stages whose weights' casts a step makes once (`runtime/shared_cast.py`): those that
    keep several microbatches in flight; with one, a kept cast would only outlive its backward."""
    return frozenset(s for s in range(schedule.stages) if schedule.in_flight(s) > 1)


def stage_names(program: Program, rank: int, *, axis: str, schedule: Schedule) -> frozenset[str]:
    """The tensors (by the graph's names) that the stages `schedule` gives `rank` read: all a
    pipeline rank needs of `build_rank_program` (its `keep`)."""
    cut = cut_stages(program.graph, compiled_cuts(program.graph, program.stage_cuts))
    position = program.layout.coords(rank)[axis]
    mine = [st for s, st in enumerate(cut.programs(program.graph)) if schedule.owner[s] == position]
    return frozenset(str(n.target) for st in mine for n in st.graph.nodes if n.op == "get_attr")


def _parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    try:
        return module.get_parameter(name)
    except AttributeError:  # a buffer, or a constant
        return None
