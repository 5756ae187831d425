"""`meshplan inspect DIR --schedule`: each pipeline rank's actions in time, from the compiled plan,
with the bubble the simulation computes (the closed forms at unit costs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.main import main

ROOT = Path(__file__).resolve().parents[2]
LLAMA = f"{ROOT}/examples/models/llama.py:build"


def compiled(tmp_path: Path, pipeline: str, mesh: str) -> Path:
    plan = tmp_path / "pp.plan"
    plan.write_text(f"mesh {mesh}\n\npipeline over pp {{\n{pipeline}}}\n")
    out = tmp_path / "build"
    assert main(["compile", str(plan), "--model", LLAMA, "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    ("pipeline", "bubble"),
    [
        ("    schedule = gpipe\n    microbatches = 8\n", "0.273"),  # (p-1)/(m+p-1) at p=4, m=8
        ("    schedule = 1f1b\n    microbatches = 8\n", "0.273"),
        ("    schedule = zero_bubble\n    microbatches = 8\n", "0.111"),  # (p-1)/(3m+p-1)
    ],
)
def test_the_schedule_as_text_with_its_bubble(tmp_path: Path, capsys, pipeline: str, bubble: str) -> None:
    out = compiled(tmp_path, pipeline, "pp=4")
    capsys.readouterr()
    assert main(["inspect", str(out), "--schedule"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4
    split = "zero_bubble" in pipeline  # the backward as input (I) and weight (W) gradients
    backward = ("I", "W") if split else ("B",)
    # every microbatch, once each way
    assert all(row.count("F") == 8 and all(row.count(k) == 8 for k in backward) for row in rows)
    assert rows[0].split()[2] == "F0" and rows[3].split()[2].startswith(".")  # the last rank waits to start
    costs = "forward 1, input gradient 1, weight gradient 1" if split else "forward 1, backward 2"
    assert text.rstrip().endswith(f"bubble {bubble} of the step (unit costs: {costs})")


def test_the_interleaved_schedule_as_a_picture(tmp_path: Path, capsys) -> None:
    out = compiled(
        tmp_path, "    schedule = interleaved\n    virtual_stages = 2\n    microbatches = 4\n", "pp=2"
    )
    capsys.readouterr()
    assert main(["inspect", str(out), "--schedule", "--format", "svg"]) == 0
    svg = capsys.readouterr().out
    assert svg.startswith("<svg") and "bubble 0.111" in svg
    assert svg.count("<rect") == 2 * 2 * 4 * 2  # ranks x chunks x microbatches x (F, B)


def test_a_plan_without_a_pipeline_has_no_schedule(tmp_path: Path, capsys) -> None:
    out = tmp_path / "build"
    assert main(["compile", str(ROOT / "examples/llama_tp.plan"), "--model", LLAMA, "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--schedule"]) == 2
    assert "has no pipeline, so no schedule" in capsys.readouterr().err
