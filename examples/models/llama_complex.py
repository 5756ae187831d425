"""A tiny Llama written the way torchtitan writes it: complex RoPE, nn.RMSNorm, GQA, SwiGLU.

Module names follow torchtitan's Llama (`tok_embeddings`, `layers.0.attention.wq`,
`layers.0.feed_forward.w1`, `layers.0.attention_norm`, `norm`, `output`); nothing is
fused, so a plan can place each projection on its own. Rotary embeddings are a complex64
`freqs_cis` buffer built with `torch.polar` and applied by complex multiplication
(`view_as_complex` / `view_as_real`); the loss is a sum-reduced cross-entropy divided by
the number of tokens, and the forward returns `(logits, loss)` when given targets.
The config uses Hugging Face's field names, so compiler checks read it as they read
any other model's.

    model = build()
    tokens, targets = example_inputs(batch=2, seq=16)
    logits, loss = model(tokens, targets)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    # torchtitan's SwiGLU width: 2/3 of 4 x hidden, rounded up to a multiple of 256
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def precompute_freqs_cis(head_dim: int, max_len: int, theta: float) -> torch.Tensor:
    """e^(i * t * theta^(-2k/D)) for every position t and pair k: (max_len, head_dim/2), complex64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (L, D/2)
    return torch.polar(torch.ones_like(angles), angles)  # (L, D/2) complex64


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate each (even, odd) pair of q and k by its position's angle, in complex64.

    xq: (B, T, nh, D), xk: (B, T, nkv, D), freqs_cis: (T, D/2) complex64.
    """
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))  # (B, T, nh, D/2)
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))  # (B, T, nkv, D/2)
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])  # (1, T, 1, D/2)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)  # (B, T, nh, D)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)  # (B, T, nkv, D)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_kv_groups = config.num_attention_heads // config.num_key_value_heads
        hidden, head_dim = config.hidden_size, config.head_dim
        self.wq = nn.Linear(hidden, config.num_attention_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=False)
        self.wo = nn.Linear(config.num_attention_heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts are left as -1 so that a tensor-parallel rank holding a slice of the
        # heads runs this same code unchanged.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, nh, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, nkv, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, nkv, D)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        # Grouped-query attention: each kv head serves num_kv_groups consecutive query heads.
        k = k.repeat_interleave(self.num_kv_groups, dim=2)  # (B, T, nh, D)
        v = v.repeat_interleave(self.num_kv_groups, dim=2)  # (B, T, nh, D)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, nh, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, H)


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SwiGLU: (B, T, H) -> (B, T, I) -> (B, T, H)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)  # (B, T, H)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, H)


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        freqs_cis = precompute_freqs_cis(config.head_dim, config.max_position_embeddings, config.rope_theta)
        # Not persistent: the table is a function of the config, not state worth checkpointing.
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) without targets; with already-shifted targets (B, T), (logits, loss)."""
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)  # (B, T, H)
        freqs_cis = self.freqs_cis[:T]  # (T, D/2)
        for layer in self.layers:
            h = layer(h, freqs_cis)  # (B, T, H)
        logits = self.output(self.norm(h))  # (B, T, V)
        if targets is None:
            return logits
        # The sum over tokens divided by their count, in fp32 whatever the compute dtype.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return logits, loss / targets.numel()


def build(seed: int = 0, **overrides: object) -> Transformer:
    """The factory a plan names. Same seed, same weights; the caller's RNG state is left alone."""
    config = LlamaConfig(**overrides)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(config)


def example_inputs(
    batch: int = 2, seq: int = 16, *, seed: int = 0, vocab_size: int = LlamaConfig.vocab_size
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (batch, seq); targets are tokens shifted left by one."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)  # (B, T+1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
