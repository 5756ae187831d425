"""When ZeRO's parameters are whole: stage 3's gathers, prefetches and frees of its units, and
stages 1/2's waits for the post-step all-gather, on the events of a forward and a backward.
The engine (`zero.py`) owns the flats and the units; this object decides when they are gathered.

Stage 3 gathers a unit's params before its forward, frees them after it, gathers them
again before its backward and frees them once backward has accumulated all their
grads; the next unit (previous, in backward) is prefetched. Two ways to mark the units:

- A compiled program (meshplan's ZeRO pass) calls `ZeroGather` before a layer's first
  parameter use and `ZeroRelease` on the values leaving it; this object binds itself to
  those modules (`zero_nodes.py`), so the order is the graph's and the gathers are in the
  ledger:

      zero_gather_layers_0 = self.zero_gather_layers_0(layers_0_attn_q_proj_weight, ...)
      ...
      zero_release_layers_0 = self.zero_release_layers_0(add_3)  # frees; backward gathers

  Stages 1 and 2 use the same `ZeroGather` nodes to overlap the all-gather of the
  updated params with the next forward: the engine's `step()` launches it, the node waits for it.
- Any other module: hooks on every numbered child of a container (`layers.0`, ...), the
  root for the rest. That needs a module per layer whose forward runs: eager models and
  `torch.export.unflatten` programs have one, the flat GraphModule of
  `torch.export(...).module()` does not (it reads every parameter at the top of the
  graph), so without the compiler's nodes it is one unit, gathered whole.

A pipeline rank holds its stages' parameters in one module that never runs and runs them in
its stage programs (`programs`), whose nodes drive the engine. Each flat lies within one
program, so its gradients are whole after that stage's last backward of the step, which
runs outside `no_sync` (a weight two of the rank's stages read gets a flat of its own that
only `finish()` reduces). Microbatches interleave, so every unit has a release, gathered
again for each microbatch's backward and kept (`Flat.pins`) until that backward has
accumulated its gradients: a split backward (zero-bubble schedules) computes the weight
gradients later, after other microbatches' forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from .zero_flats import Flat, Unit, unique
from .zero_nodes import Gathered, ZeroGather, ZeroRelease, in_backward

Record = Callable[[str, int], None]  # (op, bytes): the engine counts a collective for its ledger


class Gathers:
    """The gathers and frees of one engine's flats (`flats`, stage 3's `units`), driven by
    forward hooks on `module`, its `programs` and the units' modules, and by the compiled
    programs' `nodes` (each `ZeroGather` with its layer's `ZeroRelease`, in program order;
    `program_of` says which program each is in), which call `on_gather`, `on_release` and
    `before_backward` (`zero_nodes.Engine`). `aliases`: every name of every parameter."""

    def __init__(
        self,
        module: nn.Module,
        programs: Sequence[nn.Module],
        stage: int,
        flats: Sequence[Flat],
        units: Sequence[Unit],
        nodes: Sequence[tuple[ZeroGather, ZeroRelease | None]],
        program_of: Sequence[int],
        aliases: dict[str, nn.Parameter],
        record: Record,
    ) -> None:
        self.module, self.programs, self.stage, self.record = module, list(programs), stage, record
        self.flats, self.units, self.nodes, self._program_of = flats, units, nodes, program_of
        self._units_of: dict[int, list[Unit]] = {}  # a flat of a tied weight is in several
        for u in units:
            for f in u.flats:
                self._units_of.setdefault(id(f), []).append(u)
        # stages 1/2 on a compiled graph: which flats each ZeroGather node waits for
        flat_of = {id(p): f for f in flats for p in f.params}
        self._waits = [
            unique(flat_of[id(aliases[n])] for n in g.params if n in aliases and id(aliases[n]) in flat_of)
            for g, _ in nodes
        ]
        # stage 3: the flat and name of each parameter a gather node hands out in another dtype
        named_in = {id(p): (f, n) for f in flats for n, p in zip(f.names, f.params, strict=True)}
        self._read_as = [
            [
                named_in.get(id(aliases[n])) if d is not None and n in aliases else None
                for n, d in zip(g.params, g.dtypes, strict=True)
            ]
            for g, _ in nodes
        ]
        waited = {id(f) for fs in self._waits for f in fs}
        self._unwaited = [f for f in flats if id(f) not in waited]  # params no node uses
        self._release_order = [i for i, (_, release) in enumerate(nodes) if release is not None]
        self._release_order.sort(key=lambda i: nodes[i][1].position)  # type: ignore[union-attr]
        self._forward_order: list[Unit] = []
        self.peak = 0  # stage 3: the most parameter bytes gathered at once (the engine resets it)
        self._handles: list[Any] = []

    def register(self) -> None:
        """Hook the modules and bind the nodes (the engine hooks the parameters' gradients)."""
        self._handles = [self.module.register_forward_pre_hook(self._before_root_forward)]
        if self.programs != [self.module]:  # a pipeline's stages: the module itself never runs
            self._handles += [
                p.register_forward_pre_hook(self._before_program_forward) for p in self.programs
            ]
        for u in self.units:
            if u.module is None:
                continue  # driven by the graph's nodes
            self._handles.append(u.module.register_forward_pre_hook(self._before_unit_forward(u)))
            if u.refetch:
                self._handles.append(u.module.register_forward_hook(self._after_unit_forward(u)))
        for index, (gather, release) in enumerate(self.nodes):
            gather.bind(self, index)
            if release is not None:
                release.bind(self, index)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for gather, release in self.nodes:
            gather.bind(None, -1)
            if release is not None:
                release.bind(None, -1)

    # ------------------------------------------------------------------ module hooks

    def _before_root_forward(self, module: nn.Module, args: Any) -> None:
        """A step's forward starts: every flat counts its gradients afresh (`Zero`'s hook on
        each parameter), and the params no node waits for must be whole."""
        if in_backward():  # recomputation under activation checkpointing
            return
        for f in self.flats:
            f.ready = 0
        for f in self._unwaited:
            f.wait_gather()

    def _before_program_forward(self, module: nn.Module, args: Any) -> None:
        """A pipeline stage starts: the params no node waits for must be whole. Unlike the
        root's hook, it keeps the flats' counts of gradients: another stage's backward of the
        step may have run, and each flat is counted by its own program's backwards."""
        if not in_backward():
            for f in self._unwaited:
                f.wait_gather()

    def _before_unit_forward(self, unit: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            unit.gather(self.record)
            if in_backward():
                return
            if unit not in self._forward_order:
                self._forward_order.append(unit)  # learned on the first forward
            i = self._forward_order.index(unit)
            if i + 1 < len(self._forward_order):
                self._forward_order[i + 1].prefetch(self.record)
            self._track()

        return hook

    def _after_unit_forward(self, unit: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():  # recomputation: backward frees it once its grads are in
                return
            unit.free()
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(self._before_unit_backward(unit))

        return hook

    def _before_unit_backward(self, unit: Unit) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            unit.gather(self.record)
            i = self._forward_order.index(unit)
            if i > 0:
                self._forward_order[i - 1].prefetch(self.record)
            self._track()

        return hook

    # ------------------------------------------------------------------ the compiled nodes

    def on_gather(self, index: int, params: Sequence[Tensor]) -> tuple[Tensor | None, ...] | None:
        """`ZeroGather` node `index` runs: its layer's params must be whole from here on. Under
        mixed precision it returns the params the graph reads in another dtype (`ZeroGather`)."""
        if self.stage < 3:
            for f in self._waits[index]:
                f.wait_gather()
            return None
        self.units[index].gather(self.record)
        if not in_backward() and self._same_program(index, index + 1):
            self.units[index + 1].prefetch(self.record)
        self._track()
        dtypes = self.nodes[index][0].dtypes
        if not any(dtypes):
            return None
        out: list[Tensor | None] = [None] * len(params)
        views, mine = [], []
        for i, (p, dtype, at) in enumerate(zip(params, dtypes, self._read_as[index], strict=True)):
            if dtype is None:
                continue
            if at is not None and at[0].low is not None and at[0].low.dtype == dtype:
                views.append(at[0].views[at[1]])
                mine.append(i)
            else:  # gathered in its own dtype (read in several): cast here, as the graph did
                out[i] = p.to(dtype)
        for i, value in zip(
            mine, Gathered.apply(len(views), *views, *(params[i] for i in mine)), strict=True
        ):
            out[i] = value
        return tuple(out)

    def _same_program(self, index: int, other: int) -> bool:
        """Whether unit `other` runs next to unit `index`, in the same program (the next stage
        on a pipeline rank runs at another time: prefetching it would hold it gathered)."""
        return 0 <= other < len(self.nodes) and self._program_of[other] == self._program_of[index]

    def on_release(self, index: int) -> None:
        """`ZeroRelease` node `index` runs in forward: the layer is done with its params until
        backward. A flat a backward still needs (`Flat.pins`) stays."""
        if not in_backward():
            for f in self.units[index].flats:
                if not f.pins:
                    f.free_full()

    def before_backward(self, index: int) -> None:
        """The gradient reached `ZeroRelease` node `index`: gather its layer for its backward and
        prefetch the layer whose backward comes next (the one released before it).

        The layer's flats stay gathered until this backward has accumulated their gradients:
        a pipeline's split backward computes them later (W, after the input gradients), and the
        forwards of other microbatches may run in between; some weight gradients read the
        weights (a LayerNorm's), and so does recomputing a checkpointed layer."""
        self.units[index].gather(self.record)
        for f in self.units[index].flats:
            f.pins += 1
        k = self._release_order.index(index)
        if k > 0 and self._same_program(index, self._release_order[k - 1]):
            self.units[self._release_order[k - 1]].prefetch(self.record)
        self._track()

    # ------------------------------------------------------------------ gradients

    def grads_done(self, f: Flat) -> None:
        """Stage 3: backward has accumulated the gradients of every param of `f`. A flat no
        backward pinned (a unit kept gathered from its forward) is freed now; a pinned one once
        every flat of its unit is done (recomputing a checkpointed layer reads all of them)."""
        if not f.pins:
            f.free_full()
            return
        f.pins -= 1
        for unit in self._units_of[id(f)]:
            if not any(g.pins for g in unit.flats):
                unit.free()

    def _track(self) -> None:
        now = sum(f.full_nbytes() for f in self.flats if f.is_gathered())
        self.peak = max(self.peak, now)
