"""`runtime/linears.py`: linears grouped on one input, whose backward issues the input
gradient's reduction before computing the weight gradients.

On one process the group must compute what separate `F.linear` calls compute, forward and
backward (float64, biases and a frozen weight included). On 2 gloo ranks, behind f (all-reduce
backward) and behind sequence parallelism's all-gather (reduce-scatter backward), the gradients
must be those of the ungrouped program, the reduction must be issued (asynchronously) before
any weight gradient exists, and the entry must not reduce a second time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gloo_pool import spawn

from meshplan.runtime.linears import Linears

N, T, H = 2, 6, 8
OUT = (12, 4, 4)


def _weights(dtype=torch.float64):
    torch.manual_seed(0)
    ws = [torch.randn(o, H, dtype=dtype, requires_grad=True) for o in OUT]
    bs = [torch.randn(OUT[0], dtype=dtype, requires_grad=True), None, torch.randn(OUT[2], dtype=dtype)]
    return ws, bs


def test_the_group_computes_what_separate_linears_compute():
    ws, bs = _weights()
    ws[1].requires_grad_(False)  # a frozen weight: no gradient asked for
    x = torch.randn(N, T, H, dtype=torch.float64, requires_grad=True)
    grads = [torch.randn(N, T, o, dtype=torch.float64) for o in OUT]

    args = [a for pair in zip(ws, bs, strict=True) for a in pair]
    outs = Linears()(x, *args)
    torch.autograd.backward(outs, grads)
    got = [x.grad, *(w.grad for w in ws), bs[0].grad]

    for t in (x, *ws, bs[0]):
        t.grad = None
    want_outs = [F.linear(x, w, b) for w, b in zip(ws, bs, strict=True)]
    torch.autograd.backward(want_outs, grads)
    want = [x.grad, *(w.grad for w in ws), bs[0].grad]

    for a, b in zip(outs, want_outs, strict=True):
        torch.testing.assert_close(a, b)
    assert got[2] is None and want[2] is None  # the frozen weight
    for a, b in zip(got, want, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b)
    assert bs[2].grad is None  # a bias that needs no gradient gets none


def worker(rank: int, world_size: int, entry_kind: str) -> dict:
    import torch.distributed as dist

    from meshplan.runtime import collectives

    group = dist.group.WORLD
    entry = (
        collectives.CopyToAxis(group, "tp") if entry_kind == "copy_to" else collectives.AllGather(group, "tp")
    )
    torch.manual_seed(1 + rank)  # each rank's own shard of the weights and of x under SP
    ws = [torch.randn(o, H, requires_grad=True) for o in OUT]
    x = torch.randn(N, T // (1 if entry_kind == "copy_to" else world_size), H, requires_grad=True)
    torch.manual_seed(0)
    grads = [torch.randn(N, T, o) for o in OUT]

    events: list[str] = []
    real_all_reduce, real_reduce_scatter = dist.all_reduce, collectives.reduce_scatter_single

    def all_reduce(*args, async_op=False, **kwargs):
        events.append(f"all_reduce async={async_op}")
        return real_all_reduce(*args, async_op=async_op, **kwargs)

    def reduce_scatter(*args, async_op=False, **kwargs):
        events.append(f"reduce_scatter async={async_op}")
        return real_reduce_scatter(*args, async_op=async_op, **kwargs)

    def run(grouped: bool) -> list[torch.Tensor]:
        for t in (x, *ws):
            t.grad = None
        inp = entry(x) if entry_kind == "copy_to" else entry(x, 1)
        if grouped:
            outs = Linears()(inp, *(a for w in ws for a in (w, None)))
        else:
            outs = tuple(F.linear(inp, w) for w in ws)
        events.clear()
        hooks = [w.register_hook(lambda g, i=i: events.append(f"weight {i}")) for i, w in enumerate(ws)]
        collectives.dist.all_reduce, collectives.reduce_scatter_single = all_reduce, reduce_scatter
        try:
            torch.autograd.backward(outs, grads)
        finally:
            collectives.dist.all_reduce, collectives.reduce_scatter_single = (
                real_all_reduce,
                real_reduce_scatter,
            )
            for h in hooks:
                h.remove()
        return [x.grad.clone(), *(w.grad.clone() for w in ws)]

    plain, plain_events = run(grouped=False), list(events)
    grouped = run(grouped=True)
    return {
        "error": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(grouped, plain, strict=True)),
        "plain": plain_events,
        "grouped": list(events),
    }


@pytest.mark.parametrize("entry_kind, op", [("copy_to", "all_reduce"), ("all_gather", "reduce_scatter")])
def test_the_input_gradient_is_reduced_while_the_weight_gradients_are_computed(entry_kind, op):
    for r in spawn(worker, 2, (entry_kind,)):
        assert r["error"] < 1e-6  # fp32: the same sums in another order
        # ungrouped: every weight gradient first, then the entry's blocking reduction
        assert r["plain"][-1] == f"{op} async=False", r["plain"]
        # grouped: the reduction issued before any weight gradient exists, and only once
        assert r["grouped"][0] == f"{op} async=True", r["grouped"]
        assert sorted(r["grouped"][1:]) == ["weight 0", "weight 1", "weight 2"], r["grouped"]
