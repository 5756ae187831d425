"""The model-facing commands as a user runs them: check --model, explain, compile, inspect, verify."""

import json
import os
from pathlib import Path

import pytest

from meshplan.main import main

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests/cli/golden"
LLAMA = "examples/models/llama.py:build"


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NO_COLOR", "1")


@pytest.fixture(scope="module")
def compiled_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "llama_tp"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["compile", "examples/llama_tp.plan", "--model", LLAMA, "-o", str(out)]) == 0
    finally:
        os.chdir(cwd)
    return out


def expect(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("MESHPLAN_ACCEPT"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with MESHPLAN_ACCEPT=1 if that is intended"


def test_compile_writes_the_artifact(compiled_dir):
    names = {p.name for p in compiled_dir.iterdir()}
    assert {"manifest.json", "plan.txt", "explain.txt", "ledger.txt", "ledger.json", "graph.json"} <= names
    assert "program.py" in names and not any(n.startswith("rank") for n in names)  # one program (SPMD)
    manifest = json.loads((compiled_dir / "manifest.json").read_text())
    assert manifest["mesh"] == {"tp": 2} and manifest["collectives_per_step"] == 40  # the 9 norms: 1 bucket
    assert manifest["plan"] == "llama_tp.plan" and len(manifest["plan_sha256"]) == 64
    assert str(ROOT) not in (compiled_dir / "manifest.json").read_text()  # movable: no absolute paths


def test_the_artifact_does_not_grow_with_the_mesh(tmp_path):
    """dp=512 x tp=2 (1,024 ranks) writes what dp=1 x tp=2 writes, within a few bytes of mesh sizes."""
    tp = (ROOT / "examples/llama_tp.plan").read_text()
    sizes = {}
    for dp in (1, 512):
        plan = tmp_path / f"dp{dp}.plan"
        plan.write_text(tp.replace("mesh tp=2", f"mesh dp={dp}, tp=2") + "\ndata_parallel over dp {}\n")
        out = tmp_path / f"dp{dp}"
        assert main(["compile", str(plan), "--model", LLAMA, "-o", str(out)]) == 0
        files = list(out.iterdir())
        sizes[dp] = (len(files), sum(f.stat().st_size for f in files))
    assert sizes[1][0] == sizes[512][0]
    assert abs(sizes[512][1] - sizes[1][1]) <= 0.1 * sizes[1][1], sizes


def test_program_code_golden(compiled_dir):
    expect("llama_tp_program.expect", (compiled_dir / "program.py").read_text())


def test_ledger_golden(compiled_dir):
    expect("llama_tp_ledger.txt", (compiled_dir / "ledger.txt").read_text())


def test_explain_golden(capsys):
    assert main(["explain", "examples/llama_tp.plan", "--model", LLAMA]) == 0
    expect("llama_tp_explain.txt", capsys.readouterr().out)


def test_inspect_formats(compiled_dir, capsys):
    assert main(["inspect", str(compiled_dir), "--rank", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# meshplan rank 1 of 2: tp=1")
    assert "# reduce_scatter over tp, (batch, seq, 64) <- examples/llama_tp.plan:11" in text
    assert main(["inspect", str(compiled_dir), "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph") and "all_gather_tp" in dot and "#f4a6a6" in dot
    assert main(["inspect", str(compiled_dir), "--format", "html"]) == 0
    page = capsys.readouterr().out
    assert "<html>" in page and 'class="coll"' in page


def test_inspect_errors(compiled_dir, tmp_path, capsys):
    assert main(["inspect", str(compiled_dir), "--rank", "5"]) == 2
    assert "outside the compiled world of 2 ranks" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "is not a compiled plan" in capsys.readouterr().err


def test_check_with_model(capsys):
    assert main(["check", "examples/llama_tp.plan", "--model", LLAMA]) == 0
    assert "collectives per step" in capsys.readouterr().out


def test_model_errors_are_one_line_not_a_traceback(capsys):
    assert main(["check", "examples/llama_tp.plan", "--model", "examples/models/llama.py:biuld"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan: error:") and "did you mean" in err and "Traceback" not in err
    assert main(["check", "examples/llama_tp.plan", "--model", "nowhere.py:build"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_plan_that_does_not_fit_the_model(tmp_path, capsys):
    plan = tmp_path / "bad.plan"
    plan.write_text("mesh tp=2\n\nmodules {\n    layers.*.mlp.w4: column over tp\n}\n")
    assert main(["compile", str(plan), "--model", LLAMA, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{plan}:4:5: error: rule `layers.*.mlp.w4` matches no module" in err
    assert "hint: modules under `layers.0.mlp` are: gate_proj, up_proj, down_proj" in err
    assert not (tmp_path / "out").exists()
