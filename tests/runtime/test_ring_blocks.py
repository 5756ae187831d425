"""Ring attention's block kernels on the CPU (the flash kernel, float32 and float64) against
whole-sequence attention: `ring_blocks.check`. `tests/gpu` runs the same on CUDA."""

from __future__ import annotations

import pytest
import torch
from ring_blocks import check

from meshplan.runtime.ring_attention import block_kernel


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_cpu_flash_blocks_merge_to_whole_attention(dtype, tol):
    check("cpu", dtype, tol)


def test_a_model_mask_takes_the_matmul_path():
    q = torch.randn(1, 1, 4, 8)
    assert block_kernel(q, torch.ones(4, 4, dtype=torch.bool)) is None
    assert block_kernel(q.to("meta"), None) is not None  # what `estimate` walks
