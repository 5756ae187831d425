"""Ring attention on gloo against `scaled_dot_product_attention` of the whole sequence.

Each rank holds one chunk of the sequence; the output and the gradients of q, k and v of its
chunk must be the whole-sequence attention's (computed in float64 in the same test): causal,
full, and with the model's own mask (a causal one with some keys hidden, so whole blocks of
a row are masked), with fewer key/value heads than query heads (GQA), on 2 and 3 ranks; each
in both layouts: one contiguous chunk per rank, and the load-balanced one (chunks r and
2n-1-r of 2n, whose causal blocks are computed only where visible). The same processes check
the axis's other collectives in the load-balanced layout against slices of the whole tensor:
split, all-gather (backward: reduce-scatter), reduce-scatter and all-to-all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gloo_pool import spawn

B, H, KV, T, D = 2, 4, 2, 12, 8


def worker(rank: int, world_size: int, kind: str) -> list[float]:
    import torch.distributed as dist

    from meshplan.runtime.ring_attention import RingAttention

    torch.manual_seed(0)
    q, g = torch.randn(B, H, T, D, dtype=torch.float64), torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = torch.randn(B, KV, T, D, dtype=torch.float64), torch.randn(B, KV, T, D, dtype=torch.float64)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = H // KV
    causal = kind == "causal"
    mask = None
    if kind == "mask":  # causal, and every third key hidden from the rows after the first
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        mask[1:, ::3] = False
    want = F.scaled_dot_product_attention(
        whole[0],
        whole[1].repeat_interleave(rep, 1),
        whole[2].repeat_interleave(rep, 1),
        attn_mask=mask,
        is_causal=causal,
    )
    want.backward(g)
    errors = []
    for balanced in (False, True):
        if balanced:  # chunks rank and 2n-1-rank of 2n
            c = T // (2 * world_size)
            mine = list(range(rank * c, (rank + 1) * c)) + list(range(T - (rank + 1) * c, T - rank * c))
        else:
            mine = list(range(rank * T // world_size, (rank + 1) * T // world_size))
        local = [t[:, :, mine].float().requires_grad_() for t in (q, k, v)]
        rows = mask[mine] if mask is not None else None
        ring = RingAttention(dist.group.WORLD, "cp", balanced=balanced)
        out = ring(*local, causal, None, rows)
        out.backward(g[:, :, mine].float())
        errors += [(out.double() - want[:, :, mine]).abs().max().item()]
        errors += [
            (a.grad.double() - b.grad[:, :, mine]).abs().max().item()
            for a, b in zip(local, whole, strict=True)
        ]
    return errors + balanced_collectives(rank, world_size)


def balanced_collectives(rank: int, n: int) -> list[float]:
    """The balanced split, gather, reduce-scatter and all-to-all against slices of x: rank r's
    shard of a dim is chunks r and 2n-1-r of 2n, in that order."""
    import torch.distributed as dist

    from meshplan.runtime.collectives import AllGather, AllToAll, ReduceScatter, Split

    def mine(size: int) -> list[int]:
        c = size // (2 * n)
        return list(range(rank * c, (rank + 1) * c)) + list(range(size - (rank + 1) * c, size - rank * c))

    group = dist.group.WORLD
    x = torch.randn(B, T, 2 * n * 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    local = Split(group, "cp", balanced=True)(x, 1)
    errors = [(local - x[:, mine(T)]).abs().max().item()]
    shard = x[:, mine(T)].clone().requires_grad_()
    gathered = AllGather(group, "cp", balanced=True)(shard, 1)
    gathered.backward(g)  # every rank's g: the reduce-scatter sums n of them
    errors += [(gathered - x).abs().max().item(), (shard.grad - n * g[:, mine(T)]).abs().max().item()]
    scattered = ReduceScatter(group, "cp", balanced=True)(x, 1)
    errors += [(scattered - n * x[:, mine(T)]).abs().max().item()]
    heads = AllToAll(group, "cp", balanced=True)(
        x[:, mine(T)], 1, 2
    )  # the whole sequence, my chunks of dim 2
    errors += [(heads - x[:, :, mine(x.shape[2])]).abs().max().item()]
    return errors


@pytest.mark.parametrize(("world_size", "kind"), [(2, "causal"), (3, "causal"), (2, "full"), (3, "mask")])
def test_ring_attention_is_whole_sequence_attention(world_size: int, kind: str) -> None:
    for errors in spawn(worker, world_size, (kind,)):
        assert max(errors) < 1e-5, errors  # output, dq, dk, dv of this rank's chunk, both layouts
