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
"""

from __future__ import annotations

from pathlib import Path

import pytest
from plans import llama_rules, plan
from test_run_pipeline import run, same_steps

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
    if "tp" in mesh:  # Megatron attention and MLP over tp, sequence over cp
        text = plan(rules + llama_rules(), mesh=mesh)
    else:
        text = f"mesh {mesh}\n\nmodules {{\n{rules}}}\n"
    path = tmp_path / "cp.plan"
    path.write_text(text)
    if mode == "ulysses":
        same_steps(run(path, tmp_path / "run", "--model", MQA), request.getfixturevalue("one_process_mqa"))
    else:
        same_steps(run(path, tmp_path / "run"), request.getfixturevalue("one_process"))
