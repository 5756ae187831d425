"""One forward of the captured model on the meta device, measured by part: what `meshplan
suggest` prices thousands of layouts from without compiling any of them.

    profile = profile_model(captured, shape, hw)
    profile.block.split.saved     # bytes one block keeps for backward inside its pairs' modules
    profile.block.rest.time       # forward seconds of the rest of a block on `hw`

Each op the graph runs is priced as `estimate` prices it (`step_time.OpCosts`: a roofline with a
cost per op) and each storage it creates is counted as `estimate`'s walk counts it
(`liveness.LiveBytes`); both are put on the part of the model the op's node belongs to:

    first    everything before the blocks (the embedding)
    split    in a block, inside a module holding a Megatron pair (attention, MLP): tensor
             parallelism divides it
    rest     in a block, the rest (norms, residual adds): sequence parallelism divides it
    experts  in a block, inside the experts module: expert parallelism spreads it
    last     after the blocks (final norm, head, loss): a vocab-parallel head divides it

A storage alive when the forward ends is what backward reads (its part's `saved`). Of a part,
`checkpoint selective` keeps the matmul and attention outputs (`matmul_saved`) and recomputes
the rest of the forward (`Part.recomputed`). Blocks are averaged (they are one class).
Backward is not run: it is priced as twice the forward (each matmul's two gradients) by the
caller, who says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx

from . import meta
from .capture import Captured, bind_inputs
from .graph import keep_loss_output, normalize
from .hardware import Hardware
from .liveness import LiveBytes, flash_attention
from .passes.checkpoint import MATMUL_OPS
from .step_time import OpCosts
from .structure import ModelShape

PARTS = ("first", "split", "rest", "experts", "last")


@dataclass
class Part:
    """One part's forward, at the profile's tokens: bytes kept for backward, FLOPs, seconds."""

    saved: int = 0
    flops: float = 0.0
    time: float = 0.0  # priced on the profile's hardware, the cost per op included
    ops: int = 0
    matmul_saved: int = 0  # bytes of the matmul and attention outputs: what selective checkpointing keeps
    matmul_whole: int = 0  # of those, a row linear's: partial sums, whole under tp
    matmul_time: float = 0.0  # of `time`: those ops' (the rest is what selective checkpointing recomputes)
    matmul_ops: int = 0

    def per_block(self, layers: int) -> Part:
        n = max(layers, 1)
        return Part(
            self.saved // n,
            self.flops / n,
            self.time / n,
            self.ops // n,
            self.matmul_saved // n,
            self.matmul_whole // n,
            self.matmul_time / n,
            self.matmul_ops // n,
        )

    def recomputed(self) -> Part:
        """What selective checkpointing runs again of this part in backward: all but its matmuls."""
        return Part(time=self.time - self.matmul_time, ops=self.ops - self.matmul_ops)


@dataclass
class Profile:
    rows: int  # the sequences (or samples) the forward ran on
    tokens: int  # rows x seq (every part scales with them but `ops`)
    hidden_bytes: int  # one token's activation between blocks (what a checkpointed block keeps)
    parts: dict[str, Part] = field(default_factory=dict)  # a block's parts per block
    op_overhead: float = 0.0

    def part(self, name: str) -> Part:
        return self.parts.get(name, Part())


class _Parts(LiveBytes):
    """`LiveBytes` that remembers the part each storage was made in, and prices and counts the
    matmuls apart (phase "matmul" of their part)."""

    def __init__(self, part: list[str], costs: OpCosts) -> None:
        super().__init__(lambda: part[0], costs)
        self.part, self.costs = part, costs
        self.made_in: dict[int, str] = {}
        self.matmul_bytes: dict[str, int] = {}
        self.in_row = False  # the node being run is in a row linear (the walk sets it)
        self.row_bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in MATMUL_OPS:
            return super().__torch_dispatch__(func, types, args, kwargs)
        index = PARTS.index(self.part[0])
        self.costs.begin(index, "matmul")
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.costs.begin(index, "forward")

    def _add(self, storage: torch.UntypedStorage, func) -> None:
        key = id(storage)
        if key not in self._storages and storage.nbytes():
            self.made_in[key] = self.part[0]
            if func in MATMUL_OPS:
                made = self.row_bytes if self.in_row else self.matmul_bytes
                made[self.part[0]] = made.get(self.part[0], 0) + storage.nbytes()
        super()._add(storage, func)


class _Walk(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, part_of: dict[str, str], rows: set[str], tracker: _Parts) -> None:
        super().__init__(gm)
        self.part_of, self.rows, self.tracker = part_of, rows, tracker

    def run_node(self, n: fx.Node) -> Any:
        now = self.part_of.get(n.name)
        if now is not None and now != self.tracker.part[0]:
            self.tracker.part[0] = now
            self.tracker.costs.begin(PARTS.index(now), "forward")
        self.tracker.in_row = n.name in self.rows
        return super().run_node(n)


def profile_model(captured: Captured, shape: ModelShape, hw: Hardware) -> Profile:
    """Run the captured model's forward on meta and measure it by part (see the module docstring)."""
    gm = keep_loss_output(normalize(captured.program.module()), captured.program.call_spec.out_spec)
    flash_attention(gm)
    part_of = _parts(gm, shape)
    costs = OpCosts(hw)
    note = ["first"]
    costs.begin(0, "forward")
    inputs = [
        x.to("meta") if isinstance(x, Tensor) else x
        for x in bind_inputs(captured.model, gm, captured.args, captured.kwargs)
    ]
    tracker = _Parts(note, costs)
    with tracker:
        out = _Walk(gm, part_of, _in_rows(gm, shape), tracker).run(*inputs)
        kept: dict[str, int] = {}
        for key, (nbytes, ref) in tracker._storages.items():
            if ref() is not None:
                name = tracker.made_in.get(key, "first")
                kept[name] = kept.get(name, 0) + nbytes
        del out
    rows, tokens = _tokens(captured)
    width = shape.hidden or 0
    dtype = next((p.dtype for p in captured.model.parameters() if p.is_floating_point()), torch.float32)
    profile = Profile(rows, tokens, width * dtype.itemsize, op_overhead=hw.op_overhead)
    for i, name in enumerate(PARTS):
        cost, mm = costs.phase(i, "forward"), costs.phase(i, "matmul")
        part = Part(
            kept.get(name, 0),
            cost.flops + mm.flops,
            cost.compute + mm.compute,
            cost.ops + mm.ops,
            tracker.matmul_bytes.get(name, 0) + tracker.row_bytes.get(name, 0),
            tracker.row_bytes.get(name, 0),
            mm.compute,
            mm.ops,
        )
        profile.parts[name] = part.per_block(shape.layers) if name in ("split", "rest", "experts") else part
    return profile


def _parts(gm: fx.GraphModule, shape: ModelShape) -> dict[str, str]:
    """Node name -> its part, for the call_function nodes of `gm`."""
    blocks = shape.blocks
    pair_parents = {row.rpartition(".")[0] for row in (p.row for p in shape.pairs)}
    out: dict[str, str] = {}
    seen_block = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        path = meta.module_tag(node) or ""
        inner = _inside_block(path, blocks)
        if inner is None:
            out[node.name] = "last" if seen_block else "first"
            continue
        seen_block = True
        if shape.experts is not None and _within(inner, shape.experts):
            out[node.name] = "experts"
        elif any(_within(inner, parent) for parent in pair_parents if parent):
            out[node.name] = "split"
        else:
            out[node.name] = "rest"
    return out


def _in_rows(gm: fx.GraphModule, shape: ModelShape) -> set[str]:
    """The call_function nodes of `gm` inside a block's row linear (`o_proj`, `down_proj`)."""
    rows = [pair.row for pair in shape.pairs]
    out = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        inner = _inside_block(meta.module_tag(node) or "", shape.blocks)
        if inner is not None and any(_within(inner, row) for row in rows):
            out.add(node.name)
    return out


def _inside_block(path: str, blocks: str | None) -> str | None:
    """`layers.3.mlp.up_proj` -> `mlp.up_proj` (the path inside its block); None outside blocks."""
    if blocks is None or not path.startswith(blocks + "."):
        return None
    _index, _, inner = path[len(blocks) + 1 :].partition(".")
    return inner


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _tokens(captured: Captured) -> tuple[int, int]:
    """(rows, tokens) of the inputs captured: (batch, batch x seq), or a model's samples."""
    from .capture import token_tensors

    shapes = [t.shape for t in token_tensors(captured.args, captured.kwargs)]
    if shapes:
        return int(shapes[0][0]), int(shapes[0][0]) * int(shapes[0][1])
    first = next((x for x in captured.args if isinstance(x, Tensor)), None)
    rows = int(first.shape[0]) if first is not None and first.dim() else 1
    return rows, rows
