"""Tensor parallelism on models written the ways plain PyTorch code writes them (plain_models.py):
linears as matmuls, fused q/k/v reshaped as timm does or chunked, a state-space-style input
projection chunked in two, and nn.MultiheadAttention. In float64, one forward and backward of the
compiled program on gloo ranks matches the unpartitioned model to rounding, and what the plan
splits is split: no activation is all-gathered (no whole-tensor fallback)."""

from pathlib import Path

import pytest
from gloo_pool import shared_processes, spawn
from parity import grad_parity
from plans import plan

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODELS = f"{HERE}/plain_models.py"


@pytest.fixture(scope="module", autouse=True)
def processes():
    """`verify`'s ranks on the session's kept processes (`gloo_pool`), not four new ones."""
    with shared_processes():
        yield


SEPARATE = """
    blocks.*.attn.{q,k,v}: column over tp
    blocks.*.attn.proj:    row over tp
    blocks.*.fc1:          column over tp
    blocks.*.fc2:          row over tp
"""
FUSED = """
    blocks.*.attn.qkv:  column over tp
    blocks.*.attn.proj: row over tp
    blocks.*.fc1:       column over tp
    blocks.*.fc2:       row over tp
"""
GATED = """
    mixers.*.in_proj:  column over tp
    mixers.*.out_proj: row over tp
"""
MHA = """
    encoder.layers.*.self_attn:          column over tp
    encoder.layers.*.self_attn.out_proj: row over tp
    encoder.layers.*.linear1:            column over tp
    encoder.layers.*.linear2:            row over tp
"""

DIRECT_MHA = """
    layers.*.attn:          column over tp
    layers.*.attn.out_proj: row over tp
    layers.*.mlp.0:         column over tp
    layers.*.mlp.2:         row over tp
"""

CROSS_MHA = """
    layers.*.attn:          column over tp
    layers.*.attn.out_proj: row over tp
"""

CASES = {
    "matmul_gpt": SEPARATE,  # x @ self.weight.T + self.bias
    "matmul_gpt_transposed": SEPARATE,  # x @ self.weight, stored (in, out)
    "timm_attention": FUSED,  # qkv(x).reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
    "timm_matmul": FUSED,  # the same, the fused projection a matmul plus its bias
    "chunked_qkv": FUSED,  # qkv(x).chunk(3, dim=-1)
    "gated_mixer": GATED,  # in_proj(x).transpose(1, 2).chunk(2, dim=1)
    # nn.MultiheadAttention: its packed in_proj_weight split as q, k, v blocks by heads
    "encoder_lm": MHA,  # nn.TransformerEncoder, batch first, causal
    "encoder_lm_seq_first": MHA,  # sequence first
    "direct_mha": DIRECT_MHA,  # need_weights, a boolean mask and a key padding mask
    "cross_mha": CROSS_MHA,  # cross-attention: in_proj_weight.view(3, E, E)[i], one piece a product
    "cross_mha_kdim": CROSS_MHA,  # keys of another width: q/k/v weights apart, one packed bias
}

# attention left whole between norms on sequence shards: its input gathered at its door
WHOLE_ATTENTION = """
    layers.*.mlp.{gate,up}_proj:                 column over tp
    layers.*.mlp.down_proj:                      row over tp
    layers.*.{input,post_attention}_layernorm:   sequence over tp
    norm:                                        sequence over tp
"""

pytestmark = pytest.mark.slow


def cases(rank: int, world_size: int) -> dict[str, dict]:
    return {
        **{
            name: grad_parity(rank, world_size, plan(rules), f"{MODELS}:{name}", "float64")
            for name, rules in CASES.items()
        },
        # the norms on sequence shards: the head, a matmul by a whole weight, takes token rows
        "matmul_gpt+sp": grad_parity(
            rank,
            world_size,
            plan(SEPARATE + "    blocks.*.{norm1,norm2}: sequence over tp\n"),
            f"{MODELS}:matmul_gpt",
            "float64",
        ),
        "whole_attention": grad_parity(
            rank, world_size, plan(WHOLE_ATTENTION), f"{ROOT}/examples/models/llama.py:build", "float64"
        ),
    }


def test_plain_pytorch_layouts_split_exactly():
    for by_case in spawn(cases, 2, (), timeout_s=300):
        for case, r in by_case.items():
            assert r["loss"] <= 1e-12 and r["grad"] <= 1e-10, (case, r)
            if case == "whole_attention":
                continue
            assert "gather_replicated_tp" not in r["collectives"], (case, r["collectives"])
            assert {"copy_to_tp", "all_reduce_tp"} <= set(r["collectives"]), (case, r["collectives"])


def test_a_whole_attention_between_sequence_shards_is_gathered_at_its_door():
    """Not refused at the mesh line: a warning at the sequence rule whose shards are gathered,
    one all-gather per layer's attention input, and every projection inside it whole."""
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model
    from meshplan.dsl import check_text

    source = load_model(f"{ROOT}/examples/models/llama.py:build")
    compiled = compile_plan(check_text(plan(WHOLE_ATTENTION), "whole.plan"), source, dynamic=False)
    (warning,) = [w for w in compiled.warnings if "attend over the whole sequence" in w.message]
    assert warning.span.line == 6  # the norms' sequence rule
    assert "`layers.1.self_attn` and 2 more like it" in warning.message  # layer 0's input is whole
    gathers = [row for row in compiled.ledger.rows if row.phase == "forward" and row.op == "all_gather"]
    assert sum(row.count for row in gathers if row.rule is not None and row.rule.line == 6) == 3


def test_multihead_attention_under_context_parallelism_with_its_heads_split(tmp_path):
    """Captured head-first, nn.MultiheadAttention is one sdpa call: ring attention over `cp`
    replaces it, its heads split over `tp` beside, and the model trains as one device does."""
    from meshplan.verify import render, verify

    path = tmp_path / "mha_cp_tp.plan"
    path.write_text(
        plan(
            "\n    encoder.layers.*.self_attn: context ring over cp\n"
            + MHA.split("    encoder.layers.*.linear1")[0],
            mesh="cp=2, tp=2",
        )
    )
    report = verify(str(path), f"{MODELS}:encoder_lm", steps=2)
    assert report.ok and report.float64, render(report)
