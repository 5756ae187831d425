"""The example MoE with aux-loss-free balancing (DeepSeek-V3): each router adds a per-expert
bias to its scores to choose the top k (the weights stay the unbiased scores), and counts the
(token, slot) pairs each expert got into a buffer; `update_bias` moves the bias toward balance
between steps and clears the counts.

The update is a rate times each count's distance from the mean, not its sign as DeepSeek-V3
writes it: a rank that used its own counts instead of the whole job's would move its bias by
a quarter as much and be caught.

    meshplan run PLAN --model aux_free_moe.py:build --between-steps aux_free_moe.py:update_bias
"""

import torch

from meshplan.examples.models import moe


class BiasedRouter(moe.SparseMoE):
    def __init__(self, config: moe.MoEConfig) -> None:
        super().__init__(config)
        self.register_buffer("expert_bias", torch.zeros(config.num_local_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)  # (N, H)
        scores = self.gate(tokens).sigmoid()  # (N, E)
        index = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, index)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        pairs = index.reshape(-1)
        self.tokens_per_expert += torch.zeros_like(self.tokens_per_expert).index_add_(
            0, pairs, torch.ones_like(pairs, dtype=self.tokens_per_expert.dtype)
        )
        return self.experts(tokens, index, weights).view(B, T, H)


def build(seed: int = 0) -> moe.MoEModel:
    model = moe.build(seed)
    for layer in model.layers:
        router = BiasedRouter(model.config)
        router.load_state_dict(layer.mlp.state_dict(), strict=False)  # the same gate and experts
        layer.mlp = router
    return model


def update_bias(model: moe.MoEModel, rate: float = 2e-3) -> None:
    for module in model.modules():
        if isinstance(module, BiasedRouter):
            load = module.tokens_per_expert
            module.expert_bias += rate * (load.mean() - load)
            load.zero_()
