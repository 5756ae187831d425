"""Hugging Face model families compile to the Megatron minimum without changes to their code.

Each is built from a small config with random weights. Parity on gloo for a fused
layout is in test_tp_parity.py; here: compile, the ledger, and the fused-weight layouts.
"""

from pathlib import Path

import pytest
from plans import NEOX_TP, PHI3_TP, llama_tp

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import load_model
from meshplan.compiler.placement import Shard
from meshplan.dsl import check_text

pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize(
    ("factory", "plan"),
    [
        ("hf_llama", llama_tp(2, "model.")),
        ("hf_qwen2", llama_tp(2, "model.")),
        ("hf_phi3", PHI3_TP),
        ("hf_neox", NEOX_TP),
    ],
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
    compiled = compile_plan(check_text(PHI3_TP, "hf.plan"), load_model(f"{HERE}/hf_factories.py:hf_phi3"))
    placements = compiled.param_placements
    # q: 4 heads x 16, k and v: 2 kv heads x 16 each
    assert placements["model.layers.0.self_attn.qkv_proj.weight"] == {"tp": Shard(0, (64, 32, 32))}
    assert placements["model.layers.0.mlp.gate_up_proj.weight"] == {"tp": Shard(0, (128, 128))}


def test_neox_fused_qkv_is_head_major_and_needs_no_blocks():
    compiled = compile_plan(check_text(NEOX_TP, "hf.plan"), load_model(f"{HERE}/hf_factories.py:hf_neox"))
    assert compiled.param_placements["gpt_neox.layers.0.attention.query_key_value.weight"] == {"tp": Shard(0)}


def test_an_experts_loop_export_cannot_read_names_the_rule_that_makes_it_one_unit():
    """GPT-OSS's experts module loops over the experts that got tokens (`for expert_idx in
    expert_hit`), a decision on the data: a plan without an experts rule cannot capture it,
    and the hint names the rule that takes the module as one unit."""
    from meshplan.compiler.errors import CaptureError

    text = "mesh tp=2\n\nmodules {\n    model.layers.*.self_attn.o_proj: row over tp\n}\n"
    with pytest.raises(CaptureError) as caught:
        compile_plan(
            check_text(text, "hf.plan"), load_model(f"{HERE}/hf_factories.py:hf_gpt_oss"), dynamic=False
        )
    assert "(`for expert_idx in expert_hit:`)" in caught.value.message
    assert caught.value.hint is not None
    assert "a rule `model.layers.*.mlp.experts: experts over AXIS` captures that module" in caught.value.hint


def test_a_norm_over_key_value_heads_several_ranks_share_is_refused_at_the_rule():
    """OLMo 2 at tp=4: its 2 key/value heads are each kept by two ranks, and its k-norm weight
    (one entry per feature of every head) would have to be cut to them: refused, said at the
    op and the rule that split k_proj (it was said at the mesh line, about a weight)."""
    from meshplan.dsl.errors import PlanError

    text = llama_tp(4, "model.")
    with pytest.raises(PlanError) as raised:
        compile_plan(check_text(text, "olmo.plan"), load_model(f"{HERE}/hf_factories.py:hf_olmo2"))
    (error,) = raised.value.diagnostics
    assert "`model.layers.0.self_attn.k_norm`" in error.message and "replicated over `tp`" in error.message
    k_proj = next(i for i, line in enumerate(text.splitlines(), 1) if "{q,k,v}_proj" in line)
    assert error.span.line == k_proj
