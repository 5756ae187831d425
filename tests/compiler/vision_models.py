"""A small vision transformer in plain PyTorch, as a model factory: the model's call is
`model(pixels, labels)` (float images and integer class labels) returning the cross-entropy.

    meshplan verify PLAN --model tests/compiler/vision_models.py:build
    meshplan run PLAN --model tests/compiler/vision_models.py:build --data tests/compiler/vision_models.py:image_batches

The layout is timm's `VisionTransformer`: patches embedded by a strided Conv2d, a class token
and learned positions, pre-norm blocks whose attention computes q, k and v with one `qkv`
linear (`reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)`, then `unbind(0)`), and a linear head
on the class token. `example_inputs()` gives the call's kinds and shapes; `image_batches` is a
`--data` factory yielding image batches of the same kinds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IMAGE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 10
BATCH = 2  # example_inputs' batch


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, N, hd)
        x = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, hd)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2, num_heads: int = 4, classes: int = CLASSES):
        super().__init__()
        num_patches = (IMAGE // PATCH) ** 2
        self.patch_embed = nn.Conv2d(CHANNELS, dim, kernel_size=PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)  # (B, N, C)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, C)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, N + 1, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)[:, 0])  # (B, classes)
        return F.cross_entropy(logits.float(), labels)


def build() -> VisionTransformer:
    return VisionTransformer()


def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, CHANNELS, IMAGE, IMAGE), torch.randint(0, CLASSES, (BATCH,))


def image_batches(*, batch, seq, seed, dp_rank, dp_size, accumulation):
    """A `--data` factory: a fixed set of 64 images of 10 classes, each class a colour tint plus
    noise (learnable in a few steps), drawn by (seed, step, micro-step, dp rank)."""
    generator = torch.Generator().manual_seed(1234)
    tints = torch.randn(CLASSES, CHANNELS, 1, 1, generator=generator)
    classes = torch.arange(64) % CLASSES
    images = tints[classes] + 0.3 * torch.randn(64, CHANNELS, IMAGE, IMAGE, generator=generator)

    def get(step: int, micro_step: int):
        g = torch.Generator().manual_seed(
            seed * 1_000_003 + (step * accumulation + micro_step) * dp_size + dp_rank
        )
        rows = torch.randint(0, 64, (batch,), generator=g)
        return images[rows], classes[rows]

    return get
