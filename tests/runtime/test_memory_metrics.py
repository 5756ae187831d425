"""`state_bytes` and `peak_tensor_bytes` in `meshplan run`'s metrics, on the built-in tiny Llama in
fp32 (tests/runs.py: the command minus torchrun)."""

from pathlib import Path

import pytest
from runs import meshplan_run

from meshplan.examples.models.llama import build

pytestmark = pytest.mark.slow

PLAN = """
mesh dp={dp}

data_parallel over dp {
    zero = {zero}
}
"""

PARAMS = list(build().parameters())
N = sum(p.numel() for p in PARAMS)  # elements; fp32 AdamW holds 4 + 4 + 8 bytes of each


def record(tmp_path: Path, dp: int, zero: int, batch: int = 2) -> dict:
    """Rank 0's record of a one-step run (the first step is measured on a CPU too)."""
    plan = tmp_path / f"dp{dp}_zero{zero}_b{batch}.plan"
    plan.write_text(PLAN.replace("{dp}", str(dp)).replace("{zero}", str(zero)))
    argv = [
        str(plan),
        "--steps",
        "1",
        "--out",
        str(tmp_path / plan.stem),
        "--batch",
        str(batch),
        "--seq",
        "16",
    ]
    return meshplan_run(*argv)[0][-1]


def test_one_replica_holds_16_bytes_a_parameter_and_its_peak_grows_with_the_batch(tmp_path):
    small, large = record(tmp_path, 1, 0, batch=2), record(tmp_path, 1, 0, batch=16)
    # params, grads, both moments, and the fused AdamW's fp32 step counter of each tensor
    assert small["state_bytes"] == large["state_bytes"] == 16 * N + 4 * len(PARAMS)
    assert small["state_bytes"] < small["peak_tensor_bytes"] < large["peak_tensor_bytes"]
    assert "zero_memory" not in small
    assert 0 < small["start_memory"] <= small["peak_memory"]  # start-up's peak, before the first step


@pytest.mark.parametrize(
    ("zero", "params", "grads"),
    [(1, 4 * N, 4 * N), (2, 4 * N, 4 * N // 2), (3, 4 * N // 2, 4 * N // 2)],
)
def test_zero_divides_the_state_over_dp(tmp_path, zero, params, grads):
    got = record(tmp_path, 2, zero)
    held = got["zero_memory"]
    # each rank's fp32 shard is its master; moments of half of every flat, a step counter per flat
    counters = held["optimizer"] - 8 * N // 2
    assert 0 < counters <= 4 * len(PARAMS) and counters % 4 == 0
    assert (held["params"], held["grads"]) == (params, grads)
    assert got["state_bytes"] == held["total"] == params + grads + 8 * N // 2 + counters
    assert got["peak_tensor_bytes"] >= got["state_bytes"]


def test_a_step_that_raises_leaves_no_measuring_mode_behind(tmp_path):
    """The CPU peak is measured by a dispatch mode around the step: a step that raises (a kernel
    missing for a dtype) must take it off the stack, or every later capture in the process runs
    under it (torch.export then fails on fake tensors)."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from meshplan.runtime.train import TrainConfig, train

    model = torch.nn.Linear(4, 4)

    def loss_of(x, y):
        raise RuntimeError("no kernel for this dtype")

    with pytest.raises(RuntimeError, match="no kernel"):
        train(
            model,
            loss_of,
            lambda step, micro: (torch.ones(2, 4), None),
            TrainConfig(steps=1, run_dir=tmp_path),
        )
    assert _get_current_dispatch_mode() is None


def test_the_step_tracker_counts_what_is_made_once_and_the_gathers_it_cannot_see():
    """A collective hands back the buffer it wrote into (not new memory); ZeRO-3's gathered
    buffers are resized storages, which no op reports: the flats tell the tracker."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplan.runtime.train import _LiveTensors
    from meshplan.runtime.zero_flats import _resize

    bucket, gathered = torch.zeros(1000), torch.empty(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with _LiveTensors(0) as tracker:
            dist.all_reduce(bucket)  # in place: the bucket was there before the step
            made = torch.ones(10)  # 40 bytes, new
            _resize(gathered, 4000)  # a unit gathered
            assert tracker.live == 4040
            _resize(gathered, 0)  # and freed
            del made
        assert (tracker.live, tracker.peak) == (0, 4040)
    finally:
        dist.destroy_process_group()


PIPELINE = "mesh {mesh}\n\npipeline over pp {{\n    schedule = {schedule}\n    microbatches = 4\n}}\n"
ZERO_OVER_DP = "\ndata_parallel over dp {{\n    zero = {zero}\n}}\n"


@pytest.mark.parametrize(
    "text",
    [
        # every microbatch kept before the first backward, when no gradient is made yet
        PIPELINE.format(mesh="pp=2", schedule="gpipe"),
        # a rank's gradient flats are its stages' (two a rank), not the whole pipeline's
        PIPELINE.format(mesh="dp=2, pp=2", schedule="interleaved\n    virtual_stages = 2")
        + ZERO_OVER_DP.format(zero=1),
        # the earlier microbatches' backwards run under `no_sync`: whole gradients between them
        PIPELINE.format(mesh="dp=2, pp=2", schedule="1f1b") + ZERO_OVER_DP.format(zero=3),
        # and between micro-steps, ZeRO-1's too (its flat is made again in the last)
        "mesh dp=2\n" + ZERO_OVER_DP.format(zero=1) + "\ntrain {\n    gradient_accumulation = 2\n}\n",
    ],
    ids=["gpipe", "interleaved-zero1", "1f1b-zero3", "accumulated-zero1"],
)
def test_the_estimate_holds_each_ranks_peak_to_what_the_run_measured(tmp_path, text):
    """`meshplan estimate`'s peak for every rank of a pipeline or of accumulated micro-steps
    against the run's `peak_tensor_bytes` (issue goal: within 10%), and its training state to
    the byte."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.estimate import estimate
    from meshplan.compiler.load import load_model, on_meta_inputs
    from meshplan.dsl import check_text

    plan = tmp_path / "pipeline.plan"
    plan.write_text(text)
    argv = ["--steps", "2", "--log-every", "1", "--out", str(tmp_path / "run"), "--batch", "4", "--seq", "32"]
    runs = meshplan_run(str(plan), *argv)
    checked = check_text(text, "pipeline.plan")
    model = load_model("examples/models/llama.py:build", shapes_only=True)
    source = on_meta_inputs(with_token_shape(model, batch=4, seq=32))
    compiled = compile_plan(checked, source, world_size=checked.mesh.world_size, dynamic=False)
    est = estimate(compiled)
    for rank, records in zip(est.ranks, runs, strict=True):
        measured = max(r["peak_tensor_bytes"] for r in records)
        assert rank.state == records[-1]["state_bytes"]
        assert rank.peak == pytest.approx(measured, rel=0.1), rank.rank
