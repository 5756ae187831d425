"""What meshplan records on graph nodes: every fact, its key, its type, who writes it.

The graph is an fx `GraphModule`; the compiler's facts live in `node.meta` (and, for the
whole program, `GraphModule.meta`) under `meshplan.*` keys. This module is their schema
and their only door: every other module reads and writes them through the typed accessors
below (`placement(node)`, `set_placement(node, ...)`, ...; `tests/compiler/test_meta.py`
holds the compiler and the CLI to that), so a fact means one thing everywhere, and every
error and every line of `explain` can say which plan rule and which module a node came from.

| key                      | type                           | written by              | what it says |
|--------------------------|--------------------------------|-------------------------|--------------|
| `meshplan.module`        | `str`                          | capture, outlining      | the module path the op ran in (`layers.2.mlp`), as `named_modules()` spells it |
| `meshplan.placement`     | `dict[str, Placement]`         | tensor-parallel pass    | the value's layout on each tensor axis (`Replicate()`, `Shard(d)`, `Partial()`) |
| `meshplan.rule`          | `PlanRule`                     | tensor-parallel pass    | the plan rule that decided the value's layout (its span is the line to point at) |
| `meshplan.requires_grad` | `bool`                         | tensor-parallel pass    | the value depends on a trainable parameter |
| `meshplan.collective`    | `Collective` (a dict, below)   | tensor-parallel, experts, zero | the node is a collective: its kind, axis, dim and the rule behind it |
| `meshplan.checkpoint`    | `CheckpointRegion`             | checkpoint pass         | the call node of an outlined region: its path, mode, rule and submodule |
| `meshplan.stage`         | `int`                          | pipeline pass, zero     | the pipeline stage an activation (or a ZeRO gather or release) runs in |
| `meshplan.stages` (gm)   | `tuple[tuple[str, str], ...]`  | pipeline pass           | the pipeline's cuts, `("before", "layers.2")`, kept with the program |
| `meshplan.routing`       | `Routing`                      | expert rows             | an experts unit joined from a list's calls: its example's pairs, k and top-k node |
| `meshplan.token_chunks`  | `int`                          | tensor-parallel pass    | an experts unit borrowing a tensor axis: the chunks of tokens each rank's rows are |
| `meshplan.rows_cut`      | `list[str]`                    | tensor-parallel pass    | an experts unit: the axes that cut its tokens by rows, each rank routing its own |
| `meshplan.device`        | `str`                          | devices pass            | the node runs (a `get_attr`: the tensor lives) off the rank's device: `"cpu"`, `"cuda:N"` |
| `meshplan.device_copy`   | `DeviceCopyFact`               | devices pass            | the node is a device copy: where it goes, what it copies from, the module and rule behind it |

`program.pt` keeps the facts a rank program needs (`RUNTIME_FACTS`), pickled with the graph.
Export's own facts (`val`, `nn_module_stack`, `stack_trace`) are read through `graph.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from torch import fx

if TYPE_CHECKING:
    from meshplan.dsl.check import PlanRule

    from .placement import Placement

MODULE = "meshplan.module"
PLACEMENT = "meshplan.placement"
RULE = "meshplan.rule"
REQUIRES_GRAD = "meshplan.requires_grad"
COLLECTIVE = "meshplan.collective"
CHECKPOINT = "meshplan.checkpoint"
STAGE = "meshplan.stage"
STAGES = "meshplan.stages"  # on GraphModule.meta
# on an experts unit joined from a list's calls (`passes/experts/rows.py`): its routing's `Routing`
# (the example's (token, slot) pairs and k), which the graph's data-dependent sizes cannot say
ROUTING = "meshplan.routing"
# on an experts unit borrowing a tensor axis (`experts over tp`): how many chunks of the tokens
# its ranks share each rank's rows are (1 for a contiguous split; under sequence parallelism one
# per sequence), for a capacity counted over all of them (`runtime.experts`)
TOKEN_CHUNKS = "meshplan.token_chunks"
# on an experts unit whose tokens tensor, sequence or context axes cut by rows, each rank routing
# its own (`list[str]`): those axes; under a capacity their ranks queue their pairs together
ROWS_CUT = "meshplan.rows_cut"
# on a node placed off the rank's device by an `on cpu` / `on cuda:N` rule (`passes/devices.py`):
# that device; `compiler.lower.place` leaves such nodes' tensors and devices where they are
DEVICE = "meshplan.device"
DEVICE_COPY = "meshplan.device_copy"
# on a Ulysses all-to-all of a context axis whose attention's heads tensor axes split too
# (`context ulysses over cp` beside `column over tp`): the heads dim it splits or gathers, inside
# each tensor axis's shard of it. A tensor axis walked after keeps its cut through it (its
# rank's heads, cut again by the context axis), instead of gathering them first
HEADS_INSIDE = "meshplan.heads_inside"


class Collective(TypedDict, total=False):
    """`meta[COLLECTIVE]`: a node that communicates. `kind` names the runtime module
    (`all_reduce`, `reduce_scatter`, `zero_gather`, ...), `axis` the mesh axis; tensor
    collectives add the `dim` they gather or scatter and the `rule` that demanded them, ZeRO
    nodes their `unit` and `where`, an experts unit (`kind == "experts"`) its number of `experts`,
    its `capacity_factor`, the axis whose ranks `shared` its tokens (and, joined from a list of
    experts, its example's `routed_pairs`; with a z-loss its coefficient, `router` and `path`).

    A dict rather than a frozen dataclass: `program.pt` pickles it, and an experts unit gains its
    z-loss keys after it is made."""

    kind: str
    axis: str
    dim: int | None
    rule: Any  # PlanRule | None
    unit: str
    where: str
    experts: int
    capacity_factor: float | None
    shared: str | bool  # (True: compiled before groups of axes, meaning `axis`)
    routed_pairs: int | None
    z_loss: float
    router: str
    path: str


@dataclass(frozen=True, slots=True)
class Routing:
    """`meta[ROUTING]`: the pairs a list's routing makes in the example, its `k` (slots per
    token), and the node of its top-k's indices (None for an argmax), where a z-loss finds the
    router's logits."""

    pairs: int
    k: int
    index: fx.Node | None


@dataclass(frozen=True, slots=True)
class DeviceCopyFact:
    """`meta[DEVICE_COPY]` on a device copy node (`runtime.device_copy.DeviceCopy`): where it
    copies to and from (`"cpu"`, `"device"`: the rank's own, `"cuda:N"`), whether backward
    copies a gradient back, and the placed module whose boundary it is, with its rule."""

    to: str
    source: str
    grad: bool
    module: str
    rule: PlanRule


@dataclass(frozen=True, slots=True)
class CheckpointRegion:
    """`meta[CHECKPOINT]` on the call node of an outlined checkpoint region."""

    path: str  # the checkpointed module
    mode: str  # "full" | "selective"
    rule: PlanRule | None  # the rule behind it
    target: str  # the outlined submodule's attribute name


# facts that describe the op that made a value, not the value: a node standing for the value
# (a region's placeholder, a call's getitem) does not inherit them (`outline.value_meta`)
OP_FACTS = frozenset({MODULE, COLLECTIVE})
# the facts a rank program needs, which `program.pt` keeps (`executable.py`)
RUNTIME_FACTS = (CHECKPOINT, COLLECTIVE, MODULE, DEVICE)


def module_tag(node: fx.Node) -> str | None:
    """The module path capture (or outlining) tagged the node with; None if untagged
    (`graph.module_path` falls back to export's module stack)."""
    return node.meta.get(MODULE)


def set_module_tag(node: fx.Node, path: str) -> None:
    node.meta[MODULE] = path


def placement(node: fx.Node) -> dict[str, Placement]:
    """The value's layout per tensor axis ({} before the tensor-parallel pass: whole everywhere)."""
    return node.meta.get(PLACEMENT, {})


def set_placement(node: fx.Node, layout: dict[str, Placement]) -> None:
    """Replace the value's layout on every tensor axis."""
    node.meta[PLACEMENT] = layout


def set_axis_placement(node: fx.Node, axis: str, p: Placement) -> None:
    """Set the value's layout on one tensor axis, keeping the others."""
    node.meta.setdefault(PLACEMENT, {})[axis] = p


def rule(node: fx.Node) -> PlanRule | None:
    """The plan rule that decided the node's layout, if one did."""
    return node.meta.get(RULE)


def set_rule(node: fx.Node, rule: PlanRule) -> None:
    node.meta[RULE] = rule


def requires_grad(node: fx.Node) -> bool | None:
    """Whether the value depends on a trainable parameter (None: not judged yet)."""
    return node.meta.get(REQUIRES_GRAD)


def set_requires_grad(node: fx.Node, flag: bool) -> None:
    node.meta[REQUIRES_GRAD] = flag


def collective(node: fx.Node) -> Collective | None:
    """The node's collective, or None if it does not communicate."""
    return node.meta.get(COLLECTIVE)


def collective_of(node: fx.Node) -> Collective:
    """The collective of a node known to communicate (a `collective_nodes` one): KeyError if not."""
    return node.meta[COLLECTIVE]


def set_collective(node: fx.Node, info: Collective) -> None:
    node.meta[COLLECTIVE] = info


def checkpoint_region(node: fx.Node) -> CheckpointRegion | None:
    """The region a checkpoint call node stands for, or None for any other node."""
    return node.meta.get(CHECKPOINT)


def set_checkpoint_region(node: fx.Node, region: CheckpointRegion) -> None:
    node.meta[CHECKPOINT] = region


def stage(node: fx.Node) -> int | None:
    """The pipeline stage the node runs in (None: no pipeline, or a value every stage remakes)."""
    return node.meta.get(STAGE)


def set_stage(node: fx.Node, s: int) -> None:
    node.meta[STAGE] = s


def stage_cuts(gm: fx.GraphModule) -> tuple[tuple[str, str], ...] | None:
    """The pipeline's cuts, `("before", "layers.2")`; None if the pipeline pass has not cut it."""
    return gm.meta.get(STAGES)


def set_stage_cuts(gm: fx.GraphModule, cuts: tuple[tuple[str, str], ...]) -> None:
    gm.meta[STAGES] = cuts


def routing(node: fx.Node) -> Routing | None:
    """An experts unit's routing, when joined from a list's calls and its routing was found."""
    return node.meta.get(ROUTING)


def set_routing(node: fx.Node, r: Routing) -> None:
    node.meta[ROUTING] = r


def token_chunks(node: fx.Node) -> int:
    """How many chunks of the tokens an experts unit's ranks share each rank's rows are (1: one)."""
    return node.meta.get(TOKEN_CHUNKS, 1)


def set_token_chunks(node: fx.Node, n: int) -> None:
    node.meta[TOKEN_CHUNKS] = n


def rows_cut(node: fx.Node) -> tuple[str, ...]:
    """The axes that cut an experts unit's tokens by rows, in the order they were found."""
    return tuple(node.meta.get(ROWS_CUT, ()))


def add_rows_cut(node: fx.Node, axis: str) -> None:
    node.meta.setdefault(ROWS_CUT, []).append(axis)


def heads_inside(node: fx.Node) -> int | None:
    """The heads dim a Ulysses collective cuts inside the tensor axes' shards of it (`HEADS_INSIDE`)."""
    return node.meta.get(HEADS_INSIDE)


def set_heads_inside(node: fx.Node, dim: int) -> None:
    node.meta[HEADS_INSIDE] = dim


def device(node: fx.Node) -> str | None:
    """The device the node runs on (its tensor lives on) when not the rank's: `"cpu"`,
    `"cuda:N"`; None for the rank's own."""
    return node.meta.get(DEVICE)


def set_device(node: fx.Node, where: str | None) -> None:
    if where is None:
        node.meta.pop(DEVICE, None)
    else:
        node.meta[DEVICE] = where


def device_copy(node: fx.Node) -> DeviceCopyFact | None:
    """The device copy a node is, or None for any other node."""
    return node.meta.get(DEVICE_COPY)


def set_device_copy(node: fx.Node, fact: DeviceCopyFact) -> None:
    node.meta[DEVICE_COPY] = fact


def copy_facts(src: fx.Node, dst: fx.Node, *keys: str) -> None:
    """Give `dst` each of the facts `keys` that `src` has (the same objects, not copies)."""
    for key in keys:
        if key in src.meta:
            dst.meta[key] = src.meta[key]
