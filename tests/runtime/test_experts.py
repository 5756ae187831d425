"""Expert parallelism's runtime unit (`runtime/experts.py`) against the model's own experts module.

Two gloo processes, one launch: each holds half of the example MoE model's experts and half
of the tokens, and its `ExpertParallel` output and gradients (tokens, routing
weights, its experts' weights) must be those of the whole experts module on every token, in
float64 to the last bit. The same launch routes every token to the experts of rank 0, so
rank 1's experts get nothing: its backward still joins the reverse all-to-alls (no hang)
and its experts' gradients are zero. `sent_bytes` adds up to what the ledger predicts.

Under a capacity (`capacity_factor`) the same launch checks the unit against a reference
written here, from the routing alone: each rank's pairs queued by slot, then by token, in a
plain loop, and an expert keeping its first C = ceil(N k factor / E); the whole experts
module on every token with the dropped pairs' weights at 0. A capacity of N (nothing can
drop) must give the dropless numbers.
"""

from __future__ import annotations

import pytest
import torch
from gloo_pool import spawn

from meshplan.examples.models import moe
from meshplan.runtime.experts import ExpertParallel, expert_capacity, local_experts

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


def _kept(index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(N, k) which pairs the policy keeps, by hand: first choices of every token in token
    order, then second choices; each expert takes pairs while it has room."""
    kept = torch.zeros(index.shape, dtype=torch.bool)
    taken = [0] * num_experts
    for j in range(index.shape[1]):
        for t in range(index.shape[0]):
            e = int(index[t, j])
            if taken[e] < capacity:
                kept[t, j], taken[e] = True, taken[e] + 1
    return kept


# case -> (routing to rank 0's experts only, capacity_factor); 2.0 is C = N k / 2 = 12 = N here:
# an expert never gets more than N pairs (a token's k experts differ), so nothing drops
CASES = {
    "spread": (False, None),
    "to_rank_0": (True, None),
    "capacity": (False, 1.0),
    "capacity_to_rank_0": (True, 1.0),
    "capacity_of_n": (False, 2.0),
}


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    model = moe.build().double()
    path = "layers.0.mlp.experts"
    experts = model.get_submodule(path)
    names = ("gate_up_proj", "down_proj")
    num = experts.num_experts
    local = num // world
    units = {
        factor: ExpertParallel(
            None, "ep", path=path, num_experts=num, param_names=names, capacity_factor=factor
        ).bind(dist.group.WORLD, model)
        for factor in (None, 1.0, 2.0)
    }
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    out: dict = {}
    for case, (to_rank_0, factor) in CASES.items():
        unit = units[factor]
        x, index, weights = _routing(world, num, 64, to_rank_0=to_rank_0)
        probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        kept = torch.ones(index.shape, dtype=torch.bool)
        if factor is not None:  # each rank's tokens are a routing group of their own
            capacity = expert_capacity(TOKENS, K, num, factor)
            kept = torch.cat(
                [_kept(index[r * TOKENS : (r + 1) * TOKENS], num, capacity) for r in range(world)]
            )
        out[case + "_kept"] = int(kept[mine].sum())
        # the whole module on every token, the dropped pairs weighed 0
        xw, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        experts.zero_grad()
        (experts(xw, index, ww * kept) * probe).sum().backward()
        # this rank's tokens and experts; the loss is the mean of the ranks' (as data parallel)
        xl, wl = x[mine].clone().requires_grad_(), weights[mine].clone().requires_grad_()
        params = [
            getattr(experts, n).detach()[rank * local : (rank + 1) * local].clone().requires_grad_()
            for n in names
        ]
        y = unit(xl, index[mine], wl, *params)
        (y * probe[mine]).sum().backward()
        want = experts(x, index, weights * kept).detach()
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
    out["tokens_routed"] = units[None].take_tokens().tolist()
    out["sent_bytes"] = units[None].sent_bytes
    out["dropped"] = {f: units[f].take_dropped().tolist() for f in (None, 1.0, 2.0)}
    out["capacity_sent_bytes"] = units[1.0].sent_bytes
    return out


@pytest.mark.slow
def test_expert_parallel_unit_is_the_experts_module_split_over_two_ranks():
    results = spawn(_worker, 2)
    for rank, r in enumerate(results):
        for case in CASES:
            errors = {k: v for k, v in r[case].items() if k != "expert_grad_norm"}
            # under a capacity the experts run on other row blocks (the buffers) than the whole
            # module does, so a matmul may round in another order: within 1e-14 of float64
            limit = 0.0 if CASES[case][1] is None else 1e-14
            assert all(v <= limit for v in errors.values()), (rank, case, errors)
    assert results[1]["to_rank_0"]["expert_grad_norm"] == 0.0  # its experts got no token
    assert results[0]["to_rank_0"]["expert_grad_norm"] > 0.0
    # every (token, slot) pair counted once, on the rank whose token it is: 2 cases x 12 tokens x 2
    assert sum(sum(r["tokens_routed"]) for r in results) == 2 * 2 * TOKENS * K
    # per case, over both ranks: the counts (4 int64 each), then the dispatch, the combine and
    # both reversed, each the ranks' N k rows of 64 float64 (the ledger's 4 rows of N k per rank)
    rows = 2 * TOKENS * K * 64 * 8
    assert sum(r["sent_bytes"] for r in results) == 2 * (2 * 4 * 8 + 4 * rows)
    # capacity 1.0: C = ceil(12 x 2 x 1.0 / 4) = 6 pairs per expert and rank. Routed to rank 0's
    # 2 experts, each gets 12 pairs of each rank's 12 tokens and keeps 6: 12 of 24 dropped
    for r in results:
        assert r["capacity_to_rank_0_kept"] == 12 and sum(r["dropped"][None]) == 0
        assert r["capacity_of_n_kept"] == TOKENS * K and sum(r["dropped"][2.0]) == 0
        dropped = r["dropped"][1.0]  # both capacity-1.0 cases, counted where the token is
        assert sum(dropped) == 2 * TOKENS * K - r["capacity_kept"] - r["capacity_to_rank_0_kept"] > 12
    # fixed buffers: per case and rank, E C = 24 rows of 64 float64 each way, and back in backward
    assert [r["capacity_sent_bytes"] for r in results] == [2 * 4 * 24 * 64 * 8] * 2
