"""`meshplan run` of pipelines under ZeRO-3, with a weight tied across stages, and resumed on
another layout (minus torchrun: tests/runs.py), against the same data on one process.

The model is the example GPT, whose embedding and LM head are one parameter: its copies on
the first and the last stage must take the same steps. Helpers and conventions are those of
test_run_pipeline.py (`--batch` is one microbatch; 4 of them per micro-step).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from plans import data_parallel
from test_run_pipeline import MICRO, pipeline_plan, run, same_steps

pytestmark = pytest.mark.slow

GPT = "meshplan.examples.models.gpt:build"
# Megatron's layout for the example GPT, norms on sequence shards, every second block recomputed
GPT_RULES = """
    h.*.attn.{q,k,v}_proj: column over tp
    h.*.attn.out_proj:     row over tp
    h.*.mlp.fc:            column over tp
    h.*.mlp.proj:          row over tp
    wte:                   vocab over tp
    lm_head:               vocab over tp
    h.*.{ln_1,ln_2}:       sequence over tp
    ln_f:                  sequence over tp
    h.*:                   checkpoint every 2
"""
ZERO3_OFFLOAD = (
    "\ndata_parallel over dp {\n    zero = 3\n    bucket = 16KB\n    offload = optimizer, params\n}\n"
)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    """The reference: GPT on one process, 16 sequences per step (2 data-parallel ranks' worth)."""
    tmp = tmp_path_factory.mktemp("one")
    (tmp / "one.plan").write_text("mesh dp=1\n")
    return run(tmp / "one.plan", tmp / "run", "--model", GPT, batch=2 * 2 * MICRO)


def test_zero3_on_dp_pp_tp_trains_like_one_process_and_resumes_on_dp4(
    tmp_path: Path, one_process: list[dict]
) -> None:
    """dp=2 x pp=2 x tp=2 (+ SP, recomputation) on 8 processes, interleaved, ZeRO-3 with
    offload: each stage gathers its own layers per microbatch; the tied weight is on the
    first stage (rank 0) and the last (rank 1), and its gradient pieces are summed between
    them. Saved at step 2, the checkpoint resumes on dp=4 with ZeRO-1 (no pipeline, no tensor
    parallelism) and goes on as the uninterrupted run does."""
    path = pipeline_plan(
        tmp_path, "dpvtp", schedule="interleaved", virtual=2, mesh="dp=2, pp=2, tp=2", rules=GPT_RULES
    )
    path.write_text(path.read_text() + ZERO3_OFFLOAD)
    out = tmp_path / "run"
    same_steps(run(path, out, "--model", GPT, "--save-every", "2", steps=2), one_process[:2])
    (tmp_path / "dp4.plan").write_text("mesh dp=4\n" + data_parallel(zero=1))
    resumed = run(tmp_path / "dp4.plan", out, "--model", GPT, "--resume", batch=16 // 4)
    same_steps([r for r in resumed if r["step"] > 2], one_process[2:])


def test_zero3_under_a_v_schedule_with_the_tied_weight_on_one_rank(
    tmp_path: Path, one_process: list[dict]
) -> None:
    """ZBV on dp=2 x pp=2 with ZeRO-3: rank 0 runs the first stage and the last, both reading
    the tied weight, with each backward split (weight gradients later, after other
    microbatches' forwards). The weight is one flat in a unit of each stage, reduced at the
    end of the step (each stage's last backward is synchronized, neither is the weight's
    last); a layer stays gathered from its input gradients to its weight gradients (a
    LayerNorm's weight gradient reads the weight)."""
    block = data_parallel(zero=3, bucket="16KB")
    path = pipeline_plan(tmp_path, "zbv", schedule="zbv", virtual=2, mesh="dp=2, pp=2", extra=block)
    same_steps(run(path, tmp_path / "run", "--model", GPT), one_process)
