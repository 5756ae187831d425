"""The ZeRO pass under a pipeline (one process): each stage program gets the gather and
release nodes of its own units, so a pipeline rank binds the ones its stages run. Training
with them, against one process, is tests/cli/test_run_pipeline_zero.py."""

from __future__ import annotations

import operator

import torch
from torch import fx

from meshplan.compiler.capture import bind_inputs, with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import load_model
from meshplan.compiler.lower import build_rank_program
from meshplan.compiler.stages import compiled_cuts, cut_stages
from meshplan.dsl import check_text
from meshplan.runtime.zero_nodes import ZeroGather, ZeroRelease

GPT = "meshplan.examples.models.gpt:build"  # embedding and LM head are one tied parameter
LLAMA = "meshplan.examples.models.llama:build"


def compiled_for(
    spec: str,
    *,
    zero: int = 3,
    schedule: str = "1f1b",
    pipeline: str = "",
    mesh: str = "dp=2, pp=2",
    extra: str = "",
):
    text = (
        f"mesh {mesh}\n\npipeline over pp {{\n    schedule = {schedule}\n{pipeline}}}\n\n"
        f"data_parallel over dp {{\n    zero = {zero}\n}}\n{extra}"
    )
    plan = check_text(text, "p.plan", world_size=4)
    source = with_token_shape(load_model(spec), batch=2, seq=16)
    return compile_plan(plan, source, world_size=4, dynamic=False)  # one shape: a cheaper compile


def zero_units(stage: fx.GraphModule) -> tuple[list[str], list[str]]:
    """The units a stage program gathers and those it releases, in its order."""
    gathers, releases = [], []
    for n in stage.graph.nodes:
        module = stage.get_submodule(str(n.target)) if n.op == "call_module" else None
        if isinstance(module, ZeroGather):
            gathers.append(module.unit)
        elif isinstance(module, ZeroRelease):
            releases.append(module.unit)
    return gathers, releases


def test_each_stage_gathers_and_releases_its_own_units() -> None:
    """GPT on pp=2 with ZeRO-3 and bf16: the root is a unit per stage (its embeddings in the
    first, its final norm and the LM head in the last), the tied weight in both; every unit is
    released (microbatches interleave: none stays gathered from its forward to its backward);
    in each stage program every read of a parameter runs after the gather that lists it, and
    each stage reads the tied weight in bf16 from its own gather."""
    compiled = compiled_for(GPT, extra="\nprecision {\n    compute = bf16\n}\n")
    stages = cut_stages(compiled.graph, compiled_cuts(compiled.graph))
    programs = stages.programs(compiled.graph)
    units = [zero_units(p) for p in programs]
    assert units == [
        (["root@stage0", "h.0", "h.1"], ["root@stage0", "h.0", "h.1"]),
        (["h.2", "h.3", "root@stage1"], ["h.2", "h.3", "root@stage1"]),
    ]
    for program in programs:
        order = {n: i for i, n in enumerate(program.graph.nodes)}
        gathered: dict[str, int] = {}
        for n in program.graph.nodes:
            module = program.get_submodule(str(n.target)) if n.op == "call_module" else None
            if isinstance(module, ZeroGather):
                gathered.update(dict.fromkeys(module.params, order[n]))
        for n in program.graph.nodes:
            if n.op == "get_attr" and str(n.target) in gathered:
                readers = [u for u in n.users if u.op != "call_module" or "zero_gather" not in str(u.target)]
                assert all(order[u] > gathered[str(n.target)] for u in readers), n
        tied = [n for n in program.graph.nodes if n.op == "get_attr" and n.target == "lm_head.weight"]
        assert len(tied) == 1 and "lm_head.weight" in gathered
        # each stage reads the tied weight from its own gather, in bf16 (the gather replaced the
        # stage's cast of it: ZeRO-3 gathers it in the dtype the layers read it in)
        (gather,) = tied[0].users
        assert "zero_gather" in str(gather.target)
        index = list(gather.args).index(tied[0])
        (value,) = [u for u in gather.users if u.target is operator.getitem and u.args[1] == index]
        assert value.meta["val"].dtype == torch.bfloat16 and value.users


def test_a_layer_cut_in_two_is_a_unit_per_stage() -> None:
    """`cut after layers.1.self_attn`: layers.1's attention and MLP are units of their own
    stages, each released in the stage that gathered it."""
    compiled = compiled_for(LLAMA, pipeline="    cut after layers.1.self_attn\n")
    stages = cut_stages(compiled.graph, compiled_cuts(compiled.graph))
    first, second = (zero_units(p) for p in stages.programs(compiled.graph))
    assert first[0] == first[1] == ["root@stage0", "layers.0", "layers.1@stage0"]
    assert second[0] == second[1] == ["layers.1@stage1", "layers.2", "layers.3", "root@stage1"]


def test_unbound_stage_chain_is_the_program() -> None:
    """Without an engine the ZeRO nodes are identities: the stages chained compute the loss."""
    compiled = compiled_for(GPT)
    source = with_token_shape(load_model(GPT), batch=2, seq=16)
    program = build_rank_program(compiled, source.model, rank=0)
    inputs = bind_inputs(source.model, compiled.graph, source.args, source.kwargs)
    stages = cut_stages(compiled.graph, compiled_cuts(compiled.graph))
    values: tuple = ()
    with torch.no_grad():
        for stage in stages.programs(program):
            values = stage(*inputs, *values)
        assert torch.equal(values[0], source.model(*source.args, **source.kwargs))


def test_a_v_schedule_gathers_the_tied_weight_in_both_of_its_stages() -> None:
    """ZBV on pp=2: rank 0 runs stage 0 (the embedding) and stage 3 (the LM head). The tied
    weight is in a unit of each: each stage gathers it before its own read (the engine gives
    it one flat, shared by both units)."""
    compiled = compiled_for(GPT, schedule="zbv", pipeline="    virtual_stages = 2\n")
    stages = cut_stages(compiled.graph, compiled_cuts(compiled.graph))
    programs = stages.programs(compiled.graph)
    gathers = {}
    for s in (0, 3):
        for n in programs[s].graph.nodes:
            module = programs[s].get_submodule(str(n.target)) if n.op == "call_module" else None
            if isinstance(module, ZeroGather):
                gathers[module.unit] = module.params
    assert "lm_head.weight" in gathers["root@stage0"] and "lm_head.weight" in gathers["root@stage3"]
    assert [zero_units(programs[s])[0] for s in (0, 3)] == [["root@stage0", "h.0"], ["h.3", "root@stage3"]]
