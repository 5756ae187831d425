"""Experts kept as a list of modules (`nn.ModuleList` of one class, the parent's loop calling
each expert on its rows): held stacked (`runtime.expert_list.ExpertList`) and split over an
expert axis as one experts unit (`compiler/passes/experts/rows.py`). Trained against one device
in tests/cli/test_verify.py."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from expert_layouts import listed
from torch import nn

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.errors import CaptureError
from meshplan.compiler.load import load_model
from meshplan.compiler.passes.experts.units import ROWS_MARKER
from meshplan.compiler.placement import Shard
from meshplan.dsl import PlanError, check_text
from meshplan.examples.models import moe
from meshplan.examples.models.moe import ListedMoE, SwiGLU
from meshplan.runtime.expert_list import ExpertList, as_list_state, problem, stacked_lists
from meshplan.runtime.experts import ExpertParallel

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
        compile_plan(_plan(EP), source, world_size=2, dynamic=False)
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
        compile_plan(_plan(EP), source, world_size=2, dynamic=False)
    assert caught.value.message.endswith(f"test_expert_lists.py:{_SKIP_LINE} (`if token.numel() == 0:`)")
    assert caught.value.hint is not None and "`if rows.numel() == 0: continue`" in caught.value.hint


class SlotMajor(ListedMoE):
    """The example's block handing each expert its rows by slot, then token (the order of
    Mistral's reference loop over a one-hot (E, k, N) mask), where `ListedMoE` hands them by token."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)
        index, weights = self.route(tokens)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(index.t() == e)
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.view(B, T, H)


class Masked(ListedMoE):
    """Each expert's rows picked by a boolean mask: no index says which token a row is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(-1, H)
        index, weights = self.route(tokens)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            chosen = index == e  # (N, k)
            mask = chosen.any(-1)
            weight = (weights * chosen).sum(-1)[mask]
            out = out.index_put((mask,), expert(tokens[mask]) * weight[:, None], accumulate=True)
        return out.view(B, T, H)


def _run_one_rank(model: nn.Module, text: str):
    """The plan's program at one rank of `ep` (its unit drops as any rank's): the loss, each
    unit's dropped pairs per expert, the router's gradients."""
    from meshplan.compiler.capture import bind_inputs
    from meshplan.compiler.graph import find_loss
    from meshplan.compiler.lower import build_rank_program

    source = dataclasses.replace(load_model(f"{moe.__file__}:build"), model=model)
    compiled = compile_plan(check_text(text, "p.plan", world_size=1), source, world_size=1)
    program = build_rank_program(compiled, model, 0)
    loss = find_loss(program(*bind_inputs(model, compiled.graph, moe.example_inputs(batch=2, seq=16), {})))
    loss.backward()
    units = [m for m in program.modules() if isinstance(m, ExpertParallel)]
    routers = {n: p.grad for n, p in program.named_parameters() if n.endswith("mlp.gate.weight")}
    return loss.detach(), [u.take_dropped() for u in units], routers


@pytest.mark.parametrize("block", [ListedMoE, SlotMajor], ids=["by-token", "by-slot"])
def test_a_capacity_drops_the_pairs_the_stacked_experts_drop(block):
    """`capacity_factor=0.75` on a list: whichever order the block hands each expert its rows in,
    the unit queues them in the policy's (every first choice before any second, then by token,
    `runtime.experts.expert_positions`), so the pairs dropped, the loss and the router's
    gradients are those of the same model with its experts stacked (`moe.build`: same weights)."""
    text = "mesh ep=1\n\nmodules {\n    layers.*.mlp.experts: experts over ep (top_k=2, capacity_factor=0.75)\n}\n"
    listed_model = moe.build_listed()
    for layer in listed_model.layers:
        layer.mlp.__class__ = block
    loss, dropped, routers = _run_one_rank(listed_model, text)
    stacked_loss, stacked_dropped, stacked_routers = _run_one_rank(moe.build(), text)
    assert all(d.sum() > 0 for d in dropped)  # 64 pairs, 12 places per expert: some drop
    assert [d.tolist() for d in dropped] == [d.tolist() for d in stacked_dropped]
    assert torch.allclose(loss, stacked_loss, rtol=1e-6)
    for name, grad in routers.items():
        assert torch.allclose(grad, stacked_routers[name], rtol=1e-5, atol=1e-8), name
    dropless, _, _ = _run_one_rank(moe.build_listed(), text.replace(", capacity_factor=0.75", ""))
    assert not torch.allclose(loss, dropless, rtol=1e-6)


def test_a_lists_capacity_has_the_stacked_models_traffic():
    """With a capacity the list's unit sends the stacked model's fixed buffers: 4 experts x
    ceil(64 pairs x 1.25 / 4) = 20 rows each way, counted from the block's top-k."""
    text = EP.replace("experts over ep", "experts over ep (capacity_factor=1.25)")
    compiled = compile_plan(_plan(text), load_model(f"{HERE}/expert_layouts.py:listed"), world_size=2)
    stacked = compile_plan(_plan(text), load_model(f"{moe.__file__}:build"), world_size=2)

    def traffic(c):
        return sorted((r.phase, r.shape, r.bytes, r.count) for r in c.ledger.rows if r.kind == "experts")

    assert (
        traffic(compiled)
        == traffic(stacked)
        == [("backward", (80, 64), 20480, 2)] * 2 + [("forward", (80, 64), 20480, 2)] * 2
    )


def test_a_capacity_on_a_list_without_token_indices_is_a_located_error():
    text = EP.replace("experts over ep", "experts over ep (capacity_factor=1.25)")
    source = dataclasses.replace(load_model(f"{moe.__file__}:build"), model=_with(Masked))
    with pytest.raises(PlanError) as caught:
        compile_plan(_plan(text), source, world_size=2, dynamic=False)
    assert [(d.span.line, d.span.col, d.message) for d in caught.value.errors] == [
        (
            4,
            44,
            f"expert capacity (`capacity_factor`) for `layers.{i}.mlp.experts` needs each row's (token, slot) "
            "pair: the rows of expert 0 are not taken from the routed tokens by an index (`tokens[token]`), "
            "so which (token, slot) pair each row is cannot be known",
        )
        for i in (0, 1)
    ]
    compile_plan(_plan(EP), source, world_size=2)  # dropless, the same block splits


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
        compile_plan(
            check_text(text, "p.plan", world_size=4),
            load_model(f"{HERE}/expert_layouts.py:listed"),
            dynamic=False,
        )
    assert [(d.span.line, d.message) for d in caught.value.errors] == [(6, message)]
