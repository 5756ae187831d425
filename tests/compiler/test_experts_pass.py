"""The experts pass: each `experts over AXIS` module becomes one expert-parallel unit in the
program, its parameters split over the axis, its all-to-alls in the ledger; what cannot work
or is not lowered yet is a located error. Numbers (parity with one device) are in
tests/runtime/test_experts.py, tests/cli/test_run_experts.py and the Mixtral verify."""

from __future__ import annotations

import sys
from pathlib import Path

import expert_layouts
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.compiler.compile import Compiled, compile_plan
from meshplan.compiler.ledger import plan_line
from meshplan.compiler.load import ModelSource, load_model
from meshplan.compiler.meta import COLLECTIVE
from meshplan.compiler.placement import REPLICATE, Shard
from meshplan.compiler.print_explain import explain
from meshplan.compiler.print_program import annotated_code
from meshplan.dsl import PlanError, check_text
from meshplan.examples.models import moe

HERE = Path(__file__).resolve().parent
EXPERTS = "modules {\n    layers.*.mlp.experts: experts over ep (top_k=2)\n}\n"


def _compile(
    text: str, model: nn.Module | None = None, world_size: int | None = None, *, dynamic: bool = True
) -> Compiled:
    model = model if model is not None else moe.build()
    inputs = moe.example_inputs(batch=2, seq=16)
    plan = check_text(text, "p.plan", world_size=world_size)
    return compile_plan(plan, ModelSource("m", model, inputs), dynamic=dynamic)


def _errors(text: str, model: nn.Module | None = None, world_size: int | None = None) -> str:
    """The errors compiling `text` reports: a symbolic compile's are the example shape's
    (`compile_plan` compiles for it again to tell), so compiled for it alone (one capture)."""
    with pytest.raises(PlanError) as info:
        _compile(text, model, world_size, dynamic=False)
    return info.value.render()


def test_each_experts_module_is_one_unit_with_its_experts_split():
    compiled = _compile(f"mesh dp=2, ep=2\n\n{EXPERTS}\ndata_parallel over dp {{\n}}\n")
    units = [n for n in compiled.graph.graph.nodes if n.op == "call_module" and "experts" in str(n.target)]
    assert [str(n.target) for n in units] == ["experts_ep_0", "experts_ep_1"]
    assert not any("meshplan.experts" in str(n.target) for n in compiled.graph.graph.nodes)
    assert compiled.captured.dims is not None  # the unit keeps the batch and sequence symbolic
    split = {n: p for n, p in compiled.param_placements.items() if p}
    assert split == {
        f"layers.{i}.mlp.experts.{w}": {"ep": Shard(0)} for i in (0, 1) for w in ("gate_up_proj", "down_proj")
    }
    # per unit: the counts (4 int64), then 2 x 16 tokens x top-2 rows of 64 fp32, there and back
    rows = [(r.phase, r.shape, r.bytes, r.count) for r in compiled.ledger.rows if r.node == "experts_ep_0"]
    assert rows == [
        ("forward", (4,), 32, 1),
        ("forward", (64, 64), 16384, 2),
        ("backward", (64, 64), 16384, 2),
    ]
    # gradients: the dense parameters over dp x ep, the experts over dp, in buckets of their own
    buckets = {r.axis: r.bytes for r in compiled.ledger.rows if r.kind == "dp_bucket"}
    experts = 2 * 2 * (128 * 64 + 64 * 64) * 4  # 2 layers, 2 of the 4 experts on each rank
    assert buckets["dp"] == experts
    assert buckets["dp x ep"] == sum(p.numel() for p in moe.build().parameters()) * 4 - 2 * experts
    text = explain(compiled)
    assert (
        "experts over ep (2 ranks): each rank holds 2 of the 4 experts of layers.{0..1}.mlp.experts" in text
    )
    assert (
        "the batch is split over dp x ep (4 data ranks); gradients are averaged over them, an expert's over dp"
        in text
    )
    assert "# experts over ep: all_to_all dispatch and combine, 32,800 B <- p.plan:4" in annotated_code(
        compiled
    )


def test_experts_may_borrow_the_data_axis():
    """`experts over dp` with `data_parallel over dp`: the experts' ranks hold other experts, so
    only the dense parameters are averaged (over dp)."""
    text = (
        "mesh dp=2\n\nmodules {\n    layers.*.mlp.experts: experts over dp\n}\n\ndata_parallel over dp {\n}\n"
    )
    compiled = _compile(text)
    assert {r.axis for r in compiled.ledger.rows if r.kind == "dp_bucket"} == {"dp"}
    assert "an expert's over none (its ranks hold other experts)" in explain(compiled)


def test_what_cannot_work_is_a_located_error():
    text = (
        "mesh dp=2, ep=3\n\nmodules {\n"
        "    layers.*.mlp.experts: experts over ep (top_k=5, capacity_factor=1.25)\n}\n\n"
        "data_parallel over dp {\n    zero = 3\n}\n"
    )
    assert _errors(text) == (
        "p.plan:4:5: error: `layers.0.mlp.experts` and 1 more like it have 4 experts, "
        "not divisible by 3 ranks over `ep`\n"
        "        layers.*.mlp.experts: experts over ep (top_k=5, capacity_factor=1.25)\n"
        "        ^~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~\n"
        "hint: use an `ep` size that divides 4 (1, 2 or 4)\n"
        "p.plan:4:44: error: top_k=5 routes each token to more experts than the 4 of "
        "`layers.0.mlp.experts` and 1 more like it\n"
        "        layers.*.mlp.experts: experts over ep (top_k=5, capacity_factor=1.25)\n"
        "                                               ^~~~~~~\n"
        "hint: use top_k of at most 4"
    )


def test_a_capacity_fixes_the_all_to_all_buffers():
    """`capacity_factor=1.25`: each expert takes C = ceil(32 tokens x 2 x 1.25 / 4) = 20 pairs of
    a rank's tokens, so the dispatch and the combine move 4 x 20 rows each way, no counts."""
    text = EXPERTS.replace("(top_k=2)", "(top_k=2, capacity_factor=1.25)")
    compiled = _compile(f"mesh dp=2, ep=2\n\n{text}\ndata_parallel over dp {{\n}}\n")
    rows = [(r.phase, r.shape, r.bytes, r.count) for r in compiled.ledger.rows if r.node == "experts_ep_0"]
    assert rows == [("forward", (80, 64), 20480, 2), ("backward", (80, 64), 20480, 2)]
    assert compiled.graph.experts_ep_0.capacity_factor == 1.25
    assert (
        "all_to_all per unit and step: 2 x 20,480 B forward, 2 x 20,480 B backward (dispatch and "
        "combine of 4 x 20 rows: capacity_factor=1.25 lets each expert take 20 (token, slot) pairs "
        "of a rank's tokens here; the rest are dropped)" in explain(compiled)
    )


def test_a_capacity_under_context_parallelism_queues_the_whole_micro_batch():
    """A context rank holds a slice of each sequence: a unit with a capacity gets its call's
    every token, gathered over cp, so its queues are one device's (C = ceil(32 x 2 x 1.25 / 4)
    = 20 pairs per expert of the 32 tokens of a 2 x 16 micro-batch)."""
    text = (
        "mesh cp=2, ep=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n"
        "    layers.*.mlp.experts: experts over ep (top_k=2, capacity_factor=1.25)\n}\n"
    )
    compiled = _compile(text)
    unit = next(n for n in compiled.graph.graph.nodes if n.target == "experts_ep_0")
    tokens = unit.args[0]
    assert tokens.meta[COLLECTIVE]["axis"] == "cp" and tokens.meta[COLLECTIVE]["kind"] in (
        "all_gather",
        "gather_replicated",
    )
    dispatch = [r.shape for r in compiled.ledger.rows if r.node == "experts_ep_0" and r.phase == "forward"]
    assert dispatch == [(80, 64)]  # 4 experts x 20 rows


def test_a_router_z_loss_is_added_to_the_loss():
    """`z_loss=0.01`: the program's loss is the model's plus 0.01 x mean over the tokens of
    logsumexp(router logits)^2 for each MoE layer (ST-MoE), computed here by hand from the
    routers' outputs; loss and every gradient match on one rank (ep=1: the unit runs the
    model's experts whole), and verify's reference (`z_loss_applied`) adds the same."""
    from meshplan.compiler.capture import bind_inputs
    from meshplan.compiler.lower import build_rank_program
    from meshplan.compiler.passes.experts.router_loss import z_loss_applied

    model = moe.build().double()
    text = "mesh ep=1\n\n" + EXPERTS.replace("(top_k=2)", "(top_k=2, z_loss=0.01)")
    compiled = _compile(text, model)
    units = [n.meta[COLLECTIVE] for n in compiled.graph.graph.nodes if "z_loss" in n.meta.get(COLLECTIVE, {})]
    assert [(u["router"], u["z_loss"]) for u in units] == [(f"layers.{i}.mlp.gate", 0.01) for i in (0, 1)]
    program = build_rank_program(compiled, model, 0)
    input_ids, labels = moe.example_inputs(batch=2, seq=16)
    got = program(*bind_inputs(model, compiled.graph, (input_ids, labels), {}))[0]
    got.backward()
    grads = {n: p.grad.clone() for n, p in program.named_parameters()}

    logits = []
    hooks = [
        model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out)) for i in (0, 1)
    ]
    model.zero_grad()
    want = model(input_ids, labels) + sum(0.01 * (x.exp().sum(-1).log() ** 2).mean() for x in logits)
    want.backward()
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        assert float(got) == pytest.approx(float(want), rel=1e-12)
        assert float(want - model(input_ids, labels)) > 1e-3  # the z-loss is no rounding
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-10, atol=1e-14), name
    assert (
        "router z-loss 0.01 x mean(logsumexp(logits)^2) of layers.{0..1}.mlp.gate added to the loss"
        in explain(compiled)
    )
    units_of = {f"layers.{i}.mlp.experts": (f"layers.{i}.mlp.gate", 4, 0.01) for i in (0, 1)}
    with z_loss_applied(units_of, model) as take, torch.no_grad():
        assert float(model(input_ids, labels) + take()) == pytest.approx(float(want), rel=1e-12)
        assert take() == 0.0


def test_a_z_loss_without_softmax_routing_is_a_located_error():
    """A router that takes its top-k over sigmoid scores has no softmax logits to penalize."""
    model = moe.build()
    for layer in model.layers:
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            tokens = x.reshape(-1, x.shape[-1])  # (N, H)
            weights, index = mlp.gate(tokens).sigmoid().topk(mlp.top_k, dim=-1)  # (N, k)
            return mlp.experts(tokens, index, weights).view(x.shape)

        mlp.forward = forward
    text = "mesh ep=2\n\n" + EXPERTS.replace("(top_k=2)", "(top_k=2, z_loss=1e-3)")
    assert _errors(text, model).splitlines()[0::3] == [
        "p.plan:4:53: error: `z_loss` needs the router logits of `layers.0.mlp.experts` and 1 more "
        "like it: its top-k is taken over `sigmoid`, not over a softmax of the router's logits",
        "hint: the z-loss is taken over the logits whose softmax's top-k routes the tokens (Hugging "
        "Face's routers); remove `z_loss` or compute it in the model",
    ]


def test_top_k_is_the_models_own():
    text = "mesh ep=2\n\nmodules {\n    layers.*.mlp.experts: experts over ep (top_k=1)\n}\n"
    assert _errors(text).splitlines()[0] == (
        "p.plan:4:44: error: top_k=1, but the model routes each token of `layers.0.mlp.experts` "
        "and 1 more like it to 2 experts"
    )


def test_a_pipeline_runs_each_layers_experts_in_its_stage():
    """pp=2 x ep=2 on the 2-layer model: layer 0's unit in stage 0, layer 1's in stage 1 (each
    stage program dispatches over `ep` itself; trained in tests/cli/test_verify.py)."""
    from meshplan.compiler.meta import stage

    text = f"mesh pp=2, ep=2\n\n{EXPERTS}\npipeline over pp {{\n    schedule = gpipe\n}}\n"
    units = [n for n in _compile(text).graph.graph.nodes if str(n.target).startswith("experts_ep_")]
    assert [(str(n.target), stage(n)) for n in units] == [("experts_ep_0", 0), ("experts_ep_1", 1)]


class ExpertList(nn.ModuleList):
    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            out = out + (weights * (index == e)).sum(-1, keepdim=True) * expert(x)
        return out


class ListMoE(nn.Module):
    """Experts kept as a list of linears with a forward of its own: not stacked (the parent must
    call the experts, see tests/compiler/test_expert_lists.py)."""

    def __init__(self, hidden: int = 64, num_experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, hidden)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = ExpertList(nn.Linear(hidden, hidden) for _ in range(num_experts))
        self.head = nn.Linear(hidden, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids).flatten(0, 1)  # (N, H)
        weights, index = self.gate(x).softmax(-1).topk(2, -1)
        x = x + self.experts(x, index, weights)
        return F.cross_entropy(self.head(x), labels.flatten())


def test_a_list_of_experts_with_a_forward_of_its_own_is_refused():
    text = "mesh ep=2\n\nmodules {\n    experts: experts over ep\n}\n"
    assert _errors(text, ListMoE()).splitlines()[0] == (
        "p.plan:4:5: error: `experts` cannot be split over `ep`: its experts are a list of modules that "
        "cannot be stacked: it is a `ExpertList`, a list with code of its own; meshplan stacks an "
        "`nn.ModuleList` whose experts the parent block calls"
    )


class TokenGridExperts(nn.Module):
    """Stacked experts called on (B, T, H) tokens and (B, T, k) choices: not one row per token."""

    def __init__(self, hidden: int = 64, num_experts: int = 4) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.randn(num_experts, hidden, hidden) * 0.02)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        chosen = self.weight[index]  # (B, T, k, H, H)
        return (weights[..., None] * torch.einsum("bth,btkhg->btkg", x, chosen)).sum(2)


class GridMoE(ListMoE):
    def __init__(self) -> None:
        super().__init__()
        self.experts = TokenGridExperts()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # (B, T, H)
        weights, index = self.gate(x).softmax(-1).topk(2, -1)
        return F.cross_entropy(self.head(x + self.experts(x, index, weights)).flatten(0, 1), labels.flatten())


def test_experts_called_on_a_token_grid_are_refused():
    text = "mesh ep=2\n\nmodules {\n    experts: experts over ep\n}\n"
    assert _errors(text, GridMoE()).splitlines()[0] == (
        "p.plan:4:5: error: `experts` cannot be split over `ep`: it is called with 3, 3, 3-D tensors, "
        "not tokens (N, H) and top_k_index, top_k_weights (N, k)"
    )


def test_expert_count_of_a_hugging_face_mixtral():
    """transformers 5 holds Mixtral's experts in one module with 3-D weights and `num_experts`."""
    pytest.importorskip("transformers")
    source = load_model(f"{HERE}/hf_factories.py:hf_mixtral")
    text = "mesh ep=3\n\nmodules {\n    model.layers.*.mlp.experts: experts over ep\n}\n"
    with pytest.raises(PlanError) as info:
        compile_plan(check_text(text, "p.plan"), source, dynamic=False)
    assert info.value.render().splitlines()[0] == (
        "p.plan:4:5: error: `model.layers.0.mlp.experts` and 1 more like it have 4 experts, "
        "not divisible by 3 ranks over `ep`"
    )


def test_a_checkpointed_layer_that_writes_a_buffer_is_refused():
    """Aux-loss-free balancing counts tokens into a buffer in forward; recomputing the layer in
    backward would count them twice."""
    sys.path.insert(0, str(HERE.parent / "cli"))
    from aux_free_moe import build

    text = "mesh dp=1\n\nmodules {\n    layers.1: checkpoint\n    layers.0.self_attn: checkpoint\n}\n"
    assert _errors(text, build()) == (
        "p.plan:4:5: error: `layers.1` writes the buffer `layers.1.mlp.tokens_per_expert` in its forward: "
        "recomputing it in backward would write it again (a count would count twice)\n"
        "        layers.1: checkpoint\n"
        "        ^~~~~~~~~~~~~~~~~~~~\n"
        "hint: checkpoint modules that only read their buffers (e.g. the layer's attention)"
    )


# ---------------------------------------------------------------- tensor parallelism inside experts

EXPERT_TP = """mesh ep=2, tp=2

modules {
    layers.*.mlp.experts: experts over ep (top_k=2)
    layers.*.mlp.experts.COLUMN: column over tp
    layers.*.mlp.experts.ROW: row over tp
}
"""


def _expert_tp(column: str = "gate_up_proj", row: str = "down_proj") -> str:
    return EXPERT_TP.replace("COLUMN", column).replace("ROW", row)


def test_tensor_rules_split_each_experts_matrices():
    """Mixtral's layout (E, out, in), gate and up fused: each rank of `tp` keeps its half of the
    gate's and of the up projection's features (two blocks), and of the down projection's
    inputs; the unit's output is reduced once over `tp` after the combine (N rows of H, not
    N k), attributed to the row rule, and its tokens and routing weights go in through f."""
    compiled = _compile(_expert_tp())
    placed = compiled.param_placements
    assert placed["layers.0.mlp.experts.gate_up_proj"] == {"tp": Shard(1, (64, 64)), "ep": Shard(0)}
    assert placed["layers.0.mlp.experts.down_proj"] == {"tp": Shard(2), "ep": Shard(0)}
    unit = next(n for n in compiled.graph.graph.nodes if n.target == "experts_ep_0")
    reduce = [r for r in compiled.ledger.rows if (r.axis, r.phase, r.op) == ("tp", "forward", "all_reduce")]
    assert [(r.shape, r.count, plan_line(r.rule)) for r in reduce] == [
        ((32, 64), 1, "p.plan:6")
    ] * 2  # one per layer
    (user,) = unit.users
    assert user.meta[COLLECTIVE]["kind"] == "all_reduce" and user.meta[COLLECTIVE]["axis"] == "tp"
    tokens, _, weights = (unit.args[i] for i in range(3))
    assert all(a.meta[COLLECTIVE]["kind"] == "copy_to" for a in (tokens, weights))


def test_experts_stored_in_out_split_on_the_other_dims():
    """A grouped-matmul layout: w1, w3 (E, H, I) and w2 (E, I, H) applied as `x @ w`, so the
    features to split are dim 2 of the column matrices and dim 1 of the row matrix."""
    compiled = _compile(_expert_tp("{w1,w3}", "w2"), expert_layouts.grouped())
    placed = compiled.param_placements
    split = {w: placed[f"layers.1.mlp.experts.{w}"]["tp"] for w in ("w1", "w3", "w2")}
    assert split == {"w1": Shard(2), "w3": Shard(2), "w2": Shard(1)}


def test_gate_and_up_interleaved_split_as_one_block():
    """Gate and up fused feature by feature (GPT-OSS's `[..., ::2]`, `[..., 1::2]`): cut in two
    halves, a rank's gate and up features would not match; the probe finds that cutting the
    fused matrix as one block does (each rank's contiguous rows are pairs of both)."""
    compiled = _compile(_expert_tp(), expert_layouts.interleaved())
    placed = compiled.param_placements
    assert placed["layers.0.mlp.experts.gate_up_proj"] == {"tp": Shard(1), "ep": Shard(0)}
    assert placed["layers.0.mlp.experts.down_proj"] == {"tp": Shard(2), "ep": Shard(0)}


def test_a_bias_after_the_row_matrix_is_added_once_over_the_axis():
    """`down_proj_bias: row over tp` (matched by `down_proj*`): the bias stays whole, each rank's
    experts add half of it to their partial sum (the unit reads `div(bias, 2)`), and its
    gradient, half on each rank, is summed over tp by the gradient sync."""
    compiled = _compile(_expert_tp("gate_up_proj*", "down_proj*"), expert_layouts.biased())
    name = "layers.0.mlp.experts.down_proj_bias"
    assert compiled.param_placements[name] == {"tp": REPLICATE, "ep": Shard(0)}
    assert compiled.param_placements["layers.0.mlp.experts.gate_up_proj_bias"] == {
        "tp": Shard(1, (32, 32)),  # with its column matrix: gate and up in two halves
        "ep": Shard(0),
    }
    unit = next(n for n in compiled.graph.graph.nodes if n.target == "experts_ep_0")
    (share,) = [a for a in unit.all_input_nodes if a.target is torch.ops.aten.div.Tensor]
    assert share.args[1] == 2
    assert (share.args[0].op, share.args[0].target) == (
        "get_attr",
        name,
    )  # its f taken out: summed in a bucket
    assert "tp" in compiled.grad_sums[name]


def test_experts_split_that_would_not_add_up_are_located_errors():
    """The split is tried on the experts' own code: a nonlinearity after the row matrix adds up
    under no cut; a bias after the row matrix with no rule would be added by every rank; a
    column split alone leaves no partial sums to reduce."""
    squashed = _errors(_expert_tp(), expert_layouts.squashed())
    assert squashed.startswith(
        "p.plan:5:5: error: the experts of `layers.0.mlp.experts` and 1 more like it cannot be split over "
        "`tp` as the rules say: the sum of the 2 ranks' slices differs from the whole expert by "
    )
    assert squashed.endswith(
        "(relative), tried on random values\n"
        "        layers.*.mlp.experts.gate_up_proj: column over tp\n"
        "        ^~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~\n"
        "hint: each expert's first matrices `column`, its last `row`, as for an MLP's linear layers "
        "(a bias after the row matrix `row` too)"
    )
    assert _errors(_expert_tp("gate_up_proj*"), expert_layouts.biased()).splitlines()[0] == (
        "p.plan:5:5: error: the experts of `layers.0.mlp.experts` and 1 more like it have matrices split "
        "over `tp` and `down_proj_bias` whole: every rank of `tp` would add the whole of what it computes"
    )
    columns_only = _expert_tp("{w1,w3}", "w2").replace("row", "column")
    assert _errors(columns_only, expert_layouts.grouped()).splitlines()[0] == (
        "p.plan:5:5: error: the experts of `layers.0.mlp.experts` and 1 more like it are split by column "
        "only: their outputs must come out as partial sums, from a column split followed by a row split"
    )
    assert (
        "error: the experts of `layers.0.mlp.experts` and 1 more like it have 64 intermediate features, "
        "not divisible by 3 ranks over `tp`" in _errors(_expert_tp().replace("tp=2", "tp=3"))
    )
    assert _errors(_expert_tp("gate_proj")).splitlines()[3] == (
        "hint: did you mean `gate_up_proj`? modules under `layers.0.mlp.experts` are: gate_up_proj, down_proj"
    )


def test_the_example_plan_splits_experts_over_ep_and_inside_over_tp():
    text = (HERE.parents[1] / "examples/moe_ep_tp.plan").read_text()
    compiled = _compile(text, world_size=4)  # dp=1 x ep=2 x tp=2
    assert compiled.param_placements["layers.1.mlp.experts.down_proj"] == {"tp": Shard(2), "ep": Shard(0)}
    assert compiled.param_placements["layers.1.mlp.experts.gate_up_proj"]["tp"] == Shard(1, (64, 64))


SEQUENCE_AND_EXPERTS = """mesh tp=2, ep=2

modules {
    layers.*.self_attn.{q,k,v}_proj: column over tp
    layers.*.self_attn.o_proj: row over tp
    layers.*.*_layernorm: sequence over tp
    layers.*.mlp.experts: experts over ep (ARGS)
}
"""


def test_experts_route_their_own_rows_of_sequence_parallel_tokens():
    """Under sequence parallelism each rank of `tp` holds a shard of the tokens: its experts unit
    routes those (half the all-to-all rows of whole tokens), nothing gathered, and the experts'
    weights, which see a shard of the tokens, have their gradients summed over tp by the
    gradient sync. A capacity counts every token of the call: the tp ranks gather each other's
    routing (16 tokens x 2 int64 each) and queue their pairs together, each sending only its
    own kept pairs (at most its 32; C = 32 x 2 x 2.0 / 4 = 32 per expert over both)."""
    compiled = _compile(SEQUENCE_AND_EXPERTS.replace("ARGS", "top_k=2"))
    unit = next(n for n in compiled.graph.graph.nodes if n.target == "experts_ep_0")
    assert not any(a.op == "call_module" and "all_gather" in str(a.target) for a in unit.all_input_nodes)
    dispatch = [r.shape for r in compiled.ledger.rows if r.node == "experts_ep_0" and r.phase == "forward"]
    assert dispatch == [(4,), (32, 64)]  # 16 of the 32 tokens, top-2
    assert compiled.grad_sums["layers.0.mlp.experts.gate_up_proj"] == ("tp",)
    assert not [w for w in compiled.warnings if "runs on whole tensors" in w.message]
    capacity = _compile(SEQUENCE_AND_EXPERTS.replace("ARGS", "top_k=2, capacity_factor=2.0"))
    forward = [
        (r.op, r.axis, r.shape)
        for r in capacity.ledger.rows
        if r.node == "experts_ep_0" and r.phase == "forward"
    ]
    assert forward == [
        ("all_gather", "tp", (2, 16, 2)),
        ("all_to_all", "ep", (4,)),
        ("all_to_all", "ep", (32, 64)),
    ]
    assert capacity.graph.experts_ep_0.shared_axis() == "tp"
    assert capacity.grad_sums["layers.0.mlp.experts.gate_up_proj"] == ("tp",)


def test_experts_split_whole_tokens_over_a_tensor_axis_instead_of_computing_them_twice():
    """Attention over tp without sequence parallelism leaves the tokens whole on every tp rank:
    each rank's unit takes its split of them (half the all-to-all rows), and the output is
    gathered back whole; the experts' gradients are summed over tp. A list of experts splits its
    N k rows alike. A token count the tp ranks cannot share equally (15) stays whole."""
    text = SEQUENCE_AND_EXPERTS.replace("    layers.*.*_layernorm: sequence over tp\n", "").replace(
        "ARGS", "top_k=2"
    )
    for model in (moe.build(), moe.build_listed()):
        compiled = _compile(text, model)
        node = next(n for n in compiled.graph.graph.nodes if n.target == "experts_ep_0")
        assert str(node.args[0].target) == "split_tp"
        assert [u.meta[COLLECTIVE]["kind"] for u in node.users] == ["gather_replicated"]
        forward = [r.shape for r in compiled.ledger.rows if r.node == "experts_ep_0" and r.phase == "forward"]
        assert forward[-1] == (32, 64)  # 16 of the 32 tokens per rank, top-2
        assert compiled.grad_sums[next(n for n in compiled.grad_sums if ".0.mlp.experts." in n)] == ("tp",)
    odd = compile_plan(
        check_text(text, "p.plan"), ModelSource("m", moe.build(), moe.example_inputs(batch=1, seq=15))
    )
    node = next(n for n in odd.graph.graph.nodes if n.target == "experts_ep_0")
    assert not any(a.op == "call_module" and "split" in str(a.target) for a in node.all_input_nodes)


def test_experts_may_borrow_the_tensor_axis():
    """`experts over tp` where tensor rules split attention over tp: each tp rank holds half the
    experts and routes its own rows of the tokens (its sequence shard under sequence
    parallelism; without it, its split of the whole tokens, gathered back after). tp does not
    split the batch: the unit does not scale its experts' gradients, and only dp averages."""
    text = SEQUENCE_AND_EXPERTS.replace("tp=2, ep=2", "dp=2, tp=2").replace(
        "over ep (ARGS)", "over tp (top_k=2)"
    )
    text += "\ndata_parallel over dp {\n}\n"
    for sequence in (True, False):
        compiled = _compile(
            text if sequence else text.replace("    layers.*.*_layernorm: sequence over tp\n", "")
        )
        unit = compiled.graph.experts_tp_0
        assert not unit.splits_batch and compiled.plan.batch_axes == ("dp",)
        assert compiled.param_placements["layers.0.mlp.experts.down_proj"] == {"tp": Shard(0)}
        dispatch = [
            r.shape for r in compiled.ledger.rows if r.node == "experts_tp_0" and r.phase == "forward"
        ]
        assert dispatch == [(4,), (32, 64)]  # 16 of the 32 tokens per rank, top-2
        (user,) = next(n for n in compiled.graph.graph.nodes if n.target == "experts_tp_0").users
        assert (user.meta.get(COLLECTIVE, {}).get("kind") == "gather_replicated") == (not sequence)
        assert "layers.0.mlp.experts.gate_up_proj" not in compiled.grad_sums  # whole: the all-to-all sums it
    clash = _expert_tp().replace("over ep (top_k=2)", "over tp (top_k=2)").replace("ep=2, tp=2", "tp=2")
    assert _errors(clash).splitlines()[0] == (
        "p.plan:5:5: error: the experts of `layers.0.mlp.experts` and 1 more like it are split over `tp` "
        "and so are their matrices: one axis holds other experts or slices of the same ones, not both"
    )
    # a capacity queues the tokens tp's ranks share: each gathers their routing (16 tokens x 2
    # int64 from each rank), every expert takes ceil(32 x 2 x 1.25 / 4) = 20 pairs of them, and
    # each rank sends its own kept pairs only: at most its 32
    capacity = _compile(text.replace("(top_k=2)", "(top_k=2, capacity_factor=1.25)"))
    assert capacity.graph.experts_tp_0.token_chunks == 2  # sequence parallel: a chunk per sequence (B=2)
    assert [
        (r.op, r.shape, r.bytes)
        for r in capacity.ledger.rows
        if r.node == "experts_tp_0" and r.phase == "forward"
    ] == [("all_gather", (2, 16, 2), 256), ("all_to_all", (4,), 32), ("all_to_all", (32, 64), 8192)]
    # over dp x tp likewise: the routing gathered over tp alone (dp's ranks route other batches)
    group = _compile(text.replace("over tp (top_k=2)", "over dp x tp (top_k=2, capacity_factor=1.25)"))
    unit = group.graph.experts_dp_tp_0
    assert (unit.shared_axis(), unit.splits_batch, unit.batch_ranks) == ("tp", False, 2)
    assert [
        (r.op, r.axis, r.shape, r.bytes)
        for r in group.ledger.rows
        if r.node == "experts_dp_tp_0" and r.phase == "forward"
    ] == [
        ("all_gather", "tp", (2, 16, 2), 256),
        ("all_to_all", "dp x tp", (4,), 32),
        ("all_to_all", "dp x tp", (32, 64), 8192),
    ]
    two = (
        "mesh tp=2, tq=2\n\nmodules {\n    layers.*.self_attn.{q,k,v}_proj: column over tp\n"
        "    layers.*.self_attn.o_proj: row over tp\n    lm_head: column over tq\n"
        "    layers.*.mlp.experts: experts over tp x tq (top_k=2, capacity_factor=1.25)\n}\n"
    )
    assert (
        "p.plan:7:58: error: expert capacity (`capacity_factor`) with a group of axes that borrows two "
        "tensor axes (`tp`, `tq`) is not lowered yet: the tokens they share are cut over both"
    ) in _errors(two).splitlines()


def test_experts_over_a_group_of_axes():
    """`experts over dp x tp`: the 4 experts over the 4 ranks of both axes as one group (rank
    (d, t) holds expert 2 d + t: Shard(0) over dp, then over tp), the batch split over dp only
    (an expert's gradient is the mean over dp's 2 batches), tp's ranks routing their rows of
    the tokens; the ledger's all-to-alls are the group's, and `explain` says all of it."""
    text = (
        "mesh dp=2, tp=2\n\nmodules {\n    layers.*.self_attn.{q,k,v}_proj: column over tp\n"
        "    layers.*.self_attn.o_proj: row over tp\n    layers.*.mlp.experts: experts over dp x tp (top_k=2)\n}\n\n"
        "data_parallel over dp {\n    zero = 1\n}\n"
    )
    compiled = _compile(text)
    assert compiled.param_placements["layers.0.mlp.experts.down_proj"] == {"dp": Shard(0), "tp": Shard(0)}
    units = {str(n.target): compiled.graph.get_submodule(str(n.target)) for n in compiled.graph.graph.nodes
             if n.op == "call_module" and str(n.target).startswith("experts_")}  # fmt: skip
    assert list(units) == ["experts_dp_tp_0", "experts_dp_tp_1"]
    assert {(u.axis, u.batch_ranks) for u in units.values()} == {("dp x tp", 2)}
    assert {r.axis for r in compiled.ledger.rows if r.kind == "experts"} == {"dp x tp"}
    assert {r.group_size for r in compiled.ledger.rows if r.kind == "experts"} == {4}
    text = explain(compiled)
    assert "down_proj (4, 64, 64) -> (1, 64, 64) per rank, Shard(0) over dp x tp" in text
    assert (
        "experts over dp x tp (4 ranks): each rank holds 1 of the 4 experts of layers.{0..1}.mlp.experts"
        in text
    )
    assert "`tp` splits no batch (its ranks share the tokens): each rank routes its own rows of them" in text
    assert (
        "the batch is split over dp (2 data ranks); gradients are averaged over them, an expert's over none"
        in text
    )
