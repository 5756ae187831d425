"""`DataParallel(late=...)`: a parameter whose gradient comes from several backwards that each
end a synchronized micro-step of their own (a weight two stages of one pipeline rank read,
each stage's last backward run outside `no_sync`) is reduced by `finish()`, once whole.

Two gloo processes; one weight read by two "stages", each with its own backward, as a V
pipeline schedule runs them on the rank that holds the first stage and the last.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_pool import spawn
from torch import nn

from meshplan.runtime.data_parallel import DataParallel

pytestmark = pytest.mark.slow


class TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.other = nn.Parameter(torch.randn(4, 4))
        self.tied = nn.Parameter(torch.randn(4, 4))  # registered last: the first bucket


def averaged_grads(late: bool) -> tuple[list, list]:
    """Each rank's averaged gradients of both weights, and the expected average."""
    model = TwoStages()
    dp = DataParallel(model, dist.group.WORLD, bucket_bytes=1, late=[model.tied] if late else ())
    rank = dist.get_rank()
    x = torch.full((4,), float(rank + 1))
    # the last stage's backward (synchronized: its last of the step), then the first stage's
    (model.tied @ x).sum().backward()
    ((model.tied @ model.other) @ x).sum().backward()
    dp.finish()
    got = [model.tied.grad.clone(), model.other.grad.clone()]
    # the same two backwards on each rank's data, averaged by hand
    want = []
    for p in (model.tied, model.other):
        total = torch.zeros_like(p)
        for r in range(dist.get_world_size()):
            q = TwoStages()
            xr = torch.full((4,), float(r + 1))
            ((q.tied @ xr).sum() + ((q.tied @ q.other) @ xr).sum()).backward()
            total += q.tied.grad if p is model.tied else q.other.grad
        want.append(total / dist.get_world_size())
    return [g.numpy() for g in got], [w.numpy() for w in want]


def worker(rank: int, world_size: int) -> dict:
    try:
        averaged_grads(late=False)
        unmarked = "no error"
    except RuntimeError as e:
        unmarked = str(e)
        dist.barrier()  # both ranks raised before finish(): the launched all-reduce completes
    return {"late": averaged_grads(late=True), "unmarked": unmarked}


def test_a_late_weight_is_reduced_once_whole() -> None:
    for result in spawn(worker, 2, ()):
        got, want = result["late"]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(w))
        # without `late` the first backward launched the tied weight's all-reduce, on the bucket
        # the second backward then adds to: an error, not a wrong gradient
        assert "arrived after the bucket was launched this step" in result["unmarked"]
