"""Linear layers that read one input, with a backward that lets its reduction overlap.

Under tensor parallelism the column-split linears of a block (q, k and v; gate and up; the LM
head) read the output of one entry collective: f (identity forward, all-reduce backward) or,
under sequence parallelism, the all-gather whose backward is a reduce-scatter. Autograd runs
each linear's backward as one node computing both its input and its weight gradient, and the
entry's reduction only after all of them, so nothing overlaps it. Megatron-LM's answer, written
as one autograd node for the group:

    backward of Linears(x, w1, b1, ..., wn, bn):
        grad_x = sum_i grad_i @ w_i             the input gradient first
        issue the entry's reduction of grad_x   (`collectives.issue_backward`, async)
        grad_w_i = grad_i^T x, grad_b_i          while it runs
    backward of the entry: wait for it          the reduced gradient's first use

The wait is in the entry's own backward, after the weight gradients have been accumulated (and a
data-parallel bucket launched from their hooks), not at the end of this node. When the input is
not an entry's output (a view of it, a region recomputing it with another layout) nothing is
issued and the entry reduces as before; the values are the same either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .collectives import issue_backward


class _Linears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, entry: object, *weights_and_biases: Tensor | None):
        weights: list[Tensor] = list(weights_and_biases[0::2])  # type: ignore[arg-type]
        biases = weights_and_biases[1::2]
        ctx.entry = entry
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x: Tensor | None = None
        if needs[0]:
            grad_x = grads[0] @ weights[0]  # (..., out) @ (out, in) -> (..., in)
            for g, w in zip(grads[1:], weights[1:], strict=True):
                grad_x.add_(g @ w)
            if ctx.entry is not None and issue_backward(ctx.entry, grad_x):
                ctx.entry = None  # issued once (a zero-bubble W pass may run this node again)
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        out: list[Tensor | None] = [grad_x, None]
        for i, g in enumerate(grads):
            g2 = g.reshape(-1, g.shape[-1])  # (N, out)
            out.append(g2.t().mm(rows) if needs[2 + 2 * i] else None)
            out.append(g2.sum(0) if ctx.has_bias[i] and needs[3 + 2 * i] else None)
        return tuple(out)


class Linears(nn.Module):
    """`Linears()(x, w1, b1, w2, b2, ...)` -> (x w1^T + b1, x w2^T + b2, ...): the linears a
    compiled program groups on one entry collective's output (`compiler/passes/overlap.py`)."""

    def forward(self, x: Tensor, *weights_and_biases: Tensor | None) -> tuple[Tensor, ...]:
        return _Linears.apply(x, x.grad_fn, *weights_and_biases)
