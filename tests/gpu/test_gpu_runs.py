"""`meshplan run` on a CUDA device, as a user runs it: bf16 with checkpointing against the same
run on the CPU, fp16 with the dynamic loss scale, a checkpoint carried from the device to the CPU
and back, and weights exported from the device."""

from __future__ import annotations

import itertools
import math

import torch
from gpu_tier import DP1_BF16, DP1_FP16, DP1_FP32, meshplan_run, tier, write_plan

pytestmark = tier

STEPS = ("--steps", "8", "--warmup", "2")


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def test_bf16_checkpointed_run_on_the_device_matches_the_cpu_and_exports_for_the_cpu(tmp_path):
    plan = write_plan(tmp_path, DP1_BF16)
    export = tmp_path / "device" / "model.pt"
    device = meshplan_run(plan, tmp_path / "device", *STEPS, "--export", str(export))
    cpu = meshplan_run(plan, tmp_path / "cpu", *STEPS, on="cpu")
    # the same bf16 casts on both; the kernels differ, so each step agrees to bf16 rounding
    # (8 bits of mantissa: 2^-8 per operation) accumulated over the steps, not bit for bit
    for d, c in zip(losses(device), losses(cpu), strict=True):
        assert math.isclose(d, c, rel_tol=3e-2), (losses(device), losses(cpu))
    assert losses(device)[-1] < losses(device)[0]
    # the export loads on a machine without a GPU: every tensor was written from host memory
    state = torch.load(export, weights_only=True)
    assert all(t.device.type == "cpu" for t in state.values())
    from meshplan.examples.models.llama import build

    model = build()
    assert model.load_state_dict(state, strict=True)  # every name of the unpartitioned model


def test_fp16_with_the_dynamic_loss_scale_trains_on_the_device(tmp_path):
    records = meshplan_run(write_plan(tmp_path, DP1_FP16), tmp_path / "run", *STEPS)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert losses(records)[-1] < losses(records)[0]
    scales = [r["loss_scale"] for r in records]
    assert all(s is not None and s > 0 for s in scales)
    # an overflowing step halves the scale and is skipped: both counted, never hidden
    halvings = sum(b < a for a, b in itertools.pairwise(scales))
    assert records[-1]["skipped_steps"] >= halvings


def test_a_checkpoint_moves_from_the_device_to_the_cpu_and_back(tmp_path):
    plan = write_plan(tmp_path, DP1_FP32)
    flat = ("--warmup", "2", "--min-lr-ratio", "1")  # the learning rate does not depend on --steps
    straight = meshplan_run(plan, tmp_path / "straight", "--steps", "9", *flat)
    hop = tmp_path / "hop"
    meshplan_run(plan, hop, "--steps", "3", "--save-every", "3", *flat)
    meshplan_run(plan, hop, "--steps", "6", "--save-every", "3", "--resume", *flat, on="cpu")
    records = meshplan_run(plan, hop, "--steps", "9", "--resume", *flat)
    assert [r["step"] for r in records] == list(range(1, 10))  # each part began where the last saved
    # fp32 on both: the CPU's three steps differ from the device's only by rounding
    for h, s in zip(losses(records), losses(straight), strict=True):
        assert math.isclose(h, s, rel_tol=1e-3), (losses(records), losses(straight))
