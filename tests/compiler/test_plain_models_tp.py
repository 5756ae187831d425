"""Tensor parallelism on models written the ways plain PyTorch code writes them (plain_models.py):
linears as matmuls, fused q/k/v reshaped as timm does or chunked, a state-space-style input
projection chunked in two, and nn.MultiheadAttention. In float64, one forward and backward of the
compiled program on gloo ranks matches the unpartitioned model to rounding, and what the plan
splits is split: no activation is all-gathered (no whole-tensor fallback)."""

from pathlib import Path

import pytest
from gloo_pool import spawn
from parity import grad_parity
from plans import plan

HERE = Path(__file__).resolve().parent
MODELS = f"{HERE}/plain_models.py"

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
}

pytestmark = pytest.mark.slow


def cases(rank: int, world_size: int) -> dict[str, dict]:
    return {
        name: grad_parity(rank, world_size, plan(rules), f"{MODELS}:{name}", "float64")
        for name, rules in CASES.items()
    }


def test_plain_pytorch_layouts_split_exactly():
    for by_case in spawn(cases, 2, (), timeout_s=300):
        for case, r in by_case.items():
            assert r["loss"] <= 1e-12 and r["grad"] <= 1e-10, (case, r)
            assert "gather_replicated_tp" not in r["collectives"], (case, r["collectives"])
            assert {"copy_to_tp", "all_reduce_tp"} <= set(r["collectives"]), (case, r["collectives"])
