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


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_file_is_written_a_tensor_at_a_time_and_reads_back_exactly(tmp_path, suffix):
    """Views of one stacked tensor (a list of experts) each whole; a tied weight once, under
    every name in a torch file; every dtype a model holds; an empty tensor."""
    from meshplan.runtime.export import FileWriter

    stacked = torch.arange(12.0).reshape(3, 4)  # three experts' rows, as a list's export cuts them
    tensors = {f"experts.{i}.w": stacked[i] for i in range(3)} | {
        "embed": torch.randn(3, 5).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "steps": torch.arange(4, dtype=torch.int64),
        "half": torch.randn(2, 2, dtype=torch.float16),
        "empty": torch.zeros(0, 4),
    }
    target = tmp_path / f"model{suffix}"
    writer = FileWriter(target)
    for name, tensor in tensors.items():
        writer.add(name, tensor, also=["head"] if name == "embed" else ())
    assert not target.exists()  # bytes staged, nothing held: the file appears whole at the end
    count = writer.finish()
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        saved = load_file(target)
        assert count == len(saved) == len(tensors)  # one name per tied weight
    else:
        saved = torch.load(target, weights_only=True)
        assert count == len(saved) == len(tensors) + 1
        assert saved["head"].data_ptr() == saved["embed"].data_ptr()  # one storage, two names
    assert all(torch.equal(saved[n], t) and saved[n].dtype == t.dtype for n, t in tensors.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no staging left behind
