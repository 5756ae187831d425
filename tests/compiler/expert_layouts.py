"""The example MoE model (examples/models/moe.py) with its experts' matrices laid out as other
codebases lay them out, for tensor parallelism inside experts (`compiler/passes/tensor_parallel/expert_tensor_rules.py`):

- `grouped`: separate gate `w1`, up `w3` (E, H, I) and down `w2` (E, I, H), stored (in, out) and
  applied as `x @ w` (a grouped-matmul layout), I = 32 != H = 64;
- `interleaved`: gate and up fused in one matrix with their features alternating (gate at even
  rows, up at odd): split as one block, each rank's contiguous rows pairs of both;
- `biased`: Mixtral's layout with a random bias after each matrix (the down bias is added after
  the row matrix: each rank adds 1/tp of it);
- `squashed`: a nonlinearity after the row matrix, which no split's partial sums add up to:
  refused.

- `listed`: the experts as a list of SwiGLU modules the block loops over (`moe.build_listed`),
  stacked by `experts over` rules (`runtime/expert_list.py`).

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
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        _init(self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e], self.gate_up_proj_bias[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e], self.down_proj_bias[e])


class SquashedExperts(InterleavedExperts):
    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().expert(e, rows))


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


def squashed() -> moe.MoEModel:
    return _with(SquashedExperts)


def listed() -> moe.MoEModel:
    """The example model with its experts kept as a list of SwiGLU modules (`moe.build_listed`)."""
    return moe.build_listed(intermediate_size=32)
