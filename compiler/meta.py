"""What meshplan records on graph nodes: every fact, its key, its type, who writes it.

The graph is an fx `GraphModule`; the compiler's facts live in `node.meta` (and, for the
whole program, `GraphModule.meta`) under `meshplan.*` keys. This module is their schema:
the passes write and read them through these names and accessors, so a fact means one
thing everywhere, and every error and every line of `explain` can say which plan rule and
which module a node came from.

| key                      | type                           | written by              | what it says |
|--------------------------|--------------------------------|-------------------------|--------------|
| `meshplan.module`        | `str`                          | capture, outlining      | the module path the op ran in (`layers.2.mlp`), as `named_modules()` spells it |
| `meshplan.placement`     | `dict[str, Placement]`         | tensor-parallel pass    | the value's layout on each tensor axis (`Replicate()`, `Shard(d)`, `Partial()`) |
| `meshplan.rule`          | `PlanRule`                     | tensor-parallel pass    | the plan rule that decided the value's layout (its span is the line to point at) |
| `meshplan.requires_grad` | `bool`                         | tensor-parallel pass    | the value depends on a trainable parameter |
| `meshplan.collective`    | `Collective` (a dict, below)   | tensor-parallel, experts, zero | the node is a collective: its kind, axis, dim and the rule behind it |
| `meshplan.checkpoint`    | `CheckpointRegion` (a dict)    | checkpoint pass         | the call node of an outlined region: its path, mode, rule and submodule |
| `meshplan.stage`         | `int`                          | pipeline pass, zero     | the pipeline stage an activation (or a ZeRO gather or release) runs in |
| `meshplan.stages` (gm)   | `tuple[tuple[str, str], ...]`  | pipeline pass           | the pipeline's cuts, `("before", "layers.2")`, kept with the program |

Export's own facts (`val`, `nn_module_stack`, `stack_trace`) are read through `graph.py`.
"""

from __future__ import annotations

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
# on an experts unit joined from a list's calls (`passes/expert_rows.py`): its routing's `Routing`
# (the example's (token, slot) pairs and k), which the graph's data-dependent sizes cannot say
ROUTING = "meshplan.routing"
# on an experts unit borrowing a tensor axis (`experts over tp`): how many chunks of the tokens
# its ranks share each rank's rows are (1 for a contiguous split; under sequence parallelism one
# per sequence), for a capacity counted over all of them (`runtime.experts`)
TOKEN_CHUNKS = "meshplan.token_chunks"
# on an experts unit whose tokens tensor, sequence or context axes cut by rows, each rank routing
# its own (`list[str]`): those axes; under a capacity their ranks queue their pairs together
ROWS_CUT = "meshplan.rows_cut"


class Collective(TypedDict, total=False):
    """`meta[COLLECTIVE]`: a node that communicates. `kind` names the runtime module
    (`all_reduce`, `reduce_scatter`, `zero_gather`, ...), `axis` the mesh axis; tensor
    collectives add the `dim` they gather or scatter and the `rule` that demanded them, ZeRO
    nodes their `unit` and `where`, an experts unit (`kind == "experts"`) its number of `experts`
    (and, joined from a list of experts, its example's `routed_pairs`)."""

    kind: str
    axis: str
    dim: int | None
    rule: Any  # PlanRule | None
    unit: str
    where: str
    experts: int
    routed_pairs: int | None


class Routing(TypedDict):
    """`meta[ROUTING]`: the pairs a list's routing makes in the example, its `k` (slots per
    token), and the node of its top-k's indices (None for an argmax), where a z-loss finds the
    router's logits."""

    pairs: int
    k: int
    index: fx.Node | None


class CheckpointRegion(TypedDict):
    """`meta[CHECKPOINT]` on the call node of an outlined checkpoint region."""

    path: str  # the checkpointed module
    mode: str  # "full" | "selective"
    rule: Any  # the PlanRule behind it
    target: str  # the outlined submodule's attribute name


def placement(node: fx.Node) -> dict[str, Placement]:
    """The value's layout per tensor axis ({} before the tensor-parallel pass: whole everywhere)."""
    return node.meta.get(PLACEMENT, {})


def rule(node: fx.Node) -> PlanRule | None:
    """The plan rule that decided the node's layout, if one did."""
    return node.meta.get(RULE)


def collective(node: fx.Node) -> Collective | None:
    """The node's collective, or None if it does not communicate."""
    return node.meta.get(COLLECTIVE)


def checkpoint_region(node: fx.Node) -> CheckpointRegion | None:
    """The region a checkpoint call node stands for, or None for any other node."""
    return node.meta.get(CHECKPOINT)


def stage(node: fx.Node) -> int | None:
    """The pipeline stage the node runs in (None: no pipeline, or a value every stage remakes)."""
    return node.meta.get(STAGE)
