"""Experts kept as a list of modules (`nn.ModuleList` of one class, the parent's loop calling
each expert on its rows): held stacked (`runtime.expert_list.ExpertList`) and split over an
expert axis as one experts unit (`compiler/passes/expert_rows.py`). Trained against one device
in tests/cli/test_verify.py."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from expert_layouts import listed
from torch import nn

from meshplan.compiler.capture import load_model
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.errors import CaptureError
from meshplan.compiler.passes.experts import ROWS_MARKER
from meshplan.compiler.placement import Shard
from meshplan.dsl import PlanError, check_text
from meshplan.examples.models import moe
from meshplan.examples.models.moe import ListedMoE, SwiGLU
from meshplan.runtime.expert_list import ExpertList, as_list_state, problem, stacked_lists

HERE = Path(__file__).resolve().parent
EP = "mesh ep=2\n\nmodules {\n    layers.*.mlp.experts: experts over ep\n}\n"


def _plan(text: str):
    return check_text(text, "p.plan", world_size=2)


def _block() -> ListedMoE:
    torch.manual_seed(0)
    return ListedMoE(moe.MoEConfig(hidden_size=16, intermediate_size=8, num_local_experts=4))


def test_stacked_experts_compute_what_the_list_computes():
    """The parent's loop, unchanged, over the list and over its stacked copy: same output, and
    each expert's gradient is its slice of the stacked gradient."""
    listed_block = _block()
    stacked_block = copy.deepcopy(listed_block)
    stacked_block.experts = ExpertList.of(stacked_block.experts)  # type: ignore[assignment]
    x = torch.randn(2, 5, 16)
    a, b = listed_block(x), stacked_block(x)
    assert torch.equal(a, b)
    a.square().sum().backward()
    b.square().sum().backward()
    experts = stacked_block.experts
    assert isinstance(experts, ExpertList) and len(experts) == 4
    for name in experts.names:
        grad = experts.stacked(name).grad
        assert grad is not None
        for e, expert in enumerate(listed_block.experts):
            assert torch.allclose(grad[e], expert.get_parameter(name).grad, atol=1e-6), (name, e)
    rows = x[0]
    assert torch.equal(experts[-1](rows), experts[3](rows))
    with pytest.raises(IndexError):
        experts[4]


def test_a_stacked_list_exports_under_the_lists_names():
    model = listed()
    original = copy.deepcopy(model)
    model.layers[0].mlp.experts = ExpertList.of(model.layers[0].mlp.experts)
    state = model.state_dict()
    assert "layers.0.mlp.experts.gate_proj.weight" in state
    assert tuple(state["layers.0.mlp.experts.gate_proj.weight"].shape) == (4, 32, 64)
    restored = as_list_state(state, stacked_lists(model))
    assert restored.keys() == original.state_dict().keys()
    original.load_state_dict(restored, strict=True)
    assert all(torch.equal(v, restored[k]) for k, v in original.state_dict().items())


@pytest.mark.parametrize(
    ("experts", "why"),
    [
        (
            nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)]),
            "its experts hold different parameters (`1`'s differ from `0`'s)",
        ),
        (
            nn.ModuleList([nn.Linear(4, 4), SwiGLU(4, 4)]),
            "its experts are of different classes (`1` is a SwiGLU, `0` a Linear)",
        ),
        (
            nn.ModuleList([nn.BatchNorm1d(4), nn.BatchNorm1d(4)]),
            "its experts hold buffers (`0`), which cannot be stacked with their parameters",
        ),
        (nn.ModuleList(), "it is not a non-empty list of modules"),
    ],
    ids=["parameters", "classes", "buffers", "empty"],
)
def test_lists_that_cannot_be_stacked_say_why(experts, why):
    assert problem(experts) == why


def test_each_list_becomes_one_experts_unit_with_the_stacked_models_traffic():
    """The E calls of each layer are one `ExpertParallel` over `ep` whose stacked parameters are
    Shard(0); the ledger predicts the all-to-alls of the same model with stacked experts
    (examples/models/moe.py: same sizes, same routing), from the routing's top-k."""
    compiled = compile_plan(_plan(EP), load_model(f"{HERE}/expert_layouts.py:listed"), world_size=2)
    nodes = list(compiled.graph.graph.nodes)
    assert not any(n.target is ROWS_MARKER for n in nodes)
    units = [str(n.target) for n in nodes if n.op == "call_module" and str(n.target).startswith("experts_ep")]
    assert units == ["experts_ep_0", "experts_ep_1"]
    for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        assert compiled.param_placements[f"layers.1.mlp.experts.{name}"] == {"ep": Shard(0)}
    assert compiled.expert_lists == ("layers.0.mlp.experts", "layers.1.mlp.experts")
    stacked = compile_plan(_plan(EP), load_model(f"{moe.__file__}:build"), world_size=2)

    def traffic(c):
        return sorted((r.phase, r.shape, r.bytes, r.count) for r in c.ledger.rows if r.kind == "experts")

    assert traffic(compiled) == traffic(stacked)
    assert traffic(compiled)  # the counts, dispatch and combine, forward and backward


class Twice(ListedMoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[0](x) + self.experts[0](x)


class Skipping(ListedMoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)
        weights, index = self.gate(tokens).softmax(dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.view(B, T, H)


_SKIP_LINE = next(
    i
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if line.strip() == "if token.numel() == 0:"
)


def _with(block: type[ListedMoE]):
    model = moe.build(intermediate_size=32)
    for layer in model.layers:
        layer.mlp = block(model.config)
    return model


def test_an_expert_called_twice_is_a_located_error():
    source = dataclasses.replace(load_model(f"{moe.__file__}:build"), model=_with(Twice))
    with pytest.raises(PlanError) as caught:
        compile_plan(_plan(EP), source, world_size=2)
    assert [f"{d.span.line}: {d.message}" for d in caught.value.errors] == [
        f"4: `layers.{i}.mlp.experts` cannot be split over `ep`: the model calls its experts 0, 0 in one "
        "forward, not each of the 4 once"
        for i in (0, 1)
    ]


def test_a_loop_that_skips_idle_experts_names_the_line_that_decides():
    """`if token.numel() == 0: continue` decides on a data-dependent size: export cannot hold it.
    The error names the user's line (not export's dump of the graph so far) and how to write it."""
    source = dataclasses.replace(load_model(f"{moe.__file__}:build"), model=_with(Skipping))
    with pytest.raises(CaptureError) as caught:
        compile_plan(_plan(EP), source, world_size=2)
    assert caught.value.message.endswith(f"test_expert_lists.py:{_SKIP_LINE} (`if token.numel() == 0:`)")
    assert caught.value.hint is not None and "`if rows.numel() == 0: continue`" in caught.value.hint


def test_a_capacity_for_a_list_of_experts_is_refused():
    text = EP.replace("experts over ep", "experts over ep (capacity_factor=1.25)")
    with pytest.raises(PlanError) as caught:
        compile_plan(_plan(text), load_model(f"{HERE}/expert_layouts.py:listed"), world_size=2)
    assert [(d.span.line, d.span.col, d.message) for d in caught.value.errors] == [
        (
            4,
            44,
            "expert capacity (`capacity_factor`) for a list of experts (`layers.0.mlp.experts` and 1 more "
            "like it) is not lowered yet: its parent's loop hands each expert its rows, dropless",
        )
    ]


TP_INSIDE = """mesh ep=2, tp=2

modules {
    layers.*.self_attn.o_proj: row over tp
    layers.*.mlp.experts: experts over ep
    layers.*.mlp.experts.EXPERTS{gate_proj,up_proj}: column over tp
    layers.*.mlp.experts.EXPERTSdown_proj: row over tp
}
"""


def test_tensor_rules_name_a_lists_modules_with_or_without_the_experts_index():
    """`experts.*.gate_proj` (as the model's code names each expert's module) and
    `experts.gate_proj` (the module holding them stacked) are one rule for every expert: the
    same program. Each expert's gate_proj (I, H) is cut by rows, so the stack (E, I, H) on dim 1."""

    def placements(experts: str) -> dict:
        text = TP_INSIDE.replace("EXPERTS", experts)
        compiled = compile_plan(
            check_text(text, "p.plan", world_size=4), load_model(f"{HERE}/expert_layouts.py:listed")
        )
        return {n: p for n, p in compiled.param_placements.items() if ".experts." in n}

    by_index = placements("*.")
    assert by_index == placements("")
    assert by_index["layers.0.mlp.experts.gate_proj.weight"] == {"tp": Shard(1), "ep": Shard(0)}
    assert by_index["layers.1.mlp.experts.down_proj.weight"] == {"tp": Shard(2), "ep": Shard(0)}


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            "layers.*.mlp.experts.0.gate_proj: column over tp",
            "`layers.*.mlp.experts.0.gate_proj` names 1 of the 4 experts held stacked in "
            "`layers.0.mlp.experts`: a tensor rule splits every expert's module alike",
        ),
        (
            "layers.*.mlp.experts.*: checkpoint",
            "`layers.0.mlp.experts.0` is one of the experts of a list held stacked (`layers.0.mlp.experts`): "
            "a `checkpoint` rule cannot name one expert or cut the experts apart",
        ),
    ],
    ids=["one-expert", "checkpoint"],
)
def test_rules_that_would_cut_a_stacked_lists_experts_apart_are_located_errors(rule, message):
    text = f"mesh ep=2, tp=2\n\nmodules {{\n    layers.*.self_attn.o_proj: row over tp\n    layers.*.mlp.experts: experts over ep\n    {rule}\n}}\n"
    with pytest.raises(PlanError) as caught:
        compile_plan(check_text(text, "p.plan", world_size=4), load_model(f"{HERE}/expert_layouts.py:listed"))
    assert [(d.span.line, d.message) for d in caught.value.errors] == [(6, message)]
