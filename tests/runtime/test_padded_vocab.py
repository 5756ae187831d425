"""A vocabulary no tensor-parallel size divides (511 over tp=2): each rank holds 256 rows, the
last one zero padding. Checkpoints and exports hold the true 511 rows, so a run saved under
dp2 x tp2 + SP + ZeRO-3 resumes on a layout without tensor parallelism and back, and the
unpartitioned model loads the export strictly. Training numerics are in test_tp_parity.py
(float64 gradients) and test_verify.py."""

from pathlib import Path

import pytest
import torch
from runs import meshplan_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = f"{ROOT}/tests/compiler/factories.py:gpt_odd_vocab"

DP_TP = """
mesh dp=2, tp=2

modules {
    h.*.attn.{q,k,v}_proj: column over tp
    h.*.attn.out_proj:     row over tp
    h.*.mlp.fc:            column over tp
    h.*.mlp.proj:          row over tp
    wte:                   vocab over tp
    lm_head:               vocab over tp
    h.*.ln_{1,2}:          sequence over tp
    ln_f:                  sequence over tp
}

data_parallel over dp { zero = 3 }
"""

DP2 = "mesh dp=2\n\ndata_parallel over dp { zero = 1 }\n"


def run(tmp_path: Path, plan: str, export: str, *extra: str) -> dict[str, torch.Tensor]:
    path = tmp_path / f"{export}.plan"
    path.write_text(plan)
    target = tmp_path / f"{export}.pt"
    meshplan_run(
        *(str(path), "--model", MODEL, "--steps", "3", "--save-every", "3"),
        *("--batch", "2", "--seq", "32", "--out", str(tmp_path / "run"), "--export", str(target)),
        *extra,
    )
    return torch.load(target, weights_only=True)


def test_padded_shards_save_export_and_reshard_without_their_padding(tmp_path):
    from meshplan.compiler.load import load_model

    trained = run(tmp_path, DP_TP, "dp_tp")
    model = load_model(MODEL).model
    model.load_state_dict(trained, strict=True)  # 511 rows, no padding
    assert trained["wte.weight"].shape == (511, 64)
    # the checkpoint, loaded without tensor parallelism and back into padded shards, is unchanged
    on_dp = run(tmp_path, DP2, "dp", "--resume")
    back = run(tmp_path, DP_TP, "back", "--resume")
    for name, tensor in trained.items():
        assert torch.equal(on_dp[name], tensor), name
        assert torch.equal(back[name], tensor), name
