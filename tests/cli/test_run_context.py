"""`meshplan run` of context-parallel plans (minus torchrun: tests/runs.py), against one process.

Every activation is cut by sequence over `cp` from the token inputs on; attention gathers
the keys and values (`all_gather`), passes them around a ring (`ring`) or moves to head
shards and back (`ulysses`). The same batch on one process must give the same losses and
gradient norms at every step. Ring and all_gather run in the load-balanced causal layout
(rank r holds chunks r and 2n-1-r of 2n: tokens, labels, rotary tables, masks alike);
Ulysses runs a model with one key/value head for its four query heads, fewer than the two
ranks (repeated to the query heads by the model in layers 0 and 2, handed to attention
grouped with `enable_gqa` in 1 and 3): each rank gathers the head its query heads use. The
example Llama repeats its 2 key/value heads for 4 query heads: ring and all_gather move the 2.
The all_gather cell adds Megatron's tensor and sequence parallelism over `tp`: each cp rank's
slice of the sequence is cut again over tp at the norms.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from plans import llama_rules, llama_sequence, plan
from runs import metrics
from test_run_pipeline import run, same_steps

from meshplan.examples.models.llama import build as llama_build

pytestmark = pytest.mark.slow


MQA = f"{Path(__file__).parent}/mqa_llama.py:build"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("one")
    (tmp / "one.plan").write_text("mesh dp=1\n")
    return run(tmp / "one.plan", tmp / "run")


@pytest.fixture(scope="module")
def one_process_mqa(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("one_mqa")
    (tmp / "one.plan").write_text("mesh dp=1\n")
    return run(tmp / "one.plan", tmp / "run", "--model", MQA)


@pytest.mark.parametrize(
    ("mode", "mesh"), [("ring", "cp=2"), ("ulysses", "cp=2"), ("all_gather", "cp=2, tp=2")]
)
def test_context_parallel_trains_like_one_process(
    tmp_path: Path, request: pytest.FixtureRequest, mode: str, mesh: str
) -> None:
    rules = f"\n    layers.*.self_attn: context {mode} over cp\n"
    if "tp" in mesh:  # Megatron attention and MLP over tp, the norms' sequence shards cut again
        text = plan(rules + llama_rules() + llama_sequence(), mesh=mesh)
    else:
        text = f"mesh {mesh}\n\nmodules {{\n{rules}}}\n"
    path = tmp_path / "cp.plan"
    path.write_text(text)
    if mode == "ulysses":
        same_steps(run(path, tmp_path / "run", "--model", MQA), request.getfixturevalue("one_process_mqa"))
    else:
        same_steps(run(path, tmp_path / "run"), request.getfixturevalue("one_process"))


def test_weights_sharded_over_dp_and_cp_train_like_one_process_and_resume_without_cp(
    tmp_path: Path, one_process: list[dict]
) -> None:
    """`mesh dp=2, cp=2` under ZeRO-3: every weight's gradient is partial over cp (each rank's
    slice of the sequence), summed there while it is averaged over dp, in one reduce-scatter
    over dp x cp per flat, so each rank keeps a quarter of every weight's state. Saved at
    step 2, resumed by `mesh dp=2` under ZeRO-1 (no cp): the quarters load as halves."""
    zero3 = tmp_path / "zero3.plan"
    zero3.write_text(
        "mesh dp=2, cp=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n}\n\n"
        "data_parallel over dp {\n    zero = 3\n}\n"
    )
    zero1 = tmp_path / "zero1.plan"
    zero1.write_text("mesh dp=2\n\ndata_parallel over dp {\n    zero = 1\n}\n")
    first = run(zero3, tmp_path / "run", "--steps", "2", "--save-every", "2", batch=1)
    assert [r["step"] for r in first] == [1, 2]
    params = sum(p.numel() for p in llama_build().parameters())
    assert first[-1]["zero_memory"]["optimizer"] == pytest.approx(8 * params / 4, rel=0.01)
    run(zero1, tmp_path / "run", "--resume", batch=1)
    same_steps(metrics(tmp_path / "run")[0], one_process)
