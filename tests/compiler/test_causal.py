"""A mask that is the causal mask becomes `is_causal=True` (`compiler/causal.py`): the flash
kernel's path on a GPU, and no seq x seq mask per sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.causal import SDPA
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource, load_model
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl import check_text

HERE = Path(__file__).parent


def attentions(compiled) -> list:
    return [n for n in compiled.graph.graph.nodes if n.op == "call_function" and n.target is SDPA]


def test_hugging_face_s_traced_mask_is_written_as_is_causal_and_computes_the_same():
    source = with_token_shape(load_model(f"{HERE}/hf_factories.py:hf_llama"), batch=2, seq=16)
    compiled = compile_plan(check_text("mesh dp=1\n"), source)
    assert attentions(compiled) and all(
        n.kwargs.get("is_causal") and len(n.args) == 3 and "attn_mask" not in n.kwargs
        for n in attentions(compiled)
    )
    program = build_rank_program(compiled, source.model, 0)
    (loss,) = program(*source.args, *source.kwargs.values())
    eager = source.model(**source.kwargs).loss
    torch.testing.assert_close(loss, eager)


class Masked(nn.Module):
    """Attention under a mask made from the sequence length: `window` positions back (None: all)."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.embed, self.window = nn.Embedding(32, 8), window

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).unsqueeze(1)  # (B, 1, T, 8): one head
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        mask = pos[None, :] <= pos[:, None]
        if self.window is not None:
            mask = mask & (pos[:, None] - pos[None, :] < self.window)
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask).sum()


@pytest.mark.parametrize(("window", "rewritten"), [(None, True), (3, False)])
def test_a_mask_from_the_shapes_is_rewritten_only_when_it_is_causal(window, rewritten):
    model = Masked(window)
    source = with_token_shape(ModelSource("masked", model, (torch.randint(0, 32, (2, 9)),)), batch=2, seq=9)
    compiled = compile_plan(check_text("mesh dp=1\n"), source)
    (node,) = attentions(compiled)
    assert bool(node.kwargs.get("is_causal")) == rewritten
    program = build_rank_program(compiled, model, 0)
    torch.testing.assert_close(program(*source.args)[0], model(*source.args))


class Padded(nn.Module):
    """A mask read from the inputs (padding): values, not shapes; it stays."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).unsqueeze(1)
        mask = (ids != 0)[:, None, None, :]
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask).sum()


def test_a_mask_read_from_the_inputs_stays():
    source = ModelSource("padded", Padded(), (torch.randint(1, 32, (2, 9)),))
    (node,) = attentions(compile_plan(check_text("mesh dp=1\n"), source))
    assert not node.kwargs.get("is_causal") and (len(node.args) > 3 or "attn_mask" in node.kwargs)
