"""Tensor-parallel rewrites are exact: in float64, one forward and backward of the compiled
program on gloo ranks matches the unpartitioned model to rounding (about 1e-15), in the same test.

Training-level parity (several AdamW steps in float32 and bf16, under every composition) is
`meshplan verify`'s job: see tests/cli/test_verify.py and test_real_models.py.
"""

from pathlib import Path

import pytest
from gloo_pool import shared_processes, spawn
from parity import grad_parity
from plans import PHI3_TP, llama_rules, llama_sequence, plan

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def processes():
    """`verify`'s ranks on the session's kept processes (`gloo_pool`), not four new ones."""
    with shared_processes():
        yield


EXPLICIT_HEADS = """
mesh tp=2

modules {
    {q,k,v}: column over tp
    out:     row over tp
    embed:   vocab over tp
    head:    vocab over tp
}
"""

GPT_TP = (ROOT / "examples/gpt_tp.plan").read_text()
TOKEN_MIX = (
    "mesh tp=2\n\nmodules {\n    up: column over tp\n    down: row over tp\n    norm: sequence over tp\n}\n"
)

pytestmark = pytest.mark.slow


def cases(rank: int, world_size: int) -> dict[str, dict]:
    return {
        # tied embedding and head, both vocab-parallel
        "gpt_tied": grad_parity(
            rank,
            world_size,
            (ROOT / "examples/gpt_tp.plan").read_text(),
            f"{ROOT}/examples/models/gpt.py:build",
            "float64",
        ),
        # a literal head count in a view, rewritten to the local one
        "explicit_heads": grad_parity(
            rank, world_size, EXPLICIT_HEADS, f"{HERE}/factories.py:explicit_heads", "float64"
        ),
        # vocab-parallel cross-entropy as trainers write it: summed, label-smoothed, per token
        **{
            loss: grad_parity(rank, world_size, GPT_TP, f"{HERE}/factories.py:{loss}", "float64")
            for loss in ("gpt_sum_loss", "gpt_smoothed_loss", "gpt_token_losses")
        },
        # a vocabulary no even tp size divides (511): zero-padded shards that the loss masks; an op
        # with no vocab-parallel rule (log_softmax) gathers the logits and drops the padding
        **{
            name: grad_parity(rank, world_size, GPT_TP, f"{HERE}/factories.py:{name}", "float64")
            for name in ("gpt_odd_vocab", "gpt_odd_vocab_smoothed", "gpt_odd_vocab_log_softmax")
        },
        # a sequence shard moved to the feature dim and back by all-to-alls (softmax over tokens)
        "token_mix": grad_parity(rank, world_size, TOKEN_MIX, f"{HERE}/factories.py:token_mix", "float64"),
        # qkv_proj cut into slices of sizes (64, 32, 32): each rank holds half of each
        "phi3_fused": grad_parity(rank, world_size, PHI3_TP, f"{HERE}/hf_factories.py:hf_phi3", "float64"),
    }


def test_rewrites_are_exact_in_float64():
    pytest.importorskip("transformers")
    for by_case in spawn(cases, 2, (), timeout_s=300):
        for case, r in by_case.items():
            # HF's loss casts logits to float32 inside: 1e-6 on Phi-3. A key bias's true gradient
            # is zero (softmax cancels it): its rounding is measured against 1e-6 of the whole
            # gradient, hence 1e-10 rather than 1e-12 on gradients.
            loss, grad = (1e-6, 1e-6) if case == "phi3_fused" else (1e-12, 1e-10)
            assert r["loss"] <= loss and r["grad"] <= grad, (case, r)
            if case == "token_mix":
                assert "all_to_all_tp" in r["collectives"], r["collectives"]
            if case.startswith("gpt") and not case.endswith("log_softmax"):  # the logits are never gathered
                assert "vocab_cross_entropy_tp" in r["collectives"], (case, r["collectives"])
                assert "gather_replicated_tp" not in r["collectives"], (case, r["collectives"])


def test_llama_tp4_sequence_parallel_trains_like_one_device(tmp_path):
    from meshplan.verify import render, verify

    path = tmp_path / "tp4.plan"
    path.write_text(plan(llama_rules() + llama_sequence(), mesh="tp=4"))
    report = verify(str(path), f"{HERE}/factories.py:llama_tp4", steps=2)
    assert report.ok and report.float64, render(report)
