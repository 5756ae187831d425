"""Hugging Face model families compile to the Megatron minimum without changes to their code.

Each is built from a small config with random weights. Parity on gloo for a fused
layout is in test_tp_parity.py; here: compile, the ledger, and the fused-weight layouts.
"""

from pathlib import Path

import pytest

from meshplan.compiler.capture import load_model
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.placement import Shard
from meshplan.dsl import check_text

pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent

SEPARATE = """
mesh tp=2
modules {
    model.layers.*.self_attn.{q,k,v}_proj: column over tp
    model.layers.*.self_attn.o_proj:       row over tp
    model.layers.*.mlp.{gate,up}_proj:     column over tp
    model.layers.*.mlp.down_proj:          row over tp
    model.embed_tokens:                    vocab over tp
    lm_head:                               vocab over tp
}
"""

PHI3 = """
mesh tp=2
modules {
    model.layers.*.self_attn.qkv_proj: column over tp
    model.layers.*.self_attn.o_proj:   row over tp
    model.layers.*.mlp.gate_up_proj:   column over tp
    model.layers.*.mlp.down_proj:      row over tp
    model.embed_tokens:                vocab over tp
    lm_head:                           vocab over tp
}
"""

NEOX = """
mesh tp=2
modules {
    gpt_neox.layers.*.attention.query_key_value: column over tp
    gpt_neox.layers.*.attention.dense:           row over tp
    gpt_neox.layers.*.mlp.dense_h_to_4h:         column over tp
    gpt_neox.layers.*.mlp.dense_4h_to_h:         row over tp
    gpt_neox.embed_in:                           vocab over tp
    lm_head:                                     vocab over tp
}
"""


@pytest.mark.parametrize(
    ("factory", "plan"),
    [("hf_llama", SEPARATE), ("hf_qwen2", SEPARATE), ("hf_phi3", PHI3), ("hf_neox", NEOX)],
)
def test_minimal_collectives(factory, plan):
    compiled = compile_plan(check_text(plan, "hf.plan"), load_model(f"{HERE}/hf_factories.py:{factory}"))
    layers = 2
    # per block: 2 all-reduces forward (after the row splits), 2 backward (before the column groups);
    # plus the embedding (forward), the LM head's input (backward) and the vocab-parallel loss (3 forward)
    assert compiled.ledger.count("all_reduce", "forward") == 2 * layers + 1 + 3
    assert compiled.ledger.count("all_reduce", "backward") == 2 * layers + 1
    assert compiled.ledger.count() == compiled.ledger.count("all_reduce")


def test_phi3_fused_weights_are_cut_per_block():
    compiled = compile_plan(check_text(PHI3, "hf.plan"), load_model(f"{HERE}/hf_factories.py:hf_phi3"))
    placements = compiled.param_placements
    # q: 4 heads x 16, k and v: 2 kv heads x 16 each
    assert placements["model.layers.0.self_attn.qkv_proj.weight"] == {"tp": Shard(0, (64, 32, 32))}
    assert placements["model.layers.0.mlp.gate_up_proj.weight"] == {"tp": Shard(0, (128, 128))}


def test_neox_fused_qkv_is_head_major_and_needs_no_blocks():
    compiled = compile_plan(check_text(NEOX, "hf.plan"), load_model(f"{HERE}/hf_factories.py:hf_neox"))
    assert compiled.param_placements["gpt_neox.layers.0.attention.query_key_value.weight"] == {"tp": Shard(0)}
