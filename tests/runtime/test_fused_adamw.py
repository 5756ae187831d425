"""AdamW's fused kernel only where it steps right: never on a non-contiguous parameter."""

import torch
from torch import nn

from meshplan.runtime.buckets import fusable
from meshplan.runtime.grad_sync import make_optimizer
from meshplan.runtime.train import TrainConfig


def test_a_non_contiguous_parameter_is_stepped_as_a_contiguous_copy_of_it_is():
    torch.manual_seed(0)
    base = torch.randn(4, 8)
    sliced, whole = nn.Module(), nn.Module()
    sliced.w = nn.Parameter(base[:, 2:6])  # a column slice: a view with row strides
    whole.w = nn.Parameter(base[:, 2:6].clone())
    assert not fusable([sliced.w]) and fusable([whole.w])
    grad = torch.randn(4, 4)
    for module in (sliced, whole):
        module.w.grad = grad.clone()
        make_optimizer(module, TrainConfig(lr=0.1)).step()
    torch.testing.assert_close(sliced.w, whole.w)
