"""The suite's export cache (`capture_cache`): a hit is the model's own program, and whatever
could change the graph misses."""

from __future__ import annotations

import os

import capture_cache
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(
    os.environ.get("MESHPLAN_TEST_CAPTURE_CACHE") == "0",
    reason="the cache is off (MESHPLAN_TEST_CAPTURE_CACHE=0)",
)


class Block(nn.Module):
    def __init__(self, width: int = 8, scale: float = 2.0, act=torch.relu) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("shift", torch.zeros(width))
        self.scale = scale
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x) * self.scale + self.shift)


def export(model: nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    with capture_cache.remembered():
        return torch.export.export(model, (x,), strict=False)


def counts() -> tuple[int, int]:
    return capture_cache.hits, capture_cache.misses


def test_a_hit_is_a_program_of_the_new_models_own_weights() -> None:
    x = torch.randn(3, 8)
    first, second = Block(), Block()
    export(first, x)
    hits, misses = counts()
    program = export(second, x)
    assert counts() == (hits + 1, misses)
    assert program.state_dict["proj.weight"] is second.proj.weight
    torch.testing.assert_close(program.module()(x), second(x), rtol=0, atol=0)
    assert not torch.equal(program.module()(x), first(x))


def test_what_changes_the_graph_misses() -> None:
    x = torch.randn(3, 8)
    export(Block(), x)
    shifted = Block()
    shifted.shift.fill_(1.0)  # a buffer's value
    changed = [
        (Block(scale=3.0), x),  # a plain attribute
        (Block(act=torch.tanh), x),  # a function held by the module
        (Block(width=4), torch.randn(3, 4)),  # shapes
        (Block(), torch.randn(5, 8)),  # the call's shapes
        (Block().double(), x.double()),  # dtypes
        (Block().eval(), x),  # train/eval mode
        (shifted, x),
    ]
    for model, call in changed:
        hits, misses = counts()
        export(model, call)
        assert counts() == (hits, misses + 1), model
