"""--export DIR: the trained weights as a Hugging Face folder (safetensors shards, their index,
config.json), written shard by shard as the ranks gather them (`meshplan run` minus torchrun:
tests/runs.py, with the shard limit lowered in the workers so a tiny Llama takes several)."""

from __future__ import annotations

import json
from pathlib import Path

import gloo_pool
import pytest
import torch
from plans import llama_rules
from runs import meshplan_run

from meshplan.compiler.load import load_model
from meshplan.errors import RunError
from meshplan.launcher import prepare
from meshplan.options import parse
from meshplan.run import train_rank
from meshplan.runtime import export
from meshplan.runtime.data import make_batches

FACTORIES = Path(__file__).parents[1] / "compiler" / "hf_factories.py"
CORPUS = Path(__file__).parents[2] / "examples" / "data" / "corpus.txt"
SHARD_BYTES = 40_000  # the tiny Llama (about 0.36 MB) in a dozen shards
TP = "\nmodules {" + llama_rules("model.") + "}\n"
LAYOUTS = {
    "tp=2": "mesh tp=2\n" + TP,
    "dp=2, ZeRO-3": "mesh dp=2\n\ndata_parallel over dp {\n    zero = 3\n}\n",
}


def run_with_small_shards(*argv: str) -> None:
    """`meshplan_run`, with `MAX_SHARD_BYTES` lowered to `SHARD_BYTES` in the workers."""
    options, world_size = prepare(parse(list(argv)))
    steps = gloo_pool.spawn(_worker, world_size, (options.worker_argv(),))
    assert all(done >= options.steps for done in steps), steps


def _worker(rank: int, world_size: int, argv: list[str]) -> int:
    before, export.MAX_SHARD_BYTES = export.MAX_SHARD_BYTES, SHARD_BYTES
    try:
        return train_rank(parse(argv), rank, world_size, show_progress=False).steps_done
    finally:  # the process runs later jobs
        export.MAX_SHARD_BYTES = before


def hf_llama() -> torch.nn.Module:
    """tests/compiler/hf_factories.py's Llama: the weights every run here starts from."""
    return load_model(f"{FACTORIES}:hf_llama").model


def first_batch(batch: int) -> torch.Tensor:
    """The tokens of the first step of a `dp=1` run with `--batch batch --seq 16`."""
    batches = make_batches(str(CORPUS), batch=batch, seq=16, seed=0, dp_rank=0, dp_size=1, accumulation=1)
    return batches(0, 0)[0]


def loss(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_folder_export_is_what_from_pretrained_and_init_load(tmp_path, layout):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    plan = tmp_path / "llama.plan"
    plan.write_text(LAYOUTS[layout])
    argv = [str(plan), "--model", f"{FACTORIES}:hf_llama", "--steps", "2", "--batch", "2", "--seq", "16"]
    folder, file = tmp_path / "hf", tmp_path / "model.safetensors"
    run_with_small_shards(*argv, "--out", str(tmp_path / "run"), "--export", str(folder))
    meshplan_run(*argv, "--out", str(tmp_path / "run_file"), "--export", str(file))

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(f.name for f in folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (folder / "config.json").is_file() and not (folder / "model.safetensors").exists()
    assert not (tmp_path / "hf.tmp").exists()
    whole = {k: v for name in shards for k, v in load_file(folder / name).items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    for name in shards:  # under the limit, or one tensor past it alone (the 64 KB embedding)
        held = load_file(folder / name).values()
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held) <= SHARD_BYTES

    pretrained, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    consolidated = hf_llama()
    consolidated.load_state_dict(load_file(file))  # the single-file export of the same training
    assert whole.keys() == consolidated.state_dict().keys()
    assert all(torch.equal(whole[k], v) for k, v in consolidated.state_dict().items())
    tokens = first_batch(2)
    expected = loss(consolidated, tokens)
    assert loss(pretrained, tokens) == expected
    assert expected != loss(hf_llama(), tokens)  # trained: not the factory's weights

    # meshplan reads its own export back: a dp=1 run's first loss is the exported model's
    (tmp_path / "dp1.plan").write_text("mesh dp=1\n")
    init = [str(tmp_path / "dp1.plan"), "--model", f"{FACTORIES}:hf_llama_meta", "--init", str(folder)]
    records = meshplan_run(
        *init, "--steps", "1", "--batch", "2", "--seq", "16", "--out", str(tmp_path / "init")
    )
    assert records[0][0]["loss"] == pytest.approx(expected, rel=1e-5)


TIED = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tied_llama():
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)
"""


@pytest.mark.slow
def test_a_tied_weight_is_written_once_under_the_name_hugging_face_keeps(tmp_path):
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    (tmp_path / "tied.py").write_text(TIED)
    (tmp_path / "tp.plan").write_text(LAYOUTS["tp=2"])
    folder = tmp_path / "hf"
    argv = [str(tmp_path / "tp.plan"), "--model", f"{tmp_path}/tied.py:tied_llama", "--steps", "1"]
    meshplan_run(
        *argv, "--batch", "2", "--seq", "16", "--out", str(tmp_path / "run"), "--export", str(folder)
    )
    assert not (folder / "model.safetensors.index.json").exists()  # under 5 GB: one file
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_writer_s_shards_end_where_the_next_tensor_would_pass_the_limit(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "model-00001-of-00009.safetensors").write_bytes(b"an earlier export's")
    (folder / "tokenizer.json").write_text("{}")
    writer = export.ShardWriter(folder, max_bytes=100)
    for name, numel in [("a", 10), ("b", 10), ("c", 30), ("d", 5), ("e", 2)]:  # float32: 4 bytes each
        writer.add(name, torch.full((numel,), float(numel)))
    assert writer.finish() == 5
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    # 40 + 40 bytes; 120 alone (past the limit); 20 + 8
    assert index == {
        "metadata": {"total_size": 228, "total_parameters": 57},
        "weight_map": {
            "a": "model-00001-of-00003.safetensors",
            "b": "model-00001-of-00003.safetensors",
            "c": "model-00002-of-00003.safetensors",
            "d": "model-00003-of-00003.safetensors",
            "e": "model-00003-of-00003.safetensors",
        },
    }
    names = {f.name for f in folder.iterdir()}
    assert names == {"tokenizer.json", "model.safetensors.index.json", *index["weight_map"].values()}


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("full", r"--export .*/full is a folder that is not empty \(hint: name another folder, or pass"),
        ("model.safetensors", r"--export .*/model.safetensors exists \(hint: name another file"),
        ("a_file/hf", r"cannot write .*a_file/hf/model.safetensors"),
    ],
)
def test_an_export_that_would_replace_files_or_cannot_be_written_is_refused(tmp_path, target, message):
    """The launcher's check before any rank starts; `--overwrite` lets a folder be replaced."""
    from meshplan.launcher import _check_export

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "a_file").write_bytes(b"not a folder")
    with pytest.raises(RunError, match=message):
        _check_export(tmp_path / target, overwrite=False)
    _check_export(tmp_path / "full", overwrite=True)
    _check_export(tmp_path / "new", overwrite=False)  # made now, before training
    assert (tmp_path / "new").is_dir()
