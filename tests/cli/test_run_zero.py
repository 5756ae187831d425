"""`meshplan run` under ZeRO 1/2/3 and offload, through real torchrun, vs plain data parallel.

Plain DP (zero = 0) is itself tested against one device (tests/runtime/test_dp_tp.py), so
each ZeRO run is compared with the zero = 0 run of the same layout, data and seed: the
loss and gradient-norm sequences of the metrics JSONL must agree (1e-5 relative, fp32).
Clipping is active (max norm 0.5 below the norms seen), so the global gradient norm over
dp shards (and tp shards, for dp=2 x tp=2) must be right for the losses to agree.

Every run starts torchrun and compiles the model in each worker (seconds of start-up), so
the runs are launched side by side in two waves and the tests only read their metrics.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from plans import llama_rules

pytestmark = pytest.mark.slow

STEPS = 6
MODEL = """
from meshplan.examples.models.llama import build as _build


def build():
    return _build(num_hidden_layers=2)  # start-up (export) time grows with the layers
"""


def plan_text(zero: int, *, tp: bool = False, offload: str = "") -> str:
    mesh = "mesh dp=2, tp=2\n" if tp else "mesh dp=2\n"
    offload_line = f"    offload = {offload}\n" if offload else ""
    block = f"data_parallel over dp {{\n    zero = {zero}\n    bucket = 16KB\n{offload_line}}}\n"
    return mesh + ("modules {" + llama_rules() + "}\n" if tp else "") + block


# name -> plan; the buckets are small so that every stage has several flats
RUNS = {
    "zero0": plan_text(0),
    "zero1": plan_text(1),
    "zero2": plan_text(2),
    "zero3": plan_text(3),
    "zero3-offload": plan_text(3, offload="optimizer, params"),
    "tp-zero0": plan_text(0, tp=True),
    "tp-zero2": plan_text(2, tp=True),
}


def start(tmp: Path, name: str, *extra: str) -> subprocess.Popen:
    plan = tmp / f"{name}.plan"
    plan.write_text(RUNS[name.removesuffix("-resumed")])
    argv = ["meshplan", "run", str(plan), "--model", f"{tmp / 'model.py'}:build", "--steps", str(STEPS)]
    argv += ["--batch", "4", "--seq", "32", "--warmup", "2", "--grad-clip", "0.5", "--out", str(tmp / name)]
    env = dict(os.environ, NO_COLOR="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def finish(procs: dict[str, subprocess.Popen]) -> None:
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}:\n{out}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[list[dict]]]:
    """name -> per rank, the metrics records of each step."""
    tmp = tmp_path_factory.mktemp("zero_runs")
    (tmp / "model.py").write_text(MODEL)
    first = ["zero0", "zero1", "zero2", "zero3", "zero3-offload"]
    finish({name: start(tmp, name, *(["--save-every", "3"] if name == "zero2" else [])) for name in first})
    # resume zero2 from its step-3 checkpoint, as if it had been stopped after saving it
    shutil.copytree(tmp / "zero2", tmp / "zero2-resumed")
    shutil.rmtree(tmp / "zero2-resumed" / "checkpoints" / "step00000006")
    shutil.rmtree(tmp / "zero2-resumed" / "metrics")
    second = {name: start(tmp, name) for name in ("tp-zero0", "tp-zero2")}
    second["zero2-resumed"] = start(tmp, "zero2-resumed", "--resume", "--save-every", "3")
    finish(second)
    return {name: _metrics(tmp / name) for name in [*first, *second]}


def _metrics(run_dir: Path) -> list[list[dict]]:
    files = sorted((run_dir / "metrics").glob("rank*.jsonl"))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def _series(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


def _assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)


@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("zero1", "zero0"),
        ("zero2", "zero0"),
        ("zero3", "zero0"),
        ("zero3-offload", "zero0"),
        ("tp-zero2", "tp-zero0"),
    ],
)
def test_zero_trains_like_plain_data_parallel(runs, name: str, reference: str) -> None:
    want = runs[reference][0]
    assert min(r["grad_norm"] for r in want) > 0.5  # clipping is active on every step
    for records in runs[name]:  # every rank logs the same dp-mean loss and global norm
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        _assert_close(_series(records, "loss"), _series(want, "loss"))
        _assert_close(_series(records, "grad_norm"), _series(want, "grad_norm"))
        assert records[-1]["skipped_steps"] == 0


def test_resume_under_zero2_is_bit_identical(runs) -> None:
    for uninterrupted, resumed in zip(runs["zero2"], runs["zero2-resumed"], strict=True):
        assert [r["step"] for r in resumed] == [4, 5, 6]
        assert _series(resumed, "loss") == _series(uninterrupted[3:], "loss")
        assert _series(resumed, "grad_norm") == _series(uninterrupted[3:], "grad_norm")


def test_zero_memory_is_logged_and_sharded(runs) -> None:
    """Bytes of params, grads and optimizer state per rank right after a step: ZeRO divides them."""
    memory = {name: runs[name][0][-1]["zero_memory"] for name in ("zero1", "zero2", "zero3")}
    assert "zero_memory" not in runs["zero0"][0][-1]
    full_params = memory["zero1"]["params"]
    assert memory["zero2"]["params"] == full_params and memory["zero3"]["params"] <= full_params // 2 + 64
    assert memory["zero1"]["grads"] == full_params and memory["zero2"]["grads"] <= full_params // 2 + 64
    # exp_avg and exp_avg_sq of half the (fp32, so master = shard) params, plus the step counters
    for name in ("zero1", "zero2", "zero3"):
        assert full_params <= memory[name]["optimizer"] <= full_params + 256
