"""`python -m bench.device_check --dry-run`: lists what the device check runs, on a machine
without a GPU too (the check itself runs where there is one)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_run_lists_every_part_with_its_budget_and_what_it_skips():
    done = subprocess.run(
        [sys.executable, "-m", "bench.device_check", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("meshplan device check: 4 parts, at most 480 s")
    listed = {line.split()[0] for line in lines[1:] if not line.strip().startswith("skipped:")}
    assert listed == {"gpu-tier", "llama-1b-step", "llama-8b-tp8-memory", "cpu-offload-step"}
    assert sum("skipped:" in line for line in lines) == 1  # the skipped part says why


def test_without_a_gpu_the_check_refuses_with_exit_2():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run")
    done = subprocess.run(
        [sys.executable, "-m", "bench.device_check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr


def test_the_one_rank_memory_part_runs_a_meta_built_model_s_rank_alone_on_the_cpu():
    """The 8B part's own code, at a size the CPU runs: a tp=8 rank under the fake process group,
    its training state a rank's share of the model's (16 bytes per local parameter)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.device_check import one_rank_8b

    numbers = one_rank_8b(device="cpu", seq=32, model="llama_tiny")
    assert numbers["state_gib"] * 2**30 >= 16 * numbers["parameters_on_rank"]
    assert numbers["peak_tensor_gib"] >= numbers["state_gib"]
