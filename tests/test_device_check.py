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
    assert sum("skipped:" in line for line in lines) == 2  # each skipped part says why


def test_without_a_gpu_the_check_refuses_with_exit_2():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run")
    done = subprocess.run(
        [sys.executable, "-m", "bench.device_check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr
