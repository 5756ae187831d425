"""Ring attention's block kernels on the device: FlashAttention's pieces (bf16 and fp16),
merged by log-sum-exp and differentiated from the merged output, equal to the whole
sequence's attention in float64 to 16-bit rounding (`tests/runtime/test_ring_blocks.py`
holds the CPU's flash kernel to float64 parity)."""

from __future__ import annotations

import pytest
import torch
from gpu_tier import DEVICE, tier
from ring_blocks import check

pytestmark = tier


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_device_flash_blocks_merge_to_whole_attention(dtype):
    from meshplan.runtime.ring_attention import block_kernel

    q = torch.zeros(1, 1, 4, 8, dtype=dtype, device=DEVICE)
    assert block_kernel(q, None) is not None
    check(DEVICE, dtype, 3e-2 if dtype == torch.bfloat16 else 4e-3)
