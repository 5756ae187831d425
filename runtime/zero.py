"""ZeRO stages 1, 2 and 3 and CPU offload over one data-parallel process group.

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

Layout. Parameters are cut into *flats*: runs of same-dtype parameters laid end to end in
one 1-D buffer, padded to a multiple of the group size; rank r owns elements
[r*S, (r+1)*S) with S = ceil(numel / world). Three parameters of 3, 4 and 2 elements
on 2 ranks:

    full:   a0 a1 a2 b0 b1 | b2 b3 c0 c1 pad      numel 9, padded 10, S = 5
    owner:  rank 0         | rank 1

That is `torch.chunk` sharding of the unpadded buffer. Checkpoints do not see flats:
`full_state()` gives each parameter's whole value and moments by name. For stages 1 and 2 a flat is a
gradient bucket (`bucket_bytes`, parameters in reverse registration order, roughly the
order backward produces their gradients); for stage 3 it is one layer (a child of an
nn.ModuleList) or the root's remaining parameters.

    stage  kept per rank                     backward (per flat)        step
    1      params, full grads, 1/N opt       all-reduce grads           AdamW on own slice, all-gather params
    2      params, 1/N grads, 1/N opt        reduce-scatter grads       AdamW on own slice, all-gather params
    3      1/N params, grads, opt            reduce-scatter grads       AdamW on own slice (gathered before use)

On gloo, stages 2 and 3 issue their reduce-scatter as an all-reduce of which each rank
keeps its shard: gloo's own reduce-scatter is slower than its all-reduce of the same
tensor (11.2 vs 8.5 ms for 8 MB on 2 CPU ranks). Ledgers still list the reduce-scatter;
NCCL runs the real one.

The optimizer is a real `torch.optim.AdamW` over the fp32 shards (the master copy when
parameters are bf16/fp16 or the state is offloaded), so LR schedulers work on
`zero.optimizer` unchanged.

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

Why not FSDP2: `fully_shard` on the layer holders of a flat exported graph fails (their
forward never runs, so the graph mixes DTensor params with plain tensors), and on the
root alone it is the same single unit as here; stages 1 and 2 are not FSDP2 shapes at
all. One engine for 1-3 gives one ledger, one state-dict layout and exact memory counts.
"""

from __future__ import annotations

import contextlib
import functools
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
from .buckets import bucket_params, group_by_kind
from .zero_nodes import ZeroGather, ZeroRelease, graph_units

# torch >= 2.12 names the tensor-in/tensor-out collectives *_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPTIMIZER_KEYS = ("master", "exp_avg", "exp_avg_sq")
# Gradient reductions left running while backward goes on: enough to overlap, and a bound
# on the full-size gradient buffers alive at once (each is one bucket or one stage-3 unit).
_MAX_IN_FLIGHT = 2


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


class _Flat:
    """Same-dtype parameters as views into one padded 1-D buffer (`full`), plus this rank's shard.

    Stages 1/2 keep `full` allocated and `shard` is a view of it. Stage 3 keeps `shard` as
    its own tensor (on the CPU with params offload) and allocates `full` only between a
    gather and the matching free: the parameters stay views of `full`'s storage, which is
    resized to zero bytes when freed, so autograd's saved references see the data again
    after the next gather (FSDP1's trick).
    """

    def __init__(
        self,
        names: list[str],
        params: Sequence[Tensor],
        group: dist.ProcessGroup,
        *,
        sharded_params: bool,
        shard_device: torch.device,
        axis: str = "dp",
    ) -> None:
        self.names, self.params, self.group, self.axis = names, params, group, axis
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.dtype, self.device = params[0].dtype, params[0].device
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.shard_numel = math.ceil(self.numel / self.world)  # S
        self.padded = self.shard_numel * self.world
        self.full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)  # (padded,)
        with torch.no_grad():
            for p, off, n in zip(params, self.offsets, self.numels, strict=True):
                self.full[off : off + n].copy_(p.detach().reshape(-1))
                p.data = self.full[off : off + n].view_as(p)
        own = self.full[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]  # (S,)
        self.shard = own.to(shard_device, copy=True) if sharded_params else own
        self.full_grad: Tensor | None = None  # stage 1: (padded,) averaged grads, p.grad are views
        self.grad_shard: Tensor | None = None  # stages 2/3: (S,) averaged grads
        self.reduced = False  # grads reduced for this step
        self.ready = 0  # params whose grad has been accumulated in this backward
        self._gather_work: Any = None
        if sharded_params:
            self.free_full()

    @property
    def local_numel(self) -> int:
        """Elements of the shard inside the unpadded buffer (the last ranks may own only padding)."""
        return max(0, min(self.shard_numel, self.numel - self.rank * self.shard_numel))

    def full_nbytes(self) -> int:
        return self.padded * self.full.element_size()

    # ------------------------------------------------------------ stage 3: gather and free

    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def start_gather(self) -> Any:
        """Allocate `full` and all-gather every rank's shard into it; returns the async work."""
        self.full.untyped_storage().resize_(self.full_nbytes())
        src = self.shard.to(self.device)  # from the CPU with params offload; else no copy
        # The params are views of `full`; keep autograd from seeing the refill as an in-place edit.
        with torch.autograd._unsafe_preserve_version_counter(self.full):
            self._gather_work = _all_gather(self.full, src, group=self.group, async_op=True)
        return self._gather_work

    def wait_gather(self) -> None:
        if self._gather_work is not None:
            watchdog.note("all_gather", self.axis, watchdog.size_text(self.full_nbytes()), self.group)
            self._gather_work.wait()
            self._gather_work = None

    def free_full(self) -> None:
        self.wait_gather()
        self.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------ gradients

    def flat_grads(self, dtype: torch.dtype) -> Tensor:
        """The params' grads in one new (padded,) buffer of `dtype`; missing grads count as zero."""
        out = torch.zeros(self.padded, dtype=dtype, device=self.device)
        for p, off, n in zip(self.params, self.offsets, self.numels, strict=True):
            if p.grad is not None:
                out[off : off + n].copy_(p.grad.reshape(-1))
        return out

    def own_ranges(self) -> list[tuple[str, int, int]]:
        """(param name, start, end) of each param's elements inside this rank's shard, shard-local."""
        return [(name, mine.start, mine.stop) for name, mine, _ in self.own_slices()]

    def own_slices(self) -> list[tuple[str, slice, slice]]:
        """(param name, slice of the shard, slice of the flattened param): the elements this rank owns."""
        lo = self.rank * self.shard_numel
        out = []
        for name, off, n in zip(self.names, self.offsets, self.numels, strict=True):
            start, end = max(off, lo), min(off + n, lo + self.shard_numel)
            if start < end:
                out.append((name, slice(start - lo, end - lo), slice(start - off, end - off)))
        return out

    def own_grad(self) -> Tensor | None:
        """(S,) averaged gradient of this rank's shard, or None before any backward."""
        if self.full_grad is not None:
            return self.full_grad[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
        return self.grad_shard


class _Pending(NamedTuple):
    """A gradient reduction in flight: wait for `work`, then `finish` (which keeps the result)."""

    work: Any
    finish: Callable[[], None]
    buffer: Tensor  # the full-size gradients being reduced (counted by `memory()`)
    op: str


class _Unit:
    """Stage 3: the flats of one layer (or the root) gathered and freed together.

    `module` is the module whose forward hooks drive it, or None when the compiled
    graph's `ZeroGather` / `ZeroRelease` nodes do. `refetch`: freed after forward and
    gathered again before backward (a unit used until the end of forward, like the root
    holding the embedding and the LM head, is kept instead: backward starts with it).
    """

    def __init__(self, name: str, module: nn.Module | None, flats: list[_Flat], *, refetch: bool) -> None:
        self.name, self.module, self.flats, self.refetch = name, module, flats, refetch

    def prefetch(self, record: Callable[[str, int], None]) -> None:
        """Start gathering the flats not yet gathered; `record` counts each all-gather for the ledger."""
        for f in self.flats:
            if not f.is_gathered():
                record("all_gather", f.full_nbytes())
                f.start_gather()

    def gather(self, record: Callable[[str, int], None]) -> None:
        """Make sure every flat is gathered: wait for a prefetch, or gather now."""
        self.prefetch(record)
        for f in self.flats:
            f.wait_gather()

    def free(self) -> None:
        for f in self.flats:
            f.free_full()


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
    ) -> None:
        self.module, self.group, self.config, self.axis = module, group, config, axis
        self.world = dist.get_world_size(group)
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no trainable parameters to shard")
        self.device = params[0][1].device
        shard_device = torch.device("cpu") if config.offload_params else self.device
        # A flat holds only decayed or only undecayed params, so each master sits in one param group.
        decays = {id(p): decay is None or decay(n, p) for n, p in params}
        # the compiled graph's ZeroGather nodes, in program order (none on other modules)
        self._nodes = graph_units(module) if units is None else []
        aliases = dict(module.named_parameters(remove_duplicate=False))  # a tied param has two names
        if config.stage == 3 and self._nodes:
            self.units = _units_from_nodes(self._nodes, params, aliases, group, shard_device, decays, axis)
            self.flats = [f for u in self.units for f in u.flats]
        elif config.stage == 3:
            self.units = _build_units(module, params, group, shard_device, units, decays, axis)
            self.flats = [f for u in self.units for f in u.flats]
        else:
            self.units = []
            self.flats = [
                _Flat(names, ps, group, sharded_params=False, shard_device=shard_device, axis=axis)
                for names, ps in bucket_params(params, config.bucket_bytes, decays)
            ]
        # stages 1/2 on a compiled graph: which flats each ZeroGather node waits for
        flat_of = {id(p): f for f in self.flats for p in f.params}
        self._waits = [
            _unique(flat_of[id(aliases[n])] for n in g.params if n in aliases and id(aliases[n]) in flat_of)
            for g, _ in self._nodes
        ]
        waited = {id(f) for fs in self._waits for f in fs}
        self._unwaited = [f for f in self.flats if id(f) not in waited]  # params no node uses
        self._release_order = [i for i, (_, release) in enumerate(self._nodes) if release is not None]
        self._release_order.sort(key=lambda i: self._nodes[i][1].position)  # type: ignore[union-attr]
        self.opt_device = torch.device("cpu") if config.offload_optimizer else self.device
        self.masters = [self._master_for(f) for f in self.flats]
        param_groups: list[dict[str, Any]] = [
            {"params": [m for f, m in zip(self.flats, self.masters, strict=True) if decays[id(f.params[0])]]},
            {
                "params": [
                    m for f, m in zip(self.flats, self.masters, strict=True) if not decays[id(f.params[0])]
                ],
                "weight_decay": 0.0,
            },
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in param_groups if g["params"]],
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            eps=eps,
            foreach=False,
        )
        for m in self.masters:  # eager state: memory() and full_state() are right before step 1
            self.optimizer.state[m] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
            }
        self._sync = True
        self._gloo = dist.get_backend(group) == "gloo"
        self._pending: list[_Pending] = []  # gradient reductions in flight
        self._issued: Counter[tuple[str, int]] = Counter()
        # stage 3: the most parameter bytes gathered at once during the last step (`peak_gathered`)
        self._peak_gathered = self.peak_gathered = 0
        self._last_issued: Counter[tuple[str, int]] = Counter()
        self._forward_order: list[_Unit] = []
        self._handles = self._register_hooks()

    # ------------------------------------------------------------------ public API

    def step(self) -> None:
        """Finish the gradient reduction, update this rank's shard, and share the new params.

        Stages 1/2 on a compiled graph leave the all-gather of the new params running: each
        `ZeroGather` node of the next forward waits for its own layer's flats.
        """
        self._finish_grad_sync()
        self.wait_params()
        for f, master in zip(self.flats, self.masters, strict=True):
            grad = f.own_grad()
            master.grad = (
                torch.zeros_like(master) if grad is None else grad.to(self.opt_device, torch.float32)
            )
        self.optimizer.step()
        for f, master in zip(self.flats, self.masters, strict=True):
            master.grad = None
            if master is not f.shard:
                with torch.no_grad():
                    f.shard.copy_(master)  # fp32 master -> bf16 shard, or CPU -> device
        if self.config.stage == 3:
            for u in self.units:  # a gathered copy (e.g. from an eval forward) is stale now
                u.free()
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
        for f in self.flats:
            for p in f.params:
                p.grad = None
            f.full_grad = f.grad_shard = None
            f.reduced = False

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
        self._finish_grad_sync()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter materialized inside the block (stage 3 frees them after), e.g. to evaluate
        or export a consolidated state dict. These gathers are outside the step's ledger."""
        self.wait_params()
        if self.config.stage == 3:
            for u in self.units:
                u.gather(lambda op, nbytes: None)
        try:
            yield
        finally:
            if self.config.stage == 3:
                for u in self.units:
                    u.free()

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
        self._finish_grad_sync()
        squares = torch.zeros(len(kinds) + 1, dtype=torch.float64, device=self.device)
        for f in self.flats:
            g = f.own_grad()
            if g is None:
                continue
            for name, start, end in f.own_ranges():
                kind = next((i for i, names in enumerate(kinds) if name in names), len(kinds))
                squares[kind] += g[start:end].double().pow(2).sum()
        self._record("all_reduce", squares.nbytes)
        dist.all_reduce(squares, group=self.group)
        return squares.cpu()

    def scale_grads_(self, factor: Tensor | float) -> None:
        """Multiply this rank's gradient shards by `factor` (loss-scale unscaling, clipping)."""
        self._finish_grad_sync()
        for f in self.flats:
            g = f.own_grad()
            if g is not None:
                g.mul_(factor.to(g.dtype) if isinstance(factor, Tensor) else factor)

    def collectives(self, micro_steps: int = 1) -> list[Collective]:
        """What one optimizer step of `micro_steps` forward/backward passes issues, by op and size.

        Gradients are reduced once per step whatever `micro_steps` is; stage 3 gathers the
        params again in every micro-step. Computed from the flats; `issued()` is what the
        last step really issued, and a test checks that they agree.
        """
        rows: Counter[tuple[str, int]] = Counter()
        reduce_size = self._reduce_dtype_size
        for f in self.flats:
            grad_bytes = f.padded * reduce_size(f)
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
        params = sum(_storage_bytes(t, seen) for f in self.flats for t in (f.full, f.shard))
        grads = sum(
            _storage_bytes(t, seen)
            for f in self.flats
            for t in [f.full_grad, f.grad_shard, *(p.grad for p in f.params)]
            if t is not None
        )
        grads += sum(_storage_bytes(p.buffer, seen) for p in self._pending)  # in flight
        optimizer = 0
        for m in self.masters:
            optimizer += _storage_bytes(m, seen)
            optimizer += sum(_storage_bytes(t, seen) for t in self.optimizer.state[m].values())
        return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}

    def full_state(self) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
        """Every parameter's fp32 value and AdamW state, whole, keyed by name: what a plain
        `torch.optim.AdamW` would hold (`{"step", "exp_avg", "exp_avg_sq"}` per param). All
        ranks of the group call it (one all-gather per flat and tensor); it costs a full copy.

        The checkpoint format that does not depend on the layout (`runtime/checkpoint.py`):
        a ZeRO run saves it, and any stage, bucket size or dp size (or no ZeRO) resumes it.
        """
        self.wait_params()
        values: dict[str, Tensor] = {}
        moments: dict[str, dict[str, Tensor]] = {}
        for f, master in zip(self.flats, self.masters, strict=True):
            state = self.optimizer.state[master]
            whole = {
                key: self._gather_flat(f, t)
                for key, t in zip(
                    _OPTIMIZER_KEYS, (master, state["exp_avg"], state["exp_avg_sq"]), strict=True
                )
            }
            for name, p, off, n in zip(f.names, f.params, f.offsets, f.numels, strict=True):
                values[name] = whole["master"][off : off + n].view(p.shape).clone()
                moments[name] = {"step": state["step"].clone()} | {
                    key: whole[key][off : off + n].view(p.shape).clone() for key in _OPTIMIZER_KEYS[1:]
                }
        return values, moments

    def load_full_state(self, values: dict[str, Tensor], moments: dict[str, dict[str, Tensor]]) -> None:
        """The inverse of `full_state`: keep this rank's elements of each whole tensor."""
        self.wait_params()
        with torch.no_grad():
            for f, master in zip(self.flats, self.masters, strict=True):
                state = self.optimizer.state[master]
                state["step"] = torch.as_tensor(moments[f.names[0]]["step"]).float().clone()
                for name, mine, theirs in f.own_slices():
                    master[mine].copy_(values[name].reshape(-1)[theirs])
                    for key in _OPTIMIZER_KEYS[1:]:
                        state[key][mine].copy_(moments[name][key].reshape(-1)[theirs])
                if master is not f.shard:
                    f.shard.copy_(master)
        self._after_load()

    def _gather_flat(self, f: _Flat, shard: Tensor) -> Tensor:
        """(padded,) every rank's (S,) piece of one flat-shaped fp32 tensor, on the optimizer's device."""
        out = torch.empty(f.padded, dtype=shard.dtype, device=self.device)
        _all_gather(out, shard.detach().to(self.device), group=self.group)
        return out.to(self.opt_device)

    def _after_load(self) -> None:
        """The shards changed under the params: drop stage 3's gathered copies, refill stages 1/2's."""
        if self.config.stage == 3:
            for u in self.units:
                u.free()
        else:
            self._all_gather_params(wait=True)

    # ------------------------------------------------------------------ setup

    def _master_for(self, f: _Flat) -> Tensor:
        """The fp32 tensor AdamW updates: the shard itself when it is fp32 and already in place."""
        if f.dtype == torch.float32 and f.shard.device == self.opt_device:
            return f.shard
        return f.shard.detach().to(self.opt_device, torch.float32, copy=True)

    def _register_hooks(self) -> list[Any]:
        handles = [self.module.register_forward_pre_hook(self._before_root_forward)]
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

    def _before_unit_forward(self, unit: _Unit) -> Callable[..., None]:
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

    def _after_unit_forward(self, unit: _Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():  # recomputation: backward frees it once its grads are in
                return
            unit.free()
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(self._before_unit_backward(unit))

        return hook

    def _before_unit_backward(self, unit: _Unit) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            unit.gather(self._record)
            i = self._forward_order.index(unit)
            if i > 0:
                self._forward_order[i - 1].prefetch(self._record)
            self._track_gathered()

        return hook

    def on_gather(self, index: int) -> None:
        """`ZeroGather` node `index` runs: its layer's params must be whole from here on."""
        if self.config.stage < 3:
            for f in self._waits[index]:
                f.wait_gather()
            return
        self.units[index].gather(self._record)
        if not _in_backward() and index + 1 < len(self._nodes):
            self.units[index + 1].prefetch(self._record)
        self._track_gathered()

    def on_release(self, index: int) -> None:
        """`ZeroRelease` node `index` runs in forward: the layer is done with its params until backward."""
        if not _in_backward():
            self.units[index].free()

    def before_backward(self, index: int) -> None:
        """The gradient reached `ZeroRelease` node `index`: gather its layer for its backward and
        prefetch the layer whose backward comes next (the one released before it)."""
        self.units[index].gather(self._record)
        k = self._release_order.index(index)
        if k > 0:
            self.units[self._release_order[k - 1]].prefetch(self._record)
        self._track_gathered()

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
            if self._sync:
                self._start_reduce(f)
            if self.config.stage == 3:
                f.free_full()  # backward is done with every param of this flat

        return hook

    # ------------------------------------------------------------------ communication

    def _reduce_dtype(self, f: _Flat) -> torch.dtype:
        return self.config.reduce_dtype or f.dtype

    def _reduce_dtype_size(self, f: _Flat) -> int:
        return torch.empty((), dtype=self._reduce_dtype(f)).element_size()

    def _record(self, op: str, nbytes: int) -> None:
        """Count a collective being launched, for `issued()`, and tell the watchdog."""
        self._issued[op, nbytes] += 1
        watchdog.note(op, self.axis, watchdog.size_text(nbytes), self.group)

    def _start_reduce(self, f: _Flat) -> None:
        """Launch the reduction of one flat's grads and free the full-size grads (stages 2/3)."""
        flat = f.flat_grads(self._reduce_dtype(f))  # (padded,)
        for p in f.params:
            p.grad = None
        op = "all_reduce" if self.config.stage == 1 else "reduce_scatter"
        self._record(op, flat.nbytes)
        finish: Callable[[], None]
        if self.config.stage == 1:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            finish = functools.partial(self._finish_all_reduce, f, flat)
        elif self._gloo:  # gloo's reduce-scatter is slower than its all-reduce: reduce all, keep ours
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            own = slice(f.rank * f.shard_numel, (f.rank + 1) * f.shard_numel)
            finish = lambda: self._finish_reduce_scatter(f, flat[own].clone())  # noqa: E731
        else:
            out = flat.new_empty(f.shard_numel)  # (S,)
            work = _reduce_scatter(out, flat, group=self.group, async_op=True)
            finish = functools.partial(self._finish_reduce_scatter, f, out)
        self._pending.append(_Pending(work, finish, flat, op))
        f.reduced = True
        self._drain(keep=_MAX_IN_FLIGHT)

    def _drain(self, keep: int) -> None:
        """Finish the oldest reductions until `keep` are left: bounds the full-size buffers alive."""
        while len(self._pending) > keep:
            pending = self._pending.pop(0)
            watchdog.note(pending.op, self.axis, watchdog.size_text(pending.buffer.nbytes), self.group)
            pending.work.wait()
            pending.finish()

    def _finish_all_reduce(self, f: _Flat, flat: Tensor) -> None:
        f.full_grad = flat.div_(self.world).to(f.dtype)  # (padded,) averaged
        for p, off, n in zip(f.params, f.offsets, f.numels, strict=True):
            p.grad = f.full_grad[off : off + n].view_as(p)

    def _finish_reduce_scatter(self, f: _Flat, shard: Tensor) -> None:
        shard.div_(self.world)  # (S,) averaged, in the reduce dtype
        f.grad_shard = shard if f.grad_shard is None else f.grad_shard + shard

    def _finish_grad_sync(self) -> None:
        """Reduce what backward did not (params without grads, or hooks that never fired), then wait."""
        if self._sync:
            for f in self.flats:
                if not f.reduced and any(p.grad is not None for p in f.params):
                    self._start_reduce(f)
                    if self.config.stage == 3:
                        f.free_full()
        self._drain(keep=0)

    def _all_gather_params(self, *, wait: bool) -> None:
        """Stages 1/2: every rank's updated shard into everyone's full params, in forward order
        (the flats are in backward order). `wait=False` leaves them running (see `step`)."""
        for f in reversed(self.flats):
            src = f.shard.clone()  # (S,): the output buffer contains it; do not alias
            self._record("all_gather", f.full_nbytes())
            with torch.autograd._unsafe_preserve_version_counter(f.full):
                f._gather_work = _all_gather(f.full, src, group=self.group, async_op=True)
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
) -> Zero:
    """Shard `module`'s training state over `group` as `config.stage` says; every rank calls it.

    `units` (stage 3) names the modules whose forward gathers their params, e.g. the
    plan's `layers.0` ... `layers.N`; by default every numbered child of a container.
    `decay(name, param)` says which params get weight decay (default: all), like
    `make_optimizer`'s rule of no decay on 1-D params; the others go in their own flats
    and a second param group with `weight_decay` 0.

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
    )


# ---------------------------------------------------------------------- grouping


def _unit_modules(module: nn.Module, names: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    """The modules whose forward gathers their params (`names`, or every numbered child of a
    container: `layers.0`, `layers.1`, ...), then the root for the rest.

    A flat graph from `torch.export(...).module()` has the same module names, but its
    forward reads every parameter at the top of the graph and never calls the children:
    it gets one unit (the root), so the whole model is gathered for forward and again for
    backward. `torch.export.unflatten` keeps a forward per submodule, and per-layer units work.
    """
    if names is not None:
        modules = dict(module.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"ZeRO-3 units name no module: {', '.join(missing)}")
        return [*((n, modules[n]) for n in names if n), ("", module)]
    if isinstance(module, fx.GraphModule):
        return [("", module)]
    units: list[tuple[str, nn.Module]] = []
    for name, container in module.named_modules():
        children = list(container.named_children())
        inside_unit = any(name == u or name.startswith(u + ".") for u, _ in units)
        if children and all(c.isdigit() for c, _ in children) and not inside_unit:
            units.extend((f"{name}.{c}" if name else c, child) for c, child in children)
    return [*units, ("", module)]


def _build_units(
    module: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    group: dist.ProcessGroup,
    shard_device: torch.device,
    names: Sequence[str] | None,
    decays: dict[int, bool],
    axis: str,
) -> list[_Unit]:
    """Stage 3: each param goes to the unit that owns its name; a param tied across units to the root."""
    units = _unit_modules(module, names)
    owners: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(_owner(name, units))
    by_unit: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name, _ in units}
    for name, p in params:
        unit_names = owners[id(p)]
        by_unit[unit_names.pop() if len(unit_names) == 1 else ""].append((name, p))
    built = []
    for name, child in units:
        flats = _flats(by_unit[name], group, shard_device, decays, axis)
        if flats:
            built.append(_Unit(name, child, flats, refetch=name != ""))
    return built


def _units_from_nodes(
    nodes: list[tuple[ZeroGather, ZeroRelease | None]],
    params: list[tuple[str, nn.Parameter]],
    aliases: dict[str, nn.Parameter],
    group: dist.ProcessGroup,
    shard_device: torch.device,
    decays: dict[int, bool],
    axis: str,
) -> list[_Unit]:
    """Stage 3 on a compiled graph: one unit per `ZeroGather` node, in its order. Params no
    node names (the graph never reads them) go to a last unit only `gathered()` materializes."""
    left = {id(p): (n, p) for n, p in params}  # not yet in a unit
    units = []
    for gather, release in nodes:
        named = [left.pop(id(aliases[n])) for n in gather.params if n in aliases and id(aliases[n]) in left]
        units.append(
            _Unit(
                gather.unit,
                None,
                _flats(named, group, shard_device, decays, axis),
                refetch=release is not None,
            )
        )
    rest = _flats(list(left.values()), group, shard_device, decays, axis)
    if rest:
        units.append(_Unit("", None, rest, refetch=False))
    return units


def _flats(
    params: list[tuple[str, nn.Parameter]],
    group: dist.ProcessGroup,
    shard_device: torch.device,
    decays: dict[int, bool],
    axis: str,
) -> list[_Flat]:
    """A unit's params as sharded flats: one per dtype and decay class."""
    return [
        _Flat(
            [n for n, _ in ps],
            [p for _, p in ps],
            group,
            sharded_params=True,
            shard_device=shard_device,
            axis=axis,
        )
        for ps in group_by_kind(params, decays)
    ]


def _unique(flats: Iterable[_Flat]) -> list[_Flat]:
    return list({id(f): f for f in flats}.values())


def _owner(param_name: str, units: list[tuple[str, nn.Module]]) -> str:
    for name, _ in units:
        if name and param_name.startswith(name + "."):
            return name
    return ""


# ---------------------------------------------------------------------- helpers


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _storage_bytes(t: Tensor, seen: set[int]) -> int:
    storage = t.untyped_storage()
    key = storage.data_ptr()
    if storage.nbytes() == 0 or key in seen:
        return 0
    seen.add(key)
    return storage.nbytes()
