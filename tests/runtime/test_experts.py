"""Expert parallelism's runtime unit (`runtime/experts.py`) against the model's own experts module.

Two gloo processes, one launch: each holds half of the example MoE model's experts and half
of the tokens, and its `ExpertParallel` output and gradients (tokens, routing
weights, its experts' weights) must be those of the whole experts module on every token, in
float64 to the last bit. The same launch routes every token to the experts of rank 0, so
rank 1's experts get nothing: its backward still joins the reverse all-to-alls (no hang)
and its experts' gradients are zero. `sent_bytes` adds up to what the ledger predicts.
"""

from __future__ import annotations

import pytest
import torch

from meshplan.examples.models import moe
from meshplan.runtime.experts import ExpertParallel, local_experts
from meshplan.runtime.launch import spawn

TOKENS, K = 12, 2  # per rank


def test_local_experts_are_the_module_with_fewer_experts_and_no_weights():
    model = moe.build()
    experts = model.layers[0].mlp.experts
    local = local_experts(experts, 2)
    assert local.num_experts == 2 and experts.num_experts == 4
    assert all(p.device.type == "meta" for p in local.parameters())  # the graph passes this rank's
    assert experts.gate_up_proj.device.type == "cpu"


def _routing(world: int, num_experts: int, hidden: int, *, to_rank_0: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * TOKENS, hidden, generator=g, dtype=torch.float64)
    logits = torch.randn(world * TOKENS, num_experts, generator=g, dtype=torch.float64)
    if to_rank_0:  # only the first half of the experts: rank 0's
        logits[:, num_experts // 2 :] = -1e9
    weights, index = logits.softmax(-1).topk(K, -1)
    return x, index, weights / weights.sum(-1, keepdim=True)


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    model = moe.build().double()
    path = "layers.0.mlp.experts"
    experts = model.get_submodule(path)
    names = ("gate_up_proj", "down_proj")
    local = experts.num_experts // world
    unit = ExpertParallel(None, "ep", path=path, num_experts=experts.num_experts, param_names=names)
    unit = unit.bind(dist.group.WORLD, model)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    out: dict = {}
    for case in ("spread", "to_rank_0"):
        x, index, weights = _routing(world, experts.num_experts, 64, to_rank_0=case == "to_rank_0")
        probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        # the whole module on every token
        xw, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        experts.zero_grad()
        (experts(xw, index, ww) * probe).sum().backward()
        # this rank's tokens and experts; the loss is the mean of the ranks' (as data parallel)
        xl, wl = x[mine].clone().requires_grad_(), weights[mine].clone().requires_grad_()
        params = [
            getattr(experts, n).detach()[rank * local : (rank + 1) * local].clone().requires_grad_()
            for n in names
        ]
        y = unit(xl, index[mine], wl, *params)
        (y * probe[mine]).sum().backward()
        want = experts(x, index, weights).detach()
        out[case] = {
            "out": (y.detach() - want[mine]).abs().max().item(),
            "tokens": (xl.grad - xw.grad[mine]).abs().max().item(),
            "weights": (wl.grad - ww.grad[mine]).abs().max().item(),
            # the unit's expert gradient is its share of the ranks' mean: times `world`, the sum
            "experts": max(
                (p.grad * world - getattr(experts, n).grad[rank * local : (rank + 1) * local])
                .abs()
                .max()
                .item()
                for n, p in zip(names, params, strict=True)
            ),
            "expert_grad_norm": sum(float(p.grad.norm()) for p in params),
        }
    out["tokens_routed"] = unit.take_tokens().tolist()
    out["sent_bytes"] = unit.sent_bytes
    return out


@pytest.mark.slow
def test_expert_parallel_unit_is_the_experts_module_split_over_two_ranks():
    results = spawn(_worker, 2)
    for rank, r in enumerate(results):
        for case in ("spread", "to_rank_0"):
            errors = {k: v for k, v in r[case].items() if k != "expert_grad_norm"}
            assert all(v == 0.0 for v in errors.values()), (rank, case, errors)
    assert results[1]["to_rank_0"]["expert_grad_norm"] == 0.0  # its experts got no token
    assert results[0]["to_rank_0"]["expert_grad_norm"] > 0.0
    # every (token, slot) pair counted once, on the rank whose token it is: 2 cases x 12 tokens x 2
    assert sum(sum(r["tokens_routed"]) for r in results) == 2 * 2 * TOKENS * K
    # per case, over both ranks: the counts (4 int64 each), then the dispatch, the combine and
    # both reversed, each the ranks' N k rows of 64 float64 (the ledger's 4 rows of N k per rank)
    rows = 2 * TOKENS * K * 64 * 8
    assert sum(r["sent_bytes"] for r in results) == 2 * (2 * 4 * 8 + 4 * rows)
