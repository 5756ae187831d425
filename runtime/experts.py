"""Expert parallelism at run time: the experts of an MoE layer split over one mesh axis, each
token sent to the ranks holding its experts and its outputs sent back, by explicit all-to-all.

A compiled program calls one `ExpertParallel` node where the model called its experts
module (`compiler/passes/experts/` puts it there):

    experts_ep = self.experts_ep(tokens, top_k_index, top_k_weights, gate_up_proj, down_proj)

with this rank's experts' parameters (`E / n` of the `E` experts, along dim 0) and the
router's choice for this rank's tokens. Over the `n` ranks of the axis, with `L = E / n`
experts each (expert `e` on rank `e // L`, as local expert `e % L`):

    step       what                                                    collective
    route      the (token, slot) pairs, grouped by expert (stable sort)    -
    counts     pairs per expert, from every rank to every rank         all_to_all (E ints)
    dispatch   each pair's token to the rank of its expert             all_to_all (N k rows)
    experts    the model's own experts module on the received rows,     -
               as its local experts (k = 1, weight 1)
    combine    each output back to the rank of its token               all_to_all (N k rows)
    weigh      out[t] = sum_j w[t, j] y[t, j], as the model sums them     -

Dropless: every pair is computed, the all-to-alls have sizes that depend on the routing
(`all_to_all_single` with split sizes). Backward is the reverse all-to-all of each
(`_AllToAllV`), so autograd and the watchdog see the same collectives on every rank, even
a rank whose experts got no token.

With a capacity (`experts over ep (top_k=2, capacity_factor=1.25)`), each expert takes at
most `C = ceil(N k f / E)` pairs of this rank's `N` tokens (GShard's and Switch's capacity,
per routing group: the tokens this call routes, i.e. this rank's share of the micro-batch;
`expert_capacity`). Experts borrowing a tensor axis (`experts over tp`) route rows of tokens
the axis's ranks share: their routing group is all of those tokens, so each rank gathers the
others' top_k_index (N k ints) and queues the pairs in the tokens' order (`_shared_positions`),
as one device routing them would. Over a group of axes (`experts over dp x tp`) that gather
is over the borrowed axis's ranks alone (`share_group`): dp's ranks route other batches.
The same where an axis cuts the tokens by rows for experts over their own axis (a sequence
shard each: `shared` names that axis). Where ranks share the tokens, each sends only its own
kept pairs, in all-to-alls sized by the counts as dropless (`_routed` with `kept`): fixed
buffers of E C rows would hold every peer's places too, and compute them.
Which pairs it keeps is fixed by the routing alone (`expert_positions`):
pairs rank by slot, then by token, so every token's first choice comes before any token's
second (GShard's and DeepSpeed's top-2 order), and an expert keeps its first `C`. A dropped
pair adds nothing to its token's output (its expert output counts as zero), so its routing
weight gets no gradient from it either; the token keeps its other pairs (and the layer's
residual, in the model). The buffers are fixed: each rank sends every expert `C` rows
(kept pairs, then zero rows), so there is no count exchange, and the dispatch and combine
move `E C` rows each, whatever the routing; the experts run on `E C` rows per rank, the zero
rows' outputs are never read (so they add nothing to any gradient either). Every rank of the
axis must then route as many tokens, so that its `C` is theirs (`meshplan run` and `verify`
give every rank a batch of the same shape):

    step       what                                                    collective
    place      kept pair (t, j) at row e C + position, zero elsewhere     -
    dispatch   every expert's C rows to the rank of that expert          all_to_all (E C rows)
    experts    the model's own experts module on them                    -
    combine    back                                                      all_to_all (E C rows)
    weigh      out[t] = sum of w[t, j] y[t, j] over the kept pairs        -

Gradients. The batch is split over the expert axis too (it is data parallel for everything
but the experts: torchtitan's layout), so the loss is the mean of every data rank's loss.
An expert's weight gradient sums, through the combine's backward, the contributions of the
tokens of all `n` ranks of its group; dividing it by `n` here (`_ScaleGrad`) makes it that
mean's gradient, and the data-parallel engine then averages it over the data axes that do
not shard it (`dp` in `mesh dp=2, ep=2`), as it averages every other weight over all of them.

    ep = ExpertParallel(group, "ep", path="layers.0.mlp.experts", num_experts=8,
                        param_names=("gate_up_proj", "down_proj")).bind(group, model)

An experts module called on rows the model already permuted by expert, with their counts
(`experts(x, num_tokens_per_expert)`: torchtitan's `GroupedExperts`, Megatron's grouped MLP;
`takes_counts`) is the same unit with `grouped=True`: capture hands it each row's expert as a
(R, 1) index and weight 1 (the model weighs and un-permutes the rows itself), so the rows travel
as above (already grouped by expert: the sort keeps the model's order), and the rows a rank
receives, grouped by source rank, are regrouped by local expert for the model's module, called
as `experts(rows, counts)` on its E/n experts (int64 counts), and put back in arrival order.

On the meta device (`meshplan estimate`'s walk: shapes, no data) there is no routing to read, so
the unit routes under an assumption (`meta_routing`, "balanced" unless said): counts and split
sizes are Python ints, so the all-to-alls are issued (on the walk's fake process group) and every
op after them sees the shapes such a step has:

    routing    this rank's pairs                          the rows it receives
    balanced   N k / E to each expert (the remainder, one   as many as it sends: every rank's
               each, to the experts after its own first)    pairs spread the same way
    worst      all it can to one rank's experts (N min(k,   every rank's as many: the walk's rank
               L): a token's k experts differ), the rest    holds n N min(k, L) rows, dropless's
               spread over the others                       most

A capacity's buffers (E C rows) are fixed whatever the routing: exact, the kept pairs assumed to
fill them in order (each expert min(its pairs, C)). Experts sharing tokens over an axis keep, per
expert, their share of C (`C / s` of the `s` ranks'). The routing the model's own experts code
reads (each row's local expert, the grouped layout's counts) is made on the CPU, with those
values; an op of that code refusing meta and CPU operands together (`index_add`) is rerun with
the CPU ones as meta tensors (`_HostRouting`). No metrics are counted on meta.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from . import watchdog
from .collectives import AxisCollective, all_gather_single
from .zero_nodes import in_backward

# attributes a module or its config counts its experts in (Mixtral's `num_experts`, DeepSeek's...)
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")

# the routings a unit on the meta device can assume (`meta_routing`)
META_ROUTINGS = ("balanced", "worst")
_meta_routing = ["balanced"]


@contextlib.contextmanager
def meta_routing(routing: str = "balanced") -> Iterator[None]:
    """While it lasts, a unit called on meta tensors routes as `routing` says (the module
    docstring): "balanced" (the default outside it too) or "worst", dropless's most rows on
    the walk's rank. Real tensors route by their data, whatever is set.

        with meta_routing("worst"):
            walks = walk_stages(stages, inputs)
    """
    if routing not in META_ROUTINGS:
        raise ValueError(f"meta routing {routing!r}: one of {', '.join(META_ROUTINGS)}")
    before, _meta_routing[0] = _meta_routing[0], routing
    try:
        yield
    finally:
        _meta_routing[0] = before


def assumed_routing(
    pairs: int, tokens: int, k: int, num_experts: int, n: int, rank: int, cap: int | None = None
) -> tuple[list[int], list[int]]:
    """Under the routing `meta_routing` set, of the rank `rank` of an axis of `n` ranks holding
    `num_experts / n` experts each, `pairs` = `tokens` k routed by every rank: (E,) its pairs to
    each expert, and (n L,) at i L + l rank i's pairs for its local expert l. `cap`: the most
    pairs a rank keeps for one expert (its share of a capacity).

        assumed_routing(32, 16, 2, 4, 2, 0) == ([8, 8, 8, 8], [8, 8, 8, 8])
    """
    local = num_experts // n

    def sent_by(i: int) -> list[int]:
        if _meta_routing[0] == "worst":  # every rank's pairs to the experts of `rank`, all it can
            mine = min(pairs, tokens * min(k, local))
            q, r = divmod(mine, local)
            counts = [0] * num_experts
            for e in range(local):
                counts[rank * local + e] = q + (e < r)
            others = [e for e in range(num_experts) if e // local != rank]
            if others:
                q, r = divmod(pairs - mine, len(others))
                for j, e in enumerate(others):
                    counts[e] = q + (j < r)
        else:  # the remainder one each, from rank i's own first expert on: every rank gets as many
            q, r = divmod(pairs, num_experts)
            counts = [q + ((e - i * local) % num_experts < r) for e in range(num_experts)]
        return counts if cap is None else [min(c, cap) for c in counts]

    received = [sent_by(i)[rank * local + e] for i in range(n) for e in range(local)]
    return sent_by(rank), received


def all_to_all_v(
    x: Tensor, send: Sequence[int], recv: Sequence[int], group: dist.ProcessGroup | None
) -> Tensor:
    """Rows `x[sum(send[:j]) : sum(send[:j+1])]` go to rank j; the rows every rank sent this one
    come back in rank order: (sum(send), ...) -> (sum(recv), ...). No group: one rank, `x`."""
    if group is None:
        return x.clone()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    """`all_to_all_v` forward, the reverse one backward. `anchor` ties a rank whose experts got
    no rows into backward: its (empty) gradient makes every rank run the reverse collective."""

    @staticmethod
    def forward(ctx, x, anchor, send, recv, site, what):
        ctx.send, ctx.recv, ctx.site, ctx.what = send, recv, site, what
        ctx.anchor_shape = anchor.shape if anchor is not None else None
        site.note("all_to_all", what)
        site.sent_bytes += x.numel() * x.element_size()
        return all_to_all_v(x, send, recv, site.group)

    @staticmethod
    def backward(ctx, grad):
        ctx.site.note("all_to_all", f"{ctx.what} backward")
        ctx.site.sent_bytes += grad.numel() * grad.element_size()
        back = all_to_all_v(grad, ctx.recv, ctx.send, ctx.site.group)
        anchor = grad.new_zeros(ctx.anchor_shape) if ctx.anchor_shape is not None else None
        return (back if ctx.needs_input_grad[0] else None), anchor, None, None, None, None


def expert_capacity(num_tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Pairs an expert takes from one routing group of `num_tokens` tokens, each routed to `k`
    experts: ceil(num_tokens k factor / num_experts), the factor taken as the decimal written
    (1.1 is 11/10, so 20 pairs at 1.1 over 2 experts give 11, not 12).

        expert_capacity(32, 2, 4, 1.25) == 20
    """
    return math.ceil(Fraction(repr(float(factor))) * num_tokens * k / num_experts)


def expert_positions(top_k_index: Tensor, num_experts: int) -> Tensor:
    """(N, k) -> (N, k): each (token, slot) pair's place in the queue of its expert, from 0.
    Pairs queue by slot, then by token: every token's first choice before any second one.
    An expert with capacity C keeps the pairs whose place is below C.

        top_k_index = [[0, 1], [0, 2], [1, 0]]  ->  [[0, 1], [1, 0], [0, 2]]

    On the meta device (no routing to read): the shape alone (callers assume what is kept).
    """
    if top_k_index.is_meta:
        return torch.empty_like(top_k_index)
    num_tokens, k = top_k_index.shape
    flat = top_k_index.t().reshape(-1)  # (k N,) slot-major: pair (t, j) at j N + t
    order = flat.argsort(stable=True)  # (k N,) grouped by expert, slot-major inside
    counts = torch.bincount(flat, minlength=num_experts)  # (E,)
    starts = counts.cumsum(0) - counts  # (E,) where each expert's group begins in `order`
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return place.view(k, num_tokens).t()  # (N, k)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class ExpertParallel(AxisCollective):
    """The experts of one MoE layer over one mesh axis (see the module docstring).

    The compiled graph holds a group-less instance naming the model's experts module (`path`)
    and its parameters (`param_names`, each stacked over the experts on dim 0); `bind` makes a
    rank's, which runs the model's own module code on this rank's experts. `tokens` counts the
    rows routed to each of the `num_experts` experts by this rank since `take_tokens`,
    `dropped` those of them over capacity (`capacity_factor`; None: dropless), and
    `sent_bytes` what its all-to-alls sent (forward and backward, the rows it keeps included).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        axis: str,
        label: str = "",
        *,
        path: str = "",
        num_experts: int = 0,
        param_names: tuple[str, ...] = (),
        capacity_factor: float | None = None,
        splits_batch: bool = True,
        batch_ranks: int | None = None,
        token_chunks: int = 1,
        shared: str = "",
        rows_cut: tuple[str, ...] = (),
        grouped: bool = False,
        counted: bool = True,
    ):
        super().__init__(group, axis, label)
        self.path, self.num_experts, self.param_names = path, num_experts, param_names
        self.capacity_factor = capacity_factor
        # whether the axis splits the batch (an expert axis of its own, or borrowing the data
        # axis), so that an expert's gradient, summed over its ranks' tokens, is their mean's;
        # experts borrowing a tensor axis see rows of the same batch: the sum is the gradient
        self.splits_batch = splits_batch
        # of a group of axes (`dp x tp`), how many hold different batches (dp's): the divisor
        # of an expert's gradient; None: the group's size if `splits_batch`, else 1
        self.batch_ranks = batch_ranks
        # borrowing a tensor axis: this rank's rows of the tokens its ranks share are this many
        # chunks of them, in order (a capacity counts all of them, `_shared_positions`)
        self.token_chunks = token_chunks
        # of the unit's axes, the one whose ranks share the tokens ("": none); over a group of
        # axes (`dp x tp`) its ranks are a subgroup, `share_group`, bound with the unit's group
        self.shared = shared
        self.share_group = group
        # axes other than the unit's whose ranks route their own rows of the tokens (a sequence
        # shard, a split of whole tokens): the job's expert load sums over them too
        self.rows_cut = rows_cut
        # the model's module takes rows grouped by expert (`grouped_rows`), and their counts
        # (`takes_counts`) unless `counted` is False (`takes_rows`: an equal share each)
        self.grouped = grouped
        self.counted = counted
        # the model's module with this rank's expert count, its parameters left out (they
        # come from the graph): kept out of `_modules`, so it adds nothing to the program's state
        self.__dict__["_local"] = None
        self.tokens = torch.zeros(num_experts, dtype=torch.int64)
        self.dropped = torch.zeros(num_experts, dtype=torch.int64)
        self.sent_bytes = 0

    def extra_repr(self) -> str:
        capacity = f", capacity_factor={self.capacity_factor}" if self.capacity_factor is not None else ""
        batch = "" if getattr(self, "splits_batch", True) else ", splits_batch=False"
        if getattr(self, "batch_ranks", None) is not None:
            batch = f", batch_ranks={self.batch_ranks}"
        grouped = ", grouped=True" if getattr(self, "grouped", False) else ""
        return f"axis={self.axis!r}, path={self.path!r}, num_experts={self.num_experts}{capacity}{batch}{grouped}"

    def bind(
        self, group: dist.ProcessGroup | None, model: nn.Module, share_group: dist.ProcessGroup | None = None
    ) -> ExpertParallel:
        """This rank's instance: its process group (and, over a group of axes, the subgroup of
        the axis whose ranks share the tokens: `share_group`; else the group itself), and the
        model's experts module as the `num_experts / n` local experts it computes."""
        n = dist.get_world_size(group) if group is not None else 1
        bound = ExpertParallel(
            group if n > 1 else None,  # one rank: nothing to send
            self.axis,
            path=self.path,
            num_experts=self.num_experts,
            param_names=self.param_names,
            # a program saved before capacities existed has none: dropless
            capacity_factor=getattr(self, "capacity_factor", None),
            splits_batch=getattr(self, "splits_batch", True),
            batch_ranks=getattr(self, "batch_ranks", None),  # (programs saved before groups of axes)
            token_chunks=getattr(self, "token_chunks", 1),
            shared=self.shared_axis(),
            rows_cut=getattr(self, "rows_cut", ()),
            grouped=getattr(self, "grouped", False),
            counted=getattr(self, "counted", True),
        )
        if share_group is not None and n > 1:
            bound.share_group = share_group
        bound.__dict__["_local"] = local_experts(model.get_submodule(self.path), self.num_experts // n)
        return bound

    def shared_axis(self) -> str:
        """The axis whose ranks share the tokens ("": every rank routes its own)."""
        shared = getattr(self, "shared", None)
        if shared is None:  # a program saved before groups of axes: the unit's axis, or none
            return "" if getattr(self, "splits_batch", True) else self.axis
        return shared

    @property
    def local(self) -> nn.Module:
        """The model's experts module as this rank's experts (`bind`)."""
        local = self.__dict__["_local"]
        assert local is not None, "an unbound experts unit: `bind` it to a rank first"
        return local

    def take_tokens(self) -> Tensor:
        """(num_experts,) rows routed to each expert since the last call, from this rank."""
        tokens, self.tokens = self.tokens, torch.zeros_like(self.tokens)
        return tokens

    def take_dropped(self) -> Tensor:
        """(num_experts,) of those rows, the ones over capacity (all 0 dropless)."""
        dropped, self.dropped = self.dropped, torch.zeros_like(self.dropped)
        return dropped

    def forward(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *params: Tensor) -> Tensor:
        # x: (N, H) this rank's tokens; top_k_index, top_k_weights: (N, k); params: (E/n, ...) each
        if self.capacity_factor is None:
            if _counting(x):
                self.tokens += torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts).cpu()
            return self._routed(x, top_k_index, top_k_weights, params)
        share = self.share_group if self.shared_axis() and self.group is not None else None
        if share is None:
            return self._with_capacity(x, top_k_index, top_k_weights, params)
        # the tokens the ranks of `share` hold between them queue as one device's: each rank
        # sends only its own kept pairs (the buffers of E C rows would hold every peer's too)
        sharing = dist.get_world_size(share)
        num_tokens, k = top_k_index.shape
        capacity = expert_capacity(num_tokens * sharing, k, self.num_experts, self.capacity_factor)
        kept = self._shared_positions(top_k_index, share) < capacity  # (N, k)
        self._count(top_k_index, kept)
        cap = None
        if x.is_meta:  # this rank's share of each expert's C (the shared tokens' pairs queue as one)
            whole, extra = divmod(capacity, sharing)
            cap = whole + (dist.get_rank(share) < extra)
        return self._routed(x, top_k_index, top_k_weights, params, kept, cap)

    def _routed(
        self,
        x: Tensor,
        top_k_index: Tensor,
        top_k_weights: Tensor,
        params: Sequence[Tensor],
        kept: Tensor | None = None,
        cap: int | None = None,
    ) -> Tensor:
        """Every (token, slot) pair (or only the `kept` ones: a dropped pair's output counts as
        zero) to the rank of its expert and back, in all-to-alls sized by the counts. On meta
        tensors the counts are `assumed_routing`'s (`cap`: the most pairs kept per expert)."""
        n = dist.get_world_size(self.group) if self.group is not None else 1
        experts, local = self.num_experts, self.num_experts // n
        num_tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # (N k,) the expert of each (token, slot) pair
        if kept is not None:
            flat = torch.where(kept.reshape(-1), flat, experts)  # a dropped pair: to no rank, sorted last
        order = flat.argsort(stable=True)  # (N k,) pairs grouped by expert, so by rank
        if flat.is_meta:  # no routing to read: the assumed one's, as ints (module docstring)
            rank = dist.get_rank(self.group) if self.group is not None else 0
            assumed, arriving = assumed_routing(flat.numel(), num_tokens, k, experts, n, rank, cap)
            self._exchange(flat.new_empty((experts,)))  # the counts' all-to-all, as a step issues it
            send = [sum(assumed[j * local : (j + 1) * local]) for j in range(n)]
            recv = [sum(arriving[j * local : (j + 1) * local]) for j in range(n)]
        else:
            counts = torch.bincount(flat, minlength=experts + 1)[:experts]  # (E,) pairs per expert
            received = self._exchange(counts)  # (n L,) pairs from rank j for local expert l at j L + l
            send = counts.view(n, local).sum(1).tolist()  # pairs to each rank
            recv = received.view(n, local).sum(1).tolist()  # pairs from each rank
        sent = sum(send)  # N k, less the dropped pairs
        rows = x[order[:sent] // k]  # (sent, H) each pair's token, grouped by destination rank
        tokens = _AllToAllV.apply(rows, None, send, recv, self, "dispatch")  # (M, H)
        if flat.is_meta:  # on the CPU: the model's experts code reads it
            local_index = torch.arange(local).repeat(n).repeat_interleave(torch.tensor(arriving))  # (M,)
        else:
            local_index = torch.arange(local, device=x.device).repeat(n).repeat_interleave(received)  # (M,)
        ones = top_k_weights.new_ones((tokens.shape[0], 1))  # (M, 1): weighed after the combine
        y = self._experts(tokens, local_index, ones, params, n)  # (M, H) each row through its expert
        anchor = tokens if tokens.shape[0] == 0 else None
        back = _AllToAllV.apply(y, anchor, recv, send, self, "combine")  # (sent, H) in `order`
        if sent < flat.numel():  # the dropped pairs' outputs: zeros
            back = torch.cat([back, back.new_zeros((flat.numel() - sent, back.shape[1]))])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        pairs = back[inverse].view(num_tokens, k, -1)  # (N, k, H) in (token, slot) order
        return (pairs * top_k_weights.unsqueeze(-1)).sum(1).to(x.dtype)  # (N, H)

    def _count(self, top_k_index: Tensor, kept: Tensor) -> None:
        """The metrics: pairs routed to each expert, and of them the dropped."""
        if _counting(top_k_index):
            self.tokens += torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts).cpu()
            self.dropped += torch.bincount(top_k_index[~kept], minlength=self.num_experts).cpu()

    def _with_capacity(
        self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, params: Sequence[Tensor]
    ) -> Tensor:
        """`forward` with each expert taking at most C pairs of this rank's tokens, in fixed
        buffers of E C rows (see the module docstring)."""
        assert self.capacity_factor is not None
        n = dist.get_world_size(self.group) if self.group is not None else 1
        experts, local = self.num_experts, self.num_experts // n
        num_tokens, k = top_k_index.shape
        capacity = expert_capacity(num_tokens, k, experts, self.capacity_factor)
        place = expert_positions(top_k_index, experts)  # (N, k) each pair's place in its expert's queue
        kept = place < capacity  # (N, k)
        self._count(top_k_index, kept)
        slot = top_k_index * capacity + place  # (N, k) the pair's row in the send buffer, if kept
        source = torch.full((experts * capacity,), num_tokens, device=x.device)  # (E C,) row N: zeros
        token = torch.arange(num_tokens, device=x.device)[:, None].expand(num_tokens, k)  # (N, k)
        if x.is_meta:  # no routing: the kept pairs assumed to fill the buffers in order, E C at most
            rank = dist.get_rank(self.group) if self.group is not None else 0
            assumed = assumed_routing(num_tokens * k, num_tokens, k, experts, n, rank)[0]
            held = sum(min(c, capacity) for c in assumed)
            source[slot.reshape(-1)[:held]] = token.reshape(-1)[:held]
        else:
            source[slot[kept]] = token[kept]
        rows = torch.cat([x, x.new_zeros((1, x.shape[1]))])[source]  # (E C, H) by expert, so by rank
        split = [local * capacity] * n  # rows to (and from) each rank
        tokens = _AllToAllV.apply(rows, None, split, split, self, "dispatch")  # (n L C, H)
        device = "cpu" if x.is_meta else x.device  # (on meta: the model's experts code reads it)
        local_index = torch.arange(local, device=device).repeat_interleave(capacity).repeat(n)  # (n L C,)
        ones = top_k_weights.new_ones((tokens.shape[0], 1))  # (n L C, 1): weighed after the combine
        y = self._experts(tokens, local_index, ones, params, n)  # (n L C, H)
        anchor = tokens if tokens.shape[0] == 0 else None
        back = _AllToAllV.apply(y, anchor, split, split, self, "combine")  # (E C, H) as `rows`
        padded = torch.cat([back, back.new_zeros((1, back.shape[1]))])  # row E C: a dropped pair's zero
        pairs = padded[torch.where(kept, slot, experts * capacity)]  # (N, k, H)
        return (pairs * top_k_weights.unsqueeze(-1)).sum(1).to(x.dtype)  # (N, H)

    def _shared_positions(self, top_k_index: Tensor, share: dist.ProcessGroup) -> Tensor:
        """(N, k) each of this rank's pairs' place in its expert's queue over the tokens the
        ranks of `share` hold between them (experts borrowing a tensor axis): every rank's
        routing gathered (N k ints each) and put in the tokens' order, where each rank's rows
        are `token_chunks` chunks (chunk c of rank r is the shared tokens' chunk c n + r), then
        queued as one device queues them (`expert_positions`)."""
        n = dist.get_world_size(share)
        num_tokens, k = top_k_index.shape
        gathered = top_k_index.new_empty((n * num_tokens, k))  # rank r's at rows [r N, (r+1) N)
        watchdog.note("all_gather", self.shared_axis(), f"{self.label} routing".strip(), share)
        self.sent_bytes += top_k_index.numel() * top_k_index.element_size()
        all_gather_single(gathered, top_k_index.contiguous(), group=share)
        chunks = getattr(self, "token_chunks", 1)
        ordered = gathered.view(n, chunks, num_tokens // chunks, k).transpose(0, 1).reshape(-1, k)
        place = expert_positions(ordered, self.num_experts).view(chunks, n, num_tokens // chunks, k)
        return place[:, dist.get_rank(share)].reshape(num_tokens, k)

    def _experts(self, tokens: Tensor, local_index: Tensor, ones: Tensor, params, n: int) -> Tensor:
        """The model's experts module on rows `tokens` (M, H), row i through local expert
        `local_index[i]` with weight 1; each expert weight's gradient scaled by 1/n (the mean
        over the axis's data ranks, see the module docstring)."""
        batch_ranks = getattr(self, "batch_ranks", None)
        if batch_ranks is not None:
            n = batch_ranks  # a group of axes: the mean over those that split the batch
        elif not getattr(self, "splits_batch", True):
            n = 1  # rows of one batch: the sum over the axis's ranks is the gradient
        scaled = dict(zip(self.param_names, [_ScaleGrad.apply(p, 1.0 / n) for p in params], strict=True))
        # on meta: the routing on the CPU, the rows on meta (`_HostRouting`)
        with _HostRouting() if tokens.is_meta else contextlib.nullcontext():
            if getattr(self, "grouped", False):  # rows grouped by local expert, and their counts
                order = local_index.argsort(stable=True)  # (M,) from (source rank, expert) to (expert, rank)
                counts = torch.bincount(local_index, minlength=params[0].shape[0])  # (E/n,)
                if getattr(self, "counted", True):
                    y = torch.func.functional_call(self.local, scaled, (tokens[order], counts))
                else:  # an equal share each, which the module reads from the rows' count
                    y = self._in_equal_shares(tokens[order], counts, scaled)
                inverse = torch.empty_like(order)
                inverse[order] = torch.arange(order.numel(), device=order.device)
                return y[inverse]  # (M, H) in arrival order
            return torch.func.functional_call(
                self.local, scaled, (tokens, local_index[:, None], ones)
            )  # (M, H)

    def _in_equal_shares(self, rows: Tensor, counts: Tensor, params: dict[str, Tensor]) -> Tensor:
        """The model's module on `rows` grouped by local expert (`counts` each), which it reads
        as equal shares (`takes_rows`): where the shares differ (a tensor axis's ranks each took a
        chunk of the tokens), each expert's rows padded with zeros to the most any has, and the
        padding's outputs dropped (their gradient is zero: nothing reads them)."""
        most = int(counts.max()) if counts.numel() else 0
        if bool((counts == most).all()):
            return torch.func.functional_call(self.local, params, (rows,))
        starts = counts.cumsum(0) - counts  # (E/n,) where each expert's rows start
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        slot = expert * most + torch.arange(rows.shape[0], device=counts.device) - starts[expert]
        padded = rows.new_zeros((counts.numel() * most, *rows.shape[1:]))
        padded = padded.index_copy(0, slot.to(rows.device), rows)
        return torch.func.functional_call(self.local, params, (padded,))[slot.to(rows.device)]

    def _exchange(self, counts: Tensor) -> Tensor:
        """Every rank's pairs per expert for this rank's experts (an all-to-all of the counts)."""
        if self.group is None:
            return counts
        out = torch.empty_like(counts)
        self.note("all_to_all", "token counts")
        self.sent_bytes += counts.numel() * counts.element_size()
        dist.all_to_all_single(out, counts, group=self.group)
        return out


def _counting(routing: Tensor) -> bool:
    """Whether a forward counts its routing for the metrics: in training, once (not when
    checkpointing recomputes it in backward), on real tensors (meta ones route by assumption)."""
    return torch.is_grad_enabled() and not in_backward() and not routing.is_meta


class _HostRouting(TorchDispatchMode):
    """While the model's experts code runs on meta rows with the routing it reads on the CPU
    (`.tolist()`, `nonzero` need values): an op that refuses meta and CPU operands together
    (`index_add`, `index_copy` check their devices; indexing does not) is rerun with the CPU
    tensors as meta ones, whose shapes are all such an op takes from them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            if not any(t.is_meta for t in tensors) or not any(_on_host(t) for t in tensors):
                raise
        with _disable_current_modes():  # (the copies stand in for tensors a real step has on device)
            args, kwargs = tree_map(lambda t: t.to("meta") if _on_host(t) else t, (args, kwargs))
        return func(*args, **kwargs)


def _on_host(value: Any) -> bool:
    """A CPU tensor that is not a scalar (which any device's op takes)."""
    return isinstance(value, Tensor) and value.device.type == "cpu" and value.dim() > 0


def takes_counts(module: nn.Module) -> bool:
    """Whether an experts module is called on rows already grouped by expert, with each expert's
    row count, `experts(x, num_tokens_per_expert)` (torchtitan's `GroupedExperts`), rather than on
    tokens and their routing, `experts(tokens, top_k_index, top_k_weights)` (Hugging Face's)."""
    return _positional(module) == 2


def takes_rows(module: nn.Module) -> bool:
    """Whether an experts module is called on rows grouped by expert alone, `experts(x)`, each
    expert an equal share of them (Llama 4's: every token through every expert, scaled by its
    score before; the module views x as (E, rows / E, H))."""
    return _positional(module) == 1


def _positional(module: nn.Module) -> int | None:
    """The most of 1, 2 or 3 positional arguments the module's forward binds (0: none of them);
    None if its signature cannot be read."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    return max((n for n in (1, 2, 3) if _binds(signature, n)), default=0)


def grouped_rows(module: nn.Module) -> bool:
    """Whether an experts module takes rows the model grouped by expert (`takes_counts`,
    `takes_rows`), not tokens and their routing."""
    return takes_counts(module) or takes_rows(module)


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def local_experts(module: nn.Module, local: int) -> nn.Module:
    """A copy of the model's experts module that holds `local` experts: its parameters left
    out (placeholders; the caller passes this rank's), its expert count (the module's
    `num_experts` or its config's) set to `local`."""
    placeholders: dict[int, object] = {
        id(p): nn.Parameter(torch.empty(0, device="meta"), p.requires_grad) for p in module.parameters()
    }
    copied = copy.deepcopy(module, memo=placeholders)
    total = next((c for a in EXPERT_COUNTS if isinstance(c := getattr(module, a, None), int)), None)
    for owner in (copied, getattr(copied, "config", None)):
        for attr in EXPERT_COUNTS:
            count = getattr(owner, attr, None)
            if isinstance(count, int) and (total is None or count == total):
                setattr(owner, attr, local)
    return copied
