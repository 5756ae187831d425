"""Ring attention's block kernels without a ring, on any device: a sequence's attention
computed piece by piece with the device's fused kernel (`block_kernel`), merged by
log-sum-exp, and its backward taken piece by piece from the merged output, held to
`scaled_dot_product_attention` of the whole in float64 and its autograd. The pieces are the
load-balanced layout's own block (causal within two of them) and a block of keys cut in two.
Used by `runtime/test_ring_blocks.py` (the CPU) and `gpu/test_gpu_ring_blocks.py` (CUDA)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from meshplan.runtime.ring_attention import _accumulating, _merge, block_kernel, visible

B, H, T, D = 2, 3, 16, 8


def pieces_attention(q, k, v, pieces):
    """Output and q/k/v gradients of attention over `pieces` (query rows, key columns, causal
    within) with the kernel for q's device, against SDPA of the whole."""
    kernel = block_kernel(q, None)
    assert kernel is not None
    scale = 1 / math.sqrt(D)
    acc = _accumulating(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
    extras = []
    for rows, cols, within in pieces:
        block_out, block_lse, extra = kernel.forward(
            q[..., rows, :], k[..., cols, :], v[..., cols, :], within, scale
        )
        extras.append(extra)
        _merge(out, lse, rows, block_out, block_lse)
    grad = torch.randn(q.shape, dtype=q.dtype, device=q.device, generator=None)
    whole = out.to(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v))
    for (rows, cols, within), extra in zip(pieces, extras, strict=True):
        gq, gk, gv = kernel.backward(
            grad[..., rows, :], q[..., rows, :], k[..., cols, :], v[..., cols, :],
            whole[..., rows, :], lse[..., rows].contiguous(), within, scale, extra,
        )  # fmt: skip
        dq[..., rows, :] += gq
        dk[..., cols, :] += gk
        dv[..., cols, :] += gv
    return whole, (dq, dk, dv), grad


def check(device: str, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype, device=device) for _ in range(3))
    # the load-balanced layout's own block (causal) and a block of an earlier rank's keys
    for causal, pieces in (
        (True, visible(0, 0, 2, T, True, True)),
        (False, [(slice(0, T), slice(0, T // 2), False), (slice(0, T), slice(T // 2, T), False)]),
    ):
        if causal:  # the own block's pieces are causal within; queries after the keys see them
            assert [p[2] for p in pieces] == [True, False, True]
        out, grads, grad = pieces_attention(q, k, v, pieces)
        ref = [t.detach().double().clone().requires_grad_() for t in (q, k, v)]
        # the own block: chunk r's queries never see chunk 2n-1-r's keys, which sit after them
        want = F.scaled_dot_product_attention(*ref, is_causal=causal)
        want.backward(grad.double())
        assert (out.double() - want).abs().max().item() < tol
        for got, r in zip(grads, ref, strict=True):
            assert (got.double() - r.grad).abs().max().item() < tol
