"""verify's float64 stand-in for `torch._grouped_mm` computes the op: every operand layout the
forward and backward of a grouped experts layer use, against the kernel in float32, and the
gradients of a float64 grouped layer against the same layer written as a loop."""

import pytest
import torch

from meshplan.float64_kernels import covered, float64_kernels, grouped_mm_loop

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm here")


def operands():
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32)  # an empty group, and 2 rows of padding
    # sizes a multiple of 4: the kernel wants strides in 16-byte steps
    return torch.randn(12, 8, generator=g), torch.randn(4, 8, 8, generator=g), offs


def test_the_loop_is_the_kernel_for_every_layout():
    a, b, offs = operands()
    grad = torch.randn(12, 8)
    cases = {
        "2d x 3d": (a, b),  # the forward: each group's rows by its expert's matrix
        "3d x 2d": (b, a.t().contiguous()),  # groups of columns
        "2d x 2d": (a.t().contiguous(), grad),  # a weight gradient: one matrix per group
        "3d x 3d": (b, b.transpose(1, 2).contiguous()),
    }
    for name, (x, y) in cases.items():
        groups = offs if name != "3d x 3d" else None
        kernel = torch._grouped_mm(x, y, groups) if groups is not None else torch._grouped_mm(x, y)
        loop = grouped_mm_loop(x, y, groups)
        mine, theirs = covered(loop, x, y, groups), covered(kernel, x, y, groups)
        assert mine.numel() and torch.allclose(mine, theirs, rtol=1e-5, atol=1e-5), name


def test_float64_gradients_through_the_stand_in_are_the_loop_s():
    a, b, offs = operands()
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    with float64_kernels():  # its backward's grouped matmuls too
        out = torch._grouped_mm(a64, b64, offs)
        out.square().sum().backward()
    a_ref, b_ref = a.double().requires_grad_(), b.double().requires_grad_()
    rows = [a_ref[s:e] @ b_ref[g] for g, (s, e) in enumerate(zip([0, 3, 3, 8], [3, 3, 8, 10], strict=True))]
    torch.cat([*rows, a_ref.new_zeros(2, 8)]).square().sum().backward()
    assert out.dtype == torch.float64
    assert torch.allclose(a64.grad, a_ref.grad) and torch.allclose(b64.grad, b_ref.grad)
