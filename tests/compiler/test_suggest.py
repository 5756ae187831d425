"""`meshplan suggest`: the parts found in real models, the screen's arithmetic, and the written
plan held to what the compiler, `estimate` and a training run say of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.errors import CompileError
from meshplan.compiler.estimate import estimate
from meshplan.compiler.hardware import hardware
from meshplan.compiler.load import load_model, on_meta_inputs
from meshplan.compiler.structure import model_shape
from meshplan.compiler.suggest import HEADROOM, Layout, suggest
from meshplan.dsl import check_text
from meshplan.dsl.fmt import format_plan
from meshplan.dsl.parser import parse

LLAMA = "examples/models/llama.py:build"
MOE = "examples/models/moe.py:build"
MiB = 2**20


def source(spec: str):
    """The model built on meta, its example inputs on the host: what `suggest` shapes per layout."""
    return load_model(spec, shapes_only=True)


def shaped(spec: str, batch: int, seq: int):
    return on_meta_inputs(with_token_shape(load_model(spec, shapes_only=True), batch=batch, seq=seq))


@pytest.fixture(scope="module")
def llama_4():
    """The example Llama suggested for 4 ranks of 64 MiB: too little for plain data parallelism."""
    return suggest(source(LLAMA), world=4, hw=hardware("h100"), limit=3 * MiB, batch=8, seq=32)


def test_parts_of_the_example_models():
    llama = model_shape(load_model(LLAMA, shapes_only=True).model)
    assert llama.blocks == "layers" and llama.layers == 4
    assert [(p.columns, p.row) for p in llama.pairs] == [
        (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj"),
        (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
    ]
    assert llama.norms == ("input_layernorm", "post_attention_layernorm")
    assert (llama.embedding, llama.head, llama.final_norm, llama.tied) == (
        "embed_tokens",
        "lm_head",
        "norm",
        False,
    )
    assert llama.tp_sizes() == [1, 2, 4]  # 172 MLP features: not 8
    gpt = model_shape(load_model("examples/models/gpt.py:build", shapes_only=True).model)
    assert gpt.tied and gpt.blocks == "h" and gpt.final_norm == "ln_f"
    moe = model_shape(load_model(MOE, shapes_only=True).model)
    assert (moe.experts, moe.num_experts, moe.top_k) == ("mlp.experts", 4, 2)
    assert [p.row for p in moe.pairs] == ["self_attn.o_proj"]  # the experts' own linears are not a pair


def test_parts_of_a_hugging_face_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        shape = model_shape(LlamaForCausalLM(config))
    assert shape.blocks == "model.layers" and shape.heads == 4
    assert shape.block(shape.pairs[0].row) == "model.layers.*.self_attn.o_proj"
    assert (shape.embedding, shape.head, shape.final_norm) == ("model.embed_tokens", "lm_head", "model.norm")


def test_the_suggested_plan_is_formatted_checks_and_fits_by_estimate(llama_4):
    best = llama_4.best
    assert best is not None and best.fits
    assert format_plan(parse(best.text), best.text) == best.text  # what `meshplan fmt` prints
    assert best.text.count("# ") >= 2  # a header and a reason per block
    # compiled again from the text alone, estimated again: the numbers the plan's comments state
    plan = check_text(best.text, "suggested.plan", world_size=4)
    rows = best.layout.rows(8)  # what one rank runs at once: 8 sequences a step over its data ranks
    compiled = compile_plan(plan, shaped(LLAMA, rows, 32), world_size=4, dynamic=False)
    est = estimate(compiled, limit=3 * MiB, hw=hardware("h100"))
    assert est.fits and max(r.peak for r in est.ranks) == best.estimated_peak
    assert best.layout != Layout(dp=4)  # plain data parallelism does not fit in 3 MiB


def test_the_search_never_returns_a_plan_over_the_limit(llama_4):
    estimated = [c for c in llama_4.ranked if c.estimate is not None]
    assert estimated, "the search estimated candidates"
    # a plan fits in the memory less the headroom kept for what `estimate` does not count
    assert llama_4.limit == int(3 * MiB * (1 - HEADROOM))
    for c in estimated:
        if c.fits:
            assert c.estimated_peak <= llama_4.limit
    # the pick is the one the ranking says: no estimated layout that fits is faster by more than the tie
    fastest = min(c.estimated_time for c in estimated if c.fits)
    assert llama_4.best.estimated_time <= fastest * 1.1


def test_the_screen_follows_the_memory_arithmetic(llama_4):
    from meshplan.compiler.compile import capture_for
    from meshplan.compiler.profile import profile_model
    from meshplan.compiler.screen import Counts, Screen
    from meshplan.compiler.suggest_plan import base_plan

    src = shaped(LLAMA, 1, 32)
    shape = model_shape(src.model)
    captured = capture_for(check_text(base_plan(shape, "fp32"), "<base>", world_size=1), src)
    hw = hardware("h100")
    scr = Screen(shape, Counts.of(src.model, shape), profile_model(captured, shape, hw), hw, 4, 8)
    n = sum(p.numel() for p in src.model.parameters())
    assert scr.local_params(Layout(dp=4), 0, shape.layers) == n
    states = [scr.state_bytes(Layout(dp=4, zero=z), n)[0] for z in range(4)]
    assert states == [16 * n, 8 * n + 2 * n, 4 * n + 3 * n, 4 * n]
    # a pipeline's microbatches: ZeRO-2/3's whole gradients between them (`estimate` agrees)
    piped = [scr.state_bytes(Layout(dp=4, zero=z, pp=2, microbatches=4), n)[0] for z in range(4)]
    assert piped == [16 * n, 8 * n + 2 * n, 4 * n + 3 * n + 4 * n, 4 * n + 4 * n]
    plain, ckpt = scr.peak(Layout(dp=4)), scr.peak(Layout(dp=4, checkpoint="full"))
    assert ckpt < plain
    # tensor parallelism divides the pairs' parameters; the norms stay whole
    split = scr.local_params(Layout(dp=2, tp=2, vocab=True), 0, shape.layers)
    assert n // 2 < split < n * 0.51 + 2 * 4 * 64


def test_selective_checkpointing_keeps_the_matmuls_and_recomputes_the_rest():
    """The profile counts what `checkpoint selective` keeps of a block (its matmul and attention
    outputs; a row linear's whole on every tp rank) and prices what it runs again; the screen
    puts a selective layout between none and full, in memory and in time."""
    from meshplan.compiler.compile import capture_for
    from meshplan.compiler.profile import profile_model
    from meshplan.compiler.screen import Counts, Screen
    from meshplan.compiler.suggest_plan import base_plan

    src = shaped(LLAMA, 1, 32)
    shape = model_shape(src.model)
    captured = capture_for(check_text(base_plan(shape, "fp32"), "<base>", world_size=1), src)
    hw = hardware("h100")
    profile = profile_model(captured, shape, hw)
    split, tokens, h, i, kv = profile.part("split"), 32, 64, 172, 2 * 16
    # q, k, v, attention, o, gate, up, down outputs in fp32, and attention's logsumexp per head
    assert split.matmul_saved == 4 * tokens * (h + 2 * kv + h + h + 2 * i + h) + 4 * 4 * tokens
    assert split.matmul_whole == 4 * tokens * 2 * h  # o_proj's and down_proj's partial sums under tp
    assert 0 < split.matmul_time < split.time and split.matmul_ops == 8
    assert profile.part("rest").matmul_saved == 0  # norms and residuals: recomputed

    scr = Screen(shape, Counts.of(src.model, shape), profile, hw, 4, 8)
    none, selective, full = (Layout(dp=4, tp=1, checkpoint=c) for c in ("", "selective", "full"))
    assert scr.peak(full) < scr.peak(selective) < scr.peak(none)
    assert scr.step_time(none) < scr.step_time(selective) < scr.step_time(full)
    # under tp the column outputs are cut, the row outputs not
    tp = dict(dp=2, tp=2, sp=True, vocab=True)
    kept = scr.block_activations(Layout(**tp, checkpoint="selective"))[0]
    boundary = scr.block_activations(Layout(**tp, checkpoint="full"))[0]
    f = scr.fraction(Layout(**tp))
    assert kept - boundary == pytest.approx(
        ((split.matmul_saved - split.matmul_whole) / 2 + split.matmul_whole) * f
    )


def test_a_model_with_experts_gets_an_experts_axis():
    found = suggest(source(MOE), world=4, hw=hardware("h100"), limit=64 * MiB, batch=8, seq=32, top=2)
    assert any(c.layout.ep > 1 for c in found.ranked)
    assert found.best is not None and "experts over ep (top_k=2)" in found.best.text
    check_text(found.best.text, "suggested.plan", world_size=4)


def test_nothing_fits_is_an_error_the_cli_explains(tmp_path, capsys):
    from meshplan.main import main

    status = main(
        ["suggest", "--model", LLAMA, "--world-size", "2", "--memory", "64KiB", "--hardware", "h100"]
    )
    err = capsys.readouterr().err
    assert status == 3
    assert (
        "error: no layout of 2 ranks fits 58.9 KiB a rank (64.0 KiB less 8% headroom); "
        "the closest, `mesh dp=2` (zero 3" in err
    )
    assert "needs 1.2 MiB" in err and "hint: more ranks" in err


def test_the_cli_measures_the_best_of_two_meshes_writes_the_faster_and_trains_it(
    tmp_path, capsys, monkeypatch
):
    """`--measure 2`: the estimate's best of two meshes each trained; the one written is the
    faster measured, not the faster estimated, its text saying so. The trials' runs are stood in
    for here, the estimate's second measured the faster: docs/how-to/estimate.md runs the same
    command with real ones (tests/test_docs_run.py), and the written plan trains here."""
    import re

    from runs import meshplan_run

    from meshplan import suggest_measure
    from meshplan.main import main

    def trial(cand, found, model, folder):  # the estimate's second the faster, by half
        first = cand is suggest_measure.shortlist(found, 2)[0]
        return suggest_measure.Trial(cand, cand.estimated_time * (1.0 if first else 0.5), 1 << 20)

    monkeypatch.setattr(suggest_measure, "_trial", trial)
    out = tmp_path / "suggested.plan"
    argv = ["suggest", "--model", LLAMA, "--world-size", "2", "--memory", "1GiB", "--hardware", "cpu"]
    status = main([*argv, "--measure", "2", "-o", str(out)])
    report = capsys.readouterr().out
    assert status == 0 and f"wrote {out}" in report and "estimated" in report
    table = report[report.index("measured here") :].splitlines()
    rows = [line.split() for line in table[2:4]]
    assert [r[0] for r in rows] == ["1", "2"] and rows[0][1] != rows[1][1], table  # two meshes
    measured = [float(re.findall(r"([\d.]+) ms", line)[1]) for line in table[2:4]]
    written = next(i for i, line in enumerate(table[2:4]) if "<- written" in line)
    assert written == 1 and measured[written] == min(measured), table
    text = out.read_text()
    assert text.startswith("# Suggested by `meshplan suggest` for 2 ranks")
    assert f"mesh {rows[written][1]}" in text and "# measured here: a step in" in text
    records = meshplan_run(str(out), "--steps", "2", "--out", str(tmp_path / "run"))
    assert len(records) == 2 and all(len(r) == 2 for r in records)
    assert all(torch.isfinite(torch.tensor(r[-1]["loss"])) for r in records)


def test_every_layout_refused_says_so_not_that_it_does_not_fit(capsys):
    """Falcon's 2 key/value groups cannot be split over tp=4: the only layout the axes allow is
    refused by the compiler, and the error says that (it said no layout fit the memory, naming a
    plan that needed a hundredth of it)."""
    from meshplan.main import main

    falcon = "tests/compiler/hf_factories.py:hf_falcon"
    argv = ["suggest", "--model", falcon, "--world-size", "4", "--axes", "tp", "--batch", "4", "--seq", "32"]
    assert main([*argv, "--hardware", "cpu", "--memory", "64MiB"]) == 3
    captured = capsys.readouterr()
    assert "the compiler refused tp+sp+vocab: <suggested>" in captured.err  # the report
    assert "the compiler refused every layout of 4 ranks" in captured.err
    assert "fits" not in captured.err


def test_the_plan_alone_goes_to_stdout(capsys):
    from meshplan.main import main

    assert main(["suggest", "--model", LLAMA, "--world-size", "2", "--hardware", "h100", "--top", "1"]) == 0
    captured = capsys.readouterr()
    check_text(captured.out, "stdout.plan", world_size=2)  # nothing but the plan
    assert "searched" in captured.err


def test_unknown_axes_are_a_usage_error(capsys):
    from meshplan.main import main

    assert main(["suggest", "--model", LLAMA, "--world-size", "2", "--axes", "dp,zz"]) == 2
    assert "--axes: unknown axis zz" in capsys.readouterr().err


def test_a_refused_layout_is_never_written():
    from meshplan.compiler.suggest import Candidate, search

    def verify(c):
        if c.layout.tp > 1:
            raise CompileError("tensor parallelism refused here")
        c.estimate = type("E", (), {"fits": True, "step_time": 1.0, "ranks": []})()

    ranked = [
        Candidate(Layout(dp=2, tp=2), 0, 0.5),
        Candidate(Layout(dp=2, tp=2, zero=1), 0, 0.6),
        Candidate(Layout(dp=4), 0, 0.7),
    ]
    tried, refused = search(ranked, None, verify, top=1)
    assert [c.layout for c in tried] == [Layout(dp=2, tp=2), Layout(dp=4)]  # the second tp one skipped
    assert refused == {"tp": "tensor parallelism refused here"}


def test_gpt2s_transposed_linears_are_pairs_and_no_layout_says_what_each_axis_allows(capsys):
    from meshplan.main import main

    gpt2 = "tests/compiler/hf_factories.py:hf_gpt2"
    shape = model_shape(load_model(gpt2, shapes_only=True).model)
    assert [(p.columns, p.row) for p in shape.pairs] == [
        (("attn.c_attn",), "attn.c_proj"),
        (("mlp.c_fc",), "mlp.c_proj"),
    ]
    assert shape.tied and shape.blocks == "transformer.h" and shape.tp_sizes() == [1, 2, 4]
    argv = [
        "suggest",
        "--model",
        gpt2,
        "--world-size",
        "16",
        "--batch",
        "8",
        "--seq",
        "32",
        "--axes",
        "tp,pp",
    ]
    assert main([*argv, "--hardware", "h100"]) == 2
    err = capsys.readouterr().err
    assert (
        "no layout of 16 ranks over pp, tp for this model: it allows tp 1/2/4; pp at most 2 (its blocks)"
        in err
    )


def test_json_has_the_plan_the_pick_and_the_ranking(capsys):
    import json

    from meshplan.main import main

    argv = ["suggest", "--model", LLAMA, "--world-size", "2", "--hardware", "h100", "--top", "2", "--json"]
    assert main([*argv, "--batch", "4", "--seq", "32", "--memory", "1GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"].startswith("# Suggested by `meshplan suggest`")
    best = out["best"]
    assert best["estimated"]["fits"] and best["estimated"]["peak"] <= 2**30
    assert out["ranked"][0] == best and out["searched"] >= len(out["ranked"]) > 1
    assert any("screen" in line for line in out["assumptions"])


def test_an_encoder_decoder_with_a_learned_attention_bias_is_planned():
    """T5 adds its learned position bias as SDPA's mask: the walk keeps the math path for it
    (the flash kernel has no gradient for a mask)."""
    t5 = load_model("tests/compiler/hf_factories.py:hf_t5", shapes_only=True)
    found = suggest(t5, world=2, hw=hardware("h100"), top=1)
    assert found.best is not None and found.best.fits
    assert found.shape is not None and found.shape.blocks == "decoder.block"


HF_LLAMA = "tests/compiler/hf_factories.py:hf_llama_long"


def test_long_sequences_are_cut_over_a_context_axis():
    """At 2,048 tokens a sequence (1,024 a rank), one sequence a step on two ranks: the
    attention module (the one calling SDPA) gets a context axis, its attention a ring or
    Ulysses (4 query and 2 key/value heads: one of each a rank), each estimated; the faster
    is the suggestion, and its plan compiles."""
    found = suggest(
        source(HF_LLAMA), world=2, hw=hardware("h100"), batch=1, seq=2048, axes=frozenset({"cp"}), top=2
    )
    shape = found.shape
    assert shape is not None and shape.attention == "self_attn"
    assert shape.kv_width == 2 * 2 * 16  # keys and values, 2 kv heads of 16 features each
    assert (shape.heads, shape.kv_heads) == (4, 2)
    plain = {c.layout.context: c for c in found.ranked if c.layout == Layout(cp=2, context=c.layout.context)}
    assert set(plain) == {"ring", "ulysses"} and all(c.fits for c in plain.values())
    best = found.best
    assert best is not None and best.layout.cp == 2 and not best.layout.checkpoint
    assert best is min(plain.values(), key=lambda c: c.rank_key(estimated=True))
    assert f"model.layers.*.self_attn: context {best.layout.context} over cp" in best.text
    src = shaped(HF_LLAMA, 1, 2048)
    for c in plain.values():  # each plan as written compiles
        compile_plan(
            check_text(c.text or "", "suggested.plan", world_size=2), src, world_size=2, dynamic=False
        )


def test_ulysses_is_searched_where_the_heads_divide():
    """The compiler's rule for `context ulysses` beside `column over tp`: query heads divide by
    cp x tp; the key/value heads a tp rank keeps divide by cp or divide it."""
    from meshplan.compiler.suggest import layouts

    shape = model_shape(load_model(HF_LLAMA, shapes_only=True).model)
    shape = dataclasses.replace(shape, attention="self_attn")  # what the capture finds
    assert shape.ulysses(2, 1) and shape.ulysses(4, 1) and shape.ulysses(2, 2)  # 4 / 2 heads
    assert not shape.ulysses(8, 1) and not shape.ulysses(4, 2)  # 8 ranks for 4 query heads
    gqa = dataclasses.replace(shape, heads=12, kv_heads=3)
    assert gqa.ulysses(3, 1) and gqa.ulysses(2, 3) and not gqa.ulysses(2, 1)  # 3 kv heads on 2 ranks

    def modes(world: int) -> set[tuple[int, int, str]]:
        space = layouts(shape, world, 1, 8192, 8, frozenset({"cp", "tp"}))
        return {(lay.cp, lay.tp, lay.context) for lay in space if lay.cp > 1}

    assert modes(4) == {(4, 1, "ring"), (4, 1, "ulysses"), (2, 2, "ring"), (2, 2, "ulysses")}
    assert modes(8) == {(8, 1, "ring"), (4, 2, "ring"), (2, 4, "ring")}


def test_a_context_axis_halves_the_activations_the_screen_prices():
    from meshplan.compiler.compile import capture_for
    from meshplan.compiler.profile import profile_model
    from meshplan.compiler.screen import Counts, Screen
    from meshplan.compiler.suggest_plan import base_plan

    src = shaped(HF_LLAMA, 1, 2048)
    captured = capture_for(check_text(base_plan(model_shape(src.model), "fp32"), "<b>", world_size=1), src)
    shape = model_shape(src.model, captured)
    hw = hardware("h100")
    scr = Screen(shape, Counts.of(src.model, shape), profile_model(captured, shape, hw), hw, 2, 1)
    whole, cut = scr.block_activations(Layout()), scr.block_activations(Layout(cp=2))
    assert cut[0] == pytest.approx(whole[0] / 2)
    assert scr.step_time(Layout(cp=2)) > scr.step_time(Layout()) / 2  # the ring is not free
    # too short a sequence for a ring: not searched
    from meshplan.compiler.suggest import layouts

    assert all(lay.cp == 1 for lay in layouts(shape, 4, 4, 1024, per_node=8))
    assert any(lay.cp == 2 for lay in layouts(shape, 4, 4, 2048, per_node=8))


def test_sequence_parallel_norms_are_searched_and_written_under_a_context_axis():
    """cp=2 x tp=2: each rank's 1,024 tokens of a 2,048-token sequence are cut again over tp at
    the norms; the written plan compiles with the norm weights' gradients summed over both."""
    from meshplan.compiler.compile import capture_for
    from meshplan.compiler.suggest import Candidate, layouts
    from meshplan.compiler.suggest_plan import base_plan, write_plan

    src = shaped(HF_LLAMA, 1, 2048)
    captured = capture_for(check_text(base_plan(model_shape(src.model), "fp32"), "<b>", world_size=1), src)
    shape = model_shape(src.model, captured)  # the attention module: the one calling SDPA
    space = list(layouts(shape, 4, 1, 2048, per_node=8, axes=frozenset({"cp", "tp"})))
    lay = next(lay for lay in space if lay.cp == 2 and lay.tp == 2 and lay.sp)
    text = write_plan(
        shape,
        Candidate(lay, 0, 0.0),
        compute="fp32",
        world=4,
        hw=hardware("h100"),
        limit=None,
        batch=1,
        seq=2048,
    )
    assert "context ring over cp" in text and "norm: sequence over tp" in text
    compiled = compile_plan(
        check_text(text, "suggested.plan", world_size=4), src, world_size=4, dynamic=False
    )
    assert set(compiled.grad_sums["model.norm.weight"]) == {"cp", "tp"}


def test_an_interleaved_pipeline_is_searched_and_written():
    from meshplan.compiler.suggest import Candidate, layouts
    from meshplan.compiler.suggest_plan import write_plan

    shape = model_shape(load_model(LLAMA, shapes_only=True).model)
    space = list(layouts(shape, 2, 8, 32, per_node=8, axes=frozenset({"pp"})))
    assert {lay.virtual for lay in space} == {1, 2}  # 4 blocks: 2 chunks on each of 2 ranks
    lay = Layout(pp=2, microbatches=4, virtual=2)
    hw = hardware("h100")
    text = write_plan(
        shape, Candidate(lay, 0, 0.0), compute="fp32", world=2, hw=hw, limit=None, batch=8, seq=32
    )
    assert "schedule = interleaved" in text and "virtual_stages = 2" in text and "bubble 11%" in text
    plan = check_text(text, "suggested.plan", world_size=2)
    compiled = compile_plan(plan, shaped(LLAMA, lay.rows(8), 32), world_size=2, dynamic=False)
    assert estimate(compiled, hw=hw).fits
    from meshplan.compiler.screen import Screen

    assert Screen.in_flight(lay, 0) > Screen.in_flight(Layout(pp=2, microbatches=4), 0)


def test_measuring_more_ranks_than_this_machine_starts_is_refused_before_the_search(capsys):
    from meshplan.main import main

    argv = ["suggest", "--model", LLAMA, "--world-size", "1024", "--hardware", "h100", "--measure", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--measure trains each plan here: 1024 ranks are more than" in err and "searched" not in err


def test_hsdp_is_searched_across_nodes_written_and_priced_as_a_node_local_zero():
    """16 ranks of 8-GPU nodes: ZeRO over a node's 8 data ranks with a copy on each node is in
    the space (not on 8 ranks: one node); the screen holds twice a full shard's state, and its
    gathers cross no node, so its step is faster than ZeRO-3 over all 16 (the datasheet's links:
    inter-node 8x slower); the written plan compiles with the state cut over dp and copied over
    node, and its estimate holds 1/8 of it."""
    from meshplan.compiler.profile import profile_model
    from meshplan.compiler.screen import Counts, Screen
    from meshplan.compiler.suggest import Candidate, layouts
    from meshplan.compiler.suggest_plan import write_plan

    src = load_model(LLAMA, shapes_only=True)
    shape = model_shape(src.model)
    space = list(layouts(shape, 16, 16, 32, per_node=8, axes=frozenset({"dp"})))
    assert {(lay.copies, lay.shards) for lay in space if lay.zero} == {(1, 16), (2, 8)}
    assert all(lay.copies == 1 for lay in layouts(shape, 8, 8, 32, per_node=8))
    assert all(lay.zero for lay in space if lay.copies > 1)  # plain data parallelism has no state to cut

    hw = hardware("h100")
    compiled = compile_plan(
        check_text("mesh dp=16\n\ndata_parallel over dp {\n    zero = 3\n}\n", "p.plan", world_size=16),
        shaped(LLAMA, 1, 32),
        world_size=16,
    )
    scr = Screen(shape, Counts.of(src.model, shape), profile_model(compiled.captured, shape, hw), hw, 16, 16)
    full, hsdp = Layout(dp=16, zero=3), Layout(dp=16, zero=3, copies=2)
    n = scr.local_params(full, 0, shape.layers)
    assert scr.state_bytes(hsdp, n)[0] == 16 * n // 8 and scr.state_bytes(full, n)[0] == 16 * n // 16
    assert scr.step_time(hsdp) < scr.step_time(full)

    text = write_plan(
        shape, Candidate(hsdp, 0, 0.0), compute="fp32", world=16, hw=hw, limit=None, batch=16, seq=32
    )
    assert "mesh node=2, dp=8" in text and "data_parallel over node x dp {" in text
    assert "zero = 3 over dp" in text
    written = compile_plan(
        check_text(text, "suggested.plan", world_size=16), shaped(LLAMA, 1, 32), world_size=16
    )
    (rank,) = {(r.params, r.optimizer) for r in estimate(written, hw=hw).ranks}
    (whole,) = {(r.params, r.optimizer) for r in estimate(compiled, hw=hw).ranks}
    # 1/8 of the state, not 1/16 (each flat padded to its shard count: a few bytes apart)
    assert rank == pytest.approx((2 * whole[0], 2 * whole[1]), rel=1e-3)
