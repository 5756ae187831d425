"""A tiny mixture-of-experts decoder: the example Llama with each MLP replaced by top-k routed experts.

Each layer's `mlp` is a sparse MoE block laid out as Hugging Face's Mixtral lays it out: a
router `mlp.gate` (a linear to one logit per expert, softmax, top-k, the k weights
renormalized) and `mlp.experts`, every expert's SwiGLU weights stacked into 3-D parameters
(`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)). The experts are called as
`experts(tokens, top_k_index, top_k_weights)` and compute, for every token, the weighted sum
of its k experts' outputs, looping over the experts with the tokens each one got (sizes
that depend on the data: dropless). So `layers.*.mlp.experts: experts over ep` reads the
same for this model and for `MixtralForCausalLM`.

    model = build(num_local_experts=8, num_experts_per_tok=2)
    input_ids, labels = example_inputs(batch=2, seq=16)
    loss = model(input_ids, labels)

`build_listed` is the same model (same weights, same outputs) with each layer's experts kept
as plain PyTorch code often keeps them: `mlp.experts` an `nn.ModuleList` of SwiGLU modules
(`gate_proj`, `up_proj`, `down_proj`), the block looping over them; the same plans split it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.examples.models.llama import Attention, LlamaConfig, RMSNorm, example_inputs, rope_tables

__all__ = ["MoEConfig", "build", "build_listed", "example_inputs"]


@dataclass
class MoEConfig(LlamaConfig):
    intermediate_size: int = 64  # per expert
    num_hidden_layers: int = 2
    num_local_experts: int = 4
    num_experts_per_tok: int = 2


class Experts(nn.Module):
    """Every expert's SwiGLU, stacked: out[t] = sum_j w[t, j] * expert_{i[t, j]}(x[t])."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, inner))

    def forward(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # x: (N, H); top_k_index, top_k_weights: (N, k)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)  # (N*k,) the expert of each (token, slot) pair
        order = flat.argsort(stable=True)  # (N*k,) the pairs grouped by expert
        experts = torch.arange(self.num_experts, device=flat.device)
        counts = (flat[:, None] == experts).sum(0).tolist()  # pairs per expert
        rows = x[order // k]  # (N*k, H) each pair's token, grouped by expert
        outs, start = [], 0
        for e, n in enumerate(counts):
            chunk = rows[start : start + n]  # (n_e, H) the tokens routed to expert e
            gate, up = F.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)  # (n_e, I) each
            outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))  # (n_e, H)
            start += n
        y = torch.empty_like(rows)
        y[order] = torch.cat(outs)  # (N*k, H) back in (token, slot) order
        return (y.view(-1, k, x.shape[1]) * top_k_weights.unsqueeze(-1)).sum(1)  # (N, H)


class SparseMoE(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = Experts(config)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, H) -> each token's top-k experts and their weights, renormalized: (N, k) each."""
        probs = self.gate(tokens).softmax(dim=-1)  # (N, E)
        weights, index = probs.topk(self.top_k, dim=-1)  # (N, k)
        return index, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)  # (N, H)
        index, weights = self.route(tokens)
        return self.experts(tokens, index, weights).view(B, T, H)


class SwiGLU(nn.Module):
    """One expert as three linears."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ListedMoE(SparseMoE):
    """`SparseMoE` with its experts in a list, the block looping over them as Mistral's reference
    code does: each expert on the tokens routed to it, weighted and added into the output."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        self.experts = nn.ModuleList(  # type: ignore[assignment]
            SwiGLU(config.hidden_size, config.intermediate_size) for _ in range(config.num_local_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)  # (N, H)
        index, weights = self.route(tokens)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)  # the (token, slot) pairs routed to expert e
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.view(B, T, H)


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)  # (B, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, H)


class MoEModel(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoELayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=config.initializer_range)
            elif isinstance(module, Experts):
                nn.init.normal_(module.gate_up_proj, std=config.initializer_range)
                nn.init.normal_(module.down_proj, std=config.initializer_range)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) without labels; with already-shifted labels (B, T), the mean loss."""
        T = input_ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D)
        x = self.embed_tokens(input_ids)  # (B, T, H)
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, H)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(seed: int = 0, **overrides: object) -> MoEModel:
    """The factory a plan names. Same seed, same weights; the caller's RNG state is left alone."""
    config = MoEConfig(**overrides)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoEModel(config)


def build_listed(seed: int = 0, **overrides: object) -> MoEModel:
    """`build`'s model with each layer's experts as a list of SwiGLU modules holding the same
    weights (expert e's gate, up and down are its slices of `gate_up_proj` and `down_proj`)."""
    model = build(seed, **overrides)
    for layer in model.layers:
        stacked = layer.mlp
        with torch.random.fork_rng(devices=[]):  # its initial weights are overwritten
            listed = ListedMoE(model.config)
        listed.gate = stacked.gate
        inner = model.config.intermediate_size
        with torch.no_grad():
            for e, expert in enumerate(listed.experts):
                gate_up, down = stacked.experts.gate_up_proj[e], stacked.experts.down_proj[e]
                expert.gate_proj.weight.copy_(gate_up[:inner])
                expert.up_proj.weight.copy_(gate_up[inner:])
                expert.down_proj.weight.copy_(down)
        layer.mlp = listed
    return model
