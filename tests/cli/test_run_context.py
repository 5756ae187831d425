"""`meshplan run` of context-parallel plans through real torchrun, against one process.

Every activation is cut by sequence over `cp` from the token inputs on; attention gathers
the keys and values (`all_gather`) or moves to head shards and back (`ulysses`). The same
batch on one process must give the same losses and gradient norms at every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from plans import llama_rules, plan
from test_run_pipeline import run, same_steps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("one")
    (tmp / "one.plan").write_text("mesh dp=1\n")
    return run(tmp / "one.plan", tmp / "run")


@pytest.mark.parametrize(
    ("mode", "mesh"), [("ring", "cp=2"), ("ulysses", "cp=2"), ("all_gather", "cp=2, tp=2")]
)
def test_context_parallel_trains_like_one_process(
    tmp_path: Path, one_process: list[dict], mode: str, mesh: str
) -> None:
    rules = f"\n    layers.*.self_attn: context {mode} over cp\n"
    if "tp" in mesh:  # Megatron attention and MLP over tp, sequence over cp
        text = plan(rules + llama_rules(), mesh=mesh)
    else:
        text = f"mesh {mesh}\n\nmodules {{\n{rules}}}\n"
    path = tmp_path / "cp.plan"
    path.write_text(text)
    same_steps(run(path, tmp_path / "run"), one_process)
