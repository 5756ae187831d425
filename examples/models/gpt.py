"""A tiny GPT-2-style decoder: learned positions, LayerNorm, GELU, biases, tied embeddings.

Module names follow GPT-2's (`wte`, `wpe`, `h.0.ln_1`, `h.0.mlp.fc`, `ln_f`), except
that attention uses separate `q_proj`, `k_proj`, `v_proj` and `out_proj` instead of
GPT-2's fused `c_attn`, so a plan can place each projection on its own. `lm_head`
shares its weight with `wte`.

    model = build(num_hidden_layers=8)
    input_ids, labels = example_inputs(batch=2, seq=16)
    loss = model(input_ids, labels)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level
    hidden_size: int = 64
    intermediate_size: int = 256  # 4 x hidden, as in GPT-2
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    max_position_embeddings: int = 128
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The head count is left as -1 so that a tensor-parallel rank holding a slice of the
        # heads runs this same code unchanged.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H)
        return self.out_proj(y)  # (B, T, H)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, H) -> (B, T, I) -> (B, T, H)
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, H)
        return x + self.mlp(self.ln_2(x))  # (B, T, H)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # Tied after init so both names end up with the embedding's values.
        self.lm_head.weight = self.wte.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) without labels; with already-shifted labels (B, T), the mean loss."""
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.wte(input_ids) + self.wpe(positions)  # (B, T, H)
        for block in self.h:
            x = block(x)  # (B, T, H)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(seed: int = 0, **overrides: object) -> GPT:
    """The factory a plan names. Same seed, same weights; the caller's RNG state is left alone."""
    config = GPTConfig(**overrides)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)


def example_inputs(
    batch: int = 2, seq: int = 16, *, seed: int = 0, vocab_size: int = GPTConfig.vocab_size
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (batch, seq); labels are input_ids shifted left by one token."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)  # (B, T+1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
