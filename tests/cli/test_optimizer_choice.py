"""The plan's optimizer end to end: `meshplan verify` holds SGD (under ZeRO-1) and Adafactor (under
tensor parallelism with a vocabulary of 255 padded over 2 ranks, and ZeRO-3) to the float64 model
stepped by the same optimizer, and `meshplan run --resume` with another optimizer
than the checkpoint's is one message and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from gloo_pool import shared_processes
from runs import meshplan_command, meshplan_run

from meshplan.verify import render, verify

ROOT = Path(__file__).resolve().parents[2]
LLAMA = f"{ROOT}/examples/models/llama.py:build"


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


TP = """mesh dp=2, tp=2

modules {
    layers.*.self_attn.{q,k,v}_proj: column over tp
    layers.*.self_attn.o_proj:       row over tp
    layers.*.mlp.{gate,up}_proj:     column over tp
    layers.*.mlp.down_proj:          row over tp
    embed_tokens:                    vocab over tp
    lm_head:                         vocab over tp
}
"""


def _write(tmp_path: Path, name: str, zero: int, optimizer: str | None, mesh: str = "mesh dp=2\n") -> str:
    train = f"\ntrain {{\n    optimizer = {optimizer}\n}}\n" if optimizer else ""
    path = tmp_path / name
    path.write_text(f"{mesh}\ndata_parallel over dp {{\n    zero = {zero}\n}}\n{train}")
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("zero", "optimizer", "title", "mesh"),
    [
        (1, "sgd(momentum=0.9)", "SGD(momentum=0.9)", "mesh dp=2\n"),
        (3, "adafactor(d=2)", "Adafactor(d=2)", TP),
    ],
)
def test_verify_steps_the_plans_optimizer_on_both_sides(
    tmp_path: Path, zero: int, optimizer: str, title: str, mesh: str
):
    plan = _write(tmp_path, "case.plan", zero, optimizer, mesh)
    model = LLAMA
    if mesh == TP:  # a vocabulary the tp ranks split unevenly: one padded row
        (tmp_path / "odd.py").write_text(
            "from meshplan.examples.models import llama\n\ndef build():\n    return llama.build(vocab_size=255)\n"
        )
        model = f"{tmp_path}/odd.py:build"
    report = verify(plan, model, steps=3)
    assert report.ok and report.float64, render(report)
    assert f"`meshplan run`'s {title} (" in render(report)


@pytest.mark.slow
def test_resuming_with_another_optimizer_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    out = str(tmp_path / "run")
    meshplan_run(
        _write(tmp_path, "sgd.plan", 1, "sgd(momentum=0.9)"),
        "--steps",
        "2",
        "--save-every",
        "2",
        "--out",
        out,
    )
    done = meshplan_command(
        capfd, "run", _write(tmp_path, "adamw.plan", 1, None), "--steps", "3", "--resume", "--out", out
    )
    assert done.returncode == 2
    assert "holds sgd's state, but this run's optimizer is adamw" in done.stderr
    assert "resume with `optimizer = sgd`" in done.stderr
