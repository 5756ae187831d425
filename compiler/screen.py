"""The screen of `meshplan suggest`: a layout's worst rank's peak bytes and step time by
arithmetic over the model's parameter counts and one profiled forward (microseconds a layout).

    scr = Screen(shape, Counts.of(model, shape), profile, hw, world=64, batch=64)
    scr.peak(Layout(dp=8, tp=8, zero=1)), scr.step_time(Layout(dp=8, tp=8, zero=1))

It ranks; it does not decide: the suggestion's numbers are `estimate`'s for the written plan.
What it takes for granted is `ASSUMED` (printed with every suggestion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torch import nn

from .hardware import Hardware, Link
from .profile import Part, Profile
from .step_time import collective_time, crowding, exposed, pipelines_share_cores, shared_cores, woken
from .structure import ModelShape

ASSUMED = (
    "screen: blocks split evenly over pipeline stages, the embedding on the first, the head on the last",
    "screen: backward costs twice the forward; a checkpointed block's forward runs again in backward "
    "(selective: all but its matmuls and attention, whose outputs it keeps)",
    "screen: fp32 master weights and gradients, AdamW's two fp32 moments (16 bytes a parameter)",
    "screen: offloaded optimizer steps at 10 GB/s on the host, its gradients and weights cross at 25 GB/s",
    "screen: a context ring passes each block's keys and values cp - 1 times forward and twice that "
    "backward, behind the block's compute",
    "screen: Ulysses moves each block's queries, keys, values and attention output by all-to-all over cp, "
    "forward and again backward, in the block's path",
    "screen: interleaved 1F1B's bubble is (pp - 1) / virtual microbatches; its sends virtual times 1F1B's",
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
    checkpoint: Literal["", "full", "selective"] = ""  # every block's, when set
    microbatches: int = 1  # a pipeline's; 1 without one
    sp: bool = False  # sequence parallel norms (with tp)
    vocab: bool = False  # vocab-parallel embedding and head (with tp)
    cp: int = 1  # context parallel: each sequence's tokens cut over cp ranks
    context: Literal["ring", "ulysses"] = "ring"  # attention under cp: a ring, or Ulysses' all-to-alls
    virtual: int = 1  # a pipeline rank's chunks: 2 and up is interleaved 1F1B
    copies: int = 1  # HSDP: ZeRO's state cut over dp / copies ranks of a node, one copy per node

    def sizes(self) -> list[tuple[str, int]]:
        """The mesh's axes, outermost first: tensor parallelism innermost (inside a node), then
        experts and context, whose collectives come next in volume; under HSDP the data ranks
        are `node` x `dp`, the copies of the state outermost."""
        data = [("node", self.copies), ("dp", self.shards)] if self.copies > 1 else [("dp", self.dp)]
        return [*data, ("pp", self.pp), ("cp", self.cp), ("ep", self.ep), ("tp", self.tp)]

    @property
    def shards(self) -> int:
        """The data ranks ZeRO cuts the state over (all of them but under HSDP)."""
        return self.dp // self.copies

    def mesh(self) -> str:
        return ", ".join(f"{n}={s}" for n, s in self.sizes() if s > 1) or "dp=1"

    def rows(self, batch: int) -> int:
        """Sequences a rank runs at once (a microbatch's): what `meshplan run --batch` takes."""
        return batch // (self.dp * self.ep * self.microbatches)

    def complexity(self) -> int:
        """Moving parts a user reads and runs: what breaks a tie in time (`Candidate.rank_key`)."""
        parts = self.zero + 2 * self.offload + bool(self.checkpoint) + (self.virtual > 1) + (self.copies > 1)
        return parts + (self.pp > 1) + (self.tp > 1) + (self.ep > 1) + (self.cp > 1)

    def features(self) -> frozenset[str]:
        """What a compiler refusal of this layout may be about (plans sharing it are skipped)."""
        out = {f"tp{'+sp' if self.sp else ''}{'+vocab' if self.vocab else ''}"} if self.tp > 1 else set()
        out |= {"pp"} if self.pp > 1 else set()
        out |= {"ep"} if self.ep > 1 else set()
        out |= {f"cp ({self.context})"} if self.cp > 1 else set()
        out |= {"interleaved"} if self.virtual > 1 else set()
        out |= {f"zero{self.zero}"} if self.zero else set()
        out |= {"hsdp"} if self.copies > 1 else set()
        out |= {f"checkpoint {self.checkpoint}"} if self.checkpoint else set()
        return frozenset(out)


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
        self.compute_bytes = compute_bytes  # ZeRO-3 gathers its fp32 shards in the compute dtype
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
        """(device bytes, the largest ZeRO-3 unit's whole bytes) of `n` local parameters. A
        pipeline's earlier microbatches run backward under `no_sync`: ZeRO-2/3 hold the whole
        gradients between them (ZeRO-1 and plain data parallelism hold them whole anyway)."""
        d = lay.shards
        between = 4 * n if lay.microbatches > 1 else 0
        if lay.zero == 0:
            return 16 * n, 0
        if lay.zero == 1:
            return 8 * n + 8 * n // d, 0
        if lay.zero == 2:
            return 4 * n + 12 * n // d + between, 0
        device = (8 if lay.offload else 16) * n // d + between
        c = self.counts
        unit = 4 * (c.split // lay.tp + c.rest + c.experts // lay.ep)
        return device, unit

    def fraction(self, lay: Layout) -> float:
        """A microbatch's tokens on one rank, as a share of the profile's (a context axis cuts
        each sequence's)."""
        return lay.rows(self.batch) / (self.profile.rows * lay.cp)

    @staticmethod
    def block_cuts(lay: Layout) -> dict[str, int]:
        """A block's parts and the ranks each is divided over: the pairs by tp, the rest by tp
        under sequence parallelism, the experts not (expert parallelism spreads, not cuts)."""
        return {"split": lay.tp, "rest": lay.tp if lay.sp else 1, "experts": 1}

    def block_activations(self, lay: Layout) -> tuple[float, float]:
        """(kept for backward per block per microbatch, the whole block's): bytes."""
        f, prof, cuts = self.fraction(lay), self.profile, self.block_cuts(lay)
        whole = sum(prof.part(name).saved / d for name, d in cuts.items()) * f
        if not lay.checkpoint:
            return whole, whole
        boundary = prof.hidden_bytes * prof.tokens * f / cuts["rest"]
        if lay.checkpoint == "full":
            return boundary, whole
        # selective: the matmul and attention outputs; a row linear's are partial sums, whole on every rank
        matmuls = sum(
            (p.matmul_saved - p.matmul_whole) / d + p.matmul_whole
            for p, d in ((prof.part(name), d) for name, d in cuts.items())
        )
        return min(boundary + matmuls * f, whole), whole

    def peak(self, lay: Layout) -> int:
        kept, whole = self.block_activations(lay)
        f = self.fraction(lay)
        worst = 0
        for s, blocks in enumerate(self.stages(lay)):
            in_flight = self.in_flight(lay, s)
            n = self.local_params(lay, s, blocks)
            held, unit = self.state_bytes(lay, n)
            state = float(held)
            # a checkpointed block casts its weights again when it recomputes (ZeRO-3's are
            # gathered in the compute dtype and freed), so it keeps none; otherwise a pipeline
            # step casts each weight once for its microbatches (`runtime/shared_cast.py`),
            # except the ones ZeRO-3 gathers, cast per microbatch
            if not lay.checkpoint:
                state += self.cast_bytes * n * (in_flight if lay.zero == 3 else 1)
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

    @staticmethod
    def in_flight(lay: Layout, s: int) -> float:
        """Microbatches whose activations stage `s` keeps at once, in whole-stage units: 1F1B's
        p - s; interleaved's warm-up of (v - 1) p + 2 (p - 1 - s) + 1 chunks of 1/v each."""
        p, v, m = lay.pp, lay.virtual, lay.microbatches
        if p == 1:
            return 1
        if v == 1:
            return min(m, p - s)
        return min(m, ((v - 1) * p + 2 * (p - 1 - s) + 1) / v)

    # -- time

    def _scaled(self, part: Part, f: float, div: float) -> float:
        fixed = part.ops * self.profile.op_overhead
        return (fixed + max(0.0, part.time - fixed) * f / div) * self.slowdown

    def _link(self, span: int) -> Link:
        """The link among `span` neighbouring ranks: within a node or across."""
        return self.hw.intra if span <= self.hw.devices_per_node else self.hw.inter

    def _collective(self, op: str, nbytes: float, n: int, span: int) -> float:
        """`op` over `n` ranks among `span` neighbouring ones, on cores the ranks may share
        (`step_time.woken`), as `estimate` prices it."""
        return collective_time(op, nbytes, n, self._link(span)) * woken(self.hw, self.world, n)

    def step_time(self, lay: Layout) -> float:
        prof, t, f = self.profile, lay.tp, self.fraction(lay)
        cuts = self.block_cuts(lay)
        block = sum(self._scaled(prof.part(name), f, d) for name, d in cuts.items())
        activation = prof.hidden_bytes * prof.tokens * f  # one block's input, whole
        tp_comm = 2 * self._collective("all_reduce", activation, t, t) if t > 1 else 0.0
        ep_comm = 0.0
        if lay.ep > 1:
            ep_comm = 2 * self._collective("all_to_all", activation * self.top_k, lay.ep, t * lay.ep)
        ulysses = self._ulysses(lay, f) if lay.cp > 1 and lay.context == "ulysses" else 0.0
        ring = self._ring(lay, f) if lay.cp > 1 and lay.context == "ring" else 0.0
        overlap = self.hw.overlap
        forward_block = (
            block + tp_comm + ep_comm + ulysses + exposed(ring, ring / (lay.cp - 1 or 1), block, overlap)
        )
        recomputed = forward_block if lay.checkpoint == "full" else 0.0
        if lay.checkpoint == "selective":  # all but the matmuls again, the collectives among them
            rest = sum(self._scaled(prof.part(name).recomputed(), f, d) for name, d in cuts.items())
            # and torch's policy on every op, in the forward and again in the recomputation
            policy = sum(prof.part(name).ops for name in cuts) * self.hw.selective_op * self.slowdown
            forward_block += policy
            recomputed = forward_block - block + rest
        backward_block = (
            2 * block
            + tp_comm
            + ep_comm
            + ulysses
            + exposed(2 * ring, 2 * ring / (lay.cp - 1 or 1), 2 * block, overlap)
            + recomputed
        )
        first = self._scaled(prof.part("first"), f, 1)
        last = self._scaled(prof.part("last"), f, t if lay.vocab else 1)
        if lay.vocab:
            first += self._collective("all_reduce", activation, t, t)
        send = 0.0
        if lay.pp > 1:  # a pipeline's message, as `step_time.pipeline_timeline` prices it
            shared = pipelines_share_cores(self.hw, self.world, lay.dp)
            link = self._link(t * lay.ep * lay.pp).for_pipelines(shared)
            send = collective_time("send", activation / t, 2, link)
        forward = backward = 0.0  # the slowest stage's, one microbatch
        for s, blocks in enumerate(self.stages(lay)):
            fwd = blocks * forward_block + (first if s == 0 else 0.0) + (last if s == lay.pp - 1 else 0.0)
            bwd = blocks * backward_block + 2 * (fwd - blocks * forward_block)
            if fwd + bwd > forward + backward:
                forward, backward = fwd, bwd
        m = lay.microbatches
        if lay.pp > 1 and self.hw.cores and self.world > 1:
            steps = self._crowded_pipeline(lay, forward, backward, send)
        else:  # 1F1B: the slowest stage and its sends, plus the bubble (interleaved: a chunk's share of it)
            forward, backward = forward + lay.virtual * send, backward + lay.virtual * send
            steps = (m + (lay.pp - 1) / lay.virtual) * (forward + backward)
        return (
            steps
            + self._data_parallel(lay, forward * m, backward)
            + self._context_sums(lay)
            + self._optimizer(lay)
        )

    def _crowded_pipeline(self, lay: Layout, forward: float, backward: float, send: float) -> float:
        """The pipeline's forwards and backwards on ranks sharing a CPU's cores: its schedule
        simulated as `step_time.pipeline_timeline` simulates it, every stage at the slowest
        one's time alone, slowed by the ranks computing beside it (in the bubble, fewer), each
        message `send` in flight (its sender goes on meanwhile)."""
        from meshplan.runtime.schedules import build, simulate

        schedule = build("interleaved" if lay.virtual > 1 else "1f1b", lay.pp, lay.microbatches, lay.virtual)
        chunk = {"F": forward / lay.virtual / self.slowdown, "B": backward / lay.virtual / self.slowdown}
        crowded = crowding(self.hw, self.world, lay.pp)
        return simulate(schedule, chunk, lambda action: send, crowded=crowded).makespan

    def _ring(self, lay: Layout, f: float) -> float:
        """A block's forward ring: cp - 1 sends of this rank's keys and values (its heads)."""
        prof, shape = self.profile, self.shape
        width = shape.kv_width or 2 * (shape.hidden or 1)
        kv = prof.hidden_bytes * prof.tokens * f * width / (shape.hidden or width) / lay.tp
        return (lay.cp - 1) * self._collective("send", kv, 2, lay.cp * lay.ep * lay.tp)

    def _ulysses(self, lay: Layout, f: float) -> float:
        """A block's forward all-to-alls under Ulysses: its queries, keys and values to head
        shards, the output back to sequence shards (this rank's tp heads of each)."""
        prof, shape = self.profile, self.shape
        hidden = shape.hidden or 1
        width = 2 * hidden + (shape.kv_width or 2 * hidden)  # queries and output, keys and values
        moved = prof.hidden_bytes * prof.tokens * f * width / hidden / lay.tp
        return self._collective("all_to_all", moved, lay.cp, lay.cp * lay.ep * lay.tp)

    def _context_sums(self, lay: Layout) -> float:
        """The gradients' sum over the context axis after backward (every cp rank holds every
        weight and saw a part of each sequence)."""
        if lay.cp <= 1:
            return 0.0
        n = max(self.local_params(lay, s, b) for s, b in enumerate(self.stages(lay)))
        return self._collective("all_reduce", 4 * n, lay.cp, lay.cp * lay.ep * lay.tp)

    def _data_parallel(self, lay: Layout, forward: float, backward: float) -> float:
        """What the step waits for of the data-parallel engine's collectives, as `estimate`
        prices them (`step_time.exposed`): gradient reductions behind the last backward,
        ZeRO-1/2's all-gathers behind the next forward, ZeRO-3's gathers behind their phase."""
        if lay.dp <= 1:
            return 0.0
        n = max(self.local_params(lay, s, b) for s, b in enumerate(self.stages(lay)))
        inner = lay.tp * lay.ep * lay.pp * lay.cp
        span = lay.dp * inner
        pieces = max(self.shape.layers // lay.pp, 1) + 2  # buckets, flats or units
        overlap = self.hw.overlap
        if lay.zero == 0:
            reduce = self._collective("all_reduce", 4 * n, lay.dp, span)
            return exposed(reduce, reduce / pieces, backward, overlap)
        d = lay.shards  # under HSDP, within a node; each reduced shard then all-reduced over the copies
        half = self._collective("reduce_scatter", 4 * n, d, d * inner)
        if lay.copies > 1:
            half += self._collective("all_reduce", 4 * n / d, lay.copies, span)
        waited = exposed(half, half / pieces, backward, overlap)  # the gradients' reduce-scatter
        if lay.zero < 3:
            return waited + exposed(half, 0.0, forward, overlap)  # the parameters' all-gather after the step
        gather = self._collective("all_gather", self.compute_bytes * n, d, d * inner)
        gathers = exposed(gather, gather / pieces, forward, overlap)
        return waited + gathers + exposed(gather, gather / pieces, backward, overlap)

    def _optimizer(self, lay: Layout) -> float:
        n = max(self.local_params(lay, s, b) for s, b in enumerate(self.stages(lay)))
        if lay.zero:
            n = math.ceil(n / lay.shards)
        moved = 28 * n  # gradient read; parameter and two moments read and written (fp32)
        if lay.offload:
            return moved / HOST_STEP + 8 * n / HOST_LINK
        tensors = self.counts.tensors_per_block * max(self.stages(lay)) + 4
        return (
            moved / self.hw.memory_bandwidth * self.slowdown
            + tensors * self.hw.optimizer_tensor
            + self.hw.step_overhead
        )
