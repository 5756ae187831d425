"""`meshplan diff A.plan B.plan`: what the compiler would read differently, not what the text says
differently. Equivalent pairs print nothing and exit 0; a change is one line; an error is the
located message and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from expect import expect

from meshplan.dsl import check_text
from meshplan.dsl.diff import diff_plans, expanded
from meshplan.main import main

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests/cli/golden"
TP = (ROOT / "examples/llama_tp.plan").read_text()
PIPELINE = "mesh pp=2\n\npipeline over pp {{\n    schedule = 1f1b\n    cut before {cut}\n}}\n"


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["diff", *argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    "other",
    [
        # the rules in another order, braces expanded, comments and spacing gone
        "mesh tp=2\nmodules {\n  norm: sequence over tp\n  lm_head: vocab over tp\n  embed_tokens: vocab over tp\n"
        "  layers.*.mlp.down_proj: row over tp\n  layers.*.mlp.up_proj: column over tp\n"
        "  layers.*.mlp.gate_proj: column over tp\n  layers.*.self_attn.o_proj: row over tp\n"
        "  layers.*.self_attn.v_proj: column over tp\n  layers.*.self_attn.k_proj: column over tp\n"
        "  layers.*.self_attn.q_proj: column over tp\n  layers.*.input_layernorm: sequence over tp\n"
        "  layers.*.post_attention_layernorm: sequence over tp\n}\n",
        # a default written out
        TP + "\nprecision {\n    compute = fp32\n}\n\ntrain {\n    gradient_accumulation = 1\n}\n",
    ],
    ids=["reordered-expanded-uncommented", "defaults-written-out"],
)
def test_equivalent_plans_print_nothing_and_exit_0(tmp_path, capsys, other):
    assert run(capsys, str(ROOT / "examples/llama_tp.plan"), write(tmp_path, "b.plan", other)) == (0, "", "")


def test_sequence_parallelism_added_is_its_rules(tmp_path, capsys):
    without = TP.split("    layers.*.{input")[0] + "}\n"
    status, out, _ = run(capsys, write(tmp_path, "tp.plan", without), str(ROOT / "examples/llama_tp.plan"))
    assert status == 1
    assert out.splitlines()[2:] == [
        "+ layers.*.input_layernorm (sequence)           sequence over tp",
        "+ layers.*.post_attention_layernorm (sequence)  sequence over tp",
        "+ norm (sequence)                               sequence over tp",
    ]


def test_zero_stage_and_a_moved_cut_are_changes_of_a_setting(tmp_path):
    dp = "mesh dp=4\n\ndata_parallel over dp {\n    bucket = 4MiB\n}\n"
    zero3 = "mesh dp=4\n\ndata_parallel over dp {\n    zero = 3\n    bucket = 4194304B\n}\n"
    [change] = diff_plans(check_text(dp), check_text(zero3))
    assert (change.what, change.before, change.after, change.sign) == ("data_parallel.zero", "0", "3", "~")
    a, b = (check_text(PIPELINE.format(cut=f"layers.{i}")) for i in (2, 1))
    assert [(c.what, c.before, c.after) for c in diff_plans(a, b)] == [
        ("pipeline.cuts", "before layers.2", "before layers.1")
    ]


def test_the_printed_diff_and_its_json(capsys, monkeypatch):
    """Golden: the 3D example against the TP example: the mesh, the blocks only one has, the
    rules each has alone."""
    monkeypatch.chdir(ROOT)
    a, b = "examples/llama_tp.plan", "examples/llama_3d.plan"
    status, out, _ = run(capsys, a, b)
    assert status == 1
    expect(out, GOLDEN / "diff_tp_3d.txt")
    status, out, _ = run(capsys, a, b, "--json")
    report = json.loads(out)
    assert status == 1 and not report["equivalent"]
    assert {"what": "mesh", "before": "tp=2", "after": report["changes"][0]["after"]} == report["changes"][0]


def test_a_plan_that_does_not_parse_is_a_located_error(tmp_path, capsys):
    bad = write(tmp_path, "bad.plan", "mesh tp=2\nmodules {\n    layers.*: colum over tp\n}\n")
    status, out, err = run(capsys, str(ROOT / "examples/llama_tp.plan"), bad)
    assert status == 2 and out == ""
    assert "bad.plan:3:" in err and "Traceback" not in err


def test_braces_expand_to_the_paths_they_stand_for():
    assert expanded("layers.{0..2}.{q,k}_proj") == [
        "layers.0.q_proj",
        "layers.0.k_proj",
        "layers.1.q_proj",
        "layers.1.k_proj",
        "layers.2.q_proj",
        "layers.2.k_proj",
    ]
    assert expanded("layers.*") == ["layers.*"]
    assert expanded("layers.{0..100000}") == ["layers.{0..100000}"]  # too many: kept a pattern


LLAMA = "examples/models/llama.py:build"  # four layers


def test_with_a_model_rules_that_place_alike_are_equivalent(tmp_path, capsys, monkeypatch):
    """`layers.*` and `layers.{0..3}` are different text and, on a four-layer model, one program."""
    monkeypatch.chdir(ROOT)
    numbered = write(tmp_path, "numbered.plan", TP.replace("layers.*", "layers.{0..3}"))
    plain = run(capsys, "examples/llama_tp.plan", numbered)
    assert plain[0] == 1 and "+ layers.3.self_attn.v_proj (tensor)" in plain[1]  # as text they differ
    assert run(capsys, "examples/llama_tp.plan", numbered, "--model", LLAMA) == (0, "", "")


def test_with_a_model_the_placements_collectives_and_memory_that_change(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    mlp = ("layers.*.mlp.{gate,up}_proj:     column over tp", "layers.*.mlp.down_proj:          row over tp")
    attention_only = TP.replace(mlp[0], "layers.*.mlp.{gate,up}_proj: replicate").replace(mlp[1], "")
    without_mlp = write(tmp_path, "attention_only.plan", attention_only)
    status, out, _ = run(capsys, without_mlp, "examples/llama_tp.plan", "--model", LLAMA, "--json")
    report = json.loads(out)
    assert status == 1 and not report["equivalent"]
    effects = {e["what"]: (e["before"], e["after"]) for e in report["effects"]}
    # the MLP's projections: replicated in the first plan, split by the second's rules
    assert effects["layers.*.mlp.up_proj.weight (x4)"] == ("replicated", "Shard(0) over tp")
    assert effects["layers.*.mlp.down_proj.weight (x4)"] == ("replicated", "Shard(1) over tp")
    assert "layers.*.self_attn.q_proj.weight (x4)" not in effects  # the same in both
    before, after = effects["training state, worst rank"]
    assert before != after
    assert any(what.startswith("all_reduce over tp") for what in effects)  # the MLP's row split
    assert report["checkpoint_resumes"] is True  # the same tensors, laid out otherwise


def test_with_a_model_zero3_divides_the_state(tmp_path, capsys):
    dp = write(tmp_path, "dp.plan", "mesh dp=2\n\ndata_parallel over dp {\n    zero = 0\n}\n")
    zero3 = write(tmp_path, "zero3.plan", "mesh dp=2\n\ndata_parallel over dp {\n    zero = 3\n}\n")
    status, out, _ = run(capsys, dp, zero3, "--model", f"{ROOT}/{LLAMA}")
    assert status == 1
    lines = out.splitlines()
    assert lines[2].split() == ["~", "data_parallel.zero", "0", "->", "3"]
    state = next(line for line in lines if line.startswith("~ training state, worst rank"))
    before, after = (float(x.split()[0]) for x in state.split("  ")[-1].split(" -> "))
    assert after == pytest.approx(before / 2, rel=0.01)  # parameters, gradients, AdamW moments over dp
    assert lines[-1].startswith("checkpoints: a checkpoint of A resumes under B")


def test_a_checkpoint_resumes_where_every_tensor_keeps_its_name_and_shape():
    """What `diff --model` says of a checkpoint of A under B, from what each plan's checkpoint
    holds (tensor names and whole shapes)."""
    from meshplan.compiler.plan_effects import Effects, resume_problem

    def held(**tensors: tuple[int, ...]) -> Effects:
        checkpoint = {name.replace("__", "."): shape for name, shape in tensors.items()}
        return Effects({}, {}, 0, 0, None, "", checkpoint)

    dense = held(embed__weight=(8, 4), head__weight=(8, 4))
    assert resume_problem(dense, held(embed__weight=(8, 4), head__weight=(8, 4))) is None
    assert resume_problem(dense, held(embed__weight=(8, 4))) == "`head.weight`: A's holds it, B has none"
    assert resume_problem(dense, held(embed__weight=(16, 4), head__weight=(8, 4))) == (
        "`embed.weight` is (8, 4) under A, (16, 4) under B"
    )
    listed = held(experts__0__w1=(4, 2), experts__1__w1=(4, 2))
    stacked = held(experts__w1=(2, 4, 2))
    for a, b in ((listed, stacked), (stacked, listed)):
        assert "the experts of `experts` are a list under one plan and stacked under the other" in str(
            resume_problem(a, b)
        )
