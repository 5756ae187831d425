"""The backward split into input gradients (I) and weight gradients (W), against one backward.

For each stage shape a zero-bubble schedule meets (a middle stage, one with a weight used at
two places, one with a weight reaching an output off the input path, the first stage whose
inputs are token ids, a recomputed region), I then W must give exactly the gradients of one
`backward`, I must leave every weight untouched, and W must accumulate through the usual
accumulation nodes (the hooks data parallelism launches its buckets from fire once per weight).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from meshplan.runtime.split_backward import backward_input, backward_weight


class Block(nn.Module):
    """A pre-norm residual MLP with a weight read at two places and one (`off`) whose path can
    reach an output without meeting the activations."""

    def __init__(self, recompute: bool = False):
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.gain = nn.Parameter(torch.randn(8))
        self.off = nn.Parameter(torch.randn(8))
        self.recompute = recompute

    def mlp(self, x: Tensor) -> Tensor:
        return self.down(torch.relu(self.up(self.norm(x)))) * self.gain

    def forward(self, x: Tensor) -> Tensor:
        if self.recompute:
            h = torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False)
        else:
            h = self.mlp(x)
        return (h + x) @ self.up.weight[:8, :8] + self.gain


def _outputs(model: Block, x: Tensor, off: bool) -> list[Tensor]:
    h = model(x)
    return [h, model.off * 2] if off else [h, h.sum(0)]


def _gradients(split: bool, *, off: bool = False, recompute: bool = False, first: bool = False):
    torch.manual_seed(0)
    model = Block(recompute)
    fired: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))
    if first:  # token ids in, nothing to send back
        embed = nn.Embedding(10, 8)
        model.add_module("embed", embed)
        ids = torch.randint(0, 10, (4,))
        x = embed(ids)
        inputs: list[Tensor] = []
    else:
        x = torch.randn(4, 8, requires_grad=True)
        inputs = [x]
    outputs = _outputs(model, x, off)
    grads = [torch.randn_like(o) for o in outputs]
    if split:
        pending = backward_input(outputs, grads, inputs, list(model.parameters()))
        assert all(p.grad is None for p in model.parameters()), "I touched a weight"
        assert not fired
        input_grad = x.grad.clone() if inputs else None
        backward_weight(pending)
    else:
        torch.autograd.backward(outputs, grads)
        input_grad = x.grad if inputs else None
    return input_grad, {n: p.grad for n, p in model.named_parameters()}, sorted(fired)


@pytest.mark.parametrize(
    "case",
    [{}, {"off": True}, {"recompute": True}, {"first": True}],
    ids=["middle", "off", "recompute", "first"],
)
def test_input_then_weight_gradients_are_one_backward(case: dict) -> None:
    want_input, want, want_fired = _gradients(False, **case)
    got_input, got, got_fired = _gradients(True, **case)
    if want_input is not None:
        torch.testing.assert_close(got_input, want_input, rtol=0, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
    assert got_fired == want_fired  # each weight's accumulation hook, once


def test_a_loss_splits_too() -> None:
    """The last stage: I from a scalar loss (no incoming gradient), W later."""
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 8, requires_grad=True)
    pending = backward_input([model(x).square().mean()], [None], [x], list(model.parameters()))
    assert pending.groups, "a transformer-like block splits into weight groups"
    assert x.grad is not None and all(p.grad is None for p in model.parameters())
    backward_weight(pending)
    assert all(p.grad is not None for n, p in model.named_parameters() if n != "off")
