"""ZeRO stages 1, 2 and 3 and CPU offload over one data-parallel process group (and HSDP's
replicas of it): the engine that schedules gathers, frees and gradient reductions and drives the
optimizer step.

The training loop wraps a module (a compiled per-rank GraphModule, or any nn.Module)
and steps this object instead of an optimizer:

    zero = shard_for_zero(model, dp_group, ZeroOptions(stage=2, decay=decays))
    zero.optimizer(TrainConfig(lr=3e-4, weight_decay=0.1))  # the config's optimizer (AdamW) over the shards
    for micro in range(k):
        with zero.no_sync() if micro < k - 1 else contextlib.nullcontext():
            model(x[micro], y[micro]).backward()
    zero.step()
    zero.zero_grad()

launched like any meshplan program (`torchrun --nproc-per-node 2 -m meshplan.run PLAN`).

    stage  kept per rank                     backward (per flat)        step
    1      params, full grads, 1/N opt       all-reduce grads           step own slice, all-gather params
    2      params, 1/N grads, 1/N opt        reduce-scatter grads       step own slice, all-gather params
    3      1/N params, grads, opt            reduce-scatter grads       step own slice (gathered before use)

The step is the plan's optimizer over this rank's slice, which must be elementwise (AdamW, SGD,
Lion: `optimizers.ELEMENTWISE`); Adafactor is refused.

The pieces, one module each:

    zero_flats.py   parameters as flats (padded 1-D buffers, a shard per rank) and stage 3's units
    zero_grads.py   the gradient reductions per flat, and the averaged gradient shards they leave
    zero_optim.py   the optimizer over the fp32 shards (`zero.optimizer()`), offload, each rank's state for checkpoints
    zero_gathers.py when each unit is gathered and freed: hooks on the modules, the compiled program's nodes
    zero_nodes.py   the gather/release nodes of a compiled program, which `zero_gathers.py` binds itself to

Stage 3 gathers a unit's params before its forward and frees them after it, again for its
backward; stages 1/2 overlap the all-gather of the updated params with the next forward.
When, on which hook or compiled node, is `zero_gathers.py`'s.

Why not FSDP2: `fully_shard` on the layer holders of a flat exported graph fails (their
forward never runs, so the graph mixes DTensor params with plain tensors), and on the
root alone it is the same single unit as here; stages 1 and 2 are not FSDP2 shapes at
all. One engine for 1-3 gives one ledger, one state-dict layout and exact memory counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import watchdog
from .axes import Axes
from .buckets import by_program, read_by_several
from .compression import Bf16Feedback, BucketCompressor, Compression, restore_state, saved_state
from .disk_offload import ParamFiles, rank_folder, shards_in_memory
from .grad_sync import Accumulates, OptimizerSettings, TrainingState, held_weakly
from .zero_flats import Sharding, Unit, bucket_flats, build_units, unique, units_from_nodes
from .zero_gathers import Gathers
from .zero_grads import Replicas, ShardedGrads
from .zero_nodes import ZeroGather, ZeroRelease, graph_units
from .zero_optim import OwnElements, ShardedOptimizer, load_buffers, read_steps, training_state


@dataclass(frozen=True)
class ZeroOptions:
    """How to shard a module's training state over a data-parallel group: the plan's
    `data_parallel` block (`zero`, `bucket`, `offload`, `compress`, the reduce precision) and which
    params get weight decay. `reduce_dtype=None` reduces in the params' dtype. `decay(name, param)`
    (default: every param), like `make_optimizer`'s rule of no decay on 1-D params: the others
    go in their own flats and a second param group with `weight_decay` 0. `offload_dir` puts the
    optimizer's state in files under `offload_dir/rank{r}` instead (`runtime/disk_offload.py`);
    `params_dir` (stage 3) the parameter shards, in memory only around their gathers and the step."""

    stage: int = 1
    bucket_bytes: int = 25 * 2**20
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_dir: Path | None = None
    params_dir: Path | None = None
    reduce_dtype: torch.dtype | None = None
    decay: Callable[[str, nn.Parameter], bool] | None = None
    compression: Compression | None = None  # the gradient reductions made lossy (`zero_grads.py`)

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"ZeRO stage must be 1, 2 or 3, not {self.stage} (stage 0 is plain data parallel)"
            )
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, not {self.bucket_bytes}")
        if self.offload_params and self.stage != 3:
            raise ValueError("offloading parameters needs ZeRO-3: stages 1 and 2 keep every parameter")
        if self.params_dir is not None and not (self.stage == 3 and self.offload_params):
            raise ValueError("parameter shards on disk need ZeRO-3 with offload_params")


class Collective(NamedTuple):
    """One kind of collective per optimizer step: `bytes` as the ledger counts them (the full tensor)."""

    op: str
    bytes: int
    count: int  # type: ignore[assignment]  # the ledger's name for it; shadows tuple.count


class Zero(Accumulates):
    """A sharded optimizer plus gradient (and, for stage 3, parameter) sharding for one module.

    Build it with `shard_for_zero`. It registers hooks on the module and its parameters:
    gradients are reduced per flat as soon as backward has produced all of them, so the
    communication overlaps the rest of backward.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup,
        options: ZeroOptions,
        *,
        axis: str = "dp",
        units: Sequence[str] | None = None,
        programs: Sequence[nn.Module] = (),
        alone: Collection[str] = (),
        only: Collection[str] | None = None,
        node_axis: str | None = None,
        divisor: int | None = None,
        replicas: Replicas | None = None,
    ) -> None:
        """Shard `module`'s training state over `group` (the mesh axis `axis`) as `options` say;
        every rank calls it (as `shard_for_zero`). Then `optimizer(config)` builds its optimizer.

        `units` (stage 3) names the modules whose forward gathers their params, e.g. the
        plan's `layers.0` ... `layers.N`; by default every numbered child of a container.
        `programs`: the compiled programs that run `module`'s parameters, when it does not run
        them itself (a pipeline rank's stages); `alone`: params that get a flat of their own (a
        weight tied across pipeline ranks, whose gradient pieces `own_grad_of` gives, the same
        elements on every rank holding a copy).

        For one of several engines over one module, each over its own group
        (`runtime/expert_zero.py`): `only` the names of the params this engine shards (default:
        every trainable one), `node_axis` the group whose ZeRO nodes it binds (the compiler
        names each node's group: `dp x ep` for a layer's dense params, `dp` for its experts';
        None binds them all), and `divisor` what a summed gradient is divided by (default: the
        group's size; `expert_data_parallel.data_ranks`).

        `replicas` (HSDP): the ranks that hold the same shards as this one, each training on
        its own part of the batch (`zero = 3 over dp` of `data_parallel over node x dp`: the
        `node` peers). Each reduced gradient shard is all-reduced over them too, so every copy
        of the state takes the same step; the parameters are gathered within `group` only.

        The ranks must start from the same parameters (same seed, or a checkpoint): only each
        rank's own shard survives, so a difference would not be noticed.
        """
        self.module, self.group, self.options, self.axis = module, group, options, axis
        self.replicas = replicas
        self.world = dist.get_world_size(group)
        mine = None if only is None else set(only)
        params = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad and (mine is None or n in mine)
        ]
        if not params:
            raise ValueError("the module has no trainable parameters to shard")
        self.device = params[0][1].device
        shard_device = torch.device("cpu") if options.offload_params else self.device
        # A flat holds only decayed or only undecayed params, so each master sits in one param group.
        decay = options.decay
        self._decays = {id(p): decay is None or decay(n, p) for n, p in params}
        sharding = Sharding(group, axis, shard_device, self._decays)
        # the compiled graph's ZeroGather nodes, in program order (none on other modules), and
        # the program each is in: a pipeline rank runs several (its stages), each on its own
        programs = list(programs) or [module]
        nodes: list[tuple[ZeroGather, ZeroRelease | None]] = []
        program_of: list[int] = []
        for k, program in enumerate(programs if units is None else []):
            found = graph_units(program, node_axis)
            nodes += found
            program_of += [k] * len(found)
        aliases = dict(module.named_parameters(remove_duplicate=False))  # a tied param has two names
        # A param several programs read (a weight tied across two stages of a pipeline rank) has
        # a flat of its own, reduced only by `finish()`: each program's last backward of the
        # step is synchronized, and neither is the last to add to its gradient.
        shared = read_by_several(params, programs, aliases)
        self.units: list[Unit]
        if options.stage == 3 and nodes:
            self.units = units_from_nodes(nodes, params, aliases, sharding, alone)
            self.flats = unique(f for u in self.units for f in u.flats)
        elif options.stage == 3:
            self.units = build_units(module, params, sharding, units)
            self.flats = [f for u in self.units for f in u.flats]
        else:
            self.units = []
            # a flat within one program: its gradients are complete after that program's backward
            self.flats = [
                f
                for part in by_program(params, programs, aliases)
                for f in bucket_flats(part, options.bucket_bytes, sharding, [*alone, *shared])
            ]
        # the params in a flat of their own, whose gradient pieces `own_grad_of` hands out
        self._alone = {f.names[0]: f for f in self.flats if len(f.names) == 1 and f.names[0] in alone}
        self._late = {id(f) for f in self.flats if len(f.names) == 1 and f.names[0] in shared}
        self._optim: ShardedOptimizer | None = None  # `optimizer()` builds it
        self._files: ParamFiles | None = None  # `params_dir`: the shards' files, made with the optimizer
        self._sync = True  # False inside `no_sync`: gradients accumulate full size, at every stage
        self._grads = ShardedGrads(
            self.flats,
            group,
            stage=options.stage,
            reduce_dtype=options.reduce_dtype,
            record=self._record,
            axis=axis,
            divisor=divisor,
            compression=options.compression,
            replicas=replicas,
        )
        self._issued: Counter[tuple[str, int]] = Counter()
        self._last_issued: Counter[tuple[str, int]] = Counter()
        self.peak_gathered = 0  # stage 3: the most parameter bytes gathered at once in the last step
        self._gathers = Gathers(
            module, programs, options.stage, self.flats, self.units, nodes, program_of, aliases, self._record
        )
        self._handles = self._register_hooks()

    # ------------------------------------------------------------------ public API

    def optimizer(self, config: OptimizerSettings, axes: Axes | None = None) -> Zero:
        """Build `config`'s optimizer over this rank's fp32 shards (once,
        before the first step); `axes` say how each parameter is cut besides (Adafactor's
        step sums over every piece). The engine itself is what the loop steps: `step()` finishes
        the reduction, updates the shards and shares the new params."""
        folder = self.options.offload_dir
        self._optim = ShardedOptimizer(
            self.flats,
            self.group,
            self._decays,
            device=self.device,
            offload=self.options.offload_optimizer,
            config=config,
            disk=None if folder is None else rank_folder(folder, dist.get_rank()),
            axes=axes,
        )
        if self.options.params_dir is not None:  # the shards to their files, from here on
            where = rank_folder(self.options.params_dir, dist.get_rank())
            self._files = ParamFiles(where, self.units, self.flats, self._optim.masters, self._optim.disk)
            if self._optim.disk is None:  # else its walk reads the shards with the state
                self._optim.walker = self._files
        return self

    @property
    def optim(self) -> ShardedOptimizer:
        """The optimizer over this rank's shards, once `optimizer()` built it."""
        if self._optim is None:
            raise RuntimeError(f"ZeRO over {self.axis} has no optimizer yet: call optimizer(config) first")
        return self._optim

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups, where the loop sets the LR (an LR scheduler's too)."""
        return self.optim.optimizer.param_groups

    def step(self) -> None:
        """Finish the gradient reduction, update this rank's shard, and share the new params.

        Stages 1/2 on a compiled graph leave the all-gather of the new params running: each
        `ZeroGather` node of the next forward waits for its own layer's flats.
        """
        self._grads.finish(sync=self._sync)
        self.wait_params()
        with shards_in_memory(self._files, step=True):
            self.optim.step()
        if self.options.stage == 3:
            for u in self.units:  # a gathered copy (e.g. from an eval forward) is stale now
                u.free()
            for f in self.flats:
                f.pins = 0  # a backward that left a param without a gradient
        else:
            self._all_gather_params(wait=not self._gathers.nodes)
        self._last_issued, self._issued = self._issued, Counter()
        self.peak_gathered, self._gathers.peak = self._gathers.peak, 0

    def wait_params(self) -> None:
        """Stages 1/2: wait for the all-gather of the updated params still running (see `step`)."""
        if self.options.stage < 3:
            for f in self.flats:
                f.wait_gather()

    def zero_grad(self) -> None:
        """Drop every gradient: the params' full grads, the reduced ones and the shards."""
        self._grads.drop()

    def finish(self) -> None:
        """Wait until this step's gradients are reduced (`step()` and the methods below do it too)."""
        self._grads.finish(sync=self._sync)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter materialized inside the block (stage 3 frees them after), e.g. to evaluate
        or export a consolidated state dict. These gathers are outside the step's ledger."""
        self.wait_params()
        if self.options.stage == 3:
            for u in self.units:
                u.gather(lambda op, nbytes: None, whole=True)
        try:
            yield
        finally:
            if self.options.stage == 3:
                for u in self.units:
                    u.free()

    def gathered_by_unit(self) -> Iterator[set[str]]:
        """Each unit's parameters materialized in turn (fp32, as `gathered()` makes them), their
        names yielded, then freed: an export holds one layer on the device at a time, not the
        model. Stages 1/2 keep every parameter whole: all names at once. Every rank of the
        group iterates it to the end, in the same order (the gathers are collectives)."""
        self.wait_params()
        if self.options.stage < 3:
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
            for op, grad_bytes in self._grads.wire(f):
                rows[op, grad_bytes] += 1
            if self.options.stage < 3 and self.world > 1:
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
        grads += sum(_storage_bytes(t, seen) for t in self._grads.state())  # `compress`'s residuals
        optimizer = 0
        if self._optim is not None:  # built by `optimizer()`
            state = self._optim.optimizer.state
            for m in self._optim.masters:
                optimizer += _storage_bytes(m, seen)
                optimizer += sum(_storage_bytes(t, seen) for t in state[m].values())
        return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}

    def own_state(self) -> TrainingState:
        """`GradSync.own_state`: this rank's elements of every parameter's fp32 value and optimizer
        state (`own_elements`), under the keys a run without ZeRO saves, and the buffers.
        Each rank checkpoints its own, placed in the whole tensor (`runtime/checkpoint.py`), so
        any stage, bucket size or dp size (or no ZeRO) resumes it."""
        state = training_state(self.module, self.own_elements(), self.steps(), self.optim.choice.kind)
        return dataclasses.replace(state, local=saved_state(self.feedback()))

    def restore_local(self, saved: dict[str, Tensor]) -> bool:
        """`GradSync.restore_local`: `compress`'s state of each flat."""
        return restore_state(self.feedback(), saved)

    def feedback(self) -> list[Bf16Feedback | BucketCompressor]:
        """`compress`'s compressors whose state a checkpoint keeps (`ZeroGrads.feedback`)."""
        return self._grads.feedback()

    def loaded(self, state: TrainingState) -> None:
        """`GradSync.loaded`: a checkpoint was read into `own_state()`'s views."""
        self.reload(read_steps(state))
        load_buffers(self.module, state)

    def own_elements(self) -> OwnElements:
        """This rank's elements of every parameter's fp32 value and optimizer state, by name, as
        views (no copy, no collective)."""
        self.wait_params()
        if self._files is not None:  # a master that is its shard (`params_dir`)
            self._files.masters_in_memory()
        return self.optim.own_elements()

    def steps(self) -> dict[str, Tensor]:
        """Every parameter's step count, by name (a plain AdamW's `state[p]["step"]`; none for
        an optimizer that counts no steps)."""
        return self.optim.steps()

    def reload(self, steps: Mapping[str, Tensor]) -> None:
        """A checkpoint was read into `own_elements()`'s views: take the step counts, refresh
        the shards the masters stand for, and drop stage 3's gathered copies of the parameters
        or gather stages 1/2's again."""
        with shards_in_memory(self._files):
            self.optim.loaded(steps)
        if self.options.stage == 3:
            for u in self.units:
                u.free()
        else:
            self._all_gather_params(wait=True)

    # ------------------------------------------------------------------ hooks

    def _register_hooks(self) -> list[Any]:
        """A hook on every parameter's gradient; the modules' hooks and the nodes are `Gathers`'."""
        self._gathers.register()
        on_grad = held_weakly(self._on_grad)
        return [
            p.register_post_accumulate_grad_hook(functools.partial(on_grad, i))
            for i, f in enumerate(self.flats)
            for p in f.params
        ]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._gathers.remove()

    def _on_grad(self, index: int, param: Tensor) -> None:
        """Backward accumulated one parameter's gradient; once it has all of a flat's (counted
        from each forward: `Gathers`), reduce the flat, and under stage 3 free it."""
        f = self.flats[index]
        f.ready += 1
        if f.ready < len(f.params):
            return
        f.ready = 0
        if self._sync and id(f) not in self._late:
            self._grads.start(f)
        if self.options.stage == 3:
            self._gathers.grads_done(f)

    # ------------------------------------------------------------------ communication

    def _record(self, op: str, nbytes: int, *, replicas: bool = False) -> None:
        """Count a collective being launched, for `issued()`, and tell the watchdog (`replicas`:
        one over HSDP's replicas rather than the engine's group). A collective over this rank
        alone sends nothing and is not counted, as the ledger lists none."""
        if self.world == 1 and not replicas:
            return
        self._issued[op, nbytes] += 1
        if replicas and self.replicas is not None:
            watchdog.note(op, self.replicas.axis, watchdog.size_text(nbytes), self.replicas.group)
        else:
            watchdog.note(op, self.axis, watchdog.size_text(nbytes), self.group)

    def _all_gather_params(self, *, wait: bool) -> None:
        """Stages 1/2: every rank's updated shard into everyone's full params, in forward order
        (the flats are in backward order). `wait=False` leaves them running (see `step`)."""
        for f in reversed(self.flats):
            self._record("all_gather", f.full_nbytes())
            f.start_share()
        if wait:
            self.wait_params()


# what a rank calls to shard its module's training state: the engine itself (`Zero.__init__`)
shard_for_zero = Zero


# ---------------------------------------------------------------------- helpers


def _storage_bytes(t: Tensor, seen: set[int]) -> int:
    storage = t.untyped_storage()
    key = storage.data_ptr()
    if storage.nbytes() == 0 or key in seen:
        return 0
    seen.add(key)
    return storage.nbytes()
