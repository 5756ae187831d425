"""Resume on a different plan (`meshplan run` minus torchrun: tests/runs.py): a checkpoint saved with dp=2 x tp=2 continues with dp=4,
with or without ZeRO on either side (saved under ZeRO-3 and resumed without, and the reverse).

Checkpoints hold whole tensors keyed by parameter name (tensor-parallel shards and ZeRO
shards gathered), and the data stream depends only on the global batch, so the resumed
run continues the same computation: its losses match an uninterrupted dp=2 x tp=2 run
up to reduction order.
"""

import shutil
from pathlib import Path

import pytest
from plans import data_parallel, llama_rules, plan
from runs import meshplan_run

pytestmark = pytest.mark.slow

DP_TP = plan(llama_rules(vocab=False), mesh="dp=2, tp=2", extra=data_parallel(zero="ZERO"))
DP4 = """
mesh dp=4

data_parallel over dp {
    zero = ZERO
}
"""


def run(tmp_path: Path, plan: str, out: str, batch: int, *extra: str) -> list[dict]:
    path = tmp_path / f"{out}.plan"
    path.write_text(plan)
    argv = [str(path), "--batch", str(batch), "--seq", "32", "--out", str(tmp_path / out), *extra]
    return meshplan_run(*argv)[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """8 steps of dp=2 x tp=2 (zero = 0) without interruption, saved at step 4: its folder, and the
    losses a resumed run must continue."""
    tmp = tmp_path_factory.mktemp("straight")
    records = run(tmp, DP_TP.replace("ZERO", "0"), "a", 4, "--steps", "8", "--save-every", "4")
    return tmp / "a", {r["step"]: r["loss"] for r in records}


def stopped_at_step_4(straight_run: Path, out: Path) -> None:
    """`out`: the straight run's folder as it was after its step-4 checkpoint, which is what a
    4-step run of the same plan leaves (the learning rate is still warming up at step 8, so the
    first 4 steps do not depend on --steps)."""
    shutil.copytree(straight_run, out)
    shutil.rmtree(out / "checkpoints" / "step00000008")
    for metrics in (out / "metrics").glob("rank*.jsonl"):
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:4]))


@pytest.mark.parametrize(("saved", "resumed"), [(3, 0), (0, 1)])
def test_dp2_tp2_checkpoint_resumes_with_dp4(tmp_path, straight, saved: int, resumed: int):
    straight_run, straight_losses = straight
    if saved == 0:  # the straight run saved this checkpoint: a second 4-step run would repeat it
        stopped_at_step_4(straight_run, tmp_path / "b")
    else:
        run(tmp_path, DP_TP.replace("ZERO", str(saved)), "b", 4, "--steps", "4", "--save-every", "4")
    # the same global batch of 8 sequences: 4 per rank on 2 dp ranks, 2 per rank on 4
    dp4 = DP4.replace("ZERO", str(resumed))
    records = run(tmp_path, dp4, "b", 2, "--steps", "8", "--resume")
    resumed_losses = {r["step"]: r["loss"] for r in records}
    # steps 1-4 from the first run, 5-8 from the resumed one (a fresh start would repeat 1-4)
    assert [r["step"] for r in records] == list(range(1, 9))
    for step in range(5, 9):
        assert abs(resumed_losses[step] - straight_losses[step]) <= 1e-4 * abs(straight_losses[step]), (
            step,
            resumed_losses[step],
            straight_losses[step],
        )


HSDP = "mesh node=2, dp=2\n\ndata_parallel over node x dp {\n    zero = 3 over dp\n}\n"


@pytest.mark.parametrize("saved_under_hsdp", [True, False])
def test_hsdp_checkpoint_resumes_on_another_layout(tmp_path, straight, saved_under_hsdp: bool):
    """HSDP's shards have a copy on every node: a checkpoint holds each box once, and resumes with
    dp=4 under ZeRO-1; a dp=2 x tp=2 checkpoint resumes under HSDP (each copy reads its shards)."""
    straight_run, straight_losses = straight
    if saved_under_hsdp:
        run(tmp_path, HSDP, "b", 2, "--steps", "4", "--save-every", "4")
        resumed = DP4.replace("ZERO", "1")
    else:
        stopped_at_step_4(straight_run, tmp_path / "b")
        resumed = HSDP
    records = run(tmp_path, resumed, "b", 2, "--steps", "8", "--resume")
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records[4:]:
        step = r["step"]
        assert abs(r["loss"] - straight_losses[step]) <= 1e-4 * abs(straight_losses[step]), (step, r["loss"])
