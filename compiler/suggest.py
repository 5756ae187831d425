"""`meshplan suggest`: the plan for a model on N devices of a memory, written out.

    found = suggest(source, world=64, limit=80 * 2**30, hw=hardware("h100"), batch=64, seq=4096)
    found.best.text         # the plan, as `meshplan fmt` prints it, a comment on each block
    found.ranked            # every candidate, best first, with its screened (and estimated) numbers

Three steps, each cheaper than the next is sure:

1. **Capture once, profile once.** The model is captured as `compile_plan` would capture it
   (`compile.capture_for`), its parts found (`structure.model_shape`: blocks, Megatron pairs,
   norms, ends, experts) and one forward measured by part on meta (`profile.profile_model`).
2. **Screen every layout** (`Screen`): every factorization of N into dp x pp x ep x tp, ZeRO
   0-3 (with optimizer offload at 3), checkpointing every block or none, a pipeline's
   microbatches; sequence parallelism and vocab-parallel ends with tp. Each is priced from
   the parameter counts and the profile by arithmetic (microseconds): the state each stage
   holds, the activations its microbatches in flight keep, the step from the parts' priced
   forward (backward twice that, a recomputed forward again), the collectives' ring times
   and a 1F1B pipeline's bubble. This ranks; it does not decide.
3. **Estimate the best** (`estimate`): in the screen's order, each plan is written, checked,
   compiled from the one capture and estimated, until `top` plans fit by `estimate`'s own
   numbers or the time budget is spent. The suggestion is the fastest of those by
   `estimate`; a plan the compiler refuses is never written (its reason is kept, and plans
   sharing the refused feature are skipped).

What the screen assumes is in `ASSUMED` (and printed). Context parallelism, interleaved
schedules and selective checkpointing are not searched yet.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from .errors import CompileError
from .estimate import shared_cores
from .hardware import Hardware
from .profile import Part, Profile
from .step_time import collective_time, exposed
from .structure import ModelShape

if TYPE_CHECKING:
    from .capture import Captured
    from .estimate import Estimate
    from .load import ModelSource

ASSUMED = (
    "screen: blocks split evenly over pipeline stages, the embedding on the first, the head on the last",
    "screen: backward costs twice the forward; a checkpointed block's forward runs again in backward",
    "screen: fp32 master weights and gradients, AdamW's two fp32 moments (16 bytes a parameter)",
    "screen: offloaded optimizer steps at 10 GB/s on the host, its gradients and weights cross at 25 GB/s",
    "the suggestion's numbers are `meshplan estimate`'s for the written plan",
)
MARGIN = 0.92  # the screen keeps a layout whose screened peak is under this share of the limit
HOST_STEP = 10e9  # bytes/s an offloaded AdamW step streams on the host (all its state)
HOST_LINK = 25e9  # bytes/s between host and device (PCIe 4/5 in practice)
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TIE = 0.01  # each moving part (a ZeRO stage, offload, checkpointing, an axis) counts as 1% of time


@dataclass(frozen=True)
class Layout:
    """One candidate: mesh sizes and the choices on top of them."""

    dp: int = 1
    pp: int = 1
    ep: int = 1
    tp: int = 1
    zero: int = 0
    offload: bool = False
    checkpoint: bool = False
    microbatches: int = 1  # a pipeline's; 1 without one
    sp: bool = False  # sequence parallel norms (with tp)
    vocab: bool = False  # vocab-parallel embedding and head (with tp)

    def mesh(self) -> str:
        sizes = [("dp", self.dp), ("pp", self.pp), ("ep", self.ep), ("tp", self.tp)]
        return ", ".join(f"{n}={s}" for n, s in sizes if s > 1) or "dp=1"

    def rows(self, batch: int) -> int:
        """Sequences a rank runs at once (a microbatch's): what `meshplan run --batch` takes."""
        return batch // (self.dp * self.ep * self.microbatches)

    def complexity(self) -> int:
        """Moving parts a user reads and runs: what breaks a tie in time (`Candidate.rank_key`)."""
        parts = self.zero + 2 * self.offload + self.checkpoint
        return parts + (self.pp > 1) + (self.tp > 1) + (self.ep > 1)

    def features(self) -> frozenset[str]:
        """What a compiler refusal of this layout may be about (plans sharing it are skipped)."""
        out = {f"tp{'+sp' if self.sp else ''}{'+vocab' if self.vocab else ''}"} if self.tp > 1 else set()
        out |= {"pp"} if self.pp > 1 else set()
        out |= {"ep"} if self.ep > 1 else set()
        out |= {f"zero{self.zero}"} if self.zero else set()
        out |= {"checkpoint"} if self.checkpoint else set()
        return frozenset(out)


@dataclass
class Candidate:
    layout: Layout
    peak: int  # screened, the worst rank's bytes
    time: float  # screened step seconds
    estimate: Estimate | None = None  # once estimated
    refused: str = ""  # why the compiler refused it
    text: str = ""  # the plan, once written

    def rank_key(self, estimated: bool = False) -> float:
        """Step time, 1% longer per moving part: of two layouts as fast, the simpler first."""
        step = (self.estimated_time or 0.0) if estimated else self.time
        return step * (1 + TIE * self.layout.complexity())

    @property
    def estimated_peak(self) -> int | None:
        est = self.estimate
        return max((r.peak for r in est.ranks), default=0) if est is not None else None

    @property
    def estimated_time(self) -> float | None:
        return self.estimate.step_time if self.estimate is not None else None

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.fits


@dataclass
class Suggestion:
    best: Candidate | None
    ranked: list[Candidate]  # the estimated ones first (fastest first), then the screened
    searched: int  # layouts screened
    screened_fit: int  # of them, under the limit by the screen
    seconds: dict[str, float] = field(default_factory=dict)  # capture, screen, estimate
    refusals: dict[str, str] = field(default_factory=dict)  # feature -> the compiler's reason
    shape: ModelShape | None = None
    assumed: tuple[str, ...] = ASSUMED


# ------------------------------------------------------------------------------ the space


def layouts(
    shape: ModelShape,
    world: int,
    batch: int,
    seq: int | None,
    per_node: int,
    axes: frozenset[str] | None = None,
) -> Iterator[Layout]:
    """Every layout of `world` ranks the model's shape and the batch allow (`axes`: only these)."""

    def allowed(axis: str) -> bool:
        return axes is None or axis in axes

    tps = [t for t in shape.tp_sizes() if t <= per_node and world % t == 0 and (t == 1 or allowed("tp"))]
    eps = [1]
    if shape.num_experts and allowed("ep"):
        eps = [e for e in _divisors(world) if shape.num_experts % e == 0]
    for t in tps:
        sp = t > 1 and bool(shape.norms) and (seq is None or seq % t == 0)
        vocab = t > 1 and shape.vocab is not None and shape.vocab % t == 0 and shape.embedding is not None
        for e in eps:
            if world % (t * e):
                continue
            rest = world // (t * e)
            for p in _divisors(rest):
                if p > 1 and (not allowed("pp") or shape.layers < p):
                    continue
                d = rest // p
                if d > 1 and not allowed("dp"):
                    continue
                if batch % (d * e):
                    continue
                per_replica = batch // (d * e)
                micro = [m for m in (p, 2 * p, 4 * p, 8 * p) if per_replica % m == 0] if p > 1 else [1]
                for m in micro:
                    for zero in (0, 1, 2, 3) if d > 1 else (0,):
                        for offload in (False, True) if zero == 3 else (False,):
                            for ckpt in (False, True) if shape.blocks else (False,):
                                yield Layout(d, p, e, t, zero, offload, ckpt, m, sp, vocab)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# ------------------------------------------------------------------------------ the screen


@dataclass(frozen=True)
class Counts:
    """The model's parameters by part (elements), a block's per block."""

    split: int = 0  # in a block's pairs: divided by tp
    rest: int = 0  # the rest of a block
    experts: int = 0  # a block's experts: divided by ep
    embedding: int = 0
    head: int = 0  # 0 when tied to the embedding
    last: int = 0  # after the blocks, beside the head (the final norm)
    other: int = 0  # outside the blocks and the ends: kept on the first stage
    tensors_per_block: int = 0

    @classmethod
    def of(cls, model: nn.Module, shape: ModelShape) -> Counts:
        split_paths = {f"{c}" for pair in shape.pairs for c in (*pair.columns, pair.row)}
        per: dict[str, int] = {}
        tensors = 0
        for name, p in model.named_parameters():
            module = name.rpartition(".")[0]
            where = "other"
            if shape.blocks and module.startswith(shape.blocks + "."):
                index, _, inner = module[len(shape.blocks) + 1 :].partition(".")
                where = (
                    "experts"
                    if shape.experts and (inner == shape.experts or inner.startswith(shape.experts + "."))
                    else "split"
                    if inner in split_paths
                    else "rest"
                )
                tensors += index == "0"
            elif module == shape.embedding:
                where = "embedding"
            elif module == shape.head:
                where = "head"
            elif module == shape.final_norm:
                where = "last"
            per[where] = per.get(where, 0) + p.numel()
        layers = max(shape.layers, 1)
        return cls(
            split=per.get("split", 0) // layers,
            rest=per.get("rest", 0) // layers,
            experts=per.get("experts", 0) // layers,
            embedding=per.get("embedding", 0),
            head=per.get("head", 0),
            last=per.get("last", 0),
            other=per.get("other", 0),
            tensors_per_block=tensors,
        )


class Screen:
    """A layout's worst rank's peak bytes and its step time, by arithmetic over the counts and
    the profile (`ASSUMED` says what it takes for granted)."""

    def __init__(
        self,
        shape: ModelShape,
        counts: Counts,
        profile: Profile,
        hw: Hardware,
        world: int,
        batch: int,
        top_k: int = 1,
        compute_bytes: int = 4,
    ) -> None:
        self.shape, self.counts, self.profile, self.hw, self.world = shape, counts, profile, hw, world
        self.batch, self.top_k = batch, top_k
        # fp32 parameters computed in 16 bits: each weight's cast is kept for its backward, a
        # copy per microbatch in flight (each forward casts again)
        self.cast_bytes = compute_bytes if compute_bytes < 4 else 0
        self.slowdown = shared_cores(hw, world)  # ranks sharing a CPU's cores, as `estimate` prices them

    # -- memory

    def stages(self, lay: Layout) -> list[int]:
        """Blocks per stage: as even as the count allows, the extra ones on the later stages."""
        n, p = self.shape.layers, lay.pp
        return [n // p + (1 if s >= p - n % p else 0) for s in range(p)]

    def local_params(self, lay: Layout, s: int, blocks: int) -> int:
        c, t = self.counts, lay.tp
        n = blocks * (c.split // t + c.rest + c.experts // lay.ep)
        ends = t if lay.vocab else 1
        if s == 0:
            n += c.embedding // ends + c.other
        if s == lay.pp - 1:
            n += (c.head or (c.embedding if lay.pp > 1 else 0)) // ends + c.last
        return n

    def state_bytes(self, lay: Layout, n: int) -> tuple[int, int]:
        """(device bytes, the largest ZeRO-3 unit's whole bytes) of `n` local parameters."""
        d = lay.dp
        if lay.zero == 0:
            return 16 * n, 0
        if lay.zero == 1:
            return 8 * n + 8 * n // d, 0
        if lay.zero == 2:
            return 4 * n + 12 * n // d, 0
        device = (8 if lay.offload else 16) * n // d
        c = self.counts
        unit = 4 * (c.split // lay.tp + c.rest + c.experts // lay.ep)
        return device, unit

    def fraction(self, lay: Layout) -> float:
        """A microbatch's tokens on one rank, as a share of the profile's."""
        return lay.rows(self.batch) / self.profile.rows

    def block_activations(self, lay: Layout) -> tuple[float, float]:
        """(kept for backward per block per microbatch, the whole block's): bytes."""
        f, t = self.fraction(lay), lay.tp
        prof = self.profile
        whole = (
            prof.part("split").saved / t
            + prof.part("rest").saved / (t if lay.sp else 1)
            + prof.part("experts").saved
        ) * f
        if not lay.checkpoint:
            return whole, whole
        boundary = prof.hidden_bytes * prof.tokens * f / (t if lay.sp else 1)
        return boundary, whole

    def peak(self, lay: Layout) -> int:
        kept, whole = self.block_activations(lay)
        f = self.fraction(lay)
        worst = 0
        for s, blocks in enumerate(self.stages(lay)):
            in_flight = min(lay.microbatches, lay.pp - s) if lay.pp > 1 else 1
            n = self.local_params(lay, s, blocks)
            state, unit = self.state_bytes(lay, n)
            # the casts are read from outside a checkpointed block (kept), but ZeRO-3 casts a
            # unit's weights inside it, where checkpointing recomputes them
            if lay.zero < 3 or not lay.checkpoint:
                state += self.cast_bytes * n * in_flight
            acts = blocks * kept * in_flight
            if s == 0:
                acts += self.profile.part("first").saved * f * in_flight
            last = self.profile.part("last").saved * f / (lay.tp if lay.vocab else 1)
            if s == lay.pp - 1:
                acts += last
            buffers = 2 * unit  # ZeRO-3: a unit in use, the next one prefetched
            transient = max(whole, last if s == lay.pp - 1 else 0)
            worst = max(worst, int(state + buffers + acts + transient))
        return worst

    # -- time

    def _scaled(self, part: Part, f: float, div: float) -> float:
        fixed = part.ops * self.profile.op_overhead
        return (fixed + max(0.0, part.time - fixed) * f / div) * self.slowdown

    def _link(self, span: int):
        return self.hw.intra if span <= self.hw.devices_per_node else self.hw.inter

    def step_time(self, lay: Layout) -> float:
        prof, t, f = self.profile, lay.tp, self.fraction(lay)
        block = (
            self._scaled(prof.part("split"), f, t)
            + self._scaled(prof.part("rest"), f, t if lay.sp else 1)
            + self._scaled(prof.part("experts"), f, 1)
        )
        activation = prof.hidden_bytes * prof.tokens * f  # one block's input, whole
        tp_link = self._link(t)
        tp_comm = 2 * collective_time("all_reduce", activation, t, tp_link) if t > 1 else 0.0
        ep_comm = 0.0
        if lay.ep > 1:
            ep_comm = 2 * collective_time(
                "all_to_all", activation * self.top_k, lay.ep, self._link(t * lay.ep)
            )
        forward_block = block + tp_comm + ep_comm
        backward_block = 2 * block + tp_comm + ep_comm + (forward_block if lay.checkpoint else 0.0)
        first = self._scaled(prof.part("first"), f, 1)
        last = self._scaled(prof.part("last"), f, t if lay.vocab else 1)
        if lay.vocab:
            first += collective_time("all_reduce", activation, t, tp_link)
        send = (
            collective_time("send", activation / t, 2, self._link(t * lay.ep * lay.pp)) if lay.pp > 1 else 0.0
        )
        forward = backward = 0.0  # the slowest stage's, one microbatch
        for s, blocks in enumerate(self.stages(lay)):
            fwd = blocks * forward_block + (first if s == 0 else 0.0) + (last if s == lay.pp - 1 else 0.0)
            bwd = blocks * backward_block + 2 * (fwd - blocks * forward_block)
            if fwd + bwd > forward + backward:
                forward, backward = fwd + send, bwd + send
        m = lay.microbatches
        steps = (m + lay.pp - 1) * (forward + backward)  # 1F1B: the slowest stage, plus the bubble
        return steps + self._data_parallel(lay, forward * m, backward) + self._optimizer(lay)

    def _data_parallel(self, lay: Layout, forward: float, backward: float) -> float:
        """What the step waits for of the data-parallel engine's collectives, as `estimate`
        prices them (`step_time.exposed`): gradient reductions behind the last backward,
        ZeRO-1/2's all-gathers behind the next forward, ZeRO-3's gathers behind their phase."""
        if lay.dp <= 1:
            return 0.0
        n = max(self.local_params(lay, s, b) for s, b in enumerate(self.stages(lay)))
        link = self._link(lay.dp * lay.tp * lay.ep * lay.pp)
        pieces = max(self.shape.layers // lay.pp, 1) + 2  # buckets, flats or units
        overlap = self.hw.overlap
        if lay.zero == 0:
            reduce = collective_time("all_reduce", 4 * n, lay.dp, link)
            return exposed(reduce, reduce / pieces, backward, overlap)
        half = collective_time("reduce_scatter", 4 * n, lay.dp, link)
        waited = exposed(half, half / pieces, backward, overlap)  # the gradients' reduce-scatter
        if lay.zero < 3:
            return waited + exposed(half, 0.0, forward, overlap)  # the parameters' all-gather after the step
        gathers = exposed(half, half / pieces, forward, overlap)
        return waited + gathers + exposed(half, half / pieces, backward, overlap)

    def _optimizer(self, lay: Layout) -> float:
        n = max(self.local_params(lay, s, b) for s, b in enumerate(self.stages(lay)))
        if lay.zero:
            n = math.ceil(n / lay.dp)
        moved = 28 * n  # gradient read; parameter and two moments read and written (fp32)
        if lay.offload:
            return moved / HOST_STEP + 8 * n / HOST_LINK
        tensors = self.counts.tensors_per_block * max(self.stages(lay)) + 4
        return moved / self.hw.memory_bandwidth * self.slowdown + tensors * self.hw.optimizer_tensor


# ------------------------------------------------------------------------------ the search


def screen(scr: Screen, candidates: Iterator[Layout]) -> list[Candidate]:
    """Every layout priced, best first: by step time, of two as fast the simpler first."""
    out = [Candidate(lay, scr.peak(lay), scr.step_time(lay)) for lay in candidates]
    out.sort(key=lambda c: (c.rank_key(), c.peak))
    return out


def search(
    ranked: list[Candidate],
    limit: int | None,
    verify,
    *,
    top: int = 3,
    budget: float = 60.0,
    most: int = 24,
    started: float | None = None,
) -> tuple[list[Candidate], dict[str, str]]:
    """Estimate screened candidates in order until `top` fit by the estimate, the next one would
    end past `budget` seconds from `started` (once one fits: the first that fits is always
    found) or `most` are tried. `verify(candidate)` writes, checks, compiles and estimates it
    (raising `CompileError` when the compiler refuses it).

    The screen learns from each estimate: a candidate is skipped when its screened peak, times
    the most the screen has underestimated a layout of its kind (`_kind`: pipelined or not,
    checkpointed or not), is over the limit. A compiler refusal skips the plans
    sharing the refused feature."""
    started = time.perf_counter() if started is None else started
    refused: dict[str, str] = {}
    tried: list[Candidate] = []
    under: dict[tuple[bool, ...], float] = {}  # kind -> the most estimate / screen seen
    fitting, spent = 0, 0.0
    for cand in ranked:
        if limit is not None and cand.peak * max(MARGIN, under.get(_kind(cand.layout), 0.0)) > limit:
            continue
        if any(f in refused for f in cand.layout.features()):
            continue
        now = time.perf_counter()
        if len(tried) >= most or (fitting and now + spent / len(tried) > started + budget):
            break
        try:
            verify(cand)
        except CompileError as e:
            cand.refused = str(e).splitlines()[0]
            for feature in cand.layout.features() or {"plain"}:
                refused.setdefault(feature, cand.refused)
            tried.append(cand)
            spent += time.perf_counter() - now
            continue
        tried.append(cand)
        spent += time.perf_counter() - now
        if cand.estimated_peak and cand.peak:
            kind = _kind(cand.layout)
            under[kind] = max(under.get(kind, 0.0), cand.estimated_peak / cand.peak)
        if cand.fits:
            fitting += 1
            if fitting >= top:
                break
    return tried, refused


def _kind(lay: Layout) -> tuple[bool, ...]:
    """Layouts whose memory the screen gets wrong alike."""
    return (lay.pp > 1, lay.checkpoint)


def suggest(
    source,
    *,
    world: int,
    hw: Hardware,
    limit: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    axes: frozenset[str] | None = None,
    top: int = 3,
    budget: float = 60.0,
    compute: str | None = None,
) -> Suggestion:
    """The best plan for `source` (a `load.ModelSource`, its model on meta or not, its example
    inputs on the CPU) on `world` ranks of `hw` with `limit` bytes each, training `batch`
    sequences of `seq` tokens a step (default: the example's). Each candidate is compiled for
    what one of its ranks runs at once (a microbatch's sequences: `Layout.rows`), as `meshplan
    run --batch` and `estimate --batch` take it. Raises `CompileError` when no layout divides."""
    from meshplan.dsl import check_text

    from .compile import capture_for, compile_plan
    from .estimate import estimate
    from .profile import profile_model
    from .structure import model_shape
    from .suggest_plan import base_plan, write_plan

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    compute = compute or _compute_dtype(hw)
    if hw.cores:  # a CPU entry prices a run on this one machine, as `estimate` does: one node
        hw = dataclasses.replace(hw, devices_per_node=world)
    rows, example_seq = _example_shape(source)
    batch = batch or rows
    seq = seq or example_seq
    base = check_text(base_plan(model_shape(source.model), compute), "<suggest>", world_size=1)
    captures: dict[int, tuple[ModelSource, Captured]] = {}  # a rank's rows -> (its source on meta, capture)

    def captured_at(rows: int):
        if rows not in captures:
            shaped = _shaped(source, rows, seq)
            captures[rows] = (shaped, capture_for(base, shaped))
        return captures[rows]

    _, captured = captured_at(1)
    shape = model_shape(source.model, captured)
    profile = profile_model(captured, shape, hw)
    seconds["capture"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    scr = Screen(
        shape,
        Counts.of(source.model, shape),
        profile,
        hw,
        world,
        batch,
        shape.top_k or 1,
        COMPUTE_BYTES[compute],
    )
    ranked = screen(scr, layouts(shape, world, batch, seq, hw.devices_per_node, axes))
    seconds["screen"] = time.perf_counter() - t1
    if not ranked:
        raise CompileError(_no_layout(shape, world, batch, hw, axes), hint=_NO_LAYOUT_HINT)
    screened_fit = sum(1 for c in ranked if limit is None or c.peak <= limit * MARGIN)

    def write(cand: Candidate) -> str:
        return write_plan(shape, cand, compute=compute, world=world, hw=hw, limit=limit, batch=batch, seq=seq)

    def verify(cand: Candidate) -> None:
        cand.text = write(cand)
        plan = check_text(cand.text, "<suggested>", world_size=world)
        shaped, captured = captured_at(cand.layout.rows(batch))
        try:
            compiled = compile_plan(plan, shaped, world_size=world, dynamic=False, captured=captured)
        except Exception as e:  # the compiler's refusal, whatever its type: this plan is not written
            from meshplan.dsl.errors import PlanError

            if isinstance(e, (PlanError, CompileError)):
                raise CompileError(_first_line(e)) from e
            raise
        cand.estimate = estimate(compiled, limit=limit, hw=hw)
        cand.text = write(cand)  # again, with the estimate's numbers in its comments

    t2 = time.perf_counter()
    tried, refusals = search(ranked, limit, verify, top=top, budget=budget, started=t0)
    seconds["estimate"] = time.perf_counter() - t2
    estimated = sorted((c for c in tried if c.fits), key=lambda c: c.rank_key(estimated=True))
    # then the runners-up the screen keeps under the limit, then what the estimate or compiler ruled out
    unfit = [c for c in tried if not c.fits]
    kept = [c for c in ranked if c not in tried and (limit is None or c.peak <= limit * MARGIN)]
    rest = kept + unfit + [c for c in ranked if c not in tried and c not in kept]
    return Suggestion(
        estimated[0] if estimated else None,
        estimated + rest,
        len(ranked),
        screened_fit,
        seconds,
        refusals,
        shape,
    )


_NO_LAYOUT_HINT = "allow more axes (--axes), or pass a --batch the data ranks divide, or another --world-size"


def _no_layout(shape: ModelShape, world: int, batch: int, hw: Hardware, axes: frozenset[str] | None) -> str:
    """Why no layout of `world` ranks exists: what each axis may be."""
    tps = [t for t in shape.tp_sizes() if t <= hw.devices_per_node]
    why = [f"tp {'/'.join(map(str, tps))}" + ("" if shape.pairs else " (no column/row pairs found)")]
    why.append(
        f"pp at most {shape.layers} (its blocks)" if shape.blocks else "pp 1 (no repeated blocks found)"
    )
    why.append(f"dp x ep dividing the batch of {batch}")
    only = f" over {', '.join(sorted(axes))}" if axes is not None else ""
    return f"no layout of {world} ranks{only} for this model: it allows {'; '.join(why)}"


def _example_shape(source) -> tuple[int, int | None]:
    """(rows, seq) of the model's example inputs (seq None: inputs without a sequence)."""
    from .capture import token_tensors
    from .load import batch_rows

    tokens = next(iter(token_tensors(source.args, source.kwargs)), None)
    if tokens is not None:
        return int(tokens.shape[0]), int(tokens.shape[1])
    return batch_rows(source.args, source.kwargs) or 1, None


def _shaped(source, rows: int, seq: int | None):
    """`source` with inputs of `rows` sequences (of `seq` tokens), on meta."""
    from .capture import with_token_shape
    from .load import on_meta_inputs

    return on_meta_inputs(with_token_shape(source, batch=rows, seq=seq, seq_asked=False))


def _compute_dtype(hw: Hardware) -> str:
    """bf16 where the hardware's matmuls are faster in it (a GPU), else fp32 (a CPU)."""
    return "bf16" if hw.flops.get("bfloat16", 0.0) > 1.5 * hw.flops.get("float32", 0.0) else "fp32"


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    lines = [line for line in text if "error" in line] or text or [type(e).__name__]
    return lines[0].strip()
