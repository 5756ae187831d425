"""Context parallelism in the compiled program: what each rank runs, and what is refused.

Numerics are `tests/cli/test_run_context.py`'s (training against one process); here, the
program: the token inputs cut by sequence, attention's keys and values gathered with the
causal mask's rows of this rank (`all_gather`), or heads moved by all-to-all (`ulysses`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plans import MIXTRAL_RULES, llama_rules, llama_sequence, plan

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.meta import COLLECTIVE, PLACEMENT, placement
from meshplan.compiler.placement import REPLICATE, Shard
from meshplan.dsl import PlanError, check_text
from meshplan.examples.models import llama
from meshplan.runtime.collectives import AxisCollective


def _compile(text: str, seq: int = 16, **config: object):
    """For the example shape only: a context plan's symbolic compile falls back to it anyway
    (sequence shards flattened with the batch need static sizes), after a second capture."""
    model = llama.build(**config)
    source = ModelSource("m", model, llama.example_inputs(seq=seq))
    return compile_plan(check_text(text, "p.plan"), source, dynamic=False)


def _plan(mode: str, mesh: str = "cp=2") -> str:
    return f"mesh {mesh}\n\nmodules {{\n    layers.*.self_attn: context {mode} over cp\n}}\n"


def _calls(compiled) -> list[str]:
    return [str(n.target) for n in compiled.graph.graph.nodes if n.op in ("call_module", "call_function")]


def test_all_gather_cuts_the_tokens_and_gathers_keys_and_values():
    compiled = _compile("mesh cp=2\n\nmodules {\n    layers.*.self_attn: context all_gather over cp\n}\n")
    calls = _calls(compiled)
    layers = 4
    assert calls.count("all_gather_cp") == 2 * layers  # k and v of every layer
    assert calls.count("aten.ge.Tensor") == layers  # this rank's rows of the causal mask
    split = [n for n in compiled.graph.graph.nodes if n.target == "split_cp"]
    assert {a.name for n in split for a in n.all_input_nodes} >= {"input_ids", "labels"}
    # the loss: each rank's tokens, over the valid tokens of the whole batch, summed over cp
    assert calls.count("all_reduce_cp") == 2  # the valid-token count and the loss


def test_ulysses_moves_heads_by_all_to_all():
    compiled = _compile("mesh cp=2\n\nmodules {\n    layers.*.self_attn: context ulysses over cp\n}\n")
    assert _calls(compiled).count("all_to_all_cp") == 4 * 4  # q, k, v in and the output back, per layer
    assert not compiled.graph.all_to_all_cp.balanced  # Ulysses keeps contiguous chunks


def test_causal_ring_and_all_gather_use_the_load_balanced_layout():
    """Every collective over `cp` cuts the sequence into 2 x 2 chunks, rank r holding r and 3 - r:
    the token inputs, the rotary tables and this rank's rows of the causal mask alike."""
    for mode in ("ring", "all_gather"):
        graph = _compile(_plan(mode)).graph
        collectives = [m for m in graph.children() if isinstance(m, AxisCollective) and m.axis == "cp"]
        assert collectives and all(m.balanced for m in collectives), mode
        assert "balanced" in repr(graph.split_cp)


def test_layout_contiguous_turns_the_balanced_layout_off():
    """`(layout=contiguous)`: rank r holds chunk r of n, so a sequence n divides is enough."""
    for mode in ("ring", "all_gather"):
        text = _plan(mode).replace(" over cp", " over cp (layout=contiguous)")
        graph = _compile(text, seq=6).graph
        collectives = [m for m in graph.children() if isinstance(m, AxisCollective) and m.axis == "cp"]
        assert collectives and not any(m.balanced for m in collectives), mode


def test_layout_balanced_is_kept_where_the_compiler_would_not_choose_it():
    """Attention written in matmuls is not seen as causal, so the default is contiguous chunks;
    `(layout=balanced)` is the plan's word and is kept (verify passes it against float64)."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.load import load_model

    source = with_token_shape(
        load_model(f"{Path(__file__).parent}/factories.py:gpt_matmul_attention"), seq=16
    )
    for layout, balanced in (("", False), (" (layout=balanced)", True)):
        text = f"mesh cp=2\n\nmodules {{\n    h.*.attn: context all_gather over cp{layout}\n}}\n"
        graph = compile_plan(check_text(text, "p.plan"), source, dynamic=False).graph
        collectives = [m for m in graph.children() if isinstance(m, AxisCollective) and m.axis == "cp"]
        assert collectives and all(m.balanced == balanced for m in collectives), layout


def test_the_balanced_layout_needs_a_sequence_divisible_by_twice_the_context_size():
    with pytest.raises(PlanError) as info:
        _compile(_plan("ring"), seq=6)
    assert info.value.render().splitlines()[0] == (
        "p.plan:4:5: error: the sequence length 6 is not divisible by 4 = 2 x 2 ranks over `cp`: "
        "causal attention's load-balanced layout gives each rank two chunks (r and 3 - r of 4)"
    )
    _compile(_plan("ulysses"), seq=6)  # contiguous chunks: 6 divides by 2


@pytest.mark.parametrize(("kv", "cp"), [(1, 2), (2, 4)])
def test_ulysses_with_fewer_key_value_heads_than_ranks_keeps_each_rank_its_head(kv: int, cp: int):
    """Fewer key/value heads than ranks, handed to attention grouped: each rank gathers the
    sequence of k and v and keeps the head its query heads use, cp / kv ranks per head (kv 2
    at cp 4: ranks 0 and 1 keep head 0, ranks 2 and 3 head 1)."""
    compiled = _compile(_plan("ulysses", f"cp={cp}"), num_key_value_heads=kv, repeat_kv=False)
    calls = _calls(compiled)
    layers = 4
    assert calls.count("all_to_all_cp") == 2 * layers  # q in, the output back
    assert calls.count("all_gather_cp") == calls.count("kv_group_cp") == 2 * layers  # k and v
    kept = [n for n in compiled.graph.graph.nodes if n.target == "kv_group_cp"]
    assert {n.args[1:] for n in kept} == {(1, cp // kv)}  # heads dim, ranks per head
    assert {str(n.meta[PLACEMENT]["cp"]) for n in kept} == {f"Shard(1, replicas={cp // kv})"}
    # explain's formula (q and the output by all-to-all, k and v gathered) is the ledger's traffic
    from meshplan.compiler.print_explain import explain

    rows = [
        r for r in compiled.ledger.rows if r.kind in ("all_to_all", "all_gather") and r.phase == "forward"
    ]
    assert f"ulysses {sum(r.traffic for r in rows) / layers / 1e3:.1f} KB (this plan)" in explain(compiled)


def test_ulysses_refuses_query_heads_the_ranks_do_not_divide():
    with pytest.raises(PlanError) as info:
        _compile(_plan("ulysses"), num_attention_heads=1, num_key_value_heads=1)
    rendered = info.value.render()
    assert (
        "has 1 query heads, not divisible by 2 ranks over `cp`: Ulysses gives each rank whole heads"
        in rendered
    )
    assert (
        "hint: use `context ring` or `context all_gather` for this module, or a `cp` size dividing 1"
        in rendered
    )


ULYSSES_IN_TP = (
    "mesh cp=2, tp=2\n\nmodules {\n    layers.*.self_attn: context ulysses over cp\n"
    "    layers.*.self_attn.{q,k,v}_proj: column over tp\n    layers.*.self_attn.o_proj: row over tp\n}\n"
)


def test_ulysses_cuts_again_the_heads_tensor_parallelism_splits():
    """Ulysses over cp beside q/k/v split by heads over tp (8 query, 4 key/value heads): each tp
    rank's heads go through the all-to-alls as they are, cut again over cp, so attention runs
    on 8 / 4 query heads per rank, split over both axes, and the all-to-alls move half the
    bytes of the same plan without tp. Nothing gathers the heads over tp first (it did, before
    this composition was lowered: correct, but every tp rank attended with all its cp heads)."""
    heads = {"num_attention_heads": 8, "num_key_value_heads": 4}
    both = _compile(ULYSSES_IN_TP, **heads)
    alone = _compile(_plan("ulysses"), **heads)
    calls = _calls(both)
    assert calls.count("all_to_all_cp") == 4 * 4  # q, k, v in and the output back, per layer
    assert not [c for c in calls if c.endswith("_tp") and "gather" in c]
    attention = [
        n for n in both.graph.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default
    ]
    assert len(attention) == 4
    assert {str(p) for n in attention for p in n.meta[PLACEMENT].values()} == {"Shard(1)"}  # heads, both axes

    def moved(compiled) -> list[int]:
        return sorted(r.bytes for r in compiled.ledger.rows if r.kind == "all_to_all")

    assert moved(both) == [b // 2 for b in moved(alone)]


def test_ulysses_inside_tensor_parallelism_with_fewer_key_value_heads_than_ranks():
    """4 query and 2 key/value heads over tp=2 x cp=2: each tp rank has 2 query heads (1 per cp
    rank, by all-to-all) and 1 key/value head, which both its cp ranks' queries use: k and v are
    gathered by sequence over cp and each rank keeps that head (`kv_group_cp`, 2 ranks a head,
    picking among the tp rank's heads: nothing gathered over tp)."""
    compiled = _compile(ULYSSES_IN_TP)
    calls = _calls(compiled)
    layers = 4
    assert calls.count("all_to_all_cp") == 2 * layers  # q in, the output back
    assert calls.count("all_gather_cp") == calls.count("kv_group_cp") == 2 * layers  # k and v
    assert not [c for c in calls if c.endswith("_tp") and "gather" in c]
    kept = [n for n in compiled.graph.graph.nodes if n.target == "kv_group_cp"]
    assert {n.args[1:] for n in kept} == {(1, 2)}
    assert {(str(n.meta[PLACEMENT]["cp"]), str(n.meta[PLACEMENT]["tp"])) for n in kept} == {
        ("Shard(1, replicas=2)", "Shard(1)")
    }


def test_ulysses_refuses_query_heads_tensor_parallelism_leaves_too_few_of():
    """2 query heads over tp=2 x cp=2: a rank would hold half a head. Located at the context
    rule, with a note at the tensor rule that split them first."""
    with pytest.raises(PlanError) as info:
        _compile(ULYSSES_IN_TP, num_attention_heads=2, num_key_value_heads=2)
    rendered = info.value.render()
    assert rendered.startswith(
        "p.plan:4:5: error: the 2 query heads of `layers.0.self_attn` are split over 2 ranks of `tp`, and "
        "Ulysses over `cp` would split each rank's share again over 2: 4 does not divide 2, and a rank "
        "must hold whole heads"
    )
    assert "p.plan:5:5: note: `tp` splits the heads here" in rendered
    assert "hint: use `context ring` or `context all_gather` for this module" in rendered


def test_ulysses_refuses_key_value_heads_a_tensor_rank_keeps_that_the_context_ranks_cannot_share():
    """12 query, 6 key/value heads over tp=2 x cp=2: each tp rank keeps 3 key/value heads, which
    neither divide over 2 cp ranks nor 2 ranks share evenly."""
    with pytest.raises(PlanError) as info:
        _compile(ULYSSES_IN_TP, hidden_size=96, num_attention_heads=12, num_key_value_heads=6)
    assert info.value.render().startswith(
        "p.plan:4:5: error: the 6 key/value heads of `layers.0.self_attn` are split over 2 ranks of `tp`, "
        "and what each keeps is neither a multiple of 2 ranks over `cp` nor dividing it with its query "
        "heads: Ulysses cannot give each rank the key/value heads its query heads use"
    )


def test_a_context_axis_before_the_tensor_axis_compiles_as_after_it():
    """`mesh cp=2, tp=4` walks cp first, so the tensor walk reads every weight through cp's f
    (copy_to_cp): the split weights' rules and GQA's shared kv heads (2 for tp=4) are still
    found behind it, and the ring's kv heads, each kept by two tp ranks, stay per rank.
    It used to stop on an internal error; the numbers are meshplan verify's (8 ranks)."""
    rules = (
        "    layers.*.self_attn: context ring over cp\n"
        "    layers.*.self_attn.{q,k,v}_proj: column over tp\n    layers.*.self_attn.o_proj: row over tp\n"
        "    layers.*.mlp.{gate,up}_proj: column over tp\n    layers.*.mlp.down_proj: row over tp\n"
    )
    ledgers = []
    for mesh in ("cp=2, tp=4", "tp=4, cp=2"):
        compiled = _compile(f"mesh {mesh}\n\nmodules {{\n{rules}}}\n")
        assert _calls(compiled).count("kv_group_tp") == 2 * 4  # k and v of every layer
        assert not [d for d in compiled.warnings if "runs on whole tensors" in d.message]
        # (a gradient bucket over both axes names them in mesh order: `cp x tp`, `tp x cp`)
        rows = [
            (r.kind, sorted(r.axis.split(" x ")), r.phase, r.count, r.bytes) for r in compiled.ledger.rows
        ]
        ledgers.append(sorted(rows))
    assert ledgers[0] == ledgers[1]


@pytest.mark.parametrize("mode", ["ring", "all_gather", "ulysses"])
def test_sequence_parallel_norms_cut_each_ranks_slice_of_the_sequence_again(mode: str):
    """Megatron's sequence parallelism inside context parallelism: a rank of `cp` holds 8 of
    the 16 tokens, and the norms between the tensor-parallel pairs hold 4 of those 8 on each
    rank of `tp`: the reduce-scatters and all-gathers move (B, 8, H), the cp rank's slice; the
    norm weights' gradients are summed over both axes (layer 0's first norm reads the
    embedding's output, whole over `tp`: it runs whole). Ulysses moves heads over `cp`, so its
    attention stays whole over `tp` (the MLP is split). Mesh order does not change what the
    layers move (the loss's scalar sums differ: the walk that meets it first counts the tokens).
    Numbers: meshplan verify of each against float64 (tests/cli/test_run_context.py runs one)."""
    attention = "" if mode == "ulysses" else llama_rules(vocab=False).split("    layers.*.mlp")[0]
    mlp = "    layers.*.mlp.{gate,up}_proj: column over tp\n    layers.*.mlp.down_proj: row over tp\n"
    rules = f"\n    layers.*.self_attn: context {mode} over cp\n{attention}{mlp}{llama_sequence()}"
    ledgers = []
    for mesh in ("cp=2, tp=2", "tp=2, cp=2"):
        compiled = _compile(plan(rules, mesh=mesh))
        norm = next(
            n
            for n in compiled.graph.graph.nodes
            if n.op == "call_function"
            and "layernorm" in str(n.meta.get("nn_module_stack", ""))
            and isinstance(placement(n).get("tp"), Shard)
        )
        assert placement(norm) == {"cp": Shard(1), "tp": Shard(1)}
        tp_rows = [
            r for r in compiled.ledger.rows if r.axis == "tp" and r.kind in ("reduce_scatter", "all_gather")
        ]
        pairs = 2 if mode == "ulysses" else 4  # per layer: MLP in and out (and attention's)
        # less one: layer 0 reads the embedding's output, whole on every tp rank
        assert sum(r.count for r in tp_rows if r.phase == "forward") == 4 * pairs - 1
        assert {tuple(r.shape) for r in tp_rows} == {(2, 8, 64)}
        sums = compiled.grad_sums
        assert set(sums["norm.weight"]) == set(sums["layers.1.input_layernorm.weight"]) == {"cp", "tp"}
        assert sums["layers.0.mlp.up_proj.weight"] == ("cp",)
        layers = [r for r in compiled.ledger.rows if r.kind not in ("all_reduce", "gather_replicated")]
        ledgers.append(
            sorted((r.kind, sorted(r.axis.split(" x ")), r.phase, r.count, r.bytes) for r in layers)
        )
    assert ledgers[0] == ledgers[1]


@pytest.mark.parametrize("mesh", ["cp=2, tp=2", "tp=2, cp=2"])
def test_a_context_gather_of_tokens_the_tensor_axis_cuts_again_gathers_those_first(mesh: str):
    """Mixtral's router sorts every token of the batch, so the tokens are gathered whole before
    it. A rank holds its tp piece of its cp slice: gathering over cp first would interleave
    the pieces (the loss was off by 5e-4 at the first step); the tp pieces are gathered first,
    whichever order the mesh names the axes in. Numbers: tests/cli/test_verify.py."""
    pytest.importorskip("transformers")
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.load import load_model

    source = with_token_shape(load_model(f"{Path(__file__).parent}/hf_factories.py:hf_mixtral"), seq=16)
    rules = (
        "\n    model.layers.*.self_attn: context ring over cp\n" + MIXTRAL_RULES + llama_sequence("model.")
    )
    graph = compile_plan(check_text(plan(rules, mesh=mesh), "p.plan"), source, dynamic=False).graph
    gathers = [
        n
        for n in graph.graph.nodes
        if n.op == "call_module" and str(n.target).startswith("gather_replicated_cp")
    ]
    assert all(placement(n.args[0])["tp"] == REPLICATE for n in gathers)  # whole over tp first
    tokens = [n.args[0] for n in gathers if str(n.args[0].target).startswith("gather_replicated_tp")]
    assert tokens and all(placement(x) == {"cp": Shard(0, (16, 16)), "tp": REPLICATE} for x in tokens)


def test_a_tensor_filled_in_place_is_cut_after_its_writes():
    """DeepSeek-V3's attention makes its keys with `new_empty` and copies their two halves in
    through slices; the ring takes this rank's chunk of them. The split goes after the copies:
    taken right after `new_empty` it read uninitialized memory (the loss was NaN at step 1)."""
    pytest.importorskip("transformers")
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.load import load_model

    source = with_token_shape(load_model(f"{Path(__file__).parent}/hf_factories.py:hf_deepseek_v3"), seq=16)
    text = "mesh dp=2, cp=2\n\nmodules {\n    model.layers.*.self_attn: context ring over cp\n"
    text += "    model.layers.*.mlp.experts: experts over dp (top_k=2)\n}\n"
    nodes = list(compile_plan(check_text(text, "p.plan"), source, dynamic=False).graph.graph.nodes)
    empties = [n for n in nodes if n.target is torch.ops.aten.new_empty.default]
    assert empties
    for empty in empties:
        split = next(u for u in empty.users if u.op == "call_module")
        writes = [u for view in empty.users for u in view.users if u.target is torch.ops.aten.copy_.default]
        assert len(writes) == 2 and all(nodes.index(w) < nodes.index(split) for w in writes)


def test_a_context_rule_on_a_model_fed_images_is_refused_at_the_rule():
    """A ViT's inputs are pixels and labels, no token sequence: the rule would cut nothing and
    do nothing (it compiled to a program with no collective), so it is a located error."""
    from meshplan.compiler.load import load_model

    source = load_model(f"{Path(__file__).parent}/vision_models.py:build")
    text = "mesh cp=2\n\nmodules {\n    blocks.*.attn: context ring over cp\n}\n"
    with pytest.raises(PlanError) as info:
        compile_plan(check_text(text, "p.plan"), source, dynamic=False)
    first = info.value.render().splitlines()[0]
    assert first.startswith(
        "p.plan:4:5: error: `context` over `cp` cuts the sequence of the model's token inputs"
    )
    assert "this model takes none (pixels (2, 3, 16, 16), labels (2,))" in first


def test_a_sequence_cut_over_two_axes_must_divide_by_both():
    """Each cp rank's slice is cut again over `tp`: the sequence must divide by cp x tp, and
    the error says so at the rule that cuts it again, whichever order the mesh names the axes."""
    rules = "\n    layers.*.self_attn: context ring over cp (layout=contiguous)\n" + llama_rules(vocab=False)
    for mesh in ("cp=2, tp=2", "tp=2, cp=2"):
        text = plan(rules + llama_sequence(), mesh=mesh)
        line = next(i for i, t in enumerate(text.splitlines(), 1) if "sequence over" in t)
        with pytest.raises(PlanError) as info:
            _compile(text, seq=6)
        message = info.value.render().splitlines()[0]
        assert message.startswith(f"p.plan:{line}:"), message
        assert "cuts dim 1 (size 6) into 4 shards over `cp` x `tp`, and 6 does not divide by 4" in message
    _compile(plan(rules + llama_sequence(), mesh="cp=2, tp=2"), seq=8)


def test_ring_attention_is_one_module_per_layer_with_its_bytes_in_the_ledger():
    compiled = _compile("mesh cp=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n}\n")
    assert _calls(compiled).count("ring_attention_cp") == 4
    rows = [r for r in compiled.ledger.rows if r.kind == "ring_attention"]
    # k and v blocks forward; k, v and their gradients backward: the whole sequence's k, (n-1)/n of it each
    # (B, the 2 key/value heads: the model's GQA repeat to 4 is left to the ring, T, head_dim) float32
    k_bytes = 2 * 2 * 16 * 16 * 4
    repeats = [n for n in compiled.graph.graph.nodes if n.target is torch.ops.aten.repeat_interleave.self_int]
    assert not repeats
    assert {(r.phase, r.count, r.bytes) for r in rows} == {("forward", 2, k_bytes), ("backward", 4, k_bytes)}
    assert sum(r.traffic for r in rows) == 4 * (2 + 4) * k_bytes / 2


@pytest.mark.parametrize("mode", ["all_gather", "ulysses"])
def test_explain_predicts_each_variant_and_the_ledger_agrees(mode: str):
    """The formulas `explain` prints (k and v of the P - 1 others; Ulysses' q, k, v and output
    by all-to-all) against the ledger of the collectives the walk inserted: equal. The example
    Llama repeats its 2 key/value heads to the 4 query heads; the collectives move the 2."""
    from meshplan.compiler.print_explain import explain

    compiled = _compile(f"mesh cp=2\n\nmodules {{\n    layers.*.self_attn: context {mode} over cp\n}}\n")
    text = explain(compiled)
    # h = 4 x 16, h_kv = 2 x 16, N = 16, P = 2, B = 2, 4 bytes: 2 h_kv (N/P)(P-1) and (2h + 2h_kv)(N/P)(P-1)/P
    per_layer = {"all_gather": 4096, "ulysses": 6144}
    assert "per layer, a rank receives in forward: all_gather 4.1 KB" in text
    assert all(f"{m} {kb} KB" in text for m, kb in (("ring", "4.1"), ("ulysses", "6.1")))
    assert f"{mode} {per_layer[mode] / 1e3:.1f} KB (this plan)" in text
    assert "k/v 2 heads of 16 as they travel" in text
    balanced = "layout: load-balanced causal, the sequence in 4 chunks, rank r holding chunks r and 3 - r"
    assert (balanced in text) == (mode == "all_gather")  # Ulysses keeps contiguous chunks
    kind = "all_gather" if mode == "all_gather" else "all_to_all"
    rows = [r for r in compiled.ledger.rows if r.kind == kind and r.phase == "forward"]
    assert sum(r.traffic for r in rows) / 4 == per_layer[mode]


def test_a_batch_of_one_sequence_is_cut_by_sequence_too():
    """Long sequences come one per batch: the loss's (1, T, V) -> (T, V) keeps the sequence shard."""
    text = "mesh cp=2\n\nmodules {\n    layers.*.self_attn: context ring over cp\n}\n"
    source = ModelSource("m", llama.build(), llama.example_inputs(1, 16))
    compiled = compile_plan(check_text(text, "p.plan"), source)
    flat = [n for n in compiled.graph.graph.nodes if n.target is torch.ops.aten.flatten.using_ints]
    assert flat and all(placement(n)["cp"] == Shard(0) for n in flat)


def test_ring_and_ulysses_take_attention_written_with_matmuls_as_one_sdpa():
    """nanoGPT's attention (scores, a scale, masked_fill, softmax, @ v) is the sdpa call those
    modes replace: ring attention takes the mask buffer's rows, Ulysses moves q, k, v by heads."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.load import load_model

    source = with_token_shape(
        load_model(f"{Path(__file__).parent}/factories.py:gpt_matmul_attention"), seq=16
    )
    for mode, module in (("ring", "ring_attention"), ("ulysses", "all_to_all")):
        text = f"mesh cp=2\n\nmodules {{\n    h.*.attn: context {mode} over cp\n}}\n"
        compiled = compile_plan(check_text(text, "p.plan"), source)
        graph = compiled.graph.graph
        assert not [n for n in graph.nodes if n.target is torch.ops.aten.matmul.default]
        kinds = [n.meta[COLLECTIVE]["kind"] for n in graph.nodes if COLLECTIVE in n.meta]
        assert kinds.count(module) >= 2, kinds  # one per layer at least


def test_attention_in_matmuls_that_is_not_sdpa_is_refused_under_ring():
    """A learned temperature (a tensor, not a number) is not what sdpa computes: refused, located."""
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.load import load_model

    factory = f"{Path(__file__).parent}/factories.py:gpt_learned_temperature_attention"
    source = with_token_shape(load_model(factory), seq=16)
    text = "mesh cp=2\n\nmodules {\n    h.*.attn: context ring over cp\n}\n"
    with pytest.raises(PlanError) as e:
        compile_plan(check_text(text, "p.plan"), source, dynamic=False)
    rendered = e.value.render()
    assert "is attention written with matmuls in a form `context ring` does not recognize" in rendered
    assert "hint: use `context all_gather` for this module" in rendered


def test_hugging_face_eager_attention_gathers_its_key_value_heads_unrepeated():
    """`repeat_kv` (unsqueeze, expand, reshape) is captured as the repeat_interleave it is, so
    all_gather moves Llama's 2 kv heads and repeats them to the 4 query heads after."""
    pytest.importorskip("transformers")
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.load import load_model

    spec = f"{Path(__file__).parent}/hf_factories.py:hf_llama_eager"
    text = "mesh cp=2\n\nmodules {\n    model.layers.*.self_attn: context all_gather over cp\n}\n"
    compiled = compile_plan(check_text(text, "p.plan"), with_token_shape(load_model(spec), seq=16))
    nodes = compiled.graph.graph.nodes
    gathered = [
        n.args[0].meta["val"].shape
        for n in nodes
        if str(n.target) == "all_gather_cp" and n.args[0].meta["val"].dim() == 4
    ]
    assert gathered and all(heads == 2 for _, heads, _, _ in gathered), gathered  # k, v of each layer
    assert sum(str(n.target) == "aten.repeat_interleave.self_int" for n in nodes) == 2 * 2


def test_an_op_outside_every_rule_run_on_gathered_tokens_is_said_at_the_plans_first_rule():
    """T5 shifts its labels at the top level (`labels[..., :-1]`): a slice across the sequence
    the context axis cuts, which runs on the gathered labels. No rule holds it, so the warning
    points at the plan's first rule, with what the gather moves."""
    pytest.importorskip("transformers")
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.load import load_model

    spec = f"{Path(__file__).parent}/hf_factories.py:hf_t5"
    text = (
        "mesh cp=2\n\nmodules {\n"
        "    {encoder,decoder}.block.*.layer.0.SelfAttention: context all_gather over cp\n"
        "    decoder.block.*.layer.1.EncDecAttention: context all_gather over cp\n}\n"
    )
    source = with_token_shape(load_model(spec), seq=16)
    compiled = compile_plan(check_text(text, "t5.plan"), source, dynamic=False)
    (warning,) = [w for w in compiled.warnings if "at the top level has no sharding rule" in w.message]
    assert warning.span.line == 4
    assert (
        "`slice` at the top level" in warning.message and "all-gathered over `cp` (256 B)" in warning.message
    )
