"""What the `gpu` tier's tests share: the device they run on, the plans, `meshplan run` as a
user runs it (a subprocess, real torchrun) and one rank's session in this process.

The tier needs a CUDA device and is skipped without one. `MESHPLAN_GPU_TIER_ON_CPU=1` runs its
tests on the CPU instead (`DEVICE` becomes "cpu"; a "CPU" run is the same as a "device" run),
which checks the tests' own code where no GPU is at hand; it proves nothing about CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ON_CPU = os.environ.get("MESHPLAN_GPU_TIER_ON_CPU") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# every module of the tier: marked, and skipped where there is no CUDA device
tier = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE != "cuda" and not ON_CPU, reason="needs a CUDA device"),
]

DP1_BF16 = """
mesh dp=1

data_parallel over dp {
    zero = 0
}

precision {
    compute = bf16
    params = fp32
}

modules {
    layers.*: checkpoint
}
"""

DP1_FP16 = """
mesh dp=1

precision {
    compute = fp16
    params = fp32
    loss_scale = dynamic
}
"""

DP1_FP32 = "mesh dp=1\n"


def write_plan(folder: Path, text: str, name: str = "plan.plan") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def meshplan_run(plan: Path, out: Path, *args: str, on: str = DEVICE) -> list[dict]:
    """`meshplan run PLAN --out OUT *args` in a new process, on the device or (`on="cpu"`) with
    CUDA hidden; rank 0's metrics records, every run into OUT so far."""
    env = dict(os.environ)
    if on == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "meshplan", "run", str(plan), "--out", str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    lines = (out / "metrics" / "rank0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@contextmanager
def process_group(backend: str, rank: int = 0, world_size: int = 1) -> Iterator[None]:
    """This process as rank `rank` of a `world_size` group: "fake" (collectives that only keep
    shapes, so one rank of a larger mesh runs alone) or a real one of one rank."""
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        store: dist.Store = FakeStore()
    else:
        store = dist.HashStore()
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def open_rank_session(plan: Path, out: Path, rank: int, *args: str):
    """Rank `rank`'s session of `meshplan run PLAN --out OUT *args`, compiled and opened in this
    process, inside the process group the caller set up."""
    from meshplan.launcher import prepare
    from meshplan.options import parse
    from meshplan.session import open_session

    options, world_size = prepare(parse([str(plan), "--out", str(out), *args]))
    assert world_size == dist.get_world_size(), (world_size, dist.get_world_size())
    return open_session(options, rank, world_size)


def real_backend() -> str:
    return "nccl" if DEVICE == "cuda" else "gloo"


def llama_8_heads():
    """The built-in tiny Llama with 8 query and 4 key/value heads: `tp=4` splits both."""
    from meshplan.examples.models.llama import build

    return build(num_attention_heads=8, num_key_value_heads=4)


MODEL_8_HEADS = f"{__file__}:llama_8_heads"
