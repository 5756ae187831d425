"""`meshplan estimate` on plans with experts over an axis: the experts unit routes meta tokens
under a stated assumption (`runtime/experts.py`'s `meta_routing`: balanced unless said), so the
walk runs through its all-to-alls with the shapes such a step has, instead of failing on the
data-dependent ops (`bincount`, `.tolist()`) it runs on real tokens.

The balanced step's all-to-alls are the ledger's (the compiler sizes the dispatch and combine
at N k rows); the worst routing (every rank's pairs on the walk's rank) holds more there."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

import meshplan.compiler.liveness as liveness
from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.estimate import estimate
from meshplan.compiler.hardware import TABLE
from meshplan.compiler.load import load_model, on_meta_inputs
from meshplan.dsl import check_text
from meshplan.examples.models import moe
from meshplan.main import main
from meshplan.runtime.expert_list import ExpertList
from meshplan.runtime.experts import ExpertParallel, assumed_routing, meta_routing

ROOT = Path(__file__).resolve().parents[2]
MOE = "examples/models/moe.py:build"
GROUPED = f"{Path(__file__).resolve().parent}/grouped_experts.py:build"
EP = (ROOT / "examples/moe_ep.plan").read_text()
EP_TP = (ROOT / "examples/moe_ep_tp.plan").read_text()
GROUP = (ROOT / "examples/moe_expert_group.plan").read_text()
GROUPED_EP = "mesh dp=*, ep=2\n\nmodules {\n    layers.*.moe.experts: experts over ep (top_k=2)\n}\n"


def _compiled(text: str, model: str = MOE, world: int = 2, batch: int = 2, seq: int = 16):
    plan = check_text(text, "p.plan")
    source = on_meta_inputs(with_token_shape(load_model(model, shapes_only=True), batch=batch, seq=seq))
    return compile_plan(plan, source, world_size=world, dynamic=False)  # as `estimate` does


def _capacity(text: str, factor: float) -> str:
    return text.replace("top_k=2)", f"top_k=2, capacity_factor={factor})")


@pytest.mark.parametrize(
    ("text", "model", "world", "assumed"),
    [
        (EP, MOE, 2, "dropless routing priced balanced"),
        (EP_TP, MOE, 4, "dropless routing priced balanced"),
        (_capacity(EP, 1.25), MOE, 2, "capacity_factor: E C rows"),
        # experts over dp x tp, each tp rank routing its sequence shard: the routing gathered
        # over tp and each rank keeping its share of C (`_shared_positions` on meta)
        (_capacity(GROUP, 1.0), MOE, 4, "capacity_factor: E C rows"),
        # torchtitan's layout: the model's module takes rows grouped by expert and their counts
        (GROUPED_EP, GROUPED, 2, "dropless routing priced balanced"),
    ],
    ids=["ep", "ep_tp", "capacity", "group_capacity", "grouped"],
)
def test_the_command_estimates_experts_plans(tmp_path, capsys, text, model, world, assumed):
    plan = tmp_path / "experts.plan"
    plan.write_text(text)
    argv = [
        "estimate",
        str(plan),
        "--model",
        model,
        "--world-size",
        str(world),
        "--batch",
        "2",
        "--seq",
        "16",
    ]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["ranks"]] == list(range(world))
    for r in out["ranks"]:
        assert r["state"] > 0 and r["params"] > 0 and r["activations"] > 0 and r["peak"] > r["activations"]
    assert out["assumptions"]["experts"].startswith(assumed)


def test_the_example_plan_as_written(capsys):
    """The issue's command: `dp=*` resolved by --world-size 2 (dp=1, ep=2), the report printed."""
    argv = ["estimate", str(ROOT / "examples/moe_ep.plan"), "--model", MOE, "--world-size", "2"]
    assert main([*argv, "--batch", "2", "--seq", "16"]) == 0
    assert "ranks 0-1" in capsys.readouterr().out


class _Collectives:
    """An observer beside the step-time pricing: each all-to-all's bytes (what it sends, as
    `OpCosts` prices it) and the rows it receives, per phase."""

    def __init__(self, also) -> None:
        self.also, self.phase = also, "forward"
        self.sent: dict[str, list[int]] = {"forward": [], "backward": []}
        self.received: dict[str, list[int]] = {"forward": [], "backward": []}

    def begin(self, stage: int, phase: str) -> None:
        self.phase = phase
        if self.also is not None:
            self.also.begin(stage, phase)

    def __call__(self, func, args, kwargs, out, where) -> None:
        if self.also is not None:
            self.also(func, args, kwargs, out, where)
        if func.namespace == "c10d" and func._schema.name.endswith("alltoall_base_"):
            received, sent = args[0], args[1]
            self.sent[self.phase].append(sent.numel() * sent.element_size())
            self.received[self.phase].append(received.shape[0])


@pytest.fixture
def watched(monkeypatch):
    """The all-to-alls the walk of each `estimate` call issues (a list of `_Collectives`)."""
    seen: list[_Collectives] = []
    walk = liveness.walk_stages

    def watching(stages, inputs, free_grads=None, observer=None, zero=None):
        seen.append(_Collectives(observer))
        return walk(stages, inputs, free_grads, seen[-1], zero=zero)

    monkeypatch.setattr(liveness, "walk_stages", watching)
    return seen


def test_a_balanced_steps_all_to_alls_are_the_ledgers(watched):
    """dp=1 x ep=2, 2 x 16 tokens a rank, top-2 of 4 experts: each layer sends its 4 counts, then
    dispatches and combines N k = 64 rows of 64 floats (16 KiB) each way, forward and backward:
    what the walk priced is what the ledger says a step moves."""
    compiled = _compiled(EP.replace("dp=*", "dp=1"))
    est = estimate(compiled, hw=TABLE["h100"])
    rows = [r for r in compiled.ledger.rows if r.kind == "experts"]
    for phase in ("forward", "backward"):
        ledger = sorted(r.bytes for r in rows if r.phase == phase for _ in range(r.count))
        assert sorted(watched[0].sent[phase]) == ledger
    assert sorted(set(watched[0].sent["forward"])) == [32, 64 * 64 * 4]  # counts, then rows
    assert set(watched[0].received["forward"]) == {4, 64}  # as many rows received as sent
    time = est.ranks[0].time
    assert time is not None and time.issued.get("all_to_all", 0) > 0  # priced, not skipped


def test_the_worst_routing_lands_every_ranks_pairs_on_the_walks_rank(watched, monkeypatch):
    """Dropless's memory worst case: every rank sends the walk's rank all the pairs it can
    (N min(k, L) = 32 x 2: a token's two experts differ, and the rank holds two), so it receives
    n N min(k, L) = 128 rows a dispatch (and its own 64 back) and holds more than the balanced step."""
    compiled = _compiled(EP.replace("dp=*", "dp=1"))
    balanced = estimate(compiled).ranks[0]
    worst = estimate(compiled, routing="worst").ranks[0]
    # per layer: the counts, the dispatch's 128 rows in, the combine's 64 back (its own pairs)
    assert watched[1].received["forward"] == [4, 128, 64] * 2
    assert worst.activations > balanced.activations and worst.peak > balanced.peak
    assert worst.state == balanced.state


def test_the_command_says_which_routing_it_priced(capsys):
    argv = [
        "estimate",
        "examples/moe_ep.plan",
        "--model",
        "examples/models/moe.py:build",
        "--world-size",
        "2",
    ]
    argv += ["--batch", "2", "--seq", "16", "--json"]
    peaks = {}
    for routing in ("balanced", "worst"):
        assert main([*argv, "--routing", routing]) == 0
        out = json.loads(capsys.readouterr().out)
        peaks[routing] = out["ranks"][0]["peak"]
        assert ("balanced" if routing == "balanced" else "worst") in out["assumptions"]["experts"]
    assert peaks["worst"] > peaks["balanced"]


@pytest.mark.parametrize(
    ("pairs", "tokens", "k", "experts", "n"), [(64, 32, 2, 4, 2), (30, 15, 2, 4, 2), (26, 13, 2, 8, 4)]
)
def test_assumed_routing_sends_and_receives_as_many(pairs, tokens, k, experts, n):
    """Balanced: each expert N k / E pairs from a rank (within one), and every rank receives as
    many as it sends, a remainder included; worst: every rank's N min(k, L) on one rank's experts,
    no expert more than N of a rank's (a token's k experts differ)."""
    local = experts // n
    for rank in range(n):
        counts, received = assumed_routing(pairs, tokens, k, experts, n, rank)
        assert sum(counts) == sum(received) == pairs and max(counts) - min(counts) <= 1
        with meta_routing("worst"):
            counts, received = assumed_routing(pairs, tokens, k, experts, n, rank)
        assert sum(counts) == pairs and max(counts) <= tokens
        assert (
            sum(received) == n * tokens * min(k, local) == n * sum(counts[rank * local : (rank + 1) * local])
        )
        assert sum(assumed_routing(pairs, tokens, k, experts, n, rank, cap=3)[0]) == min(pairs, 3 * experts)
    with pytest.raises(ValueError, match="balanced, worst"), meta_routing("skewed"):
        pass


def _unit(model: torch.nn.Module, path: str, names: tuple[str, ...], factor: float | None = None):
    experts = model.get_submodule(path)
    unit = ExpertParallel(None, "ep", path=path, num_experts=4, param_names=names, capacity_factor=factor)
    return unit.bind(None, model), [experts.get_parameter(n) for n in names]


@pytest.mark.parametrize("factor", [None, 1.25])
def test_real_tokens_route_by_their_data_whatever_is_assumed(factor):
    """A real step is the same under either routing (the assumption is for meta tensors only), and
    counts its tokens; on meta the unit gives the output's shape and counts nothing."""
    model = moe.build()
    unit, params = _unit(model, "layers.0.mlp.experts", ("gate_up_proj", "down_proj"), factor)
    x = torch.randn(12, model.config.hidden_size)
    index = torch.zeros(12, 2, dtype=torch.int64)
    index[:, 1] = torch.arange(12) % 3 + 1  # expert 0 for every token: the most unbalanced
    weights = torch.full((12, 2), 0.5)
    plain = unit(x, index, weights, *params)
    with meta_routing("worst"):
        assert torch.equal(unit(x, index, weights, *params), plain)
    assert unit.take_tokens().tolist() == [24, 8, 8, 8]
    meta = [t.detach().to("meta") for t in (x, index, weights, *params)]
    with meta_routing("worst") if factor is None else contextlib.nullcontext():
        out = unit(*meta)
    assert out.shape == x.shape and out.is_meta and unit.take_tokens().sum() == 0


def test_model_code_that_refuses_mixed_devices_runs_on_meta():
    """Experts in a list (`ExpertList`: `index_add` of each expert's rows, which checks that its
    index is on its device) on meta rows with the routing on the CPU: the op is rerun on meta."""
    model = moe.build_listed()
    for layer in model.layers:
        layer.mlp.experts = ExpertList.of(layer.mlp.experts)
    names = tuple(n for n, _ in model.layers[0].mlp.experts.named_parameters())
    unit, params = _unit(model, "layers.0.mlp.experts", names)
    x = torch.empty(12, model.config.hidden_size, device="meta", requires_grad=True)
    index = torch.empty(12, 2, dtype=torch.int64, device="meta")
    weights = torch.empty(12, 2, device="meta", requires_grad=True)
    out = unit(x, index, weights, *[p.detach().to("meta").requires_grad_() for p in params])
    assert out.shape == x.shape and out.is_meta
    out.backward(torch.empty_like(out))
    assert x.grad is not None and x.grad.shape == x.shape
