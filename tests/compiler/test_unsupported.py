"""Constructs that are not lowered yet are refused when compiling, after their sizes are checked.

`check` without a model accepts them (the language is ahead of the compiler); every command
that compiles against a model refuses them with one located error per rule, so a plan never
compiles into a program that silently lacks what it asks for. (Device placement, `on cpu`, is
lowered now: its own refusals are `tests/compiler/test_devices.py`'s.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.passes.unsupported import not_lowered
from meshplan.dsl import PlanError, check_text, load_plan
from meshplan.examples.models import llama
from meshplan.main import main

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "examples/models/llama.py:build"


def _refusal(text: str, model: nn.Module | None = None, *, seq: int = 16) -> str:
    """The rendered errors of compiling `text` for `model` (the 4-layer example Llama)."""
    model = model if model is not None else llama.build()
    inputs = llama.example_inputs(seq=seq) if isinstance(model, llama.Llama) else _moe_inputs()
    with pytest.raises(PlanError) as info:  # a refusal is the static compile's (a symbolic one retries it)
        compile_plan(check_text(text, "p.plan"), ModelSource("m", model, inputs), dynamic=False)
    return info.value.render()


# ---------------------------------------------------------------------------- each construct refused


def test_pipeline_with_data_parallel_compiles():
    text = "mesh dp=2, pp=2\n\npipeline over pp {\n    schedule = gpipe\n}\n\ndata_parallel over dp {\n}\n"
    compiled = compile_plan(
        check_text(text, "p.plan"), ModelSource("m", llama.build(), llama.example_inputs())
    )
    assert compiled.graph.meta["meshplan.stages"] == (("before", "layers.2"),)


@pytest.mark.parametrize(("schedule", "cuts"), [("zero_bubble", 1), ("zbv", 3)])
def test_zero_bubble_schedules_compile_into_stages(schedule: str, cuts: int):
    """ZB-H1 has a stage per rank, ZBV two (a V): 1 and 3 cuts over the 4 layers on pp=2."""
    text = f"mesh pp=2\n\npipeline over pp {{\n    schedule = {schedule}\n}}\n"
    compiled = compile_plan(
        check_text(text, "p.plan"), ModelSource("m", llama.build(), llama.example_inputs())
    )
    assert len(compiled.graph.meta["meshplan.stages"]) == cuts


def test_a_pipeline_alone_compiles_into_stages():
    text = "mesh pp=2\n\npipeline over pp {\n    schedule = 1f1b\n}\n"
    compiled = compile_plan(
        check_text(text, "p.plan"), ModelSource("m", llama.build(), llama.example_inputs())
    )
    assert compiled.graph.meta["meshplan.stages"] == (("before", "layers.2"),)


SELECTIVE_UNDER_ZB = (
    "mesh pp=2\n\nmodules {\n    layers.0: checkpoint selective\n}\n\npipeline over pp {\n"
    "    schedule = zero_bubble\n}\n"
)


def test_one_error_per_rule_and_block():
    text = (
        "mesh pp=2, cp=2\n\nmodules {\n"
        "    layers.{0,1}.self_attn: context ring over cp\n"
        "    layers.{2,3}.self_attn: context ulysses over cp\n"
        "    layers.0: checkpoint selective\n"
        "    layers.1: checkpoint selective\n"
        "}\n\npipeline over pp {\n    schedule = zero_bubble\n}\n"
    )
    plan = check_text(text, "p.plan")
    assert [(d.span.line, d.span.col) for d in not_lowered(plan)] == [(6, 15), (7, 15)]  # context runs
    assert _refusal(text).count("error:") == 2


def test_refusals_come_with_the_other_problems_of_the_plan():
    """A tensor rule that does not divide and a rule not lowered: both reported in one run."""
    text = (
        "mesh tp=3, pp=2\n\nmodules {\n    layers.*.mlp.{gate,up}_proj: column over tp\n"
        "    layers.*.mlp.down_proj: row over tp\n    layers.0: checkpoint selective\n}\n\n"
        "pipeline over pp {\n    schedule = zero_bubble\n}\n"
    )
    rendered = _refusal(text)
    assert "not divisible by 3 ranks over `tp`" in rendered
    assert "selective checkpointing under `schedule = zero_bubble` is not lowered yet" in rendered


def test_plans_without_these_constructs_still_compile():
    text = "mesh tp=2\n\nmodules {\n    layers.*.mlp.{gate,up}_proj: column over tp\n    layers.*.mlp.down_proj: row over tp\n}\n"
    model = llama.build()
    compiled = compile_plan(check_text(text, "p.plan"), ModelSource("m", model, llama.example_inputs()))
    assert compiled.ledger.count() > 0


# ---------------------------------------------------------------------------- sizes that can never work


@pytest.mark.parametrize("mode", ["ring", "ulysses", "all_gather"])
def test_sequence_not_divisible_by_the_context_axis(mode: str):
    text = f"mesh cp=4\n\nmodules {{\n    layers.*.self_attn: context {mode} over cp\n}}\n"
    assert _refusal(text, seq=10) == (
        "p.plan:4:5: error: the sequence length 10 is not divisible by 4 ranks over `cp`\n"
        f"        layers.*.self_attn: context {mode} over cp\n"
        f"        ^{'~' * (len(f'layers.*.self_attn: context {mode} over cp') - 1)}\n"
        "hint: compile for a sequence length that is a multiple of 4 (--seq), or use a `cp` size dividing 10"
    )


def test_more_pipeline_stages_than_layers():
    text = "mesh pp=8\n\npipeline over pp {\n    schedule = gpipe\n}\n"
    assert _refusal(text) == (
        "p.plan:1:6: error: `pipeline over pp` makes 8 stages, but the model has 4 layers: "
        "a stage would hold no layer\n"
        "    mesh pp=8\n"
        "         ^~~~\n"
        "hint: use a `pp` size of at most 4"
    )


def test_virtual_stages_count_as_stages():
    text = "mesh pp=4\n\npipeline over pp {\n    schedule = interleaved\n    virtual_stages = 2\n}\n"
    rendered = _refusal(text)
    assert "makes 4 x 2 virtual = 8 stages, but the model has 4 layers" in rendered
    assert "hint: make `pp` x `virtual_stages` at most 4" in rendered


def test_layer_count_from_the_outermost_module_list():
    model = TinyMoE(num_layers=3)  # no config; its experts are lists too, deeper down
    text = "mesh pp=4\n\npipeline over pp {\n    schedule = gpipe\n}\n"
    assert "makes 4 stages, but the model has 3 layers" in _refusal(text, model)


def test_as_many_stages_as_layers_compiles():
    text = "mesh pp=4\n\npipeline over pp {\n    schedule = gpipe\n}\n"
    compiled = compile_plan(
        check_text(text, "p.plan"), ModelSource("m", llama.build(), llama.example_inputs())
    )
    assert [path for _, path in compiled.graph.meta["meshplan.stages"]] == [
        "layers.1",
        "layers.2",
        "layers.3",
    ]


def test_fewer_microbatches_than_stages_is_refused_before_the_model_loads(capsys):
    plan = ROOT / "tests/dsl/invalid/microbatches_fewer_than_stages.plan"
    with pytest.raises(PlanError, match="1f1b needs at least as many microbatches as stages: 2 < 4"):
        load_plan(plan)
    assert main(["check", str(plan), "--model", LLAMA]) == 2
    assert "2 < 4" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the command line


EXAMPLES_NOT_LOWERED = ["ulysses_gpipe", "llama_interleaved"]  # their device rules under a pipeline


@pytest.mark.parametrize("name", EXAMPLES_NOT_LOWERED)
def test_check_without_a_model_accepts_them(name: str, capsys):
    assert main(["check", str(ROOT / "examples" / f"{name}.plan")]) == 0
    assert ": ok" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["check"], ["explain"], ["compile", "-o", "OUT"]])
def test_commands_that_compile_refuse_them(command: list[str], tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NO_COLOR", "1")
    plan = tmp_path / "selective.plan"
    plan.write_text(SELECTIVE_UNDER_ZB)
    argv = [command[0], str(plan), "--model", LLAMA]
    argv += [str(tmp_path / "out") if a == "OUT" else a for a in command[1:]]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        f"{plan}:4:15: error: selective checkpointing under `schedule = zero_bubble` is not lowered yet: "
        "its backward runs in two halves, and a selective region can be backwarded once\n"
        "        layers.0: checkpoint selective\n"
        "                  ^~~~~~~~~~~~~~~~~~~~\n"
    ) in err
    assert err.endswith(f"{plan}: 1 error\n")
    assert not (tmp_path / "out").exists()


def test_check_with_a_model_reads_the_sequence_length_from_seq(monkeypatch, capsys):
    """examples/long_context.plan (pp x cp x tp + SP, ring attention, zero bubble) compiles at its
    example shape, and `--seq` is the length it is checked for (by 2 x cp: the balanced layout)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["check", "examples/long_context.plan", "--model", LLAMA]) == 0
    capsys.readouterr()
    # 10 divides by cp = 2, but causal ring attention's load-balanced layout cuts it in 4 chunks
    assert main(["check", "examples/long_context.plan", "--model", LLAMA, "--seq", "10"]) == 2
    err = capsys.readouterr().err
    assert (
        "examples/long_context.plan:9:5: error: the sequence length 10 is not divisible by 4 = 2 x 2 ranks "
        "over `cp`: causal attention's load-balanced layout gives each rank two chunks (r and 3 - r of 4)"
        in err
    )
    assert err.endswith("examples/long_context.plan: 1 error\n")


# ---------------------------------------------------------------------------- models


class ExpertList(nn.ModuleList):
    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return sum(weights[..., i : i + 1] * expert(x) for i, expert in enumerate(self))  # (B, T, H)


class SoftMoE(nn.Module):
    """Every expert sees every token, weighted by the router: enough to have expert modules."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts: nn.Module = ExpertList(nn.Linear(hidden, hidden) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(x, self.gate(x).softmax(-1))


class Block(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.mlp = SoftMoE(hidden, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class TinyMoE(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 8, num_layers: int = 2, num_experts: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, num_experts) for _ in range(num_layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # (B, T, H)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _moe_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
def test_selective_checkpointing_under_a_split_backward_is_refused(schedule: str):
    text = (
        "mesh pp=2\n\nmodules {\n    layers.*: checkpoint selective\n}\n\n"
        f"pipeline over pp {{\n    schedule = {schedule}\n}}\n"
    )
    rendered = _refusal(text)
    assert rendered.startswith(
        f"p.plan:4:15: error: selective checkpointing under `schedule = {schedule}` is not lowered yet"
    )
    assert "hint: use `checkpoint full` here" in rendered
