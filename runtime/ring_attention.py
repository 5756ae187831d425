"""Ring attention: queries stay, key/value blocks travel around the context-parallel ring.

Each of the n ranks of the axis holds one chunk of the sequence: its queries, keys and
values. In n steps every rank attends its queries to every rank's block, the blocks moving
one rank on (send to r + 1, receive from r - 1) while the current block is computed, and
the partial results merge by an online softmax (a running log-sum-exp). Backward walks the
ring again with each block's key/value gradients travelling beside it, accumulated by every
rank they visit and delivered home by one last step. A rank never holds more than two
blocks, whatever the sequence length; the all-gather variant holds all n.

    step s on rank r holds the block of rank (r - s) mod n
    causal: a block from a later rank is masked whole (skipped), its own block triangularly

Causal attention over contiguous chunks gives the last rank n blocks of work and rank 0 one.
Under the load-balanced layout (`balanced`, the compiler's default for causal context
parallelism) the sequence is cut into 2n chunks and rank r holds chunks r and 2n-1-r, so
every rank does the same work at every step (`visible`, c = T / 2n, the block's chunks s and
2n-1-s against the rank's r and 2n-1-r):

    src == r   chunk r against itself and chunk 2n-1-r against both, causal within: 3 c x c
               (chunk r never sees chunk 2n-1-r: that quarter is skipped)
    src <  r   every query row, the block's first chunk only (c columns): 2c x c
    src >  r   the rank's second chunk only (c rows), every column: c x 2c

Each block is one fused attention kernel where the device has one (`block_kernel`: the
CPU's flash kernel, in every float dtype and on meta; FlashAttention on CUDA in 16 bits),
which gives the block's log-sum-exp for the merge; its backward is the kernel's own, fed
the merged output and log-sum-exp so it recomputes the whole softmax's probabilities. A
model's own mask (and CUDA in float32) takes plain matmuls in float32 (float64 for float64
inputs) instead, holding one
block's scores at a time. Under `balanced` the own-block piece whose queries follow its keys
is cut in two, so every causal piece is causal from its top-left corner, as kernels take it.
The messages are `isend`/`irecv` on the axis's group. The whole-sequence result equals
`scaled_dot_product_attention` with `is_causal`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import COLLECTIVES, AxisCollective, Wire


class RingAttention(AxisCollective):
    """`scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)` over a sequence
    cut into one contiguous chunk per rank of the axis, or under `balanced` into chunks r and
    2n-1-r of 2n (q: (B, H, T/n, D); k, v: (B, H_kv, T/n, D)). Under GQA (H_kv dividing H)
    the blocks travel with their key/value heads only and are repeated to the query heads
    where a step computes, so the ring moves H_kv / H of what repeated heads would cost; the
    gradients of a head's H / H_kv repeats are summed before they travel."""

    kind = "ring_attention"
    # k and v around the ring; backward also their gradients (n - 1 sends of a rank's block each)
    forward_wire = (Wire("send_recv", 2),)
    backward_wire = (Wire("send_recv", 4),)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        scale: float | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """`mask`: the model's own attention mask, this rank's query rows over the whole
        sequence's keys ((.., T/n, T), boolean (True attends) or added to the scores)."""
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return _RingFunction.apply(q, k, v, causal, scale, mask, self)


COLLECTIVES[RingAttention.kind] = RingAttention


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        scale: float,
        mask: Tensor | None,
        owner: RingAttention,
    ):
        ring = _RingPlace(owner)
        kernel = block_kernel(q, mask)
        acc = _accumulating(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
        block = [k.contiguous(), v.contiguous()]
        t, rep = q.shape[-2], q.shape[1] // k.shape[1]  # rep: query heads per key/value head
        extras: list[list[tuple]] = []  # a fused kernel's per-piece facts its backward takes
        for step in range(ring.n):
            src = (ring.rank - step) % ring.n
            pending = ring.shift(block, "forward") if step < ring.n - 1 else None
            extras.append([])
            for piece in visible(ring.rank, src, ring.n, t, causal, owner.balanced):
                rows, cols, within = piece
                kc, vc = _repeated(block[0][..., cols, :], rep), _repeated(block[1][..., cols, :], rep)
                if kernel is not None:
                    block_out, block_lse, extra = kernel.forward(q[..., rows, :], kc, vc, within, scale)
                    extras[-1].append(extra)
                else:
                    block_out, block_lse = _math_forward(
                        q, kc, vc, scale, piece, _mask_of(mask, src, piece, owner)
                    )
                _merge(out, lse, rows, block_out, block_lse)
            if pending is not None:
                block = pending()
        result = out.to(q.dtype)
        # a kernel's backward reads the output in the inputs' dtype; the matmul path in lse's
        kept = result if kernel is not None else out
        ctx.save_for_backward(q, k, v, kept, lse, *([mask] if mask is not None else []))
        ctx.causal, ctx.scale, ctx.owner, ctx.kernel, ctx.extras = causal, scale, owner, kernel, extras
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, *masks = ctx.saved_tensors
        mask = masks[0] if masks else None
        kernel: BlockKernel | None = ctx.kernel
        lse = torch.where(torch.isinf(lse), 0.0, lse)  # a row that attends nowhere has no gradient
        ring = _RingPlace(ctx.owner)
        if kernel is not None:
            grad = grad.contiguous()
        else:
            grad = grad.to(lse.dtype)
            delta = (grad * out).sum(-1, keepdim=True)
        acc = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        zeros = functools.partial(torch.zeros, dtype=acc, device=k.device)  # on k's device
        block = [k.contiguous(), v.contiguous(), zeros(k.shape), zeros(v.shape)]
        t, rep = q.shape[-2], q.shape[1] // k.shape[1]
        for step in range(ring.n):
            src = (ring.rank - step) % ring.n
            kb, vb, dk, dv = block
            pieces = visible(ring.rank, src, ring.n, t, ctx.causal, ctx.owner.balanced)
            for i, piece in enumerate(pieces):
                rows, cols, within = piece
                kc, vc = _repeated(kb[..., cols, :], rep), _repeated(vb[..., cols, :], rep)
                if kernel is not None:
                    gq, gk, gv = kernel.backward(
                        grad[..., rows, :],
                        q[..., rows, :],
                        kc,
                        vc,
                        out[..., rows, :],
                        lse[..., rows].contiguous(),
                        within,
                        ctx.scale,
                        ctx.extras[step][i],
                    )
                else:
                    piece_mask = _mask_of(mask, src, piece, ctx.owner)
                    gq, gk, gv = _math_backward(grad, q, kc, vc, lse, delta, ctx.scale, piece, piece_mask)
                dq[..., rows, :] += gq
                dk[..., cols, :] += _folded(gk, rep)
                dv[..., cols, :] += _folded(gv, rep)
            # the last step only takes each block's gradients home
            moving = block if step < ring.n - 1 else [dk, dv]
            received = ring.shift(moving, "backward")()
            block = received if step < ring.n - 1 else [kb, vb, *received]
        dk, dv = block[2], block[3]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _accumulating(dtype: torch.dtype) -> torch.dtype:
    """Sums and softmax statistics in float32, or float64 for float64 inputs (`verify`)."""
    return torch.promote_types(dtype, torch.float32)


def _merge(out: Tensor, lse: Tensor, rows: slice, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's attention of query `rows` into the running output and log-sum-exp
    (the online softmax). Rows a mask hides from the whole block add nothing (and no NaN)."""
    merged = torch.logaddexp(lse[..., rows], block_lse)
    keep = torch.where(torch.isinf(merged), 0.0, torch.exp(lse[..., rows] - merged))
    add = torch.where(torch.isinf(merged), 0.0, torch.exp(block_lse - merged))
    out[..., rows, :] = out[..., rows, :] * keep.unsqueeze(-1) + block_out.to(out.dtype) * add.unsqueeze(-1)
    lse[..., rows] = merged


def _math_forward(q, kc, vc, scale: float, piece: Piece, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """One block by plain matmuls (float32 at least): its output (normalized by its own sum) and
    log-sum-exp."""
    scores = _scores(q[..., piece[0], :], kc, scale, piece, mask)
    block_lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(block_lse), 0.0, block_lse)
    return torch.exp(scores - finite.unsqueeze(-1)) @ vc.to(scores.dtype), block_lse


def _math_backward(grad, q, kc, vc, lse, delta, scale: float, piece: Piece, mask: Tensor | None):
    """One block's share of dq, and its (repeated-head) dk, dv, from the whole output's
    log-sum-exp and `delta` (rowsum of grad x out): the probabilities recomputed in `lse`'s dtype."""
    rows = piece[0]
    acc = lse.dtype
    qr, gr = q[..., rows, :].to(acc), grad[..., rows, :]
    kc, vc = kc.to(acc), vc.to(acc)
    p = torch.exp(_scores(qr, kc, scale, piece, mask) - lse[..., rows].unsqueeze(-1))
    ds = p * (gr @ vc.transpose(-1, -2) - delta[..., rows, :]) * scale
    return ds @ kc, ds.transpose(-1, -2) @ qr, p.transpose(-1, -2) @ gr


class BlockKernel:
    """A device's fused attention for one block (no mask, causal top-left within the block or
    none): `forward` gives the block's output and log-sum-exp (float32 at least) and what its backward
    needs again; `backward` takes the whole output and log-sum-exp (so the probabilities it
    recomputes are the merged softmax's) and gives the block's dq, dk, dv."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, tuple]:
        raise NotImplementedError

    def backward(
        self, grad, q, k, v, out, lse, causal: bool, scale: float, extra: tuple
    ) -> tuple[Tensor, ...]:
        raise NotImplementedError


class _CpuFlash(BlockKernel):
    """The CPU's flash kernel (every float dtype; on meta, what `estimate` walks)."""

    def forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, ()

    def backward(self, grad, q, k, v, out, lse, causal, scale, extra):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=scale
        )


class _CudaFlash(BlockKernel):
    """FlashAttention on CUDA (16-bit inputs, head size at most 256)."""

    def forward(self, q, k, v, causal, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, grad, q, k, v, out, lse, causal, scale, extra):
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )


def block_kernel(q: Tensor, mask: Tensor | None) -> BlockKernel | None:
    """The fused kernel for blocks of `q`'s device and dtype, or None for the float32 matmul
    path (a model's own mask; CUDA in float32 or with heads over 256 features)."""
    if mask is not None:
        return None
    if q.device.type in ("cpu", "meta"):
        return _CpuFlash()
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        return _CudaFlash()
    return None


Piece = tuple[slice, slice, bool]  # query rows, key columns, causal within (by local index)


def visible(rank: int, src: int, n: int, t: int, causal: bool, balanced: bool) -> list[Piece]:
    """The scores rank `rank` (of n) computes against the key block of rank `src`, each rank
    holding `t` positions: rectangles of (query rows, key columns, causal), where causal masks
    a column whose local index exceeds the row's (positions increase with the local index in
    both layouts). Rectangles masked whole are left out. Under `balanced` each rank holds
    chunks r and 2n-1-r of 2n (see the module docstring)."""
    whole = slice(0, t)
    if not causal:
        return [(whole, whole, False)]
    if not balanced:  # contiguous chunks: an earlier rank's block whole, a later one's not at all
        return [(whole, whole, src == rank)] if src <= rank else []
    first, second = slice(0, t // 2), slice(t // 2, t)
    if src == rank:  # our first chunk never sees our second: a quarter of the block skipped
        return [(first, first, True), (second, first, False), (second, second, True)]
    if src < rank:  # its chunk src precedes both of ours; its chunk 2n-1-src follows both
        return [(whole, first, False)]
    return [(second, whole, False)]  # our chunk 2n-1-r follows both of its chunks


def _repeated(x: Tensor, rep: int) -> Tensor:
    """Key/value heads repeated to the query heads they serve (GQA): (B, H_kv, .., D) -> (B, H, .., D)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _folded(x: Tensor, rep: int) -> Tensor:
    """The gradient of `_repeated`: each key/value head's `rep` query-head gradients summed."""
    return x if rep == 1 else x.unflatten(1, (-1, rep)).sum(2)


def _mask_of(mask: Tensor | None, src: int, piece: Piece, owner: RingAttention) -> Tensor | None:
    """The model's mask for the scores `piece` computes: its rows of this rank's queries (unless
    broadcast), its columns of the keys in rank `src`'s block."""
    if mask is None:
        return None
    n = dist.get_world_size(owner.group)
    rows, cols, _ = piece
    if owner.balanced:  # the block is chunks src and 2n-1-src of 2n
        width = mask.shape[-1] // (2 * n)
        first, second = src * width, (2 * n - 1 - src) * width
        block = torch.cat([mask[..., first : first + width], mask[..., second : second + width]], -1)
    else:
        width = mask.shape[-1] // n
        block = mask[..., src * width : (src + 1) * width]
    if block.shape[-2] != 1:
        block = block[..., rows, :]
    return block[..., cols]


def _scores(q: Tensor, k: Tensor, scale: float, piece: Piece, mask: Tensor | None = None) -> Tensor:
    acc = _accumulating(q.dtype)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.to(acc)
    rows, cols, causal = piece
    if causal:  # within the rank's own block: a key after the query is hidden
        at = scores.device  # on the scores' device (a CPU mask cannot fill a CUDA or meta tensor)
        later = (
            torch.arange(cols.start, cols.stop, device=at)[None, :]
            > torch.arange(rows.start, rows.stop, device=at)[:, None]
        )
        scores = scores.masked_fill(later, -math.inf)
    return scores


class _RingPlace:
    """This rank's place on the ring of `owner`'s group, and the one-step shift of a block."""

    def __init__(self, owner: RingAttention):
        assert owner.group is not None, "a ring of one rank is never compiled (the axis has one rank)"
        self.owner = owner
        self.group = owner.group
        self.n = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.n)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.n)

    def shift(self, tensors: list[Tensor], part: str):
        """Send `tensors` to the next rank and receive the previous rank's; returns a function
        that waits and gives the received ones (the caller computes in between)."""
        buffers = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in buffers]
        self.owner.note("ring send/recv", part)
        if tensors[0].is_meta:  # `meshplan estimate`'s walk: a fake group has no coalescing backend
            works = [op.op(op.tensor, op.peer, op.group) for op in ops]
        else:
            works = dist.batch_isend_irecv(ops)

        def wait() -> list[Tensor]:
            for w in works:
                w.wait()
            return buffers

        return wait
