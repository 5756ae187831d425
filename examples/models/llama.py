"""A tiny Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module names match Hugging Face's `LlamaForCausalLM` inside its `model.` prefix
(`layers.0.self_attn.q_proj`, `layers.0.mlp.down_proj`, ...), but the top level
is flat: `embed_tokens`, `layers`, `norm`, `lm_head`. So a plan written for this
model reads like one written for a real Llama.

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
class LlamaConfig:
    vocab_size: int = 256  # byte-level
    hidden_size: int = 64
    intermediate_size: int = 172
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    # False: attention gets the grouped key/value heads (`enable_gqa`), as Hugging Face's sdpa
    # path does without a mask, instead of heads repeated to the query heads first
    repeat_kv: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 even under bf16 compute: the mean of squares loses too much otherwise.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.type_as(x)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (max_len, head_dim), in the rotate-half layout Llama uses."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (L, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (L, D)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, D); cos, sin: (T, D) broadcast over batch and heads
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_kv_groups = config.num_attention_heads // config.num_key_value_heads
        self.repeat_kv = config.repeat_kv
        hidden, head_dim = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # The head count is left as -1 so that a tensor-parallel rank holding a slice of the
        # heads runs this same code unchanged.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if not self.repeat_kv:  # attention repeats them itself
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, D)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, H)
        # Grouped-query attention: each kv head serves num_kv_groups consecutive query heads.
        k = k.repeat_interleave(self.num_kv_groups, dim=1)  # (B, nh, T, D)
        v = v.repeat_interleave(self.num_kv_groups, dim=1)  # (B, nh, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*D)
        return self.o_proj(y)  # (B, T, H)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SwiGLU: (B, T, H) -> (B, T, I) -> (B, T, H)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)  # (B, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, H)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.head_dim, config.max_position_embeddings, config.rope_theta)
        # Not persistent: the tables are a function of the config, not state worth checkpointing.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

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


def build(seed: int = 0, **overrides: object) -> Llama:
    """The factory a plan names. Same seed, same weights; the caller's RNG state is left alone."""
    config = LlamaConfig(**overrides)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Llama(config)


def example_inputs(
    batch: int = 2, seq: int = 16, *, seed: int = 0, vocab_size: int = LlamaConfig.vocab_size
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (batch, seq); labels are input_ids shifted left by one token."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)  # (B, T+1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
