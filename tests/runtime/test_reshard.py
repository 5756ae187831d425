"""Resume on a different plan: a checkpoint saved with dp=2 x tp=2 continues with dp=4.

Checkpoints hold full tensors keyed by parameter name (tensor-parallel shards gathered),
and the data stream depends only on the global batch, so the resumed run continues the
same computation: its losses match an uninterrupted dp=2 x tp=2 run up to reduction order.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DP_TP = """
mesh dp=2, tp=2

modules {
    layers.*.self_attn.{q,k,v}_proj: column over tp
    layers.*.self_attn.o_proj:       row over tp
    layers.*.mlp.{gate,up}_proj:     column over tp
    layers.*.mlp.down_proj:          row over tp
}

data_parallel over dp {
    zero = 0
}
"""

DP4 = """
mesh dp=4

data_parallel over dp {
    zero = 0
}
"""


def run(tmp_path: Path, plan: str, out: str, batch: int, *extra: str) -> list[dict]:
    path = tmp_path / f"{out}.plan"
    path.write_text(plan)
    done = subprocess.run(
        [
            "meshplan",
            "run",
            str(path),
            "--batch",
            str(batch),
            "--seq",
            "32",
            "--out",
            str(tmp_path / out),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, NO_COLOR="1"),
        timeout=400,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (tmp_path / out / "metrics/rank0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_dp2_tp2_checkpoint_resumes_with_dp4(tmp_path):
    straight = {r["step"]: r["loss"] for r in run(tmp_path, DP_TP, "a", 4, "--steps", "8")}
    run(tmp_path, DP_TP, "b", 4, "--steps", "4", "--save-every", "4")
    # the same global batch of 8 sequences: 4 per rank on 2 dp ranks, 2 per rank on 4
    resumed = {r["step"]: r["loss"] for r in run(tmp_path, DP4, "b", 2, "--steps", "8", "--resume")}
    for step in range(5, 9):
        assert abs(resumed[step] - straight[step]) <= 1e-4 * abs(straight[step]), (
            step,
            resumed[step],
            straight[step],
        )
