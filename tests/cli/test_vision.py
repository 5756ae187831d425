"""Models that take no token ids: a vision transformer called as `model(pixels, labels)`
(tests/compiler/vision_models.py) verified and trained under data parallelism, ZeRO, a pipeline
and bf16 compute; random batches drawn like its example inputs; `--data` factories of images
checked against the program's inputs; `--seq` refused for a model that has no sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_pool import shared_processes
from plans import data_parallel
from runs import meshplan_run

from meshplan.batches import checked_call, drawn_batches, example_batch
from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource, load_model
from meshplan.compiler.lower import build_rank_program
from meshplan.dsl.check import check_text
from meshplan.errors import RunError
from meshplan.launcher import prepare
from meshplan.main import main
from meshplan.options import parse
from meshplan.runtime.data import CallBatch, DataError
from meshplan.verify import render, verify

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests/compiler/vision_models.py"
VIT = f"{MODELS}:build"
IMAGES = f"{MODELS}:image_batches"
BF16 = "\nprecision {\n    compute = bf16\n}\n"


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


def write(tmp_path: Path, text: str, name: str = "case.plan") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------- verify


@pytest.mark.parametrize(
    "text",
    [
        "mesh dp=2\n" + data_parallel(zero=1),
        "mesh dp=2\n" + data_parallel(zero=3) + BF16,
        "mesh pp=2\n\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 2\n}\n",
    ],
    ids=["dp2-zero1", "dp2-zero3-bf16", "pp2"],
)
def test_a_vision_transformer_passes_verify(tmp_path, text):
    report = verify(write(tmp_path, text), VIT, steps=2)
    assert report.ok and report.float64, render(report)
    assert report.job.example is not None  # drawn like its example inputs, not token ids
    assert "random samples drawn like the model's example inputs" in render(report)


def test_seq_for_a_model_without_a_sequence_is_refused_at_its_example_inputs(tmp_path, capsys):
    plan = write(tmp_path, "mesh dp=2\n" + data_parallel(zero=0))
    assert main(["verify", plan, "--model", VIT, "--seq", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan: error: tests/compiler/vision_models.py:") or "vision_models.py:" in err
    assert "--seq 16: the inputs of" in err and "have no sequence to set" in err
    assert "pixels (2, 3, 16, 16) float32, labels (2,) int64" in err
    assert "hint: leave out --seq" in err
    with pytest.raises(RunError, match="have no sequence to set"):
        prepare(parse([plan, "--model", VIT, "--seq", "16", "--out", str(tmp_path / "run")]))


# ---------------------------------------------------------------------------- run


def test_run_trains_images_from_a_data_factory_and_the_loss_goes_down(tmp_path):
    plan = write(tmp_path, "mesh dp=2\n" + data_parallel(zero=3) + BF16)
    argv = ["--model", VIT, "--data", IMAGES, "--steps", "30", "--batch", "8", "--lr", "1e-3"]
    ranks = meshplan_run(plan, *argv, "--out", str(tmp_path / "run"))
    losses = [r["loss"] for r in ranks[0]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_run_without_data_trains_on_batches_drawn_like_the_example(tmp_path, capsys):
    plan = write(tmp_path, "mesh dp=2\n" + data_parallel(zero=0))
    ranks = meshplan_run(plan, "--model", VIT, "--steps", "3", "--batch", "4", "--out", str(tmp_path / "run"))
    assert [len(r) for r in ranks] == [3, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in ranks[0])
    err = capsys.readouterr().err
    assert "note: no --data:" in err and "pixels (4, 3, 16, 16) float32, labels (4,) int64" in err


FACTORY = """\
import torch

def make(*, batch, seq, seed, dp_rank, dp_size, accumulation):
    def get(step, micro_step):
        return {body}
    return get
"""


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "torch.randn(batch, 3, 8, 8), torch.zeros(batch, dtype=torch.long)",
            "the batch of step 0, micro-step 0: input `pixels` is (4, 3, 8, 8) float32; the program "
            "takes pixels (4, 3, 16, 16) float32",
        ),
        (
            "torch.randn(batch, 3, 16, 16), torch.zeros(batch)",
            "input `labels` is (4,) float32; the program takes labels (4,) int64",
        ),
        (
            "{'pixels': torch.randn(batch, 3, 16, 16)}",
            "the batch of step 0, micro-step 0 has no input `labels`; the program takes labels (4,) int64",
        ),
        ("'images'", "the batch of step 0, micro-step 0 is a str (hint: return the model's inputs"),
    ],
    ids=["shape", "dtype", "missing", "type"],
)
def test_a_data_factory_batch_that_does_not_fit_the_program_names_the_input(tmp_path, body, message):
    write(tmp_path, FACTORY.format(body=body), "data.py")
    plan = write(tmp_path, "mesh dp=2\n" + data_parallel(zero=0))
    data = f"{tmp_path}/data.py:make"
    with pytest.raises(RunError) as raised:
        prepare(parse([plan, "--model", VIT, "--data", data, "--batch", "4", "--out", str(tmp_path / "run")]))
    assert f"--data {data}: " in str(raised.value)
    assert message in str(raised.value)


def test_a_text_file_for_a_model_without_token_inputs_is_refused(tmp_path):
    plan = write(tmp_path, "mesh dp=2\n" + data_parallel(zero=0))
    with pytest.raises(RunError, match=r"a text file gives token ids, and .* takes pixels"):
        data = str(ROOT / "examples/data/corpus.txt")
        prepare(parse([plan, "--model", VIT, "--data", data, "--out", str(tmp_path / "run")]))


def test_a_data_factory_may_return_keyword_inputs(tmp_path):
    source = with_token_shape(load_model(VIT), batch=4)
    check = checked_call(source, 4, "data.py:make")
    pixels, labels = torch.randn(4, 3, 16, 16), torch.zeros(4, dtype=torch.long)
    batch = check({"labels": labels, "pixels": pixels}, 0, 0)
    assert batch.rows == 4 and batch.kwargs["pixels"] is pixels and batch.args == ()
    with pytest.raises(DataError, match="has input `mask`, which the program does not take"):
        check({"labels": labels, "pixels": pixels, "mask": pixels}, 0, 0)


# ---------------------------------------------------------------------------- drawing


def test_batches_are_drawn_of_the_example_kinds_deterministically():
    mask = torch.tensor([[True, False], [False, True]])
    example = CallBatch((torch.randn(2, 3), torch.tensor([3, 7]), mask, torch.ones(5)), {}, rows=2)
    draw = drawn_batches(example, rows=4, seed=0, dp_rank=1, dp_size=2, accumulation=1)
    (first, none), (again, _) = draw(3, 0), draw(3, 0)
    assert none is None and first.rows == 4
    floats, ints, masks, fixed = first.args
    assert floats.shape == (4, 3) and floats.dtype == torch.float32
    assert ints.dtype == torch.int64 and int(ints.min()) >= 0 and int(ints.max()) < 8  # the example's range
    assert torch.equal(masks, torch.cat([mask, mask]))  # bool masks as given
    assert fixed is example.args[3]  # not batched: the example's own
    assert all(torch.equal(a, b) for a, b in zip(first.args, again.args, strict=True))
    assert not torch.equal(floats, draw(4, 0)[0].args[0])
    halves = first.chunk(2)
    assert [h.rows for h in halves] == [2, 2] and torch.equal(halves[1].args[0], floats[2:])
    assert halves[0].args[3] is fixed


def test_a_token_model_keeps_its_token_batches():
    source = with_token_shape(load_model(f"{ROOT}/examples/models/llama.py:build"), batch=2, seq=8)
    assert example_batch(source) is None


# ---------------------------------------------------------------------------- capture and precision


def test_the_batch_of_a_vision_model_stays_symbolic():
    source = with_token_shape(load_model(VIT), batch=4)
    compiled = compile_plan(check_text("mesh dp=2\n" + data_parallel(zero=0), "p.plan"), source, world_size=2)
    assert compiled.captured.dims is not None and compiled.captured.dims.seq is None
    assert not compiled.warnings
    program = build_rank_program(compiled, source.model, 0)
    for rows in (3, 5):  # one program serves every batch
        loss = program(torch.randn(rows, 3, 16, 16), torch.zeros(rows, dtype=torch.long))
        assert torch.isfinite(loss[0] if isinstance(loss, tuple | list) else loss)


class OwnFloats(torch.nn.Module):
    """Makes its own float32 activations from uint8 images (`pixels.float()`), as a loader's
    images come in; under `compute = bf16` its weights are bf16 at the linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(12, 4)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = pixels.float().flatten(1) / 255  # (B, 12) float32
        return torch.nn.functional.cross_entropy(self.proj(x).float(), labels)


@pytest.mark.parametrize("make", ["own", "vit"])
def test_float32_activations_meet_bf16_weights_as_under_autocast(make):
    """The model's float32 activations (float images in, or `pixels.float()`) are cast to the
    compute dtype at the ops autocast runs in it: the capture records the cast instead of
    stopping at "Input type (float) and bias type (c10::BFloat16) should be the same"."""
    torch.manual_seed(0)
    if make == "own":
        images = torch.randint(0, 256, (4, 3, 2, 2), dtype=torch.uint8)
        source = ModelSource("own", OwnFloats(), (images, torch.tensor([0, 1, 2, 3])))
    else:
        source = with_token_shape(load_model(VIT), batch=4)
    compiled = compile_plan(check_text("mesh dp=1" + BF16, "p.plan"), source, world_size=1)
    casts = [
        n
        for n in compiled.captured.graph_module.graph.nodes
        if n.target in (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)
        and n.meta["val"].dtype == torch.bfloat16
    ]
    assert casts  # the cast at the op is a node of the program
    program = build_rank_program(compiled, source.model, 0)
    out = program(*source.args)
    loss = out[0] if isinstance(out, tuple | list) else out
    expected = source.model(*source.args).detach()
    assert loss.dtype == torch.float32 and abs(float(loss.detach()) - float(expected)) < 0.05 * float(
        expected
    )
