"""Float64 stand-ins, for `meshplan verify`'s reference, of kernels PyTorch has here only in
lower precision.

`torch._grouped_mm` (Hugging Face's default experts on a CPU, torchtitan's `GroupedExperts`) has
no float64 kernel ("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"), so an
MoE model's float64 reference could not run and verify fell back to fixed bounds, which a 1e-4
bug passes. While the reference trains, `float64_kernels()` computes a float64 grouped matmul as
the loop of matmuls it is: each group's rows of one operand against the group's matrix of the
other, below autograd, so its backward's grouped matmuls are computed the same way. Before its
first use the loop is checked against the kernel on the same operands in float32: a stand-in that
does not compute the op is an error (verify then says it fell back, and why), never a reference.

    with float64_kernels():
        reference = train(float64_model, ...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


@contextlib.contextmanager
def float64_kernels() -> Iterator[None]:
    grouped = getattr(aten, "_grouped_mm", None)
    if grouped is None:  # this torch has no grouped matmul: nothing to stand in for
        yield
        return
    with _StandIns(grouped.default):
        yield


class _StandIns(TorchDispatchMode):
    def __init__(self, grouped_mm) -> None:
        super().__init__()
        self.grouped_mm = grouped_mm
        self.checked: set[tuple[int, int]] = set()  # operand ranks whose loop was held to the kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self.grouped_mm and args[0].dtype == torch.float64:
            a, b, *rest = args
            offs = rest[0] if rest else kwargs.get("offs")
            if (rest[1] if len(rest) > 1 else kwargs.get("bias")) is not None:
                raise NotImplementedError("no float64 stand-in for a grouped matmul with a bias")
            if (a.dim(), b.dim()) not in self.checked:
                _check(func, a, b, offs)
                self.checked.add((a.dim(), b.dim()))
            return grouped_mm_loop(a, b, offs)
        return func(*args, **kwargs)


def grouped_mm_loop(a: Tensor, b: Tensor, offs: Tensor | None) -> Tensor:
    """`torch._grouped_mm(a, b, offs)` as a loop of matmuls, in `a`'s dtype. `offs` ends each
    group (cumulative): rows of `a` (2-D x 3-D), columns of `b` (3-D x 2-D), or the contracted
    dim (2-D x 2-D, a weight gradient: one (M, N) result per group); 3-D x 3-D is a batched matmul."""
    if a.dim() == 3 and b.dim() == 3:
        return torch.bmm(a, b)
    assert offs is not None, "a grouped matmul of a 2-D operand takes offs"
    ends = [int(e) for e in offs.tolist()]
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    if a.dim() == 2 and b.dim() == 3:  # rows past the last group (padding) stay zero
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (start, end) in enumerate(bounds):
            out[start:end] = a[start:end] @ b[g]
        return out
    if a.dim() == 3 and b.dim() == 2:
        out = a.new_zeros(a.shape[1], b.shape[1])
        for g, (start, end) in enumerate(bounds):
            out[:, start:end] = a[g] @ b[:, start:end]
        return out
    return torch.stack([a[:, start:end] @ b[start:end] for start, end in bounds])


def covered(out: Tensor, a: Tensor, b: Tensor, offs: Tensor | None) -> Tensor:
    """The part of a grouped matmul's output its groups write: the kernel leaves rows (2-D x
    3-D) or columns (3-D x 2-D) past the last group unwritten, the loop zero."""
    if offs is None or not len(offs):
        return out
    end = int(offs[-1])
    if a.dim() == 2 and b.dim() == 3:
        return out[:end]
    if a.dim() == 3 and b.dim() == 2:
        return out[:, :end]
    return out


def _check(kernel, a: Tensor, b: Tensor, offs: Tensor | None) -> None:
    """The loop against the kernel, on these operands rounded to float32."""
    a32, b32 = a.detach().float(), b.detach().float()
    theirs = kernel(a32, b32, offs) if offs is not None else kernel(a32, b32)
    ours = grouped_mm_loop(a32, b32, offs)
    theirs, ours = covered(theirs, a, b, offs), covered(ours, a, b, offs)
    scale = float(theirs.norm()) or 1.0
    if float((ours - theirs).norm()) > 1e-5 * scale:
        raise RuntimeError(
            f"the float64 stand-in for a {a.dim()}-D x {b.dim()}-D grouped matmul differs from "
            "PyTorch's kernel in float32"
        )
