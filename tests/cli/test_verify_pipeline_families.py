"""`meshplan verify` of one pipeline plan (pp=2, 1F1B, 2 microbatches) on every model family the
suite has a factory for that captures without an experts rule: decoder-only (Llama, nanoGPT,
torchtitan's Llama, GPT-2 with its head tied across the stages), an encoder (BERT), an
encoder-decoder (T5, its head tied to the embedding both stages read: the decoder's inputs are
the labels shifted right inside forward, written in place into a tensor of zeros, which the
decoder's stage must remake with the writes), and mixtures of experts (the example's and a
dropless one, dense on each rank; Hugging Face's MoEs need an experts rule to capture, or run
grouped_mm, which has no float64). A later stage that needs a value made from the inputs or
computed early must get the value the unpartitioned model computes, from step 1 on. (Qwen2, Phi-3
and GPT-NeoX cut between layers as Llama does: their pipelines are the Llama's, and their layers
are held to one device under tensor parallelism in tests/compiler/test_tp_parity.py.)
"""

from pathlib import Path

import pytest
from gloo_pool import shared_processes

from meshplan.verify import render, verify

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests/compiler"
HF = TESTS / "hf_factories.py"

PLAN = "mesh pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 2\n}\n"
# T5 under ZeRO-3 too: its relative position bias, made from a weight and fixed buckets, is read
# by both stages and owned by neither; each stage's unit gathers the weight for its own copy
ZERO3 = PLAN.replace("mesh pp=2", "mesh dp=2, pp=2") + "\ndata_parallel over dp {\n    zero = 3\n}\n"
CUT_DECODER = (
    "mesh pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 2\n    cut before decoder\n}\n"
)


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


@pytest.mark.slow
@pytest.mark.parametrize(
    ("factory", "text"),
    [
        (f"{HF}:hf_llama", PLAN),
        (f"{HF}:hf_gpt2", PLAN),
        (f"{HF}:hf_bert_mlm", PLAN),
        (f"{HF}:hf_t5", PLAN),  # balanced: the cut falls inside the decoder
        (f"{HF}:hf_t5_scaled", CUT_DECODER),
        (f"{HF}:hf_t5", ZERO3),
        (f"{TESTS}/factories.py:nanogpt", PLAN),
        (f"{TESTS}/factories.py:titan_llama", PLAN),
        (f"{TESTS}/factories.py:dropless_moe", PLAN),
        (f"{ROOT}/examples/models/moe.py:build", PLAN),
    ],
    ids=[
        "hf-llama",
        "hf-gpt2",
        "hf-bert-mlm",
        "hf-t5",
        "hf-t5-scaled-cut-before-decoder",
        "hf-t5-zero3-over-dp",
        "nanogpt",
        "titan-llama",
        "dropless-moe",
        "example-moe",
    ],
)
def test_a_pipeline_trains_each_family_as_one_device_does(tmp_path, factory, text):
    pytest.importorskip("transformers")
    path = tmp_path / "pp.plan"
    path.write_text(text)
    report = verify(str(path), factory, steps=1, batch=2, seq=16)
    assert report.ok, render(report)
    assert report.float64, report.why_not_float64
    assert report.job.microbatches == 2
