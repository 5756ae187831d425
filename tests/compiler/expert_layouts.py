"""The example MoE model (examples/models/moe.py) with its experts' matrices laid out as other
codebases lay them out, for tensor parallelism inside experts (`compiler/expert_tensor_rules.py`):

- `grouped`: separate gate `w1`, up `w3` (E, H, I) and down `w2` (E, I, H), stored (in, out) and
  applied as `x @ w` (a grouped-matmul layout), I = 32 != H = 64;
- `interleaved`: gate and up fused in one matrix with their features alternating (gate at even
  rows, up at odd), which a split in two halves cannot cut: refused;
- `biased`: Mixtral's layout with a bias after each matrix (the down bias is added after the row
  matrix, which is not lowered yet): refused.

Each factory is the example model (same routing, attention, seed) with its experts replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.examples.models import moe
from meshplan.examples.models.moe import example_inputs  # noqa: F401  (the factories' inputs)


class _Routed(nn.Module):
    """The example's loop over experts, each one's rows through `expert(e, rows)`."""

    def __init__(self, config: moe.MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        counts = (flat[:, None] == torch.arange(self.num_experts, device=flat.device)).sum(0).tolist()
        rows = x[order // k]
        outs, start = [], 0
        for e, n in enumerate(counts):
            outs.append(self.expert(e, rows[start : start + n]))
            start += n
        y = torch.empty_like(rows)
        y[order] = torch.cat(outs)
        return (y.view(-1, k, x.shape[1]) * top_k_weights.unsqueeze(-1)).sum(1)


def _init(*params: nn.Parameter) -> None:
    for p in params:
        nn.init.normal_(p, std=0.02)


class GroupedExperts(_Routed):
    def __init__(self, config: moe.MoEConfig) -> None:
        super().__init__(config)
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.w1 = nn.Parameter(torch.empty(e, h, i))
        self.w2 = nn.Parameter(torch.empty(e, i, h))
        self.w3 = nn.Parameter(torch.empty(e, h, i))
        _init(self.w1, self.w2, self.w3)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return (F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])) @ self.w2[e]


class InterleavedExperts(_Routed):
    def __init__(self, config: moe.MoEConfig) -> None:
        super().__init__(config)
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        _init(self.gate_up_proj, self.down_proj)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        both = F.linear(rows, self.gate_up_proj[e])
        return F.linear(F.silu(both[:, ::2]) * both[:, 1::2], self.down_proj[e])


class BiasedExperts(_Routed):
    def __init__(self, config: moe.MoEConfig) -> None:
        super().__init__(config)
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
        _init(self.gate_up_proj, self.down_proj)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e], self.gate_up_proj_bias[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e], self.down_proj_bias[e])


def _with(experts: type[_Routed]) -> moe.MoEModel:
    model = moe.build(intermediate_size=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for layer in model.layers:
            layer.mlp.experts = experts(model.config)
    return model


def grouped() -> moe.MoEModel:
    return _with(GroupedExperts)


def interleaved() -> moe.MoEModel:
    return _with(InterleavedExperts)


def biased() -> moe.MoEModel:
    return _with(BiasedExperts)


class SwiGLU(nn.Module):
    """One expert as plain PyTorch writes it: three linears."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ListedMoE(nn.Module):
    """A sparse MoE block with its experts in a list, looping over them as Mistral's reference
    code does: each expert on the tokens routed to it, weighted and added into the output."""

    def __init__(self, config: moe.MoEConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(config.hidden_size, config.intermediate_size) for _ in range(config.num_local_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)  # (N, H)
        probs = self.gate(tokens).softmax(dim=-1)  # (N, E)
        weights, index = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)  # the (token, slot) pairs routed to expert e
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.view(B, T, H)


def listed() -> moe.MoEModel:
    model = moe.build(intermediate_size=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for layer in model.layers:
            layer.mlp = ListedMoE(model.config)
    return model
