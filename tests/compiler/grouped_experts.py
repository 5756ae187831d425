"""A mixture-of-experts decoder laid out as torchtitan lays it out: the MoE module routes and
permutes the tokens itself, and its experts module takes rows already grouped by expert with
their counts, `experts(x, num_tokens_per_expert)` (torchtitan's `GroupedExperts`, Megatron's
grouped MLP), instead of Hugging Face's `experts(tokens, top_k_index, top_k_weights)`.

Per layer (`layers.*.moe`):

- `router`: a linear to one logit per expert, softmax, top-k (the scores not renormalized);
- the permutation, in the MoE module: every (token, slot) pair sorted by expert (a stable
  argsort), the pairs per expert counted with `torch.histc`, each pair's token row gathered;
- `experts` (`GroupedExperts`): w1, w3 (E, dim, hidden) and w2 (E, hidden, dim), applied as
  `x @ w`; its forward loops over `x.split(num_tokens_per_expert.tolist())` (`build`) or, in
  `build_grouped_mm`, calls `torch._grouped_mm` with the counts' offsets (on CPU it has fp32
  and bf16 kernels, none for float64);
- the un-permutation: each output row times its routing score, added into its token's row
  with `scatter_add` (torchtitan's combine).

Attention, norms and rotary tables are the example Llama's. Small enough to train in seconds:
2 layers, hidden 64, 4 experts of hidden 32, top-2, vocab 256.

    model = build()
    input_ids, labels = example_inputs(batch=2, seq=16)
    loss = model(input_ids, labels)

`switch` is the same model with its experts as a dict of modules the MoE module loops over
(Switch Transformers' `nn.ModuleDict` of `expert_{i}`), which expert parallelism refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.examples.models.llama import Attention, LlamaConfig, RMSNorm, example_inputs, rope_tables

__all__ = ["GroupedExperts", "build", "build_grouped_mm", "example_inputs", "switch"]


@dataclass
class GroupedConfig(LlamaConfig):
    num_hidden_layers: int = 2
    moe_inter_dim: int = 32  # each expert's hidden width
    num_experts: int = 4
    top_k: int = 2
    use_grouped_mm: bool = False


class GroupedExperts(nn.Module):
    """Every expert's SwiGLU stacked: w1, w3 (E, dim, hidden), w2 (E, hidden, dim). Called on rows
    grouped by expert, `num_tokens_per_expert[e]` of them for expert e, in expert order; rows past
    the counts' sum (padding) give zeros."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # x: (R, dim) grouped by expert; num_tokens_per_expert: (E,)
        if self.use_grouped_mm:
            return self._grouped_mm(x, num_tokens_per_expert)
        sizes = [int(n) for n in num_tokens_per_expert.tolist()]
        kept = sum(sizes)
        outs = []
        for e, rows in enumerate(torch.split(x[:kept], sizes, dim=0)):
            h = F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])  # (n_e, hidden)
            outs.append(h @ self.w2[e])  # (n_e, dim)
        out = torch.cat(outs)
        return torch.cat([out, out.new_zeros((x.shape[0] - kept, out.shape[1]))])  # (R, dim)

    def _grouped_mm(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)  # (E,) each group's end
        h = F.silu(torch._grouped_mm(x, self.w1, offs=offsets)) * torch._grouped_mm(x, self.w3, offs=offsets)
        return torch._grouped_mm(h, self.w2, offs=offsets)  # (R, dim); rows past the last offset: 0


class MoE(nn.Module):
    """Top-k routing, the pairs permuted by expert, the experts on them, the rows combined back."""

    def __init__(self, config: GroupedConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = GroupedExperts(
            config.hidden_size, config.moe_inter_dim, config.num_experts, config.use_grouped_mm
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(-1, D)  # (N, D)
        scores = self.router(tokens).softmax(dim=-1)  # (N, E)
        top_scores, selected = scores.topk(self.top_k, dim=-1)  # (N, k)
        flat = selected.reshape(-1)  # (N k,) each pair's expert
        num_tokens_per_expert = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts)
        order = flat.argsort(stable=True)  # (N k,) the pairs grouped by expert
        token_of_row = order // self.top_k  # (N k,) each row's token
        rows = tokens[token_of_row]  # (N k, D) permuted by expert
        out = self.experts(rows, num_tokens_per_expert.to(torch.int64))  # (N k, D)
        out = out * top_scores.reshape(-1)[order, None]  # each row weighed by its score
        index = token_of_row[:, None].expand(-1, D)
        return torch.zeros_like(tokens).scatter_add(0, index, out).view(B, T, D)


class SwitchMoE(MoE):
    """`MoE` with its experts a dict of SwiGLU modules (`expert_0` ...) looped over per expert."""

    def __init__(self, config: GroupedConfig) -> None:
        super().__init__(config)
        self.experts = nn.ModuleDict(  # type: ignore[assignment]
            {
                f"expert_{e}": _SwiGLU(config.hidden_size, config.moe_inter_dim)
                for e in range(config.num_experts)
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(-1, D)
        scores = self.router(tokens).softmax(dim=-1)
        top_scores, selected = scores.topk(self.top_k, dim=-1)  # (N, k)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts.values()):
            token, slot = torch.where(selected == e)
            out = out.index_add(0, token, expert(tokens[token]) * top_scores[token, slot, None])
        return out.view(B, T, D)


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, config: GroupedConfig, moe: type[MoE]) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.moe = moe(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.moe(self.ffn_norm(x))


class GroupedMoEModel(nn.Module):
    def __init__(self, config: GroupedConfig, moe: type[MoE] = MoE) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, moe) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=config.initializer_range)
            elif isinstance(module, GroupedExperts):
                for p in (module.w1, module.w2, module.w3):
                    nn.init.normal_(p, std=config.initializer_range)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) without labels; with already-shifted labels (B, T), the mean loss."""
        T = input_ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _build(seed: int, moe: type[MoE], **overrides: object) -> GroupedMoEModel:
    config = GroupedConfig(**overrides)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GroupedMoEModel(config, moe)


def build(seed: int = 0, **overrides: object) -> GroupedMoEModel:
    """The experts loop over `x.split(num_tokens_per_expert.tolist())`: every dtype, float64 too."""
    return _build(seed, MoE, **overrides)


def build_grouped_mm(seed: int = 0, **overrides: object) -> GroupedMoEModel:
    """`build`'s model (same weights) with its experts calling `torch._grouped_mm`."""
    return _build(seed, MoE, use_grouped_mm=True, **overrides)


def switch(seed: int = 0, **overrides: object) -> GroupedMoEModel:
    """The experts as a dict of modules (Switch Transformers' layout)."""
    return _build(seed, SwitchMoE, **overrides)
