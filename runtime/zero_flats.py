"""ZeRO's parameter storage: flats (parameters as views into one padded buffer, of which each
rank owns a shard) and, for stage 3, units (the flats of one layer, gathered and freed
together), and which parameters go into which. The engine (`zero.py`) decides when.

Parameters are cut into *flats*: runs of same-dtype parameters laid end to end in one 1-D
buffer, padded to a multiple of the group size; rank r owns elements [r*S, (r+1)*S) with
S = ceil(numel / world). Three parameters of 3, 4 and 2 elements on 2 ranks:

    full:   a0 a1 a2 b0 b1 | b2 b3 c0 c1 pad      numel 9, padded 10, S = 5
    owner:  rank 0         | rank 1

That is `torch.chunk` sharding of the unpadded buffer. For stages 1 and 2 a flat is a
gradient bucket (`bucket_bytes`, parameters in reverse registration order, roughly the
order backward produces their gradients: `bucket_flats`); for stage 3 a unit is one layer
(a child of an nn.ModuleList, or a compiled program's `ZeroGather` node) or the root's
remaining parameters, and its flats one per dtype and decay class (`build_units`,
`units_from_nodes`). Which parameters share a flat is `buckets.py`'s rule, which the
compiler's ledger uses too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn

from . import watchdog
from .buckets import bucket_params, group_by_kind
from .collectives import all_gather_single
from .hollow import value_of
from .zero_nodes import ZeroGather, ZeroRelease


class Flat:
    """Same-dtype parameters as views into one padded 1-D buffer (`full`), plus this rank's shard.

    Stages 1/2 keep `full` allocated and `shard` is a view of it. Stage 3 keeps `shard` as
    its own tensor (on the CPU with params offload) and allocates `full` only between a
    gather and the matching free: the parameters stay views of `full`'s storage, which is
    resized to zero bytes when freed, so autograd's saved references see the data again
    after the next gather (FSDP1's trick). With `offload = params:disk` (`files`) the shard
    is in a file between gathers: read before its all-gather, freed after it
    (`disk_offload.ParamFiles`).
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
        gather_dtype: torch.dtype | None = None,
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
                self.full[off : off + n].copy_(value_of(p).reshape(-1))  # a hollow one's made now
                p.data = self.full[off : off + n].view_as(p)
        own = self.full[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]  # (S,)
        self.shard = own.to(shard_device, copy=True) if sharded_params else own
        self.full_grad: Tensor | None = None  # stage 1: (padded,) averaged grads, p.grad are views
        self.grad_shard: Tensor | None = None  # stages 2/3: (S,) averaged grads
        self.reduced = False  # grads reduced for this step
        # params that got no gradient at all this step (`flat_grads`): the optimizer skips them
        self.missing: frozenset[str] = frozenset()
        self.ready = 0  # params whose grad has been accumulated in this backward
        self.pins = 0  # stage 3: backwards that gathered it and have not accumulated its grads yet
        self._gather_work: Any = None
        self.files: ShardFiles | None = None  # `offload = params:disk`: where the shard is between gathers
        # stage 3, params the graph reads in another dtype (bf16 compute over fp32 params): what a
        # gather fills is this (padded,) buffer in that dtype, and `views` hand it out by name;
        # `full` (fp32) is gathered only for `gathered()` (export, evaluation)
        self.low: Tensor | None = None
        self.views: dict[str, Tensor] = {}
        if sharded_params and gather_dtype is not None and gather_dtype != self.dtype:
            self.low = torch.empty(self.padded, dtype=gather_dtype, device=self.device)
            # tensors on `low`'s storage, not autograd views of it: a gather refills `low` in
            # place, which must not touch the version of what the layer saved for backward
            storage = self.low.untyped_storage()
            self.views = {
                name: torch.empty(0, dtype=gather_dtype, device=self.device).set_(
                    storage, off, p.shape, torch.empty(p.shape, device="meta").stride()
                )
                for name, p, off, n in zip(names, params, self.offsets, self.numels, strict=True)
            }
            storage.resize_(0)
        if sharded_params:
            self.free_full()

    @property
    def local_numel(self) -> int:
        """Elements of the shard inside the unpadded buffer (the last ranks may own only padding)."""
        return max(0, min(self.shard_numel, self.numel - self.rank * self.shard_numel))

    def full_nbytes(self) -> int:
        """Bytes of what a gather fills: the compute-dtype buffer if the params are read in one."""
        return self.padded * self._target().element_size()

    def _target(self, whole: bool = False) -> Tensor:
        return self.low if self.low is not None and not whole else self.full

    # ------------------------------------------------------------ stage 3: gather and free

    def is_gathered(self, whole: bool = False) -> bool:
        return self._target(whole).untyped_storage().nbytes() > 0

    def start_gather(self, whole: bool = False) -> Any:
        """Allocate the buffer and all-gather every rank's shard into it; returns the async work.
        `whole`: into the fp32 `full` the params view, also when they are read in another dtype."""
        target = self._target(whole)
        _resize(target, self.padded * target.element_size())
        if self.files is not None:
            self.files.need(self)  # read from its file (read ahead, usually)
        src = self.shard.to(self.device, target.dtype)  # from the CPU with params offload; else no copy
        # The params (or views) are of this buffer; keep autograd from seeing the refill as an in-place edit.
        with torch.autograd._unsafe_preserve_version_counter(target):
            self._gather_work = all_gather_single(target, src, group=self.group, async_op=True)
        return self._gather_work

    def wait_gather(self) -> None:
        if self._gather_work is not None:
            watchdog.note("all_gather", self.axis, watchdog.size_text(self.full_nbytes()), self.group)
            self._gather_work.wait()
            self._gather_work = None
            if self.files is not None:
                self.files.gathered(self)

    def free_full(self) -> None:
        self.wait_gather()
        _resize(self.full, 0)
        if self.low is not None:
            _resize(self.low, 0)

    # ------------------------------------------------------------ stages 1/2: share the update

    def start_share(self) -> None:
        """Stages 1/2: all-gather every rank's updated shard into `full` (which stays allocated);
        `wait_gather` waits for it."""
        src = self.shard.clone()  # (S,): the output buffer contains it; do not alias
        with torch.autograd._unsafe_preserve_version_counter(self.full):
            self._gather_work = all_gather_single(self.full, src, group=self.group, async_op=True)

    # ------------------------------------------------------------ gradients

    def flat_grads(self, dtype: torch.dtype) -> Tensor:
        """The params' grads in one new (padded,) buffer of `dtype`; missing grads count as zero.
        Only the padding and the missing grads are zero-filled (not the whole buffer first: a
        memset of every gradient byte was 3% of a ZeRO-3 step)."""
        out = torch.empty(self.padded, dtype=dtype, device=self.device)
        self.missing = frozenset(n for n, p in zip(self.names, self.params, strict=True) if p.grad is None)
        for p, off, n in zip(self.params, self.offsets, self.numels, strict=True):
            if p.grad is not None:
                out[off : off + n].copy_(p.grad.reshape(-1))
            else:
                out[off : off + n].zero_()
        out[self.numel :].zero_()
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


class ShardFiles(Protocol):
    """Where a stage-3 shard lives between its gathers (`disk_offload.ParamFiles`)."""

    def need(self, f: Flat) -> None: ...  # the shard in memory, for its all-gather
    def gathered(self, f: Flat) -> None: ...  # its all-gather is done: it may leave memory


class Unit:
    """Stage 3: the flats of one layer (or the root) gathered and freed together.

    `module` is the module whose forward hooks drive it, or None when the compiled
    graph's `ZeroGather` / `ZeroRelease` nodes do. `refetch`: freed after forward and
    gathered again before backward (a unit used until the end of forward, like the root
    holding the embedding and the LM head, is kept instead: backward starts with it).
    """

    def __init__(self, name: str, module: nn.Module | None, flats: list[Flat], *, refetch: bool) -> None:
        self.name, self.module, self.flats, self.refetch = name, module, flats, refetch

    def prefetch(self, record: Callable[[str, int], None]) -> None:
        """Start gathering the flats not yet gathered; `record` counts each all-gather for the ledger."""
        for f in self.flats:
            if not f.is_gathered():
                record("all_gather", f.full_nbytes())
                f.start_gather()

    def gather(self, record: Callable[[str, int], None], *, whole: bool = False) -> None:
        """Make sure every flat is gathered: wait for a prefetch, or gather now. `whole`: the
        fp32 params themselves, also those the graph reads in another dtype."""
        for f in self.flats:
            f.wait_gather()  # a prefetch of the compute-dtype buffer
        if whole:
            for f in self.flats:
                if not f.is_gathered(whole=True):
                    f.start_gather(whole=True)
                    f.wait_gather()
            return
        self.prefetch(record)
        for f in self.flats:
            f.wait_gather()

    def free(self) -> None:
        for f in self.flats:
            f.free_full()


# told the bytes a gathered buffer gains or loses (the CPU step tracker, `runtime.train.StepPeak`:
# resizing a storage is no op a dispatch mode sees)
RESIZED: list[Callable[[int], None]] = []


def _resize(buffer: Tensor, nbytes: int) -> None:
    storage = buffer.untyped_storage()
    before = storage.nbytes()
    storage.resize_(nbytes)
    for tell in RESIZED:
        tell(nbytes - before)


class Sharding(NamedTuple):
    """How one engine cuts its params into flats: over `group` (the mesh axis `axis`), each
    rank's shard kept on `shard_device`, and a flat holding params of one decay class only
    (`decays`, by param id: each flat's master then sits in one param group)."""

    group: dist.ProcessGroup
    axis: str
    shard_device: torch.device
    decays: dict[int, bool]

    def flat(
        self,
        names: list[str],
        params: Sequence[Tensor],
        *,
        sharded: bool,
        gather_dtype: torch.dtype | None = None,
    ) -> Flat:
        """The flat of `params` (named `names`): sharded (stage 3) or kept whole (stages 1/2)."""
        return Flat(
            names,
            params,
            self.group,
            sharded_params=sharded,
            shard_device=self.shard_device,
            axis=self.axis,
            gather_dtype=gather_dtype,
        )


def unique(flats: Iterable[Flat]) -> list[Flat]:
    """`flats` in order, each once (a flat of a tied weight is in several units)."""
    return list({id(f): f for f in flats}.values())


# ---------------------------------------------------------------------- grouping


def bucket_flats(
    params: list[tuple[str, nn.Parameter]],
    bucket_bytes: int,
    sharding: Sharding,
    alone: Collection[str] = (),
) -> list[Flat]:
    """Stages 1/2: the params as unsharded flats, one per gradient bucket (`bucket_params`),
    and one of its own for each param named in `alone` (see `Zero`)."""
    rest = [(n, p) for n, p in params if n not in alone]
    return [
        *(sharding.flat([n], [p], sharded=False) for n, p in params if n in alone),
        *(
            sharding.flat(names, ps, sharded=False)
            for names, ps in bucket_params(rest, bucket_bytes, sharding.decays)
        ),
    ]


def unit_modules(module: nn.Module, names: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
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


def build_units(
    module: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    sharding: Sharding,
    names: Sequence[str] | None,
) -> list[Unit]:
    """Stage 3: each param goes to the unit that owns its name; a param tied across units to the root."""
    units = unit_modules(module, names)
    owners: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(_owner(name, units))
    by_unit: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name, _ in units}
    for name, p in params:
        unit_names = owners[id(p)]
        by_unit[unit_names.pop() if len(unit_names) == 1 else ""].append((name, p))
    built = []
    for name, child in units:
        flats = sharded_flats(by_unit[name], sharding)
        if flats:
            built.append(Unit(name, child, flats, refetch=name != ""))
    return built


def units_from_nodes(
    nodes: list[tuple[ZeroGather, ZeroRelease | None]],
    params: list[tuple[str, nn.Parameter]],
    aliases: dict[str, nn.Parameter],
    sharding: Sharding,
    alone: Collection[str] = (),
) -> list[Unit]:
    """Stage 3 on a compiled graph: one unit per `ZeroGather` node, in its order. Params no
    node names (the graph never reads them) go to a last unit only `gathered()` materializes.
    A param several nodes name (a weight tied across pipeline stages of one rank) gets a flat
    of its own, in each of their units: each gathers it before its reads."""
    named_by: dict[int, int] = {}
    read_as: dict[int, set[torch.dtype | None]] = {}  # the dtypes the graph reads each param in
    for gather, _ in nodes:
        for i in {id(aliases[n]) for n in gather.params if n in aliases}:
            named_by[i] = named_by.get(i, 0) + 1
        for n, dtype in zip(gather.params, gather.dtypes, strict=True):
            if n in aliases:
                read_as.setdefault(id(aliases[n]), set()).add(dtype)
    # gathered in the one dtype every read wants; a param read in several stays in its own
    gather_dtypes = {i: d for i, ds in read_as.items() if len(ds) == 1 and (d := next(iter(ds))) is not None}
    left = {id(p): (n, p) for n, p in params}  # not yet in a unit
    shared = {
        i: sharded_flats([left.pop(i)], sharding, gather_dtypes=gather_dtypes)[0]
        for i, count in named_by.items()
        if count > 1 and i in left
    }
    units = []
    for gather, release in nodes:
        ids = list(dict.fromkeys(id(aliases[n]) for n in gather.params if n in aliases))
        named = [left.pop(i) for i in ids if i in left]
        units.append(
            Unit(
                gather.unit,
                None,
                [
                    *sharded_flats(named, sharding, alone, gather_dtypes),
                    *(shared[i] for i in ids if i in shared),
                ],
                refetch=release is not None,
            )
        )
    rest = sharded_flats(list(left.values()), sharding, alone)
    if rest:
        units.append(Unit("", None, rest, refetch=False))
    return units


def sharded_flats(
    params: list[tuple[str, nn.Parameter]],
    sharding: Sharding,
    alone: Collection[str] = (),
    gather_dtypes: dict[int, torch.dtype] | None = None,
) -> list[Flat]:
    """A unit's params as sharded flats: one per dtype, gather dtype (`gather_dtypes`, by id:
    the dtype the graph reads a param in) and decay class, and one of its own for each param
    named in `alone`."""
    gather_dtypes = gather_dtypes or {}
    rest = [(n, p) for n, p in params if n not in alone]
    groups: list[list[tuple[str, Tensor]]] = [[(n, p)] for n, p in params if n in alone]
    groups += group_by_kind(rest, sharding.decays, gather_dtypes)
    return [
        sharding.flat(
            [n for n, _ in ps], [p for _, p in ps], sharded=True, gather_dtype=gather_dtypes.get(id(ps[0][1]))
        )
        for ps in groups
    ]


def _owner(param_name: str, units: list[tuple[str, nn.Module]]) -> str:
    for name, _ in units:
        if name and param_name.startswith(name + "."):
            return name
    return ""
