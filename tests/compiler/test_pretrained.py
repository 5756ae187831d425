"""`meshplan run --init PATH`: pretrained weights in, each rank reading only its own pieces
(`compiler/pretrained.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gloo_pool import shared_processes
from hf_factories import hf_llama
from plans import llama_rules
from runs import meshplan_run

from meshplan.compiler.lower import local_shard
from meshplan.compiler.placement import Shard
from meshplan.compiler.pretrained import InitError, Pretrained
from meshplan.main import main
from meshplan.runtime.data import make_batches
from meshplan.runtime.mesh import MeshLayout

HERE = Path(__file__).parent
META_LLAMA = f"{HERE}/hf_factories.py:hf_llama_meta"
TP = "\nmodules {" + llama_rules("model.") + "}\n"


@pytest.fixture(scope="module", autouse=True)
def processes():
    """`verify`'s ranks on the session's kept processes (`gloo_pool`), not new ones."""
    with shared_processes():
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A Llama with trained-looking weights (not its init), saved as Hugging Face does, in
    several shards with an index."""
    model = hf_llama()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(folder, max_shard_size="40KB")
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    return folder


LAYOUT = MeshLayout(("tp",), (2,))


@pytest.mark.parametrize(
    ("name", "placement"),
    [
        ("model.layers.0.mlp.up_proj.weight", {"tp": Shard(0)}),  # rows
        ("model.layers.0.self_attn.o_proj.weight", {"tp": Shard(1)}),  # a segment of each row
        (
            "model.layers.0.self_attn.q_proj.weight",
            {"tp": Shard(0, blocks=(32, 32))},
        ),  # a chunk of each block
        ("model.embed_tokens.weight", {"tp": Shard(0, padded=255)}),  # the last rank's last row: padding
    ],
)
def test_a_piece_is_the_local_shard_of_the_whole_and_reads_its_own_bytes(saved, name, placement):
    weights = Pretrained.open(saved)
    whole = weights.piece(name, {}, {}, LAYOUT, torch.float32)
    padded = placement["tp"].padded
    if padded:
        whole = whole[:padded]
        weights.shapes[name] = (padded, *whole.shape[1:])  # as if the vocabulary were 255
    for rank in (0, 1):
        before = weights.bytes_read
        piece = weights.piece(name, placement, {"tp": rank}, LAYOUT, torch.float32)
        assert torch.equal(piece, local_shard(whole, placement, {"tp": rank}, LAYOUT))
        assert piece.is_contiguous()
        read = weights.bytes_read - before
        rows = piece.shape[0] - (1 if padded and rank == 1 else 0)  # the last row: padding, not read
        assert read == rows * piece[0].numel() * 4  # exactly the piece


def first_loss_of_the_pretrained_model(folder: Path, batch: int, seq: int) -> float:
    """One process: `from_pretrained` on the first batch `meshplan run` trains on."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder)
    input_ids, _ = make_batches(
        str(Path(__file__).parents[2] / "examples" / "data" / "corpus.txt"),
        batch=batch,
        seq=seq,
        seed=0,
        dp_rank=0,
        dp_size=1,
        accumulation=1,
    )(0, 0)
    with torch.no_grad():
        # labels are the inputs: Hugging Face's models shift them themselves
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()


LAYOUTS = {
    "tp=2": ("mesh tp=2\n" + TP, 4),
    "dp=2 x tp=2, ZeRO-3": ("mesh dp=2, tp=2\n\ndata_parallel over dp {\n    zero = 3\n}\n" + TP, 2),
    "pp=2": ("mesh pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 2\n}\n", 2),
}


@pytest.fixture(scope="module")
def trained(saved, tmp_path_factory) -> SimpleNamespace:
    """A run from the pretrained folder under dp=2 x tp=2 with ZeRO-3 (every weight checkpointed
    as ranges of flats: boxes of partial rows): one step, its checkpoint, its weights exported
    to one file, its metrics."""
    folder = tmp_path_factory.mktemp("trained")
    plan = folder / "zero3.plan"
    text, batch = LAYOUTS["dp=2 x tp=2, ZeRO-3"]
    plan.write_text(text)
    run = folder / "run"
    argv = [str(plan), "--model", META_LLAMA, "--init", str(saved), "--steps", "1", "--save-every", "1"]
    records = meshplan_run(
        *argv,
        "--batch",
        str(batch),
        "--seq",
        "16",
        "--out",
        str(run),
        "--export",
        str(run / "weights.safetensors"),
    )
    return SimpleNamespace(run=run, records=records)


@pytest.mark.slow
def test_a_pretrained_folder_starts_every_layout_from_the_pretrained_model_s_loss(saved, trained, tmp_path):
    """Four sequences a step in each (--batch is per data rank, and per microbatch under a
    pipeline); the model built on the meta device, so nothing but the files holds its values."""
    expected = first_loss_of_the_pretrained_model(saved, 4, 16)
    assert trained.records[0][0]["loss"] == pytest.approx(expected, rel=1e-5), "dp=2 x tp=2, ZeRO-3"
    for name, (text, batch) in LAYOUTS.items():
        if name == "dp=2 x tp=2, ZeRO-3":
            continue  # the `trained` run
        plan = tmp_path / f"{name.split(',')[0].replace(' ', '')}.plan"
        plan.write_text(text)
        argv = [str(plan), "--model", META_LLAMA, "--init", str(saved), "--steps", "1", "--batch", str(batch)]
        records = meshplan_run(*argv, "--seq", "16", "--out", str(tmp_path / plan.stem))
        assert records[0][0]["loss"] == pytest.approx(expected, rel=1e-5), name


# ---------------------------------------------------------------------------- mistakes


def meshplan_init(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], init: str, *more: str
) -> SimpleNamespace:
    """`meshplan run --init INIT` (the command's `main`, in this process): its status and output."""
    plan = tmp_path / "dp1.plan"
    plan.write_text("mesh dp=1\n")
    argv = ["run", str(plan), "--model", f"{HERE}/hf_factories.py:hf_llama", "--init", init, "--steps", "1"]
    status = main([*argv, "--batch", "1", "--seq", "16", "--out", str(tmp_path / "run"), *more])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=out, stderr=err)


def one_error(done: SimpleNamespace, tmp_path: Path) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("meshplan: error:") == 1, done.stderr
    run = tmp_path / "run"  # nothing compiled, nothing trained
    assert not (run / "program.pt").exists() and not any(run.glob("metrics/*"))
    return done.stderr


def _drop_key(saved: Path, folder: Path) -> str:
    from safetensors.torch import load_file, save_file

    state = {k: v for f in sorted(saved.glob("*.safetensors")) for k, v in load_file(f).items()}
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, folder / "model.safetensors")
    return str(folder)


def _reshape_key(saved: Path, folder: Path) -> str:
    from safetensors.torch import load_file, save_file

    state = {k: v for f in sorted(saved.glob("*.safetensors")) for k, v in load_file(f).items()}
    state["model.norm.weight"] = torch.ones(32)
    path = folder / "weights.safetensors"
    save_file(state, path)
    return str(path)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda saved, folder: str(folder),
            r"holds neither model.safetensors nor model.safetensors.index.json",
        ),
        (_drop_key, r"`model.layers.1.mlp.down_proj.weight` is missing"),
        (_reshape_key, r"`model.norm.weight` is \(32\) in weights.safetensors, the model's is \(64\)"),
        (lambda saved, folder: _text(folder / "w.safetensors"), r"w.safetensors: not a safetensors file"),
    ],
    ids=["no weights", "missing key", "shape", "not safetensors"],
)
def test_weights_that_do_not_fit_are_one_located_error_before_any_rank_starts(saved, tmp_path, make, message):
    """The launcher's checks, in this process (the command's exit 2 for them: the next test)."""
    from meshplan.errors import RunError
    from meshplan.launcher import prepare
    from meshplan.options import parse

    folder = tmp_path / "weights"
    folder.mkdir()
    plan = tmp_path / "dp1.plan"
    plan.write_text("mesh dp=1\n")
    argv = [str(plan), "--model", f"{HERE}/hf_factories.py:hf_llama", "--init", make(saved, folder)]
    with pytest.raises(RunError, match=message):
        prepare(parse([*argv, "--batch", "1", "--seq", "16", "--out", str(tmp_path / "run")]))
    assert not (tmp_path / "run" / "program.pt").exists()


def _text(path: Path) -> str:
    path.write_text("not weights at all")
    return str(path)


def test_the_command_exits_2_with_one_line_for_weights_that_do_not_fit_and_for_init_with_resume(
    saved, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("MESHPLAN_DEBUG", raising=False)
    err = one_error(meshplan_init(tmp_path, capsys, str(tmp_path)), tmp_path)
    assert f"--init {tmp_path}: holds neither model.safetensors" in err
    err = one_error(meshplan_init(tmp_path, capsys, str(saved), "--resume"), tmp_path)
    assert "--init and --resume: a resumed run continues from its own checkpoint" in err


def test_an_unexpected_key_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    state = {k: v for f in sorted(saved.glob("*.safetensors")) for k, v in load_file(f).items()}
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(state, tmp_path / "extra.safetensors")
    with pytest.raises(InitError, match=r"`model.layers.9.mlp.up_proj.weight` is not in the model"):
        Pretrained.open(tmp_path / "extra.safetensors").check(hf_llama())


@pytest.mark.slow
def test_verify_starts_both_sides_from_the_pretrained_weights(saved, tmp_path):
    from transformers import LlamaForCausalLM

    from meshplan.verify import token_batches, verify

    plan = tmp_path / "tp2.plan"
    plan.write_text("mesh tp=2\n" + TP)
    report = verify(str(plan), META_LLAMA, steps=1, batch=2, seq=16, init=str(saved))
    assert report.ok, report.measures
    input_ids, _ = token_batches(report.job, dp_rank=0, dp_size=1, accumulation=1)(0, 0)
    with torch.no_grad():
        model = LlamaForCausalLM.from_pretrained(saved)
        expected = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()
    assert report.partitioned.losses[0] == pytest.approx(expected, rel=1e-5)
    assert report.reference.losses[0] == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------- a meshplan checkpoint


@pytest.mark.slow
def test_a_checkpoint_s_weights_are_the_run_s_weights_piece_by_piece(trained):
    from meshplan.pretrained import open_init

    saved, exported = open_init(str(trained.run)), Pretrained.open(trained.run / "weights.safetensors")
    assert saved.path == trained.run / "checkpoints" / "step00000001"  # the run's latest
    saved.check(hf_llama())
    for key, shape in exported.shapes.items():
        placements = [{}, {"tp": Shard(0)}]
        if len(shape) == 2:
            placements += [{"tp": Shard(1)}, {"tp": Shard(0, blocks=(shape[0] // 2, shape[0] // 2))}]
        for placement in placements:
            for rank in (0, 1):
                expected = exported.piece(key, placement, {"tp": rank}, LAYOUT, torch.float32)
                piece = saved.piece(key, placement, {"tp": rank}, LAYOUT, torch.float32)
                assert torch.equal(piece, expected), (key, placement, rank)


@pytest.mark.slow
def test_a_run_started_from_a_checkpoint_starts_from_its_weights(trained, tmp_path):
    """The trained model's loss, one process, on the first batch of a tp=2 run --init from the
    run folder (a new run: step 1, not a resumption)."""
    from safetensors.torch import load_file

    model = hf_llama()
    loaded = model.load_state_dict(load_file(trained.run / "weights.safetensors"), strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}  # tied: one name
    input_ids, _ = make_batches(
        str(Path(__file__).parents[2] / "examples" / "data" / "corpus.txt"),
        batch=4, seq=16, seed=0, dp_rank=0, dp_size=1, accumulation=1,
    )(0, 0)  # fmt: skip
    with torch.no_grad():
        expected = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.item()
    plan = tmp_path / "tp2.plan"
    plan.write_text(LAYOUTS["tp=2"][0])
    argv = [str(plan), "--model", META_LLAMA, "--init", str(trained.run), "--steps", "1", "--batch", "4"]
    records = meshplan_run(*argv, "--seq", "16", "--out", str(tmp_path / "run"))
    assert records[0][0]["step"] == 1
    assert records[0][0]["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_a_checkpoint_that_cannot_start_a_run_is_one_located_error(trained, tmp_path):
    import shutil

    from meshplan.pretrained import open_init

    empty = tmp_path / "empty-run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(InitError, match=r"empty-run: a run folder without a complete checkpoint"):
        open_init(str(empty))
    damaged = tmp_path / "damaged"
    shutil.copytree(trained.run / "checkpoints" / "step00000001", damaged)
    data = next(damaged.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(InitError, match=rf"--init {damaged}: checkpoint .* is damaged: {data.name} has"):
        open_init(str(damaged))
