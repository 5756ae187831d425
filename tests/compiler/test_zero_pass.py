"""The ZeRO pass on its own (one process): where the gather/release nodes go, what they cover,
and that unbound they change nothing. Training with them is tests/runtime/test_zero_compiled.py."""

from __future__ import annotations

import torch
from torch import fx

from meshplan.compiler.capture import bind_inputs, with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import load_model
from meshplan.compiler.lower import build_rank_program
from meshplan.compiler.passes.zero import unit_of
from meshplan.dsl.check import check_text
from meshplan.runtime.zero_nodes import ZeroGather, ZeroRelease

GPT = "meshplan.examples.models.gpt:build"  # embedding and LM head are one tied parameter


def compiled_for(zero: int, spec: str = GPT, extra: str = ""):
    plan = check_text(f"mesh dp=2\ndata_parallel over dp {{\n    zero = {zero}\n}}\n{extra}", world_size=2)
    return compile_plan(plan, with_token_shape(load_model(spec), batch=2, seq=16), world_size=2)


def nodes_of(gm: fx.GraphModule, kind: type) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), kind)
    ]


def test_unit_of_is_the_first_numbered_module() -> None:
    assert unit_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3"
    assert unit_of("h.0.attn.q_proj.bias") == "h.0"
    assert unit_of("layers.1.experts.7.w1") == "layers.1"
    assert unit_of("lm_head.weight") == ""


def test_every_parameter_is_gathered_once_before_its_first_reader() -> None:
    compiled = compiled_for(3)
    gm = compiled.graph
    params = dict(gm.named_parameters(remove_duplicate=False))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    covered: dict[int, str] = {}
    for node in nodes_of(gm, ZeroGather):
        gather = gm.get_submodule(str(node.target))
        for name in gather.params:
            assert id(params[name]) not in covered, (
                f"{name} gathered by {covered[id(params[name])]} and {node}"
            )
            covered[id(params[name])] = node.name
        for attr in node.args:  # the parameters' reads: every other reader comes after the gather
            assert all(order[u] > order[node] for u in attr.users if u is not node), attr
    assert set(covered) == {id(p) for p in params.values() if p.requires_grad}  # the tied one too


def test_zero3_releases_every_unit_but_the_last() -> None:
    gm = compiled_for(3).graph
    gathered = [gm.get_submodule(str(n.target)).unit for n in nodes_of(gm, ZeroGather)]
    released = [gm.get_submodule(str(n.target)).unit for n in nodes_of(gm, ZeroRelease)]
    assert gathered == ["", "h.0", "h.1", "h.2", "h.3"]
    assert released == ["h.0", "h.1", "h.2", "h.3"]  # the root (tied embedding/head) ends forward: kept


def test_zero2_only_waits() -> None:
    gm = compiled_for(2).graph
    assert len(nodes_of(gm, ZeroGather)) == 5
    assert nodes_of(gm, ZeroRelease) == []


def test_ledger_flats_cover_the_model_once() -> None:
    """ZeRO-3's forward all-gathers move each parameter once (plus padding to a multiple of 2)."""
    compiled = compiled_for(3)
    model = load_model(GPT).model
    numel = sum(p.numel() for p in model.parameters())  # tied counted once
    gathered = sum(r.bytes for r in compiled.ledger.rows if r.op == "all_gather" and r.phase == "forward")
    flats = sum(1 for r in compiled.ledger.rows if r.op == "all_gather" and r.phase == "forward")
    assert numel * 4 <= gathered <= (numel + flats) * 4


def test_checkpointed_layer_is_gathered_around_its_call() -> None:
    gm = compiled_for(3, extra="modules {\n    h.1: checkpoint\n}\n").graph
    release = next(n for n in nodes_of(gm, ZeroRelease) if gm.get_submodule(str(n.target)).unit == "h.1")
    assert any(a.meta.get("meshplan.checkpoint") for a in release.all_input_nodes)  # outside the region


def test_unbound_nodes_leave_the_numbers_alone() -> None:
    compiled = compiled_for(3)
    source = with_token_shape(load_model(GPT), batch=2, seq=16)
    program = build_rank_program(compiled, source.model, rank=0)
    with torch.no_grad():
        got = program(*bind_inputs(source.model, compiled.graph, source.args, source.kwargs))[0]
        want = source.model(*source.args, **source.kwargs)
    assert torch.equal(got, want)
