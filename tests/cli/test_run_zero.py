"""`meshplan run` under ZeRO 1/2/3 and offload, through the run's own worker setup, vs plain data parallel.

Plain DP (zero = 0) is itself tested against one device (tests/runtime/test_dp_tp.py), so
each ZeRO run is compared with the zero = 0 run of the same layout, data and seed: the
loss and gradient-norm sequences of the metrics JSONL must agree (1e-5 relative, fp32).
Clipping is active (max norm 0.5 below the norms seen), so the global gradient norm over
dp shards (and tp shards, for dp=2 x tp=2) must be right for the losses to agree.

Each run is what `meshplan run` does, minus torchrun: the plan compiled once and saved (the
launcher's `program.pt`), every rank loading it (`session.open_session`, as a worker does) and
training with `train_session`, which writes the metrics JSONL and the checkpoints. Starting
processes and importing torch was most of each launch's cost, so the dp=2 runs share one spawn
of two gloo processes and the dp=2 x tp=2 runs one of four; the tests only read the metrics.
ZeRO through real torchrun is in test_reshard.py and test_padded_vocab.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gloo_pool import spawn
from plans import llama_rules

from meshplan.options import parse
from meshplan.session import open_session, train_session

pytestmark = pytest.mark.slow

STEPS = 6
MODEL = """
from meshplan.examples.models.llama import build as _build


def build():
    return _build(num_hidden_layers=2)  # start-up (export) time grows with the layers
"""
BATCH, SEQ = 4, 32
RUN_FLAGS = ("--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ), "--warmup", "2")


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
    "zero3-disk": plan_text(3, offload="optimizer:disk, params"),
    "tp-zero0": plan_text(0, tp=True),
    "tp-zero2": plan_text(2, tp=True),
}
DP_RUNS = ["zero0", "zero1", "zero2", "zero3", "zero3-offload", "zero3-disk"]
TP_RUNS = ["tp-zero0", "tp-zero2"]


def run(rank: int, world_size: int, tmp: Path, name: str, *extra: str) -> None:
    """One `meshplan run` of RUNS[name] into tmp/name, on the ranks of this spawn."""
    import torch.distributed as dist

    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.executable import save_executable, to_executable
    from meshplan.compiler.load import load_model
    from meshplan.dsl import load_plan

    plan_name = name.removesuffix("-resumed")  # a resumed run runs the same plan and program
    plan, program = tmp / f"{plan_name}.plan", tmp / f"{plan_name}.program.pt"
    model = f"{tmp / 'model.py'}:build"
    if rank == 0 and not program.exists():  # compiled once, as the launcher does; every rank loads it
        plan.write_text(RUNS[plan_name])
        shaped = with_token_shape(load_model(model), batch=BATCH, seq=SEQ)
        compiled = compile_plan(load_plan(plan, world_size=world_size), shaped, world_size=world_size)
        save_executable(to_executable(compiled), program)
    dist.barrier()
    argv = [str(plan), "--program", str(program), "--model", model, *RUN_FLAGS, "--grad-clip", "0.5"]
    options = parse([*argv, "--out", str(tmp / name), *extra])
    train_session(open_session(options, rank, world_size), show_progress=False)
    dist.barrier()


def dp_worker(rank: int, world_size: int, tmp: str) -> None:
    folder = Path(tmp)
    for name in DP_RUNS:
        run(rank, world_size, folder, name, *(["--save-every", "3"] if name == "zero2" else []))
    # resume zero2 from its step-3 checkpoint, as if it had been stopped after saving it
    if rank == 0:
        shutil.copytree(folder / "zero2", folder / "zero2-resumed")
        shutil.rmtree(folder / "zero2-resumed" / "checkpoints" / "step00000006")
        shutil.rmtree(folder / "zero2-resumed" / "metrics")
    run(rank, world_size, folder, "zero2-resumed", "--resume", "--save-every", "3")


def tp_worker(rank: int, world_size: int, tmp: str) -> None:
    for name in TP_RUNS:
        run(rank, world_size, Path(tmp), name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[list[dict]]]:
    """name -> per rank, the metrics records of each step."""
    tmp = tmp_path_factory.mktemp("zero_runs")
    (tmp / "model.py").write_text(MODEL)
    spawn(dp_worker, 2, (str(tmp),), timeout_s=300)
    spawn(tp_worker, 4, (str(tmp),), timeout_s=300)
    return {name: _metrics(tmp / name) for name in [*DP_RUNS, "zero2-resumed", *TP_RUNS]}


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


def test_optimizer_on_disk_is_bit_identical_to_host_memory(runs) -> None:
    """`offload = optimizer:disk` steps the same arithmetic as `offload = optimizer`, flat by flat."""
    for on_disk, in_memory in zip(runs["zero3-disk"], runs["zero3-offload"], strict=True):
        for key in ("loss", "grad_norm"):
            assert _series(on_disk, key) == _series(in_memory, key)
        assert on_disk[-1]["zero_memory"]["optimizer"] < 64  # the step counters: the rest is on disk


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
