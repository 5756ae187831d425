"""Tensor and sequence parallelism on the models users bring, against the unpartitioned model.

Each family is built in-process from a small config (no download) and compiled under a
Megatron layout at tp=2, with and without sequence parallelism; one forward and backward on
gloo ranks must give the unpartitioned model's loss and gradients. float64 shows the
rewrite is exact (rounding of about 1e-15). Two exceptions, both the model's own: Hugging
Face's causal-LM loss casts the logits to float32 (`logits.float()`), so GPT-2's loss and
everything downstream of it carries float32 rounding (about 1e-7); Mixtral runs in float32
(its grouped matmul has no float64 kernel on CPU), rounding through two layers.

What each family exercises:
- GPT-2: Conv1D (weights stored (in, out)), fused c_attn, tied embeddings, and `view(-1, H)`
  around every linear, which flattens a sequence shard with the batch (blocks, not a gather);
- BERT: post-norm LayerNorms under `sequence`, the same flattening; a vocab-parallel MLM head
  whose decoder bias is also `cls.predictions.bias` (placed through the decoder's rule);
- Mixtral: the MoE block's dispatch has no sharding rule; under SP it runs on whole tokens;
- a torchtitan-style Llama: nn.RMSNorm (aten.rms_norm) and complex RoPE (view_as_complex),
  placed by DTensor's own strategies; logits sharded by token into a sum-reduced loss;
- PyTorch's DTensor test Transformer (`common_dtensor`): tied embedding and output, learned
  positions, logits cast with `.float()` (hence float32 rounding on its loss).

Then GQA with fewer key/value heads than ranks (tp=4), and the families trained under
dp=2 x tp=2 with SP and ZeRO-3, most with checkpointing, by `meshplan verify` (end of the file).
The jobs of one world size run on the same processes (`gloo_pool`): starting them and importing
the models' libraries was most of a job's cost.
"""

import traceback
from pathlib import Path

import pytest
from gloo_pool import shared_processes
from parity import grad_parity
from plans import (
    BERT_RULES,
    BERT_SEQUENCE,
    DTENSOR_RULES,
    DTENSOR_SEQUENCE,
    GPT2_RULES,
    GPT2_SEQUENCE,
    MIXTRAL_RULES,
    TITAN_RULES,
    TITAN_SEQUENCE,
    llama_rules,
    llama_sequence,
    llama_tp,
    plan,
)

from meshplan.runtime import launch

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
FAMILIES = {  # name: (factory, tensor rules, sequence rules, dtype)
    "gpt2": ("hf_factories.py:hf_gpt2", GPT2_RULES, GPT2_SEQUENCE, "float64"),
    "bert": ("hf_factories.py:hf_bert_mlm", BERT_RULES, BERT_SEQUENCE, "float64"),
    "mixtral": ("hf_factories.py:hf_mixtral", MIXTRAL_RULES, llama_sequence("model."), "float32"),
    "titan_llama": ("factories.py:titan_llama", TITAN_RULES, TITAN_SEQUENCE, "float64"),
    "dtensor_transformer": ("factories.py:dtensor_transformer", DTENSOR_RULES, DTENSOR_SEQUENCE, "float64"),
}

TOLERANCE = {"gpt2": 1e-6, "bert": 1e-12, "mixtral": 1e-5, "titan_llama": 1e-12, "dtensor_transformer": 1e-6}


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


def cells(rank: int, world_size: int, family: str) -> dict[str, dict]:
    factory, tensor, sequence, dtype = FAMILIES[family]
    spec = f"{HERE}/{factory}"
    return {
        "tp": grad_parity(rank, world_size, plan(tensor), spec, dtype),
        "tp_sp": grad_parity(rank, world_size, plan(tensor + sequence), spec, dtype),
    }


def every_family(rank: int, world_size: int) -> dict[str, dict[str, dict] | str]:
    """`cells` of each family (or the traceback of the one that raised): one spawn for all."""
    out: dict[str, dict[str, dict] | str] = {}
    for family in sorted(FAMILIES):
        try:
            out[family] = cells(rank, world_size, family)
        except Exception:
            out[family] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def family_cells() -> list[dict[str, dict[str, dict] | str]]:
    """Each rank's `cells` by family: starting processes and importing the models' libraries is
    most of a family's cost, so every family runs in one spawn of two processes."""
    return launch.spawn(every_family, 2, (), timeout_s=600)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp_and_sequence_parallel_match_one_device(family_cells, family: str) -> None:
    tolerance = TOLERANCE[family]
    for by_family in family_cells:
        by_cell = by_family[family]
        assert isinstance(by_cell, dict), by_cell
        for cell, r in by_cell.items():
            assert r["loss"] <= tolerance and r["grad"] <= tolerance, (cell, r)


def test_a_whole_tensor_fallback_names_the_sequence_rule_behind_it() -> None:
    """Mixtral's expert dispatch has no sharding rule: under SP it runs on whole tokens, and the
    warning points at the `sequence` rule that sharded them, not at an unrelated line."""
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model
    from meshplan.dsl import check_text

    factory, tensor, sequence, _ = FAMILIES["mixtral"]
    text = plan(tensor + sequence)
    compiled = compile_plan(check_text(text, "mixtral.plan", world_size=2), load_model(f"{HERE}/{factory}"))
    (warning, *_) = [w for w in compiled.warnings if "runs on whole tensors" in w.message]
    assert "sequence over tp" in text.splitlines()[warning.span.line - 1]
    assert "`index` in `model.layers.0.mlp.experts`" in warning.message


def gqa_cells(rank: int, world_size: int) -> dict[str, dict]:
    llama_gqa = f"{HERE}/factories.py:llama_gqa"
    return {
        "llama_gqa": grad_parity(rank, world_size, llama_tp(4), llama_gqa, "float64"),
        "llama_gqa_sp": grad_parity(
            rank, world_size, plan(llama_rules() + llama_sequence(), mesh="tp=4"), llama_gqa, "float64"
        ),
        "qwen2": grad_parity(
            rank, world_size, llama_tp(4, "model."), f"{HERE}/hf_factories.py:hf_qwen2", "float64"
        ),
        # GQA by repeat_interleave after complex RoPE on the shared kv heads (view_as_complex,
        # mul, view_as_real decided by DTensor's strategies on each rank's chunk)
        "titan_llama_sp": grad_parity(
            rank,
            world_size,
            plan(TITAN_RULES + TITAN_SEQUENCE, mesh="tp=4"),
            f"{HERE}/factories.py:titan_llama",
            "float64",
        ),
        # the same with a whole tensor meeting the shared kv heads after RoPE
        "titan_llama_lerp": grad_parity(
            rank,
            world_size,
            plan(TITAN_RULES, mesh="tp=4"),
            f"{HERE}/factories.py:titan_llama_lerp",
            "float64",
        ),
    }


def test_fewer_key_value_heads_than_ranks_are_replicated() -> None:
    """GQA at tp=4 with 2 kv heads (the example Llama with 8 query heads, Qwen2 with 4, the
    torchtitan-style Llama): each rank keeps the kv head its query heads use. Qwen2's loss and
    the torchtitan-style Llama's RoPE are float32 inside."""
    for by_cell in launch.spawn(gqa_cells, 4, (), timeout_s=300):
        for cell, r in by_cell.items():
            # the torchtitan-style Llama rotates k in float32 (`xk.float()`): under replication its
            # backward rounds each rank's share of a kv head's gradient before the sum
            tolerance = 1e-6 if cell in ("qwen2", "titan_llama_sp", "titan_llama_lerp") else 1e-12
            assert r["loss"] <= tolerance and r["grad"] <= tolerance, (cell, r)
            assert "kv_group_tp" in r["collectives"], cell


# ---------------------------------------------------------------------------- trained: dp2 x tp2 + SP + ZeRO-3
# The production layout, trained for a few AdamW steps on four gloo processes by `meshplan verify`
# (`meshplan run`'s own worker setup and loop) beside the float64 model and the one-device
# yardstick: HF GPT-2, Llama, Qwen2, the torchtitan-style Llama and PyTorch's DTensor test
# Transformer, with and without checkpointing.

TRAINED = {  # name: (factory, modules block)
    "gpt2": ("hf_factories.py:hf_gpt2", GPT2_RULES + GPT2_SEQUENCE),
    "llama": ("hf_factories.py:hf_llama", llama_rules("model.") + llama_sequence("model.")),
    "qwen2": ("hf_factories.py:hf_qwen2", llama_rules("model.") + llama_sequence("model.")),
    "titan_llama": ("factories.py:titan_llama", TITAN_RULES + TITAN_SEQUENCE),
    "dtensor_transformer": ("factories.py:dtensor_transformer", DTENSOR_RULES + DTENSOR_SEQUENCE),
}
CHECKPOINTED = {"gpt2": "transformer.h.*", "llama": "model.layers.*", "qwen2": "model.layers.*"}


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_sp_zero3_trains_like_one_device(tmp_path, family: str) -> None:
    from meshplan.verify import render, verify

    factory, modules = TRAINED[family]
    if family in CHECKPOINTED:
        modules += f"    {CHECKPOINTED[family]}: checkpoint\n"
    path = tmp_path / f"{family}.plan"
    path.write_text(plan(modules, mesh="dp=2, tp=2", extra="\ndata_parallel over dp {\n    zero = 3\n}\n"))
    report = verify(str(path), f"{HERE}/{factory}", steps=3)
    assert report.ok and report.float64, render(report)
