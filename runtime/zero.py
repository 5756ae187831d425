"""ZeRO stages 1, 2 and 3 and CPU offload over one data-parallel process group: the engine
that schedules gathers, frees and gradient reductions and drives the optimizer step.

The training loop wraps a module (a compiled per-rank GraphModule, or any nn.Module)
and calls this object instead of an optimizer:

    zero = shard_for_zero(model, dp_group, ZeroConfig(stage=2), lr=3e-4, betas=(0.9, 0.95),
                          weight_decay=0.1, eps=1e-8)
    for micro in range(k):
        with zero.no_sync() if micro < k - 1 else contextlib.nullcontext():
            model(x[micro], y[micro]).backward()
    zero.step()
    zero.zero_grad()

launched like any meshplan program (`torchrun --nproc-per-node 2 -m meshplan.run PLAN`).

    stage  kept per rank                     backward (per flat)        step
    1      params, full grads, 1/N opt       all-reduce grads           AdamW on own slice, all-gather params
    2      params, 1/N grads, 1/N opt        reduce-scatter grads       AdamW on own slice, all-gather params
    3      1/N params, grads, opt            reduce-scatter grads       AdamW on own slice (gathered before use)

The pieces, one module each:

    zero_flats.py   parameters as flats (padded 1-D buffers, a shard per rank) and stage 3's units
    zero_grads.py   the gradient reductions per flat, and the averaged gradient shards they leave
    zero_optim.py   AdamW over the fp32 shards (`zero.optimizer`), offload, each rank's state for checkpoints
    zero_nodes.py   the gather/release nodes of a compiled program, which this engine binds itself to

Stage 3 gathers a unit's params before its forward, frees them after it, gathers them
again before its backward and frees them once backward has accumulated all their
grads; the next unit (previous, in backward) is prefetched. Two ways to mark the units:

- A compiled program (meshplan's ZeRO pass) calls `ZeroGather` before a layer's first
  parameter use and `ZeroRelease` on the values leaving it; the engine binds itself to
  those modules, so the order is the graph's and the gathers are in the ledger:

      zero_gather_layers_0 = self.zero_gather_layers_0(layers_0_attn_q_proj_weight, ...)
      ...
      zero_release_layers_0 = self.zero_release_layers_0(add_3)  # frees; backward gathers

  Stages 1 and 2 use the same `ZeroGather` nodes to overlap the all-gather of the
  updated params with the next forward: `step()` launches it, the node waits for it.
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

Why not FSDP2: `fully_shard` on the layer holders of a flat exported graph fails (their
forward never runs, so the graph mixes DTensor params with plain tensors), and on the
root alone it is the same single unit as here; stages 1 and 2 are not FSDP2 shapes at
all. One engine for 1-3 gives one ledger, one state-dict layout and exact memory counts.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_flatten

from . import watchdog
from .zero_flats import Flat, Unit, bucket_flats, build_units, units_from_nodes
from .zero_grads import ShardedGrads
from .zero_nodes import Gathered, graph_units
from .zero_optim import OwnState, ShardedAdamW


@dataclass(frozen=True)
class ZeroConfig:
    """How to shard over the data-parallel group. `reduce_dtype=None` reduces in the params' dtype."""

    stage: int = 1
    bucket_bytes: int = 25 * 2**20
    offload_optimizer: bool = False
    offload_params: bool = False
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"ZeRO stage must be 1, 2 or 3, not {self.stage} (stage 0 is plain data parallel)"
            )
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, not {self.bucket_bytes}")
        if self.offload_params and self.stage != 3:
            raise ValueError("offloading parameters needs ZeRO-3: stages 1 and 2 keep every parameter")


class Collective(NamedTuple):
    """One kind of collective per optimizer step: `bytes` as the ledger counts them (the full tensor)."""

    op: str
    bytes: int
    count: int  # type: ignore[assignment]  # the ledger's name for it; shadows tuple.count


class Zero:
    """Sharded AdamW plus gradient (and, for stage 3, parameter) sharding for one module.

    Build it with `shard_for_zero`. It registers hooks on the module and its parameters:
    gradients are reduced per flat as soon as backward has produced all of them, so the
    communication overlaps the rest of backward.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup,
        config: ZeroConfig,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float,
        units: Sequence[str] | None = None,
        decay: Callable[[str, nn.Parameter], bool] | None = None,
        axis: str = "dp",
        programs: Sequence[nn.Module] = (),
        alone: Collection[str] = (),
        only: Collection[str] | None = None,
        node_axis: str | None = None,
        divisor: int | None = None,
    ) -> None:
        self.module, self.group, self.config, self.axis = module, group, config, axis
        self.world = dist.get_world_size(group)
        mine = None if only is None else set(only)
        params = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad and (mine is None or n in mine)
        ]
        if not params:
            raise ValueError("the module has no trainable parameters to shard")
        self.device = params[0][1].device
        shard_device = torch.device("cpu") if config.offload_params else self.device
        # A flat holds only decayed or only undecayed params, so each master sits in one param group.
        decays = {id(p): decay is None or decay(n, p) for n, p in params}
        # the compiled graph's ZeroGather nodes, in program order (none on other modules), and
        # the program each is in: a pipeline rank runs several (its stages), each on its own
        self._programs = list(programs) or [module]
        self._nodes, self._program_of = [], []
        for k, program in enumerate(self._programs if units is None else []):
            found = graph_units(program, node_axis)
            self._nodes += found
            self._program_of += [k] * len(found)
        aliases = dict(module.named_parameters(remove_duplicate=False))  # a tied param has two names
        # A param several programs read (a weight tied across two stages of a pipeline rank) has
        # a flat of its own, reduced only by `finish()`: each program's last backward of the
        # step is synchronized, and neither is the last to add to its gradient.
        shared = _read_by_several(params, self._programs, aliases)
        self.units: list[Unit]
        if config.stage == 3 and self._nodes:
            self.units = units_from_nodes(
                self._nodes, params, aliases, group, shard_device, decays, axis, alone
            )
            self.flats = _unique(f for u in self.units for f in u.flats)
        elif config.stage == 3:
            self.units = build_units(module, params, group, shard_device, units, decays, axis)
            self.flats = [f for u in self.units for f in u.flats]
        else:
            self.units = []
            # a flat within one program: its gradients are complete after that program's backward
            self.flats = [
                f
                for part in _by_program(params, self._programs, aliases)
                for f in bucket_flats(
                    part, config.bucket_bytes, group, shard_device, decays, axis, [*alone, *shared]
                )
            ]
        self._units_of: dict[int, list[Unit]] = {}  # a flat of a tied weight is in several
        for u in self.units:
            for f in u.flats:
                self._units_of.setdefault(id(f), []).append(u)
        # the params in a flat of their own, whose gradient pieces `own_grad_of` hands out
        self._alone = {f.names[0]: f for f in self.flats if len(f.names) == 1 and f.names[0] in alone}
        self._late = {id(f) for f in self.flats if len(f.names) == 1 and f.names[0] in shared}
        # stages 1/2 on a compiled graph: which flats each ZeroGather node waits for
        flat_of = {id(p): f for f in self.flats for p in f.params}
        self._waits = [
            _unique(flat_of[id(aliases[n])] for n in g.params if n in aliases and id(aliases[n]) in flat_of)
            for g, _ in self._nodes
        ]
        # stage 3: the flat and name of each parameter a gather node hands out in another dtype
        named_in = {id(p): (f, n) for f in self.flats for n, p in zip(f.names, f.params, strict=True)}
        self._read_as = [
            [
                named_in.get(id(aliases[n])) if d is not None and n in aliases else None
                for n, d in zip(g.params, g.dtypes, strict=True)
            ]
            for g, _ in self._nodes
        ]
        waited = {id(f) for fs in self._waits for f in fs}
        self._unwaited = [f for f in self.flats if id(f) not in waited]  # params no node uses
        self._release_order = [i for i, (_, release) in enumerate(self._nodes) if release is not None]
        self._release_order.sort(key=lambda i: self._nodes[i][1].position)  # type: ignore[union-attr]
        self._adam = ShardedAdamW(
            self.flats,
            group,
            decays,
            device=self.device,
            offload=config.offload_optimizer,
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            eps=eps,
        )
        self.optimizer, self.masters, self.opt_device = (
            self._adam.optimizer,
            self._adam.masters,
            self._adam.opt_device,
        )
        self._sync = True
        self._grads = ShardedGrads(
            self.flats,
            group,
            stage=config.stage,
            reduce_dtype=config.reduce_dtype,
            record=self._record,
            axis=axis,
            divisor=divisor,
        )
        self._issued: Counter[tuple[str, int]] = Counter()
        # stage 3: the most parameter bytes gathered at once during the last step (`peak_gathered`)
        self._peak_gathered = self.peak_gathered = 0
        self._last_issued: Counter[tuple[str, int]] = Counter()
        self._forward_order: list[Unit] = []
        self._handles = self._register_hooks()

    # ------------------------------------------------------------------ public API

    def step(self) -> None:
        """Finish the gradient reduction, update this rank's shard, and share the new params.

        Stages 1/2 on a compiled graph leave the all-gather of the new params running: each
        `ZeroGather` node of the next forward waits for its own layer's flats.
        """
        self._grads.finish(sync=self._sync)
        self.wait_params()
        self._adam.step()
        if self.config.stage == 3:
            for u in self.units:  # a gathered copy (e.g. from an eval forward) is stale now
                u.free()
            for f in self.flats:
                f.pins = 0  # a backward that left a param without a gradient
        else:
            self._all_gather_params(wait=not self._nodes)
        self._last_issued, self._issued = self._issued, Counter()
        self.peak_gathered, self._peak_gathered = self._peak_gathered, 0

    def wait_params(self) -> None:
        """Stages 1/2: wait for the all-gather of the updated params still running (see `step`)."""
        if self.config.stage < 3:
            for f in self.flats:
                f.wait_gather()

    def zero_grad(self) -> None:
        """Drop every gradient: the params' full grads, the reduced ones and the shards."""
        self._grads.drop()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (full size, every stage); the next synced backward reduces them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish(self) -> None:
        """Wait until this step's gradients are reduced (`step()` and the methods below do it too)."""
        self._grads.finish(sync=self._sync)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter materialized inside the block (stage 3 frees them after), e.g. to evaluate
        or export a consolidated state dict. These gathers are outside the step's ledger."""
        self.wait_params()
        if self.config.stage == 3:
            for u in self.units:
                u.gather(lambda op, nbytes: None, whole=True)
        try:
            yield
        finally:
            if self.config.stage == 3:
                for u in self.units:
                    u.free()

    def gathered_by_unit(self) -> Iterator[set[str]]:
        """Each unit's parameters materialized in turn (fp32, as `gathered()` makes them), their
        names yielded, then freed: an export holds one layer on the device at a time, not the
        model. Stages 1/2 keep every parameter whole: all names at once. Every rank of the
        group iterates it to the end, in the same order (the gathers are collectives)."""
        self.wait_params()
        if self.config.stage < 3:
            yield {n for f in self.flats for n in f.names}
            return
        for u in self.units:
            u.gather(lambda op, nbytes: None, whole=True)
            try:
                yield {n for f in u.flats for n in f.names}
            finally:
                u.free()

    def own_grad_of(self, name: str) -> Tensor:
        """This rank's piece of the averaged gradient of parameter `name`, given a flat of its
        own (`alone`): elements [r*S, (r+1)*S) of it, flattened and padded, S =
        `shard_numel(numel)`. So an engine of the same group size elsewhere (another pipeline
        rank holding a copy of a tied weight) holds the same elements. A view: changing it in
        place changes the gradient the step uses."""
        self._grads.finish(sync=self._sync)
        grad = self._alone[name].own_grad()
        assert grad is not None, f"{name} has no gradient this step"
        return grad

    def holds_alone(self, name: str) -> bool:
        """Whether parameter `name` has a flat of its own here (`alone`)."""
        return name in self._alone

    def shard_numel(self, numel: int) -> int:
        """S: the elements of a flat of `numel` elements each rank of the group owns."""
        return math.ceil(numel / self.world)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the sharded gradients so their global L2 norm is at most `max_norm`; return the norm."""
        norm = self.grad_squares().sum().sqrt().float()
        self.scale_grads_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def grad_squares(self, kinds: Sequence[Collection[str]] = ()) -> Tensor:
        """`GradSync.grad_squares`: sums of squares of the averaged gradient over the whole group,
        in float64, one per kind of parameter (names) and one for the rest; the same on every rank.

        Each rank sums the part of each param inside its own shard, then one all-reduce adds
        the shards. A kind cut over other axes (tensor parallel) is this rank's piece of it:
        the caller sums it over those axes.
        """
        self._grads.finish(sync=self._sync)
        return self._grads.squares(kinds, self.device)

    def scale_grads_(self, factor: Tensor | float) -> None:
        """Multiply this rank's gradient shards by `factor` (loss-scale unscaling, clipping)."""
        self._grads.finish(sync=self._sync)
        self._grads.scale_(factor)

    def collectives(self, micro_steps: int = 1) -> list[Collective]:
        """What one optimizer step of `micro_steps` forward/backward passes issues, by op and size.

        Gradients are reduced once per step whatever `micro_steps` is; stage 3 gathers the
        params again in every micro-step. Computed from the flats; `issued()` is what the
        last step really issued, and a test checks that they agree.
        """
        rows: Counter[tuple[str, int]] = Counter()
        for f in self.flats:
            grad_bytes = self._grads.wire_bytes(f)
            if self.config.stage == 1:
                rows["all_reduce", grad_bytes] += 1
            else:
                rows["reduce_scatter", grad_bytes] += 1
            if self.config.stage < 3:
                rows["all_gather", f.full_nbytes()] += 1
        for u in self.units:
            for f in u.flats:
                # forward, and again before backward unless kept (the last unit is not freed after forward)
                rows["all_gather", f.full_nbytes()] += micro_steps * (2 if u.refetch else 1)
        return [Collective(op, nbytes, count) for (op, nbytes), count in sorted(rows.items())]

    def issued(self) -> list[Collective]:
        """The collectives the last `step()`'s iteration really issued (forward, backward and step)."""
        return [Collective(op, nbytes, count) for (op, nbytes), count in sorted(self._last_issued.items())]

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, by what the tensors are (live storages, each counted once)."""
        seen: set[int] = set()
        params = sum(
            _storage_bytes(t, seen) for f in self.flats for t in (f.full, f.shard, f.low) if t is not None
        )
        grads = sum(
            _storage_bytes(t, seen)
            for f in self.flats
            for t in [f.full_grad, f.grad_shard, *(p.grad for p in f.params)]
            if t is not None
        )
        grads += sum(_storage_bytes(p.buffer, seen) for p in self._grads.pending)  # in flight
        optimizer = 0
        for m in self.masters:
            optimizer += _storage_bytes(m, seen)
            optimizer += sum(_storage_bytes(t, seen) for t in self.optimizer.state[m].values())
        return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}

    def own_state(self) -> list[OwnState]:
        """This rank's elements of every parameter's fp32 value and AdamW moments, by name, as
        views (no copy, no collective): each rank checkpoints its own, placed in the whole
        tensor (`runtime/checkpoint.py`), so any stage, bucket size or dp size (or no ZeRO)
        resumes it. A checkpoint loads into the same views, then calls `loaded`."""
        self.wait_params()
        return self._adam.own_state()

    def steps(self) -> dict[str, Tensor]:
        """Every parameter's AdamW step count, by name (a plain AdamW's `state[p]["step"]`)."""
        return self._adam.steps()

    def loaded(self, steps: dict[str, Tensor]) -> None:
        """A checkpoint was read into `own_state()`'s views: take the step counts, refresh the
        shards the masters stand for and the gathered copies of the parameters."""
        self._adam.loaded(steps)
        self._after_load()

    def _after_load(self) -> None:
        """The shards changed under the params: drop stage 3's gathered copies, refill stages 1/2's."""
        if self.config.stage == 3:
            for u in self.units:
                u.free()
        else:
            self._all_gather_params(wait=True)

    # ------------------------------------------------------------------ setup

    def _register_hooks(self) -> list[Any]:
        handles = [self.module.register_forward_pre_hook(self._before_root_forward)]
        if self._programs != [self.module]:  # a pipeline's stages: the module itself never runs
            handles += [p.register_forward_pre_hook(self._before_program_forward) for p in self._programs]
        for i, f in enumerate(self.flats):
            for p in f.params:
                handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(i)))
        for u in self.units:
            if u.module is None:
                continue  # driven by the graph's nodes
            handles.append(u.module.register_forward_pre_hook(self._before_unit_forward(u)))
            if u.refetch:
                handles.append(u.module.register_forward_hook(self._after_unit_forward(u)))
        for index, (gather, release) in enumerate(self._nodes):
            gather.bind(self, index)
            if release is not None:
                release.bind(self, index)
        return handles

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        for gather, release in self._nodes:
            gather.bind(None, -1)
            if release is not None:
                release.bind(None, -1)

    # ------------------------------------------------------------------ hooks

    def _before_root_forward(self, module: nn.Module, args: Any) -> None:
        if _in_backward():  # recomputation under activation checkpointing
            return
        for f in self.flats:
            f.ready = 0
        for f in self._unwaited:
            f.wait_gather()

    def _before_program_forward(self, module: nn.Module, args: Any) -> None:
        """A pipeline stage starts: the params no node waits for must be whole. Unlike the
        root's hook, it keeps the flats' counts of gradients: another stage's backward of the
        step may have run, and each flat is counted by its own program's backwards."""
        if not _in_backward():
            for f in self._unwaited:
                f.wait_gather()

    def _before_unit_forward(self, unit: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            unit.gather(self._record)
            if _in_backward():
                return
            if unit not in self._forward_order:
                self._forward_order.append(unit)  # learned on the first forward
            i = self._forward_order.index(unit)
            if i + 1 < len(self._forward_order):
                self._forward_order[i + 1].prefetch(self._record)
            self._track_gathered()

        return hook

    def _after_unit_forward(self, unit: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():  # recomputation: backward frees it once its grads are in
                return
            unit.free()
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(self._before_unit_backward(unit))

        return hook

    def _before_unit_backward(self, unit: Unit) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            unit.gather(self._record)
            i = self._forward_order.index(unit)
            if i > 0:
                self._forward_order[i - 1].prefetch(self._record)
            self._track_gathered()

        return hook

    def on_gather(self, index: int, params: Sequence[Tensor]) -> tuple[Tensor | None, ...] | None:
        """`ZeroGather` node `index` runs: its layer's params must be whole from here on. Under
        mixed precision it returns the params the graph reads in another dtype (`ZeroGather`)."""
        if self.config.stage < 3:
            for f in self._waits[index]:
                f.wait_gather()
            return None
        self.units[index].gather(self._record)
        if not _in_backward() and self._same_program(index, index + 1):
            self.units[index + 1].prefetch(self._record)
        self._track_gathered()
        dtypes = self._nodes[index][0].dtypes
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
        return 0 <= other < len(self._nodes) and self._program_of[other] == self._program_of[index]

    def on_release(self, index: int) -> None:
        """`ZeroRelease` node `index` runs in forward: the layer is done with its params until
        backward. A flat a backward still needs (`Flat.pins`) stays."""
        if not _in_backward():
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
        self.units[index].gather(self._record)
        for f in self.units[index].flats:
            f.pins += 1
        k = self._release_order.index(index)
        if k > 0 and self._same_program(index, self._release_order[k - 1]):
            self.units[self._release_order[k - 1]].prefetch(self._record)
        self._track_gathered()

    def _grads_done(self, f: Flat) -> None:
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

    def _track_gathered(self) -> None:
        now = sum(f.full_nbytes() for f in self.flats if f.is_gathered())
        self._peak_gathered = max(self._peak_gathered, now)

    def _grad_hook(self, index: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            f = self.flats[index]
            f.ready += 1
            if f.ready < len(f.params):
                return
            f.ready = 0
            if self._sync and id(f) not in self._late:
                self._grads.start(f)
            if self.config.stage == 3:
                self._grads_done(f)

        return hook

    # ------------------------------------------------------------------ communication

    def _record(self, op: str, nbytes: int) -> None:
        """Count a collective being launched, for `issued()`, and tell the watchdog."""
        self._issued[op, nbytes] += 1
        watchdog.note(op, self.axis, watchdog.size_text(nbytes), self.group)

    def _all_gather_params(self, *, wait: bool) -> None:
        """Stages 1/2: every rank's updated shard into everyone's full params, in forward order
        (the flats are in backward order). `wait=False` leaves them running (see `step`)."""
        for f in reversed(self.flats):
            self._record("all_gather", f.full_nbytes())
            f.start_share()
        if wait:
            self.wait_params()


def shard_for_zero(
    module: nn.Module,
    group: dist.ProcessGroup,
    config: ZeroConfig,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.01,
    eps: float = 1e-8,
    units: Sequence[str] | None = None,
    decay: Callable[[str, nn.Parameter], bool] | None = None,
    axis: str = "dp",
    programs: Sequence[nn.Module] = (),
    alone: Collection[str] = (),
    only: Collection[str] | None = None,
    node_axis: str | None = None,
) -> Zero:
    """Shard `module`'s training state over `group` as `config.stage` says; every rank calls it.

    `units` (stage 3) names the modules whose forward gathers their params, e.g. the
    plan's `layers.0` ... `layers.N`; by default every numbered child of a container.
    `decay(name, param)` says which params get weight decay (default: all), like
    `make_optimizer`'s rule of no decay on 1-D params; the others go in their own flats
    and a second param group with `weight_decay` 0. `programs`: the compiled programs that
    run `module`'s parameters, when it does not run them itself (a pipeline rank's stages);
    `alone`: params that get a flat of their own (a weight tied across pipeline ranks, whose
    gradient pieces `own_grad_of` gives, the same elements on every rank holding a copy).
    `only`: the names of the params this engine shards (default: every trainable one), when
    several engines share a module, each over its own group (`runtime/expert_zero.py`), and
    `node_axis` the group whose ZeRO nodes it binds (the compiler names each node's group:
    `dp x ep` for a layer's dense params, `dp` for its experts'); None binds them all.

    The ranks must start from the same parameters (same seed, or a checkpoint): only each
    rank's own shard survives, so a difference would not be noticed.
    """
    return Zero(
        module,
        group,
        config,
        lr=lr,
        betas=betas,
        weight_decay=weight_decay,
        eps=eps,
        units=units,
        decay=decay,
        axis=axis,
        programs=programs,
        alone=alone,
        only=only,
        node_axis=node_axis,
    )


# ---------------------------------------------------------------------- helpers


def _read_by_several(
    params: list[tuple[str, nn.Parameter]], programs: Sequence[nn.Module], aliases: dict[str, nn.Parameter]
) -> set[str]:
    """The names of the `params` that more than one of `programs` reads."""
    readers: dict[int, int] = {}
    for program in programs if len(programs) > 1 else ():
        graph = program.graph if isinstance(program, fx.GraphModule) else None
        nodes = graph.nodes if graph is not None else ()
        read = {id(aliases[str(n.target)]) for n in nodes if n.op == "get_attr" and str(n.target) in aliases}
        for i in read:
            readers[i] = readers.get(i, 0) + 1
    return {n for n, p in params if readers.get(id(p), 0) > 1}


def _by_program(
    params: list[tuple[str, nn.Parameter]], programs: Sequence[nn.Module], aliases: dict[str, nn.Parameter]
) -> list[list[tuple[str, nn.Parameter]]]:
    """`params` split by the first of `programs` that reads each (the rest in a last part);
    one part, all of them, when there is one program."""
    if len(programs) == 1:
        return [params]
    first: dict[int, int] = {}
    for k, program in enumerate(programs):
        graph = program.graph if isinstance(program, fx.GraphModule) else None
        for node in graph.nodes if graph is not None else ():
            p = aliases.get(str(node.target)) if node.op == "get_attr" else None
            if p is not None:
                first.setdefault(id(p), k)
    parts: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(programs) + 1)]
    for name, p in params:
        parts[first.get(id(p), len(programs))].append((name, p))
    return [part for part in parts if part]


def _unique(flats: Iterable[Flat]) -> list[Flat]:
    return list({id(f): f for f in flats}.values())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _storage_bytes(t: Tensor, seen: set[int]) -> int:
    storage = t.untyped_storage()
    key = storage.data_ptr()
    if storage.nbytes() == 0 or key in seen:
        return 0
    seen.add(key)
    return storage.nbytes()
