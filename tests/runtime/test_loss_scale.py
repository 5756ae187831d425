"""fp16 training under `meshplan run` (minus torchrun: tests/runs.py): overflowing steps are skipped and counted, nothing is updated."""

from pathlib import Path

import pytest
from runs import meshplan_run

pytestmark = pytest.mark.slow

PLAN = """
mesh dp=2

data_parallel over dp {
    zero = 0
}

precision {
    compute = fp16
    loss_scale = {scale}
}
"""


def run(tmp_path: Path, scale: str, steps: int) -> list[dict]:
    plan = tmp_path / "fp16.plan"
    plan.write_text(PLAN.replace("{scale}", scale))
    argv = [str(plan), "--steps", str(steps), "--out", str(tmp_path / "run"), "--batch", "4", "--seq", "32"]
    return meshplan_run(*argv)[0]


def test_a_scale_that_always_overflows_skips_every_step(tmp_path):
    # 1e30 x the loss overflows fp16 activation gradients: every step must be skipped
    records = run(tmp_path, "1e30", 4)
    assert [r["skipped_steps"] for r in records] == [1, 2, 3, 4]
    assert all(r["loss_scale"] == 1e30 for r in records)  # a fixed scale stays fixed


def test_dynamic_scaling_trains_in_fp16(tmp_path):
    records = run(tmp_path, "dynamic", 20)
    assert records[-1]["skipped_steps"] == 0 or records[-1]["loss_scale"] < 2.0**16
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
