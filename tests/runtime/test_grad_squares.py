"""The gradient norm's sums of squares: float64, chunk by chunk, never a float64 copy of a
whole large gradient."""

import torch

from meshplan.runtime import grad_sync
from meshplan.runtime.grad_sync import sum_of_squares


def test_a_large_tensor_is_summed_in_chunks_to_the_same_value(monkeypatch):
    t = torch.randn(1000, 33)
    whole = t.double().pow(2).sum()
    monkeypatch.setattr(grad_sync, "SQUARES_CHUNK", 100)
    seen: list[int] = []
    double = torch.Tensor.double

    def recording(self, *args, **kwargs):
        seen.append(self.numel())
        return double(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "double", recording)
    chunked = sum_of_squares(t)
    assert max(seen) <= 100 and sum(seen) == t.numel()  # no copy beyond a chunk
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=0)
