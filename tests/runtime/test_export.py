"""--export writes full weights that the unpartitioned model loads strictly, from a TP run
(`meshplan run` minus torchrun: tests/runs.py)."""

from pathlib import Path

import pytest
import torch
from runs import meshplan_run

from meshplan.examples import CORPUS
from meshplan.examples.models import llama
from meshplan.runtime.data import TextBatches

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_tensor_parallel_run_exports_a_loadable_state_dict(tmp_path, suffix):
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    target = tmp_path / f"model{suffix}"
    meshplan_run(
        *(str(ROOT / "examples/llama_tp.plan"), "--steps", "20", "--batch", "4", "--seq", "32"),
        *("--out", str(tmp_path / "run"), "--export", str(target)),
    )
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(target))
    else:
        state = torch.load(target, weights_only=True)
    model, untrained = llama.build(), llama.build()
    model.load_state_dict(state, strict=suffix == ".pt")
    assert set(model.state_dict()) - set(state) <= {"lm_head.weight"}  # safetensors keeps one name per tie
    assert not torch.equal(model.lm_head.weight, untrained.lm_head.weight)
    # the trained weights, put back together from both ranks' shards, predict the corpus better
    batch = TextBatches.from_file(CORPUS, batch=4, seq=32, seed=123)
    input_ids, labels = batch(0, 0)
    with torch.no_grad():
        assert model(input_ids, labels) < untrained(input_ids, labels) - 1.0


def test_a_safetensors_file_keeps_each_view_of_a_stacked_tensor_and_a_tied_weight_once(tmp_path):
    from safetensors.torch import load_file

    from meshplan.runtime.export import write_state_dict

    stacked = torch.arange(12.0).reshape(3, 4)  # three experts' rows, as a list's export cuts them
    embedding = torch.ones(2, 2)
    state = {f"experts.{i}.w": stacked[i] for i in range(3)} | {"embed": embedding, "head": embedding}
    write_state_dict(state, tmp_path / "model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == ["embed", "experts.0.w", "experts.1.w", "experts.2.w"]
    assert all(torch.equal(saved[f"experts.{i}.w"], stacked[i]) for i in range(3))
