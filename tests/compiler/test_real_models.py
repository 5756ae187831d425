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
- BERT: post-norm LayerNorms under `sequence`, the same flattening;
- Mixtral: the MoE block's dispatch has no sharding rule; under SP it runs on whole tokens;
- a torchtitan-style Llama: nn.RMSNorm (aten.rms_norm) and complex RoPE (view_as_complex),
  placed by DTensor's own strategies; logits sharded by token into a sum-reduced loss.
"""

from pathlib import Path

import pytest
from parity import grad_parity

from meshplan.runtime.launch import spawn

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
FAMILIES = {  # name: (factory, tensor rules, sequence rules, dtype)
    "gpt2": (
        "hf_factories.py:hf_gpt2",
        """
    transformer.h.*.attn.c_attn: column over tp
    transformer.h.*.attn.c_proj: row over tp
    transformer.h.*.mlp.c_fc:    column over tp
    transformer.h.*.mlp.c_proj:  row over tp
    transformer.wte:             vocab over tp
    lm_head:                     vocab over tp
""",
        """
    transformer.h.*.{ln_1,ln_2}: sequence over tp
    transformer.ln_f:            sequence over tp
""",
        "float64",
    ),
    "bert": (
        "hf_factories.py:hf_bert_mlm",
        """
    bert.encoder.layer.*.attention.self.{query,key,value}: column over tp
    bert.encoder.layer.*.attention.output.dense:           row over tp
    bert.encoder.layer.*.intermediate.dense:               column over tp
    bert.encoder.layer.*.output.dense:                     row over tp
""",
        """
    bert.encoder.layer.*.attention.output.LayerNorm: sequence over tp
    bert.encoder.layer.*.output.LayerNorm:           sequence over tp
""",
        "float64",
    ),
    "mixtral": (
        "hf_factories.py:hf_mixtral",
        """
    model.layers.*.self_attn.{q,k,v}_proj: column over tp
    model.layers.*.self_attn.o_proj:       row over tp
    model.embed_tokens:                    vocab over tp
    lm_head:                               vocab over tp
""",
        """
    model.layers.*.{input,post_attention}_layernorm: sequence over tp
    model.norm:                                      sequence over tp
""",
        "float32",
    ),
    "titan_llama": (
        "factories.py:titan_llama",
        """
    layers.*.attention.{wq,wk,wv}: column over tp
    layers.*.attention.wo:         row over tp
    layers.*.feed_forward.{w1,w3}: column over tp
    layers.*.feed_forward.w2:      row over tp
    tok_embeddings:                vocab over tp
""",
        """
    layers.*.{attention_norm,ffn_norm}: sequence over tp
    norm:                               sequence over tp
""",
        "float64",
    ),
}
TOLERANCE = {"gpt2": 1e-6, "bert": 1e-12, "mixtral": 1e-5, "titan_llama": 1e-12}


def plan(rules: str) -> str:
    return f"mesh tp=2\n\nmodules {{{rules}}}\n"


def cells(rank: int, world_size: int, family: str) -> dict[str, dict]:
    factory, tensor, sequence, dtype = FAMILIES[family]
    spec = f"{HERE}/{factory}"
    return {
        "tp": grad_parity(rank, world_size, plan(tensor), spec, dtype),
        "tp_sp": grad_parity(rank, world_size, plan(tensor + sequence), spec, dtype),
    }


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp_and_sequence_parallel_match_one_device(family: str) -> None:
    tolerance = TOLERANCE[family]
    for by_cell in spawn(cells, 2, (family,), timeout_s=300):
        for cell, r in by_cell.items():
            assert r["loss"] <= tolerance and r["grad"] <= tolerance, (cell, r)


def test_a_whole_tensor_fallback_names_the_sequence_rule_behind_it() -> None:
    """Mixtral's expert dispatch has no sharding rule: under SP it runs on whole tokens, and the
    warning points at the `sequence` rule that sharded them, not at an unrelated line."""
    from meshplan.compiler.capture import load_model
    from meshplan.compiler.compile import compile_plan
    from meshplan.dsl import check_text

    factory, tensor, sequence, _ = FAMILIES["mixtral"]
    text = plan(tensor + sequence)
    compiled = compile_plan(check_text(text, "mixtral.plan", world_size=2), load_model(f"{HERE}/{factory}"))
    (warning, *_) = [w for w in compiled.warnings if "runs on whole tensors" in w.message]
    assert "sequence over tp" in text.splitlines()[warning.span.line - 1]
    assert "`index` in `model.layers.0.mlp.experts`" in warning.message


def gqa_cells(rank: int, world_size: int) -> dict[str, dict]:
    from tp_plans import llama_tp

    sequence = (
        "    layers.*.{input,post_attention}_layernorm: sequence over tp\n    norm: sequence over tp\n}\n"
    )
    return {
        "llama_gqa": grad_parity(rank, world_size, llama_tp(4), f"{HERE}/factories.py:llama_gqa", "float64"),
        "llama_gqa_sp": grad_parity(
            rank,
            world_size,
            llama_tp(4).rstrip().removesuffix("}") + sequence,
            f"{HERE}/factories.py:llama_gqa",
            "float64",
        ),
        "qwen2": grad_parity(
            rank, world_size, llama_tp(4, "model."), f"{HERE}/hf_factories.py:hf_qwen2", "float64"
        ),
    }


def test_fewer_key_value_heads_than_ranks_are_replicated() -> None:
    """GQA at tp=4 with 2 kv heads (the example Llama with 8 query heads, Qwen2 with 4): each
    rank keeps the kv head its query heads use. Qwen2's loss is float32 inside (see above)."""
    for by_cell in spawn(gqa_cells, 4, (), timeout_s=300):
        for cell, r in by_cell.items():
            tolerance = 1e-6 if cell == "qwen2" else 1e-12
            assert r["loss"] <= tolerance and r["grad"] <= tolerance, (cell, r)
            assert "kv_group_tp" in r["collectives"], cell
