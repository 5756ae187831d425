"""Autograd-correct collectives over one mesh axis, as modules a compiled graph calls.

A compiled per-rank program calls these as `call_module` nodes, so its printed code
names every collective and the axis it runs over:

    copy_to_tp = self.copy_to_tp(mul_1)             # f: identity forward, all-reduce backward
    linear = torch.ops.aten.linear.default(copy_to_tp, layers_0_self_attn_q_proj_weight)
    ...
    all_reduce_tp = self.all_reduce_tp(linear_3)    # g: all-reduce forward, identity backward

Each forward collective has its conjugate in backward (Megatron's f/g pairs):

    module                 forward                 backward
    CopyToAxis             identity                all-reduce
    AllReduce              all-reduce              identity
    AllGather(dim)         all-gather on dim       reduce-scatter on dim   (before a column split)
    GatherReplicated(dim)  all-gather on dim       take the local chunk     (for replicated consumers)
    ReduceScatter(dim)     reduce-scatter on dim   all-gather on dim
    Split(dim)             take the local chunk    all-gather on dim
        (these four also take `blocks`: dim cut into equal blocks, each block sharded)
    AllToAll(src, dst)     shard on src -> on dst  shard on dst -> on src   (Ulysses, expert dispatch)
    VocabParallelEmbedding lookup of the local vocab rows, partial sums; the caller reduces
    VocabParallelCrossEntropy  cross-entropy over vocab-sharded logits (3 small all-reduces)

A collective made with `balanced=True` (a context axis under the load-balanced causal layout)
cuts a sharded dim into 2n chunks and gives rank r chunks r and 2n-1-r, in that order; its
split, gather, reduce-scatter and all-to-all all use that layout (`to_balanced` before a
contiguous cut, `from_balanced` after a contiguous gather), so the shards stay consistent:

    n = 2, T = 8, chunks of 2:   rank 0 holds positions 0 1 6 7, rank 1 holds 2 3 4 5

Each module class is its collective kind, declared once (`kind`, the name in the graph's
node facts and in `COLLECTIVES`): the ops it puts on the wire per call, forward and backward
(`forward_wire`, `backward_wire`: the compiler's ledger counts them), whether its autograd
function saves a tensor for backward (`saves_tensors`: how far a checkpointed region's
recomputation must go), and whether it is an overlap entry (`overlap_entry`: the linears that
read it may issue its backward reduction early, `issue_backward`).

The modules hold their process group; nothing here is global state. Each collective
tells `runtime/watchdog.py` what it is about to wait in (op, axis, node label), so a rank
that times out can say which collective; `label_collectives` names the nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import watchdog

# torch >= 2.12 names the tensor-in/tensor-out collectives *_single (the old names warn)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def balanced_order(n: int) -> list[int]:
    """The 2n chunks of a dim in the order the ranks hold them under the load-balanced layout:
    rank r holds chunks r and 2n-1-r. n = 2: [0, 3, 1, 2]; n = 3: [0, 5, 1, 4, 2, 3]."""
    return [c for r in range(n) for c in (r, 2 * n - 1 - r)]


def to_balanced(x: Tensor, dim: int, n: int) -> Tensor:
    """A whole `dim` in sequence order -> in the ranks' order: its n contiguous pieces are then
    the n ranks' shards under the load-balanced layout."""
    chunks = x.chunk(2 * n, dim)
    return torch.cat([chunks[c] for c in balanced_order(n)], dim)


def from_balanced(x: Tensor, dim: int, n: int) -> Tensor:
    """The inverse of `to_balanced`: the ranks' shards side by side -> sequence order."""
    chunks = x.chunk(2 * n, dim)
    where = {c: i for i, c in enumerate(balanced_order(n))}
    return torch.cat([chunks[where[c]] for c in range(2 * n)], dim)


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup, balanced: bool = False) -> Tensor:
    """Concatenate every rank's `x` along `dim`: (.., n, ..) -> (.., n * world, ..)."""
    world = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    all_gather_single(out, moved, group=group)
    out = from_balanced(out, 0, world) if balanced else out
    return out.movedim(0, dim)


def reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup, balanced: bool = False) -> Tensor:
    """Sum over ranks, each keeping its chunk of `dim`: (.., n, ..) -> (.., n / world, ..)."""
    world = dist.get_world_size(group)
    moved = x.movedim(dim, 0)
    moved = (to_balanced(moved, 0, world) if balanced else moved).contiguous()
    out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
    reduce_scatter_single(out, moved, group=group)
    # a tensor of its own, not a view: the model may write into it in place (Falcon adds its
    # attention output into the MLP's), which autograd forbids on a view a Function made
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def all_to_all(x: Tensor, src: int, dst: int, group: dist.ProcessGroup, balanced: bool = False) -> Tensor:
    """A shard on `src` -> a shard on `dst`: `x` (this rank's chunk of `src`) is cut into `world`
    pieces along `dst`, piece j sent to rank j; the pieces received (every rank's chunk of `src`,
    this rank's of `dst`) are laid side by side along `src`: (.., S/n, .., D, ..) -> (.., S, .., D/n, ..)."""
    world = dist.get_world_size(group)
    x = to_balanced(x, dst, world) if balanced else x
    sends = [piece.contiguous() for piece in x.chunk(world, dst)]
    received = [torch.empty_like(sends[0]) for _ in range(world)]
    dist.all_to_all(received, sends, group=group)
    out = torch.cat(received, src)
    return from_balanced(out, src, world) if balanced else out


def local_chunk(x: Tensor, dim: int, group: dist.ProcessGroup, balanced: bool = False) -> Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if balanced:  # chunks rank and 2 world - 1 - rank of 2 world
        chunks = x.chunk(2 * world, dim)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim).contiguous()
    chunk = x.chunk(world, dim)[rank]
    # a tensor of its own, not a view of `x` (see `reduce_scatter`)
    return chunk.contiguous() if not chunk.is_contiguous() else chunk.clone()


# ---------------------------------------------------------------- issued early, waited late
#
# The backward collective of an entry into sharded compute (f's all-reduce, the sequence-parallel
# gather's reduce-scatter) may be issued by the node that reads the entry's output, as soon as
# that node has the input gradient: `runtime/linears.py` computes it before its weight gradients
# and issues the reduction here, on the entry's autograd node (its `ctx`); the entry's own
# backward, the gradient's first use, waits for it. An entry nobody issued for reduces as usual.


class _Issued(NamedTuple):
    work: dist.Work
    result: Callable[[], Tensor]  # the reduced gradient, once `work` is done
    op: str


def issue_backward(entry: Any, grad: Tensor) -> bool:
    """Start the backward collective of `entry` (an entry collective's autograd node: the
    `grad_fn` of its output) on `grad`, the whole gradient of that output, without waiting.
    False, and nothing started, for any other node (a view of the output, another op)."""
    if isinstance(entry, _Copy._backward_cls):  # type: ignore[attr-defined]
        reduced = grad.contiguous()  # reduced in place: the entry's backward returns it
        work = dist.all_reduce(reduced, group=entry.site.group, async_op=True)
        entry.issued = _Issued(work, lambda: reduced, "all_reduce")
        return True
    if isinstance(entry, _Gather._backward_cls) and entry.grad_is_partial and not entry.site.balanced:  # type: ignore[attr-defined]
        dim, group = entry.dim, entry.site.group
        moved = grad.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // dist.get_world_size(group), *moved.shape[1:]))
        work = reduce_scatter_single(out, moved, group=group, async_op=True)
        entry.issued = _Issued(work, lambda: out.movedim(0, dim), "reduce_scatter")
        return True
    return False


def _wait_issued(ctx) -> Tensor | None:
    """The gradient a consumer issued the reduction of (`issue_backward`), waited for; None if
    nobody did."""
    issued = getattr(ctx, "issued", None)
    if issued is None:
        return None
    ctx.issued = None
    ctx.site.note(issued.op, "backward (issued early)")
    issued.work.wait()
    return issued.result()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, site):
        ctx.site = site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        reduced = _wait_issued(ctx)
        if reduced is not None:
            return reduced, None
        ctx.site.note("all_reduce", "backward")
        return all_reduce(grad, ctx.site.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, site):
        site.note("all_reduce")
        return all_reduce(x, site.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """All-gather forward; backward reduce-scatters a partial gradient or keeps this rank's
    chunk of a whole one, as the module (`site.grad_is_partial`) says."""

    @staticmethod
    def forward(ctx, x, dim, site):
        ctx.dim, ctx.site, ctx.grad_is_partial = dim, site, site.grad_is_partial
        site.note("all_gather")
        return all_gather(x, dim, site.group, site.balanced)

    @staticmethod
    def backward(ctx, grad):
        site = ctx.site
        reduced = _wait_issued(ctx)
        if reduced is not None:
            return reduced, None, None
        if ctx.grad_is_partial:
            site.note("reduce_scatter", "backward")
            return reduce_scatter(grad, ctx.dim, site.group, site.balanced), None, None
        return local_chunk(grad, ctx.dim, site.group, site.balanced), None, None


class _ToChunk(torch.autograd.Function):
    """Base: a forward `(x, dim, site)` that leaves this rank's chunk of `dim`; backward
    all-gathers the chunk's gradient into the whole dim's."""

    @staticmethod
    def backward(ctx, grad):
        ctx.site.note("all_gather", "backward")
        return all_gather(grad, ctx.dim, ctx.site.group, ctx.site.balanced), None, None


class _ReduceScatter(_ToChunk):
    @staticmethod
    def forward(ctx, x, dim, site):
        ctx.dim, ctx.site = dim, site
        site.note("reduce_scatter")
        return reduce_scatter(x, dim, site.group, site.balanced)


class _Split(_ToChunk):
    @staticmethod
    def forward(ctx, x, dim, site):
        ctx.dim, ctx.site = dim, site
        return local_chunk(x, dim, site.group, site.balanced)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, site):
        ctx.src, ctx.dst, ctx.site = src, dst, site
        site.note("all_to_all")
        return all_to_all(x, src, dst, site.group, site.balanced)

    @staticmethod
    def backward(ctx, grad):
        ctx.site.note("all_to_all", "backward")
        return all_to_all(grad, ctx.dst, ctx.src, ctx.site.group, ctx.site.balanced), None, None, None


def _in_blocks(op, x: Tensor, dim: int, blocks: int) -> Tensor:
    """`op(x, dim)` applied to each of `blocks` equal blocks of `dim` at once.

    A sequence shard flattened with the batch, (B, T/n, H) -> (B*T/n, H), is this rank's
    chunk of each of B blocks of T rows: the collective runs on the (B, T/n, H) view.
    """
    if blocks == 1:
        return op(x, dim)
    return op(x.unflatten(dim, (blocks, -1)), dim + 1).flatten(dim, dim + 1)


class Wire(NamedTuple):
    """A collective on the wire: its op (all_reduce, all_gather, reduce_scatter, all_to_all,
    send_recv) and how many times one call issues it."""

    op: str
    times: int = 1


class AxisCollective(nn.Module):
    """Base: a collective bound to the process group of one mesh axis.

    `label` is its name in the program (`all_reduce_tp_3`, see `label_collectives`): the
    watchdog's report names the node a rank waits in. `balanced`: the axis's shards are in the
    load-balanced layout (rank r holds chunks r and 2n-1-r of 2n), see the module docstring.
    A subclass declares its kind (see the module docstring); one that does not say otherwise
    saves tensors for backward, the conservative answer.
    """

    kind: ClassVar[str]
    forward_wire: ClassVar[tuple[Wire, ...]] = ()
    backward_wire: ClassVar[tuple[Wire, ...]] = ()
    saves_tensors: ClassVar[bool] = True
    overlap_entry: ClassVar[bool] = False

    balanced: bool = False  # (a class default: programs saved before the layout existed)

    def __init__(
        self, group: dist.ProcessGroup | None, axis: str, label: str = "", *, balanced: bool = False
    ):
        super().__init__()
        self.group = group
        self.axis = axis
        self.label = label
        self.balanced = balanced

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}" + (", balanced" if self.balanced else "")

    def note(self, op: str, part: str = "") -> None:
        """Tell the watchdog this rank enters `op` here (`part`: "backward", a step of the loss)."""
        detail = f"{self.label} {part}" if self.label and part else self.label or part
        watchdog.note(op, self.axis, detail, self.group)


class _Whole(AxisCollective):
    """Base: a collective on its whole input, by its autograd `function` applied as `(x, site)`."""

    function: ClassVar[type[torch.autograd.Function]]
    saves_tensors = False  # its function keeps only the module

    def forward(self, x: Tensor) -> Tensor:
        return self.function.apply(x, self)


class _OnDim(AxisCollective):
    """Base: a collective on one dim of its input, by its autograd `function` applied as
    `(x, dim, site)` to each of `blocks` equal blocks of the dim at once (`_in_blocks`)."""

    function: ClassVar[type[torch.autograd.Function]]
    saves_tensors = False  # its function keeps only the dim and the module

    def forward(self, x: Tensor, dim: int, blocks: int = 1) -> Tensor:
        return _in_blocks(lambda t, d: self.function.apply(t, d, self), x, dim, blocks)


class CopyToAxis(_Whole):
    """f: a replicated tensor entering sharded compute; gradients are summed over the axis."""

    kind = "copy_to"
    function = _Copy
    backward_wire = (Wire("all_reduce"),)
    overlap_entry = True


class AllReduce(_Whole):
    """g: partial sums leaving sharded compute (after a row split)."""

    kind = "all_reduce"
    function = _Reduce
    forward_wire = (Wire("all_reduce"),)


class AllGather(_OnDim):
    """Sequence shards -> full sequence before a column split; backward reduce-scatters."""

    kind = "all_gather"
    function = _Gather
    grad_is_partial = True  # the gradient of the gathered tensor: backward reduce-scatters it
    forward_wire = (Wire("all_gather"),)
    backward_wire = (Wire("reduce_scatter"),)
    overlap_entry = True


class GatherReplicated(_OnDim):
    """Shards -> a full tensor used by replicated compute; backward keeps the local chunk."""

    kind = "gather_replicated"
    function = _Gather
    grad_is_partial = False  # every rank has the whole gradient: backward keeps its chunk
    forward_wire = (Wire("all_gather"),)


class ReduceScatter(_OnDim):
    """Partial sums -> sequence shards after a row split (sequence parallelism)."""

    kind = "reduce_scatter"
    function = _ReduceScatter
    forward_wire = (Wire("reduce_scatter"),)
    backward_wire = (Wire("all_gather"),)


class Split(_OnDim):
    """A replicated tensor -> this rank's chunk; backward all-gathers."""

    kind = "split"
    function = _Split
    backward_wire = (Wire("all_gather"),)


class AllToAll(AxisCollective):
    """A shard on one dim -> a shard on another, without ever holding the whole tensor; backward
    is the reverse all-to-all."""

    kind = "all_to_all"
    forward_wire = (Wire("all_to_all"),)
    backward_wire = (Wire("all_to_all"),)

    def forward(self, x: Tensor, src: int, dst: int) -> Tensor:
        return _AllToAll.apply(x, src, dst, self)


class KeyValueGroup(AxisCollective):
    """Keep this rank's key/value head of a projection computed whole (GQA, fewer kv heads than
    ranks): chunk rank // replicas of the last dim's n / replicas. No communication; backward
    puts the gradient back in its place (zeros elsewhere), the input's f sums the ranks'."""

    kind = "kv_group"

    def forward(self, x: Tensor, dim: int, replicas: int) -> Tensor:
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        return x.chunk(world // replicas, dim)[rank // replicas]


class VocabParallelEmbedding(AxisCollective):
    """Embedding lookup with the vocabulary rows sharded over the axis.

    Each rank holds rows [start, start + local_vocab); ids outside give zeros, so the
    result is a partial sum that the next node reduces (all-reduce, or reduce-scatter
    under sequence parallelism).
    """

    kind = "vocab_embedding"

    def forward(self, weight: Tensor, ids: Tensor, padding_idx: int | None = None) -> Tensor:
        local_vocab = weight.shape[0]
        start = dist.get_rank(self.group) * local_vocab
        outside = (ids < start) | (ids >= start + local_vocab)
        local_ids = (ids - start).masked_fill(outside, 0)
        # the padding row gets no gradient, on the rank that holds it
        local_pad = (
            padding_idx - start
            if padding_idx is not None and 0 <= padding_idx - start < local_vocab
            else None
        )
        out = nn.functional.embedding(local_ids, weight, padding_idx=local_pad)  # (B, T, H)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, H) partial over the axis


REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # ATen's reduction codes


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits sharded on the last (vocab) dim, never gathering them.

    Per token i with target t over the global vocabulary V, in float32 at least:
        loss_i = (1 - smoothing) * (lse_i - x_it) + smoothing * (lse_i - mean_j x_ij)
    (0 where t is ignore_index), then none / mean over the valid tokens / sum, as ATen.
    A vocabulary the ranks do not divide (`vocab` < V/world * world) is zero-padded at the end:
    padded columns are masked out of every sum and get no gradient.
    """

    @staticmethod
    def forward(ctx, logits, target, site, ignore_index, reduction, smoothing, vocab):
        # logits: (N, V/world) this rank's vocab slice; target: (N,) global vocab ids
        group = site.group
        world = dist.get_world_size(group)
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        vocab = vocab or local_vocab * world
        ctx.input_dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 logits: fp32 math
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab  # (V/world,)
        if start + local_vocab > vocab:
            logits = logits.masked_fill(padding, float("-inf"))
        row_max = logits.max(dim=-1).values
        site.note("all_reduce", "row max")
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)  # (N, V/world)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        site.note("all_reduce", "softmax sum")
        dist.all_reduce(sum_exp, group=group)
        valid = target != ignore_index
        outside = (target < start) | (target >= start + local_vocab) | ~valid
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        site.note("all_reduce", "target logit")
        dist.all_reduce(target_logit, group=group)
        lse = sum_exp.log()
        losses = lse - target_logit  # (N,)
        if smoothing:
            mean_logit = shifted.masked_fill(padding, 0.0).sum(dim=-1)
            site.note("all_reduce", "logit sum")
            dist.all_reduce(mean_logit, group=group)
            mean_logit /= vocab
            losses = (1 - smoothing) * losses + smoothing * (lse - mean_logit)
        losses = losses.masked_fill(~valid, 0.0)
        count = valid.sum().clamp(min=1)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_target, outside, valid, count, padding)
        ctx.reduction, ctx.smoothing, ctx.vocab = reduction, smoothing, vocab
        if REDUCTIONS[reduction] == "none":
            return losses.to(ctx.input_dtype)
        total = losses.sum()
        return total / count if REDUCTIONS[reduction] == "mean" else total

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, outside, valid, count, padding = ctx.saved_tensors
        grad_logits = softmax.clone()
        if ctx.smoothing:
            grad_logits -= (ctx.smoothing / ctx.vocab) * (~padding).to(grad_logits.dtype)
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_target] -= (1 - ctx.smoothing) * (~outside).to(grad_logits.dtype)
        per_token = valid.to(grad_logits.dtype)  # d total / d loss_i
        if REDUCTIONS[ctx.reduction] == "mean":
            per_token = per_token / count
        grad_logits *= (per_token * grad).unsqueeze(-1)  # grad: () or (N,) for "none"
        return grad_logits.to(ctx.input_dtype), None, None, None, None, None, None


class VocabParallelCrossEntropy(AxisCollective):
    kind = "vocab_cross_entropy"
    forward_wire = (Wire("all_reduce", 3),)  # row max, softmax sum, target logit (label smoothing: 4)

    def forward(
        self,
        logits: Tensor,
        target: Tensor,
        ignore_index: int = -100,
        reduction: int = 1,
        smoothing: float = 0.0,
        vocab: int = 0,  # the true vocabulary when the shards are padded; 0: they divide it
    ) -> Tensor:
        return _VocabParallelCrossEntropy.apply(
            logits, target, self, ignore_index, reduction, smoothing, vocab
        )


def label_collectives(root: nn.Module) -> None:
    """Label each collective module under `root` with its name there (`all_reduce_tp_3`, the
    node the printed rank program shows), unless it has a label already."""
    for name, module in root.named_modules():
        if isinstance(module, AxisCollective) and not module.label:
            module.label = name


# the collectives that move data over their own axis only: a tensor's layout over every other
# axis passes through them (a vocab-parallel embedding or loss sees whole tensors over those)
LAYOUT_KEEPING: tuple[type[AxisCollective], ...] = (
    CopyToAxis,
    AllReduce,
    AllGather,
    GatherReplicated,
    ReduceScatter,
    Split,
    AllToAll,
    KeyValueGroup,
)

# every collective this module declares
_DECLARED: tuple[type[AxisCollective], ...] = (
    *LAYOUT_KEEPING,
    VocabParallelEmbedding,
    VocabParallelCrossEntropy,
)

# kind -> its module class (`ring_attention.py` adds its own)
COLLECTIVES: dict[str, type[AxisCollective]] = {c.kind: c for c in _DECLARED}
