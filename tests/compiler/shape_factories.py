"""Small models for the dynamic-shape tests (`test_dynamic_shapes.py`)."""

import torch
import torch.nn.functional as F
from torch import nn


class SequenceView(nn.Module):
    """Views a tensor on sequence shards with the whole sequence's length, `view(B, T, 4, 16)`
    after a norm that runs on sequence shards: the compiled view must read the run's T over
    the tensor-parallel size, whatever T is."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.norm = nn.LayerNorm(64)
        self.scale = nn.Parameter(torch.randn(4, 16))
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 256, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        x = self.embed(input_ids)  # (B, T, 64)
        h = self.norm(x).view(B, T, 4, 16) * self.scale  # (B, T/n, 4, 16) on sequence shards
        h = h.reshape(B, T, 64)
        x = x + self.down(F.gelu(self.up(h)))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def sequence_view() -> SequenceView:
    torch.manual_seed(0)
    return SequenceView()


def example_inputs(batch: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
