"""`meshplan run` of the example MoE model with its experts over `ep` (minus torchrun:
tests/runs.py), against the same global batch on one process.

One launch checks several things at once: `mesh dp=2, ep=2` on 4 processes (the dense
gradients averaged over dp x ep, the experts' over dp), a checkpointed layer (its
all-to-alls run again in backward) and two accumulated micro-steps of one sequence per
rank. The one-process run trains the same 8 sequences per step: losses and gradient norms
(clipping active) must agree step by step, and the metrics count every routed token once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from runs import meshplan_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = f"{ROOT}/examples/models/moe.py:build"
STEPS, SEQ = 4, 16
EXPERT_PARALLEL = """mesh dp=2, ep=2

modules {
    layers.*.mlp.experts: experts over ep (top_k=2)
    layers.1:             checkpoint
}

data_parallel over dp {
    bucket = 64KB
}

train {
    gradient_accumulation = 2
}
"""


def run(tmp: Path, name: str, text: str, batch: int) -> list[dict]:
    (tmp / f"{name}.plan").write_text(text)
    argv = [str(tmp / f"{name}.plan"), "--model", MODEL, "--steps", str(STEPS), "--batch", str(batch)]
    argv += ["--seq", str(SEQ), "--warmup", "2", "--grad-clip", "0.5", "--out", str(tmp / name)]
    return meshplan_run(*argv)[0]


def test_experts_over_ep_train_like_one_process(tmp_path: Path) -> None:
    got = run(tmp_path, "ep", EXPERT_PARALLEL, batch=1)
    want = run(tmp_path, "one", "mesh dp=1\n", batch=8)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), g["step"]
    for record in got:  # every (token, slot) pair of the step's 8 sequences, once per layer
        load = record["expert_load"]
        assert sorted(load) == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
        assert all(sum(unit["tokens"]) == 8 * SEQ * 2 and unit["overload"] >= 1.0 for unit in load.values())
