"""`meshplan suggest`: the plan for a model on N devices of a memory, written out.

    found = suggest(source, world=64, limit=80 * 2**30, hw=hardware("h100"), batch=64, seq=4096)
    found.best.text         # the plan, as `meshplan fmt` prints it, a comment on each block
    found.ranked            # every candidate, best first, with its screened (and estimated) numbers

Three steps, each cheaper than the next is sure:

1. **Capture once, profile once.** The model is captured as `compile_plan` would capture it
   (`compile.capture_for`), its parts found (`structure.model_shape`: blocks, Megatron pairs,
   norms, ends, experts) and one forward measured by part on meta (`profile.profile_model`).
2. **Screen every layout** (`screen.Screen`): every factorization of N into dp x pp x cp x ep
   x tp, ZeRO 0-3 (with optimizer offload at 3), checkpointing every block (all of it, or
   selectively: its matmul and attention outputs kept) or none, a
   pipeline's microbatches and schedule (1F1B, interleaved over 2 chunks a rank); sequence
   parallelism (or none) and vocab-parallel ends with tp; a context axis where sequences are
   long (`CONTEXT_TOKENS` a rank), its attention a ring or Ulysses (where the heads divide).
   Each is priced from the parameter counts and the profile by
   arithmetic (microseconds): the state each stage holds, the activations its microbatches
   in flight keep, the step from the parts' priced forward, the collectives' ring times and
   the pipeline's bubble. This ranks; it does not decide.
3. **Estimate the best** (`estimate`): in the screen's order, each plan is written, checked,
   compiled from the one capture and estimated, until `top` plans fit by `estimate`'s own
   numbers or the time budget is spent. The suggestion is the fastest of those by
   `estimate`; a plan the compiler refuses is never written (its reason is kept, and plans
   having every feature of the refused one are skipped).

What the screen assumes is in `ASSUMED` (and printed). Not searched yet: checkpointing every k
blocks, gradient accumulation, 16-bit parameters, the zero-bubble
schedules, expert tensor parallelism.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .errors import CompileError
from .hardware import Hardware
from .headroom import HEADROOM
from .screen import ASSUMED, COMPUTE_BYTES, MARGIN, TIE, Counts, Layout, Screen
from .structure import ModelShape

if TYPE_CHECKING:
    from .capture import Captured
    from .estimate import Estimate
    from .load import ModelSource


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
    refusals: dict[str, str] = field(default_factory=dict)  # "tp + zero1" -> the compiler's reason
    shape: ModelShape | None = None
    assumed: tuple[str, ...] = ASSUMED
    compute: str = "fp32"  # the plans' compute dtype (bf16 where the hardware's matmuls are faster in it)
    limit: int | None = None  # bytes a rank may plan for: its memory less the headroom
    batch: int = 0  # sequences a step
    seq: int | None = None  # tokens a sequence (None: inputs without one)

    def runners_up(self, k: int) -> list[Candidate]:
        """The best `k` a user may run: those that fit by the estimate, then those the screen
        keeps under the limit (not estimated); never one the estimate or compiler ruled out."""

        def kept(c: Candidate) -> bool:
            return c.estimate is None and not c.refused and screened_under(c, self.limit)

        return [c for c in self.ranked if c.fits or kept(c)][:k]


def screened_under(c: Candidate, limit: int | None) -> bool:
    """Whether the screen keeps `c` under the memory limit (with its margin): a runner-up a user
    may run, until the estimate says otherwise."""
    return limit is None or c.peak <= limit * MARGIN


# ------------------------------------------------------------------------------ the space


CHECKPOINTS: tuple[Literal["", "full", "selective"], ...] = ("", "selective", "full")  # every block's
CONTEXT_TOKENS = 1024  # a context axis is searched where each rank keeps this many of a sequence's tokens


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
    cps = [1]
    if shape.attention is not None and seq is not None and allowed("cp"):
        cps = [c for c in _divisors(world) if seq % (2 * c) == 0 and (c == 1 or seq // c >= CONTEXT_TOKENS)]
    for t, e, c in itertools.product(tps, eps, cps):
        if world % (t * e * c):
            continue
        contexts: tuple[Literal["ring", "ulysses"], ...] = (
            ("ring", "ulysses") if c > 1 and shape.ulysses(c, t) else ("ring",)
        )
        # under a context axis, each rank's slice of the sequence is cut again over tp
        sp = t > 1 and bool(shape.norms) and (seq is None or seq % (c * t) == 0)
        vocab = t > 1 and shape.vocab is not None and shape.vocab % t == 0 and shape.embedding is not None
        rest = world // (t * e * c)
        for p in _divisors(rest):
            if p > 1 and (not allowed("pp") or shape.layers < p):
                continue
            d = rest // p
            if (d > 1 and not allowed("dp")) or batch % (d * e):
                continue
            per_replica = batch // (d * e)
            micro = [m for m in (p, 2 * p, 4 * p, 8 * p) if per_replica % m == 0] if p > 1 else [1]
            virtuals = (1, 2) if p > 1 and shape.layers >= 2 * p else (1,)
            # HSDP: the state cut over the data ranks of one node, a copy on each node
            node = per_node // (p * c * e * t) if per_node % (p * c * e * t) == 0 else 0
            hsdp = (1, d // node) if node > 1 and d % node == 0 and d > node else (1,)
            for m, v, zero, copies in itertools.product(
                micro, virtuals, (0, 1, 2, 3) if d > 1 else (0,), hsdp
            ):
                if copies > 1 and zero == 0:
                    continue
                # sequence parallelism where the norms allow it, and without: the screen ranks it
                # first (less memory), the plain split is there for a model whose compile refuses it
                for offload, ckpt, context, seq_parallel in itertools.product(
                    (False, True) if zero == 3 else (False,),
                    CHECKPOINTS if shape.blocks else ("",),
                    contexts,
                    (True, False) if sp else (False,),
                ):
                    yield Layout(
                        dp=d,
                        pp=p,
                        ep=e,
                        tp=t,
                        cp=c,
                        context=context,
                        zero=zero,
                        offload=offload,
                        checkpoint=ckpt,
                        microbatches=m,
                        virtual=v,
                        sp=seq_parallel,
                        vocab=vocab,
                        copies=copies,
                    )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


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
    """Estimate screened candidates, the most promising first, until `top` fit by the estimate
    and no candidate left promises to beat them, the next one would end past `budget` seconds
    from `started` (once one fits: the first that fits is always found) or `most` are tried.
    `verify(candidate)` writes, checks, compiles and estimates it (raising `CompileError` when
    the compiler refuses it).

    The screen learns from each estimate. Its step times are wrong alike for layouts of one
    shape (`_time_kind`: which axes, ZeRO-3 or not), so a candidate promises its screened time
    times what the estimate made of its kind's screened times so far (a kind not estimated yet:
    the least of those, so each kind gets its chance). A candidate is skipped when its
    screened peak, times the most the screen has underestimated a layout of its memory kind
    (`_kind`), is over the limit. A compiler refusal skips the plans having every feature of
    the refused one (`Layout.features`: its axes and choices) from then on."""
    started = time.perf_counter() if started is None else started
    refused: dict[frozenset[str], str] = {}
    tried: list[Candidate] = []
    under: dict[tuple[bool | str, ...], float] = {}  # memory kind -> the most estimate / screen seen
    slow: dict[tuple[bool, ...], float] = {}  # time kind -> the latest estimate / screen
    fits: list[float] = []  # the estimated rank keys of those that fit, best first
    spent = 0.0

    def promise(c: Candidate) -> float:
        return c.rank_key() * slow.get(_time_kind(c.layout), min(slow.values(), default=1.0))

    def ruled_out(c: Candidate) -> bool:
        if limit is not None and c.peak * max(MARGIN, under.get(_kind(c.layout), 0.0)) > limit:
            return True
        return any(features <= c.layout.features() for features in refused)

    left = list(ranked)
    while left:
        left = [c for c in left if not ruled_out(c)]
        if not left:
            break
        cand = min(left, key=promise)
        if len(fits) >= top and promise(cand) >= fits[top - 1]:
            break  # nothing left promises to beat the `top` found
        now = time.perf_counter()
        if len(tried) >= most or (fits and now + spent / len(tried) > started + budget):
            break
        left.remove(cand)
        try:
            verify(cand)
        except CompileError as e:
            cand.refused = str(e).splitlines()[0]
            refused.setdefault(cand.layout.features(), cand.refused)
            tried.append(cand)
            spent += time.perf_counter() - now
            continue
        tried.append(cand)
        spent += time.perf_counter() - now
        if cand.estimated_peak and cand.peak:
            kind = _kind(cand.layout)
            under[kind] = max(under.get(kind, 0.0), cand.estimated_peak / cand.peak)
        if cand.estimated_time and cand.time:
            slow[_time_kind(cand.layout)] = cand.estimated_time / cand.time
        if cand.fits:
            fits = sorted([*fits, cand.rank_key(estimated=True)])
    return tried, {" + ".join(sorted(f)) or "plain data parallelism": why for f, why in refused.items()}


def shape_of(lay: Layout) -> tuple[str, int]:
    """What tells two layouts apart for `suggest --measure`: the mesh and a pipeline's chunks
    (ZeRO stages, checkpointing and microbatches vary within one)."""
    return lay.mesh(), lay.virtual


def other_shapes(ranked: list[Candidate], tried: list[Candidate], limit: int | None, count: int, verify):
    """Estimate, in the screen's order, the first layout under the limit of up to `count`
    shapes (`shape_of`) none of `tried` fits with, until `count` more shapes fit: what a
    measurement of a few plans chooses among, each the best the screen found of its shape."""
    have = {shape_of(c.layout) for c in tried if c.fits}
    refused: set[tuple[str, int]] = set()
    attempts = 4 * count  # a shape whose best does not fit by the estimate gets its next one
    for cand in ranked:
        key = shape_of(cand.layout)
        if count <= 0 or attempts <= 0:
            break
        if key in have or key in refused or cand in tried or not screened_under(cand, limit):
            continue
        tried.append(cand)
        attempts -= 1
        try:
            verify(cand)
        except CompileError as e:
            cand.refused = str(e).splitlines()[0]
            refused.add(key)
            continue
        if cand.fits:
            have.add(key)
            count -= 1


def _kind(lay: Layout) -> tuple[bool | str, ...]:
    """Layouts whose memory the screen gets wrong alike."""
    return (lay.pp > 1, lay.checkpoint, lay.cp > 1)


def _time_kind(lay: Layout) -> tuple[bool, ...]:
    """Layouts whose step time the screen gets wrong alike: the axes they use, ZeRO-3's gathers."""
    return (lay.pp > 1, lay.tp > 1, lay.cp > 1, lay.ep > 1, lay.zero == 3)


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
    headroom: float = HEADROOM,
    shapes: int = 0,
) -> Suggestion:
    """The best plan for `source` (a `load.ModelSource`, its model on meta or not, its example
    inputs on the CPU) on `world` ranks of `hw` with `limit` bytes each (of which the plans may
    use all but `headroom`, a share kept for what `estimate` does not count), training `batch`
    sequences of `seq` tokens a step (default: the example's). Each candidate is compiled for
    what one of its ranks runs at once (a microbatch's sequences: `Layout.rows`), as `meshplan
    run --batch` and `estimate --batch` take it. `shapes`: also estimate the screen's best of
    that many more shapes (`other_shapes`; for `suggest --measure`). Raises `CompileError`
    when no layout divides."""
    from meshplan.dsl import check_text

    from .compile import capture_for, compile_plan
    from .estimate import estimate
    from .profile import profile_model
    from .structure import model_shape
    from .suggest_plan import base_plan, write_plan

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    memory, limit = limit, None if limit is None else int(limit * (1 - headroom))
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
        return write_plan(
            shape, cand, compute=compute, world=world, hw=hw, memory=memory, limit=limit, batch=batch, seq=seq
        )

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
    other_shapes(ranked, tried, limit, shapes, verify)
    seconds["estimate"] = time.perf_counter() - t2
    estimated = sorted((c for c in tried if c.fits), key=lambda c: c.rank_key(estimated=True))
    # then the runners-up the screen keeps under the limit, then what the estimate or compiler ruled out
    unfit = [c for c in tried if not c.fits]
    kept = [c for c in ranked if c not in tried and screened_under(c, limit)]
    rest = kept + unfit + [c for c in ranked if c not in tried and c not in kept]
    return Suggestion(
        estimated[0] if estimated else None,
        estimated + rest,
        len(ranked),
        screened_fit,
        seconds,
        refusals,
        shape,
        compute=compute,
        limit=limit,
        batch=batch,
        seq=seq,
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
    """bf16 on an accelerator whose matmuls are faster in it; fp32 on a CPU (whose bf16
    matmuls may be fast, but a step's casts and its many small ops are not)."""
    if hw.cores:
        return "fp32"
    return "bf16" if hw.flops.get("bfloat16", 0.0) > 1.5 * hw.flops.get("float32", 0.0) else "fp32"


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    lines = [line for line in text if "error" in line] or text or [type(e).__name__]
    return lines[0].strip()
