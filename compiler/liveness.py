"""The liveness walk of `meshplan estimate`: a program's stages run forward and backward on the
meta device (no weights, no data; collectives on a fake process group), a dispatch mode adding
up the storages the ops create while they live.

    walks = walk_stages(stages, inputs)       # per stage: bytes kept for backward, peaks, where
    in_flight(schedule, stage)                # microbatches whose activations a stage keeps at once

A storage counts from the op that creates it (an output no alias annotation ties to an input,
as `runtime/train.py`'s CPU tracker counts) until it dies; parameters and the engine's state
are not created by the step and are the caller's to add.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.runtime.shared_cast import SharedCast
from meshplan.runtime.zero_nodes import MAX_IN_FLIGHT, graph_units, in_backward


class Observer(Protocol):
    """Sees every op the walk runs (`compiler/step_time.py`'s `OpCosts` prices them); `where`
    names the node for collectives only."""

    def begin(self, stage: int, phase: str) -> None: ...

    def __call__(self, func: Any, args: Any, kwargs: Any, out: Any, where: str) -> None: ...


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create while they live, on any device (meta included), their
    peak and the op at the peak. `where()` names the op being run (set by the walk)."""

    def __init__(self, where: Callable[[], str], observer: Observer | None = None) -> None:
        super().__init__()
        self._observe = observer
        self.live = self.peak = 0
        self.engine = 0  # of `live`: what `hold` counts (an emulated engine's buffers)
        self.peak_at = ""
        self._where = where
        self._storages: dict[int, tuple[int, weakref.ref]] = {}
        self._fresh: dict[Any, list[bool]] = {}
        # storages of the parameters and of what only they make (a cast), by id while alive
        self.weights: dict[int, weakref.ref] = {}
        self.joins = 0  # bytes of the outputs where weights join activations, in forward
        # gradients backward has added into ones held from before (a later microbatch's
        # backward), counted toward `first_peak` only: the peak a step's first backward, which
        # makes them, reaches
        self.made = self.first_peak = 0

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._storages.clear()

    def reset_peak(self) -> None:
        self.peak, self.peak_at = self.live, ""
        self.made, self.first_peak = 0, self.live

    def _grew(self) -> None:
        self.first_peak = max(self.first_peak, self.live + self.made)

    def gradient_made(self, nbytes: int) -> None:
        self.made += nbytes
        self._grew()

    def hold(self, nbytes: int, what: str) -> None:
        """Bytes an engine allocates outside the program's ops (`ZeroWalk`), counted as if made."""
        self.engine += nbytes
        self.live += nbytes
        self._grew()
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, f"{self._where()} ({what})"

    def let_go(self, nbytes: int) -> None:
        self.engine -= nbytes
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._observe is not None:
            self._observe(func, args, kwargs or {}, out, self._where() if func.namespace == "c10d" else "")
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = [r.alias_info is None for r in func._schema.returns]
        if any(fresh):
            results = out if isinstance(out, tuple) else (out,)
            made = [
                t
                for result, new in zip(results, fresh, strict=False)
                if new
                for t in (result if isinstance(result, list) else (result,))
                if isinstance(t, Tensor) and t.layout == torch.strided
            ]
            for t in made:
                self._add(t.untyped_storage(), func)
            if self.weights and made and not in_backward():
                self._joined(args, made)
        return out

    def _joined(self, args: Any, made: list[Tensor]) -> None:
        """Forward: an op reading weights (or what only weights make, a cast of one) and other
        tensors is where a weight's gradient path joins the activations': a split backward keeps
        the gradient of its output from I to W (`runtime/split_backward.py`)."""
        weighted = [_weighs(self.weights, t) for t in pytree.tree_leaves(args) if isinstance(t, Tensor)]
        if all(weighted):  # weights alone (a cast, a transpose): still the weight's side
            self.weights.update(_by_id(t) for t in made)
        elif any(weighted):
            self.joins += sum(_nbytes(t) for t in made)

    def _add(self, storage: torch.UntypedStorage, func) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if not nbytes or key in self._storages:
            return
        self._storages[key] = (nbytes, weakref.ref(storage, functools.partial(self._dead, key)))
        self.live += nbytes
        self._grew()
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, f"{self._where()} ({func.__name__})"

    def _dead(self, key: int, _: object = None) -> None:
        nbytes, _ = self._storages.pop(key, (0, None))
        self.live -= nbytes


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def flash_attention(gm: nn.Module) -> None:
    """`scaled_dot_product_attention` in `gm`'s graphs (nested ones too: checkpoint regions)
    called, on meta tensors, as the kernels that run it keep memory. Changes `gm` in place.

    On meta, SDPA has no fused kernel and decomposes into the math path, whose softmax keeps
    batch x heads x seq x seq probabilities for backward. The runs it stands for never do:
    CUDA picks a flash or memory-efficient kernel and the CPU its flash kernel, which keep the
    output and one log-sum-exp per row. So on meta it is called as the CPU flash kernel (its
    meta function gives those shapes, its backward their gradients; `step_time` prices it)."""
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        found = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is _SDPA]
        for node in found:
            node.target = _flash_on_meta
        if found:
            sub.recompile()


def _flash_on_meta(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False
):
    learned_mask = isinstance(attn_mask, Tensor) and attn_mask.requires_grad  # T5's position bias
    if query.device.type != "meta" or enable_gqa or learned_mask or query.shape[-1] != value.shape[-1]:
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


def _by_id(t: Tensor) -> tuple[int, weakref.ref]:
    storage = t.untyped_storage()
    return id(storage), weakref.ref(storage)


def _weighs(weights: dict[int, weakref.ref], t: Tensor) -> bool:
    """Whether `t` views a parameter's storage (or one only parameters made): the same storage
    object, alive (an id of a dead one can come back)."""
    storage = t.untyped_storage()
    ref = weights.get(id(storage))
    return ref is not None and ref() is storage


@dataclass
class StageWalk:
    """One stage's (or the whole program's) forward and backward on one microbatch."""

    saved: int = 0  # created in forward, alive when it ends: what backward reads
    forward_peak: int = 0
    backward_peak: int = 0  # over the live bytes when backward starts (the saved ones included)
    # `backward_peak` as the step's first backward reaches it: the gradients it adds into ones
    # held from an earlier microbatch are made by it instead
    first_backward_peak: int = 0
    # each stage's engine buffers when this one's backward starts (`ZeroWalk.held`: a later
    # stage's, on this stage's rank, are the gradients its backward has already made)
    engine_held: tuple[int, ...] = ()
    peak_at: str = ""
    received: int = 0  # bytes of the values it receives from the stage before
    joins: int = 0  # bytes of the forward's outputs where a weight joins (kept from I to W if split)
    shared: int = 0  # of `saved`: the weights' casts a pipeline step makes once (`SharedCast`)
    sends: list[Any] = field(default_factory=list)


class _Where(fx.Interpreter):
    """Runs a graph and says which node is running (the peak's op); keeps what its
    `SharedCast`s make (`casts`: weak references)."""

    def __init__(self, module: fx.GraphModule, note: list[str]) -> None:
        super().__init__(module)
        self.note = note
        self.casts: list[tuple[weakref.ref, int]] = []

    def run_node(self, n: fx.Node) -> Any:
        self.note[0] = f"{n.name} (forward)"
        out = super().run_node(n)
        if n.op == "call_module" and isinstance(self.module.get_submodule(str(n.target)), SharedCast):
            storage = out.untyped_storage()
            self.casts.append((weakref.ref(storage), storage.nbytes()))
        return out

    def kept_casts(self) -> int:
        """Bytes of the shared casts still alive (kept for backward)."""
        return sum(n for ref, n in self.casts if ref() is not None)


def _where_backward(note: list[str]) -> Callable[[], str]:
    def where() -> str:
        node = torch._C._current_autograd_node()
        return f"{node.name()} (backward)" if node is not None else note[0]

    return where


def walk_stages(
    stages: Sequence[fx.GraphModule],
    inputs: Sequence[Any],
    free_grads: Callable[[nn.Parameter], None] | None = None,
    observer: Observer | None = None,
    zero: ZeroSteps | None = None,
) -> list[StageWalk]:
    """Each stage run forward on `inputs` (plus what the one before sends), then backward from
    the last (the loss) to the first, on whatever device the tensors are (meta: no data);
    `observer` sees every op, told the stage and phase first. `zero`: ZeRO's engine,
    whose buffers are counted as it makes and frees them (`ZeroWalk`). The stages' attention
    is called as its kernels keep memory (`flash_attention`, in place)."""
    note = ["start"]
    for stage in stages:
        flash_attention(stage)
    walks = [StageWalk() for _ in stages]
    outputs: list[Any] = []
    received: list[list[Tensor | None]] = []  # per stage, one per value it receives
    handles = []
    if free_grads is not None:
        for st in stages:
            for p in st.parameters():
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(free_grads))
    tracker = LiveBytes(_where_backward(note), observer)
    # gradients held from an earlier backward (accumulation): what the first would have made
    held = [p for st in stages for p in st.parameters() if p.requires_grad and p.grad is not None]
    handles += [
        p.register_post_accumulate_grad_hook(lambda q: tracker.gradient_made(_nbytes(q)))
        for p in dict.fromkeys(held)
    ]
    tracker.weights = dict(_by_id(p) for st in stages for p in st.parameters() if p.requires_grad)
    engine = ZeroWalk(stages, tracker, zero) if zero is not None else None
    begin = observer.begin if observer is not None else (lambda stage, phase: None)
    engine_at = [0] * len(stages)  # the engine's bytes when each stage's forward starts
    own_at = [0] * len(stages)  # of those, the stage's own (`ZeroWalk.held`)
    own = (lambda s: engine.held[s]) if engine is not None else (lambda s: 0)
    try:
        with tracker:
            sends: Sequence[Any] = ()
            for s, stage in enumerate(stages):
                recv = [
                    t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, Tensor) else t
                    for t in sends
                ]
                received.append([t if isinstance(t, Tensor) and t.requires_grad else None for t in recv])
                walks[s].received = sum(_nbytes(t) for t in recv if isinstance(t, Tensor))
                start, engine_at[s], own_at[s] = tracker.live, tracker.engine, own(s)
                tracker.reset_peak()
                tracker.joins = 0
                begin(s, "forward")
                running = _Where(stage, note)
                out = running.run(*inputs, *recv)
                walks[s].shared = running.kept_casts()
                walks[s].joins = tracker.joins
                walks[s].forward_peak = tracker.peak - start
                walks[s].peak_at = tracker.peak_at
                walks[s].saved = tracker.live - start - (tracker.engine - engine_at[s])  # activations
                outputs.append(out)
                sends = out if isinstance(out, (tuple, list)) else (out,)
            for s in reversed(range(len(stages))):
                out = outputs[s]
                values = list(out) if isinstance(out, (tuple, list)) else [out]
                roots: list[Tensor] = []
                grads: list[Tensor | None] = []
                if s == len(stages) - 1:
                    roots, grads = [next(v for v in values if isinstance(v, Tensor))], [None]
                else:
                    for v, r in zip(values, received[s + 1], strict=False):
                        if isinstance(v, Tensor) and r is not None and r.grad is not None:
                            roots.append(v)
                            grads.append(r.grad)
                start, engine_b = tracker.live, own(s)
                walks[s].engine_held = tuple(engine.held) if engine is not None else ()
                tracker.reset_peak()
                note[0] = f"stage {s} backward"
                begin(s, "backward")
                if roots and any(r.requires_grad for r in roots):
                    torch.autograd.backward(roots, grads)
                if engine is not None:
                    engine.drain()
                peak = tracker.peak - start
                # over the stage's forward start: its activations, and what the engine held
                # for it then (the later stages' buffers are their ranks')
                held_before = walks[s].saved + max(0, engine_b - own_at[s])
                walks[s].backward_peak = peak + held_before
                walks[s].first_backward_peak = tracker.first_peak - start + held_before
                if walks[s].backward_peak > walks[s].forward_peak:
                    walks[s].peak_at = tracker.peak_at
                outputs[s] = None
                if s + 1 < len(stages):
                    for r in received[s + 1]:
                        if r is not None:
                            r.grad = None
    finally:
        for h in handles:
            h.remove()
        if engine is not None:
            engine.unbind()
    return walks


@dataclass(frozen=True)
class ZeroSteps:
    """What `ZeroWalk` emulates: the ZeRO `stage`, the ranks a flat of an axis is sharded over
    (`group`), and under stages 1/2 the flats, each the stage program whose backward completes
    it and its parameter names (a flat never spans two programs; stage 3's are its units)."""

    stage: int
    group: Callable[[str], int]
    axis: str = ""
    flats: Sequence[tuple[int, Sequence[str]]] = ()
    bf16: bool = False  # `compress = bf16`: each reduction's bf16 copy and error feedback's buffers
    across: bool = False  # and HSDP's second one, of what each rank keeps, across the copies


class ZeroWalk:
    """ZeRO's engine as the walk meets it, counting the buffers it makes and frees
    (`LiveBytes.hold`) in the order it does (`runtime/zero_gathers.py`, `runtime/zero_grads.py`),
    without making them. Stage 3 binds it to the programs' `ZeroGather`/`ZeroRelease` nodes, as
    `runtime.zero` binds itself:

    - a unit gathered at its gather node (in the dtype the graph reads each parameter in), the
      next one in the program prefetched, freed at its release; gathered again when backward
      reaches the release, the one released before it prefetched, freed when its gradients are in;

    and at every stage, once backward has made every gradient of a flat (stage 3: a unit): the
    gradients copied into one flat buffer (and freed), at most `MAX_IN_FLIGHT` reductions in
    flight, then what the rank keeps: the whole averaged flat (stage 1) or its shard (2, 3).
    Under `compress = bf16` each flat's bf16 copy lives until its reduction finishes, and the
    rounding and new residual briefly beside the old one; under HSDP the kept part is rounded
    again for the all-reduce across the copies.

    Each buffer is its stage program's (`held`): the walk runs every stage of a pipeline, and a
    stage's rank holds its own stages' buffers, not those of the stages on other ranks.
    """

    def __init__(self, stages: Sequence[fx.GraphModule], tracker: LiveBytes, zero: ZeroSteps) -> None:
        self.tracker, self.zero, self.in_flight = tracker, zero, MAX_IN_FLIGHT
        named: dict[str, nn.Parameter] = {}
        for stage in stages:
            named.update(stage.named_parameters(remove_duplicate=False))
        self.nodes: list[tuple[Any, Any]] = []
        self.program: list[int] = []  # each unit's stage program
        self.bytes: list[int] = []  # each unit gathered, in the dtypes the graph reads it in
        flats: list[tuple[list[nn.Parameter], str, int | None]] = []  # params, axis, unit
        self.held = [0] * len(stages)  # bytes of each stage program's buffers
        self.flat_stage: list[int] = []
        if zero.stage == 3:
            for s, stage in enumerate(stages):
                for gather, release in graph_units(stage):
                    held = [
                        (named[n], d) for n, d in zip(gather.params, gather.dtypes, strict=True) if n in named
                    ]
                    flats.append(([q for q, _ in held], gather.axis, len(self.nodes)))
                    self.flat_stage.append(s)
                    self.nodes.append((gather, release))
                    self.program.append(s)
                    self.bytes.append(sum(q.numel() * (d or q.dtype).itemsize for q, d in held))
        else:
            flats = [([named[n] for n in names if n in named], zero.axis, None) for _, names in zero.flats]
            self.flat_stage = [s for s, _ in zero.flats]
        self.gathered = [False] * len(self.nodes)
        self.pins = [0] * len(self.nodes)
        self.release_order: list[int] = []
        for i, (gather, release) in enumerate(self.nodes):
            gather.bind(self, i)
            if release is not None:
                release.bind(self, i)
        self.flats = [([q for q in ps if q.requires_grad], axis, unit) for ps, axis, unit in flats]
        self.waiting = [{id(q) for q in ps} for ps, _, _ in self.flats]  # gradients still to come
        self.owner = {id(q): f for f, (ps, _, _) in enumerate(self.flats) for q in ps}
        self.pending: list[int] = []  # flats being reduced
        self.handles = [
            q.register_post_accumulate_grad_hook(self._grad_made)
            for q in dict.fromkeys(named.values())
            if id(q) in self.owner
        ]

    def unbind(self) -> None:
        for gather, release in self.nodes:
            gather.bind(None, -1)
            if release is not None:
                release.bind(None, -1)
        for h in self.handles:
            h.remove()

    def _hold(self, stage: int, nbytes: int, what: str) -> None:
        self.held[stage] += nbytes
        self.tracker.hold(nbytes, what)

    def _let_go(self, stage: int, nbytes: int) -> None:
        self.held[stage] -= nbytes
        self.tracker.let_go(nbytes)

    def _gather(self, i: int) -> None:
        if not self.gathered[i]:
            self.gathered[i] = True
            self._hold(self.program[i], self.bytes[i], f"gather {self.nodes[i][0].unit or 'root'}")

    def _free(self, i: int) -> None:
        if self.gathered[i]:
            self.gathered[i] = False
            self._let_go(self.program[i], self.bytes[i])

    # the engine's side of the nodes (`runtime.zero_nodes.Engine`)

    def on_gather(self, index: int, params: Sequence[Tensor]) -> tuple[Tensor | None, ...] | None:
        self._gather(index)
        if (
            not in_backward()
            and index + 1 < len(self.nodes)
            and self.program[index + 1] == self.program[index]
        ):
            self._gather(index + 1)
        dtypes = self.nodes[index][0].dtypes
        if not any(dtypes):
            return None
        from torch.utils._python_dispatch import _disable_current_modes

        from meshplan.runtime.zero_nodes import Gathered

        read = [i for i, d in enumerate(dtypes) if d is not None]
        with _disable_current_modes():  # the gathered buffer's views: counted by `_gather`
            views = [torch.empty(params[i].shape, dtype=dtypes[i], device=params[i].device) for i in read]
        out: list[Tensor | None] = [None] * len(params)
        for i, value in zip(
            read, Gathered.apply(len(views), *views, *(params[i] for i in read)), strict=True
        ):
            out[i] = value
        return tuple(out)

    def on_release(self, index: int) -> None:
        if not in_backward():
            self.release_order.append(index)
            if not self.pins[index]:
                self._free(index)

    def before_backward(self, index: int) -> None:
        self._gather(index)
        self.pins[index] += 1
        if index in self.release_order:
            k = self.release_order.index(index)
            if k > 0 and self.program[self.release_order[k - 1]] == self.program[index]:
                self._gather(self.release_order[k - 1])

    # gradients

    def _flat_bytes(self, f: int) -> int:
        return sum(q.numel() * q.dtype.itemsize for q in self.flats[f][0])

    def _grad_made(self, q: nn.Parameter) -> None:
        f = self.owner[id(q)]
        self.waiting[f].discard(id(q))
        if self.waiting[f]:
            return
        params, _, unit = self.flats[f]
        self._hold(self.flat_stage[f], self._flat_bytes(f), "gradient flat")
        for p in params:
            p.grad = None  # copied into the flat
        if self.zero.bf16:  # the flat sent in bf16, until its reduction finishes
            self._feedback(f, sum(q.numel() for q in params), "the flat in bf16")
        self.pending.append(f)
        self._drain(self.in_flight)
        if unit is not None:
            if self.pins[unit]:
                self.pins[unit] -= 1
            if not self.pins[unit]:
                self._free(unit)

    def _feedback(self, f: int, numel: int, what: str) -> None:
        """`compress = bf16` rounding `numel` elements of flat `f` (`runtime.compression.
        Bf16Feedback`): its bf16 copy held until the reduction ends (`_drain`), and for a moment
        the rounding in the flat's dtype and the new residual beside the old one."""
        size = self.flats[f][0][0].dtype.itemsize
        self._hold(self.flat_stage[f], numel * 2, what)
        self._hold(self.flat_stage[f], 2 * numel * size, "error feedback's new residual")
        self._let_go(self.flat_stage[f], 2 * numel * size)

    def _drain(self, keep: int) -> None:
        while len(self.pending) > keep:
            f = self.pending.pop(0)
            stage, numel, nbytes = (
                self.flat_stage[f],
                sum(q.numel() for q in self.flats[f][0]),
                self._flat_bytes(f),
            )
            group = self.zero.group(self.flats[f][1])
            if self.zero.stage > 1:  # this rank's shard of the average, kept to the step
                self._hold(stage, -(-nbytes // group), "gradient shard")
            if self.zero.across:  # HSDP: what this rank keeps, rounded again for the copies
                kept = numel if self.zero.stage == 1 else -(-numel // group)
                self._feedback(f, kept, "the kept gradient in bf16")
                self._let_go(stage, kept * 2)
            if self.zero.bf16:
                self._let_go(stage, numel * 2)  # the flat's bf16 copy, reduced
            if self.zero.stage > 1:  # stage 1 keeps the averaged flat whole: its gradients view it
                self._let_go(stage, nbytes)

    def drain(self) -> None:
        """Backward is over: the reductions still in flight finish."""
        self._drain(0)


def most_kept(
    schedule, owner: int, saved: dict[int, int], joins: dict[int, int], shared: dict[int, int] | None = None
) -> int:
    """The most bytes rank `owner`'s actions keep at once for backward: each stage's `saved`
    bytes a microbatch from its forward (F) to its backward (B; W under a split backward), and
    under a split backward its `joins` bytes from I to W (the gradients W starts from). Of
    `saved`, a stage's `shared` bytes (its weights' casts, `runtime/shared_cast.py`) are kept
    once, from its first forward of the step to its last backward."""
    return max(kept_around_first_backward(schedule, owner, saved, joins, shared))


def kept_around_first_backward(
    schedule, owner: int, saved: dict[int, int], joins: dict[int, int], shared: dict[int, int] | None = None
) -> tuple[int, int]:
    """`most_kept`, split at the rank's first backward: the most kept when it starts (no
    gradient made yet: GPipe's peak, every microbatch kept, meets none), and the most kept
    from its end on (the gradients made, as 1F1B's steady state keeps them)."""
    shared = shared or {}
    actions = schedule.actions[owner]
    first = {s: next(i for i, a in enumerate(actions) if a.stage == s) for s in saved}
    last = {a.stage: i for i, a in enumerate(actions) if a.kind in ("B", "W")}
    backward = next(
        (i for i, a in enumerate(actions) if a.stage in saved and a.kind in ("B", "I")), len(actions)
    )
    live = before = after = 0
    for i, a in enumerate(actions):
        if a.stage not in saved:
            continue
        once = shared.get(a.stage, 0)
        if a.kind == "F":
            live += saved[a.stage] - once + (once if i == first[a.stage] else 0)
        elif a.kind in ("B", "W"):
            live -= saved[a.stage] - once + (once if i == last.get(a.stage) else 0)
        if a.kind == "I":
            live += joins[a.stage]
        elif a.kind == "W":
            live -= joins[a.stage]
        if i < backward:
            before = max(before, live)
        else:
            after = max(after, live)
    return before, after


def in_flight(schedule, stage: int) -> int:
    """`Schedule.in_flight`: the most microbatches whose activations `stage` keeps at once."""
    return schedule.in_flight(stage)
