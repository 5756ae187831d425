"""The training state a gradient-sync engine keeps on one rank, computed with the runtime's own
bucketing functions (`runtime/buckets.py`) so it cannot drift from the engines: parameters,
gradients and optimizer state by where they live (the device, the host, or files under
`offload = optimizer:disk` and `params:disk`), and the communication buffers ZeRO makes during a
step.
`compiler/estimate.py` adds activations and the schedule's buffers to it per rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from meshplan.dsl.optimizer import OptimizerSpec
from meshplan.runtime.buckets import bucket_params, decays, feedback_bytes, group_by_kind

from .optimizer_state import shard_state_bytes, whole_state_bytes


@dataclass
class State:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    host: int = 0
    gathered: int = 0  # ZeRO-3: bytes of the largest unit, gathered
    reducing: int = 0  # ZeRO: the largest flat's whole gradient, made for its reduction
    accumulating: int = 0  # ZeRO under gradient accumulation: whole gradients between micro-steps
    grads_between_steps: int = 0  # gradient storage held across steps (data-parallel buckets)
    engine: str = "none"
    flats: int = 0  # ZeRO: the flats the optimizer steps (one fused update each)
    disk: int = 0  # `optimizer:disk`, `params:disk`: what is in files (`host` counts what a step reads back)


# `optimizer:disk` holds this many flats' state in memory during a step: the one stepping, and
# the next being read or the last being written (one I/O thread: `runtime/disk_offload.py`)
DISK_RESIDENT_FLATS = 2


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def state_of(
    params: dict[str, Tensor],
    *,
    zero: int,
    group_size: Callable[[str], int],
    engine: str,
    bucket_bytes: int,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    on_disk: bool = False,
    params_on_disk: bool = False,
    on_host: bool = False,
    accumulation: int = 1,
    bucketed: Callable[[str], bool] = lambda name: False,
    units: Sequence[tuple[str, Sequence[str], Sequence[torch.dtype | None]]] = (),
    optimizer: OptimizerSpec | None = None,
    compress: tuple[str, int] | None = None,
    compressed: Callable[[str], bool] = lambda name: True,
    replicated: bool = False,
    whole: Mapping[str, torch.Size] | None = None,
    programs: Mapping[str, int | None] | None = None,
) -> State:
    """The training state the engine keeps for `params` (this rank's, local shapes), as
    `GradSync.memory()` counts it right after the optimizer step. `group_size(name)`: the ranks
    a parameter's ZeRO state is cut over (1: not cut). `units`: ZeRO-3's gather units in
    program order (name, its parameters, the dtype each is gathered in). `on_host`: the ranks
    run on CPUs, where offloading moves nothing (no fp32 copy of an fp32 shard is made).
    `accumulation`: backwards a step (micro-steps, a pipeline's microbatches); ZeRO keeps whole
    gradients between them (`no_sync`; stage 1's flat, dropped by `zero_grad`, is made again).
    `bucketed(name)`: the per-axes engine reduces this parameter's gradient (in a bucket).
    `optimizer`: the plan's, whose state is counted (`optimizer_state.py`; None: AdamW).
    `on_disk`: the optimizer's state is in files (`State.disk`), the host holding the
    `DISK_RESIDENT_FLATS` largest flats' of it (the master is always a copy there).
    `params_on_disk` (ZeRO-3): the parameter shards are in files too (`disk`), the host holding
    two consecutive units' shards at once (the one being gathered, the next being read; the
    root's counted in), or every shard when the optimizer's state is in memory (its step reads
    them all: `runtime/disk_offload.ParamFiles`).
    `compress`: the plan's (method, rank): what its error feedback keeps, counted with the
    gradients as the engines count it (`buckets.feedback_bytes`; under ZeRO a bf16 residual is
    of the whole padded flat; `replicated`, HSDP's copies: a second one, of what each rank keeps);
    `compressed(name)`: whether the engine reducing this parameter compresses (the per-axes
    engines: those over a data axis).
    `whole`: each parameter's whole shape (Adafactor's row and column
    moments are the whole matrix's; default: the local shape). `programs`: on a pipeline rank
    of several stages, the one whose program reads each parameter first (`runtime.buckets.
    by_program`), None for one several read: stages 1/2's flats never span two programs, and
    such a parameter has a flat of its own (`runtime.zero`)."""
    optimizer = optimizer or OptimizerSpec()
    shape_of = lambda n: (whole or {}).get(n, params[n].shape)  # noqa: E731
    s = State(engine=engine)
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    s.params = sum(nbytes(p) for p in params.values() if not p.requires_grad)
    if zero == 0:
        s.params += sum(nbytes(p) for p in trainable.values())
        s.grads = sum(nbytes(p) for p in trainable.values())
        s.optimizer = sum(whole_state_bytes(optimizer, p, shape_of(n)) for n, p in trainable.items())
        # a data-parallel engine's buckets outlive zero_grad (the per-axes engine's hold the
        # gradients it reduces: averaged over a data axis or summed over `grad_sums`' axes);
        # gradients nothing reduces are freed with it
        kept = trainable if engine == "data parallel" else {n: p for n, p in trainable.items() if bucketed(n)}
        s.grads_between_steps = sum(nbytes(p) for p in kept.values()) if engine != "none" else 0
        if compress is not None:
            feedback = feedback_bytes([p for n, p in trainable.items() if compressed(n)], *compress)
            s.grads += feedback
            s.grads_between_steps += feedback
        return s
    dec = {id(p): decays(n, p) for n, p in trainable.items()}
    flats: list[tuple[list[str], torch.dtype, torch.dtype]] = []  # names, dtype, gather dtype
    if zero < 3:
        # one engine per group size (the per-axes engines cut each set of parameters over its own)
        programs = programs or {}
        alone = [n for n in trainable if n in programs and programs[n] is None]
        by_group: dict[tuple[int, int | None], list[tuple[str, Tensor]]] = {}
        for n, p in trainable.items():
            if n not in alone:
                by_group.setdefault((group_size(n), programs.get(n, 0)), []).append((n, p))
        for named in by_group.values():
            for names, ps in bucket_params(named, bucket_bytes, dec):
                flats.append((names, ps[0].dtype, ps[0].dtype))
        flats += [([n], trainable[n].dtype, trainable[n].dtype) for n in alone]
    else:
        left = dict(trainable)
        for _, names, dtypes in units:
            named = [(n, left.pop(n)) for n in names if n in left]
            gather = {id(p): d for (n, p), d in zip(named, dtypes, strict=False) if d is not None}
            for group in group_by_kind(named, dec, gather):
                p0 = group[0][1]
                flats.append(([n for n, _ in group], p0.dtype, gather.get(id(p0), p0.dtype)))
        for group in group_by_kind(list(left.items()), dec):
            flats.append(([n for n, _ in group], group[0][1].dtype, group[0][1].dtype))
    s.flats = len(flats)
    unit_bytes: dict[int, int] = {}
    grad_bytes: dict[int, int] = {}
    on_disk_bytes: list[int] = []  # each flat's state in its file
    shard_bytes: dict[int, int] = {}  # `params_on_disk`: each flat's parameter shard in its file
    for i, (names, dtype, gathered) in enumerate(flats):
        world = group_size(names[0])
        numel = sum(trainable[n].numel() for n in names)
        shard = math.ceil(numel / world)
        padded, size = shard * world, dtype.itemsize
        grad_bytes[i] = padded * size
        if compress is not None and compressed(names[0]):  # the whole (padded) flat's residual, or PowerSGD's
            bf16 = compress[0] == "bf16"
            feedback = padded * size if bf16 else feedback_bytes([trainable[n] for n in names], *compress)
            if replicated:  # HSDP's all-reduce across the copies, its own residual of what it sends
                feedback += (padded if zero == 1 else shard) * size
            s.grads += feedback
            s.grads_between_steps += feedback  # kept from one step's reduction to the next
        if zero < 3:
            s.params += padded * size  # every parameter whole, the shard a view
            s.grads += padded * size if zero == 1 else shard * size  # dropped by `zero_grad`
        else:
            if params_on_disk:
                shard_bytes[i] = shard * size
            elif offload_params:
                s.host += shard * size
            else:
                s.params += shard * size
            s.grads += shard * size  # made by the reductions, dropped by `zero_grad`
            unit_bytes[i] = padded * gathered.itemsize
        # the engine's fp32 master is the shard itself when that is fp32 and where the optimizer runs
        moved = offload_optimizer and not (offload_params or on_host)
        master = shard * 4 if dtype != torch.float32 or moved or on_disk else 0
        members = [(shape_of(n), trainable[n].numel()) for n in names]
        optim = master + shard_state_bytes(optimizer, shard, members, world)
        if on_disk:
            on_disk_bytes.append(optim)
        elif offload_optimizer:
            s.host += optim
        else:
            s.optimizer += optim
    s.disk = sum(on_disk_bytes)
    s.host += sum(sorted(on_disk_bytes)[-DISK_RESIDENT_FLATS:])
    if shard_bytes:
        s.disk += sum(shard_bytes.values())
        s.host += _largest_unit(flats, shard_bytes, units) if on_disk else sum(shard_bytes.values())
    if zero >= 1 and accumulation > 1:
        s.accumulating = sum(grad_bytes.values())
    if zero == 3:
        s.gathered = _largest_unit(flats, unit_bytes, units)
        # a unit's gradients, whole, and the flat they are copied into before the reduce-scatter
        s.reducing = 2 * _largest_unit(flats, grad_bytes, units, pairs=False)
    else:
        s.reducing = max(grad_bytes.values(), default=0)  # one bucket's flat in flight
    return s


def _largest_unit(flats, unit_bytes: dict[int, int], units, *, pairs: bool = True) -> int:
    """Bytes of the two largest consecutive units gathered at once (the current and the
    prefetched; `pairs=False`: the largest one), with the root's parameters, which stay
    gathered through the step."""
    member = {n: u for u, (_, names, _) in enumerate(units) for n in names}
    per_unit: dict[int, int] = {}
    for i, (names, _, _) in enumerate(flats):
        u = member.get(names[0], -1)
        per_unit[u] = per_unit.get(u, 0) + unit_bytes.get(i, 0)
    order = [per_unit.get(u, 0) for u in range(len(units))]
    sums = ([a + b for a, b in itertools.pairwise(order)] if pairs else []) or order or [0]
    return max(sums) + per_unit.get(-1, 0)
