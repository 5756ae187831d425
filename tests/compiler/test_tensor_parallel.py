"""The tensor-parallel pass in one process: what it inserts, local shapes, and its errors.

Numerics are in test_tp_parity.py (gloo, several processes); here the fake process
group lets any mesh size build and run a rank's program for shapes.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource, load_model
from meshplan.compiler.lower import build_rank_program, local_shard
from meshplan.compiler.placement import Shard
from meshplan.dsl import PlanError, check_text
from meshplan.examples.models import gpt, llama
from meshplan.runtime.mesh import MeshLayout, init_mesh

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

TP_RULES = """
mesh tp={n}

modules {{
    layers.*.self_attn.{{q,k,v}}_proj: column over tp
    layers.*.self_attn.o_proj:       row over tp
    layers.*.mlp.{{gate,up}}_proj:     column over tp
    layers.*.mlp.down_proj:          row over tp
    embed_tokens:                    vocab over tp
    lm_head:                         vocab over tp
{extra}}}
"""


def compile_text(text: str, source: ModelSource):
    return compile_plan(check_text(text, "test.plan"), source)


@pytest.fixture(scope="module")
def llama_tp8():
    return load_model(f"{HERE}/factories.py:llama_tp8")


def test_ledger_is_the_megatron_minimum_without_sequence_parallel(llama_tp8):
    compiled = compile_text(TP_RULES.format(n=8, extra=""), llama_tp8)
    layers = 2
    ledger = compiled.ledger
    # forward: one all-reduce after each row split (2 per block) and after the vocab-parallel
    # embedding, and 3 small ones inside the vocab-parallel loss (max, sum of exp, target logit)
    assert ledger.count("all_reduce", "forward") == 2 * layers + 1 + 3
    # backward: one all-reduce per column group (q/k/v share one, gate/up share one) and one
    # for the LM head's input
    assert ledger.count("all_reduce", "backward") == 2 * layers + 1
    assert ledger.count("all_gather") == ledger.count("reduce_scatter") == 0
    b, t, h = 2, 16, 64
    block_rows = [r for r in ledger.rows if r.op == "all_reduce" and r.shape == (b, t, h)]
    assert {r.bytes for r in block_rows} == {b * t * h * 4}


def test_sequence_parallel_swaps_all_reduce_for_gather_and_reduce_scatter(llama_tp8):
    extra = "    layers.*.{input,post_attention}_layernorm: sequence over tp\n    norm: sequence over tp\n"
    compiled = compile_text(TP_RULES.format(n=8, extra=extra), llama_tp8)
    layers = 2
    ledger = compiled.ledger
    assert ledger.count("all_gather", "forward") == 2 * layers + 1  # before each column group and the LM head
    assert (
        ledger.count("reduce_scatter", "forward") == 2 * layers + 1
    )  # after each row split and the embedding
    assert ledger.count("reduce_scatter", "backward") == 2 * layers + 1
    assert ledger.count("all_gather", "backward") == 2 * layers + 1
    # the norm weights see only a sequence shard: their gradients are partial over tp, summed
    # by the gradient sync in one bucket (not one all-reduce per norm)
    assert set(compiled.grad_sums) == {
        f"layers.{i}.{n}.weight"
        for i in range(layers)
        for n in ("input_layernorm", "post_attention_layernorm")
    } | {"norm.weight"}
    assert ledger.count("all_reduce", "backward") == 1
    assert ledger.count("all_reduce", "forward") == 3  # the vocab-parallel loss


def test_q_k_v_share_one_input_collective(llama_tp8):
    compiled = compile_text(TP_RULES.format(n=8, extra=""), llama_tp8)
    copies = [
        n for n in compiled.graph.graph.nodes if n.op == "call_module" and str(n.target) == "copy_to_tp"
    ]
    # one f, read by one group of the three linears (`passes/overlap.py`)
    qkv = next(n for n in compiled.graph.graph.nodes if n.op == "call_module" and n.target == "linears")
    assert qkv.args[0] in copies and list(qkv.args[0].users) == [qkv]
    weights = {w.target for w in qkv.args[1::2]}
    assert weights == {f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"}


def test_rank_program_runs_with_local_shapes_on_the_fake_process_group(llama_tp8):
    compiled = compile_text(TP_RULES.format(n=8, extra="    norm: sequence over tp\n"), llama_tp8)
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        mesh = init_mesh(compiled.layout)
        program = build_rank_program(compiled, llama_tp8.model, rank=3, mesh=mesh)
        params = dict(program.named_parameters())
        assert params["layers.0.self_attn.q_proj.weight"].shape == (8, 64)  # 8 heads x 8 dims / 8 ranks
        assert params["layers.0.mlp.down_proj.weight"].shape == (64, 16)
        assert params["embed_tokens.weight"].shape == (32, 64)
        (loss,) = program(*llama_tp8.args)
        loss.backward()
        assert params["layers.0.mlp.gate_proj.weight"].grad.shape == (16, 64)
    finally:
        dist.destroy_process_group()


def test_local_shard_of_blocked_placement_takes_a_chunk_of_each_block():
    full = torch.arange(12).reshape(1, 12)  # q: 0-3, k: 4-7, v: 8-11
    layout = MeshLayout(("tp",), (2,))
    local = local_shard(full, {"tp": Shard(1, blocks=(4, 4, 4))}, {"tp": 1}, layout)
    assert local.tolist() == [[2, 3, 6, 7, 10, 11]]


def test_local_shard_of_padded_placement_ends_in_zeros():
    full = torch.arange(1, 6)  # a vocabulary of 5 over 2 ranks: 3 rows each
    layout = MeshLayout(("tp",), (2,))
    shards = [local_shard(full, {"tp": Shard(0, padded=5)}, {"tp": r}, layout) for r in (0, 1)]
    assert [s.tolist() for s in shards] == [[1, 2, 3], [4, 5, 0]]


def test_a_vocabulary_the_axis_does_not_divide_is_padded_and_explained():
    from meshplan.compiler.print_explain import explain

    plan = check_text((ROOT / "examples/gpt_tp.plan").read_text(), "gpt_tp.plan")
    compiled = compile_plan(plan, load_model(f"{HERE}/factories.py:gpt_odd_vocab"))
    assert compiled.param_placements["wte.weight"] == {"tp": Shard(0, padded=511)}
    text = explain(compiled)
    assert "weight (511, 64) -> (256, 64) per rank" in text and "1 zero padding at the end" in text
    ce = next(n for n in compiled.graph.graph.nodes if str(n.target) == "vocab_cross_entropy_tp")
    assert ce.args[-1] == 511  # the loss masks the padded logit


def test_a_shard_moves_between_dims_by_all_to_all():
    """Sequence shards (dim 1) reach a softmax over the tokens: one all-to-all moves them to the
    feature dim; the next softmax, over the features, moves them back. Numerics: test_tp_parity."""
    text = (
        "mesh tp=2\nmodules {\n    up: column over tp\n    down: row over tp\n    norm: sequence over tp\n}\n"
    )
    compiled = compile_text(text, load_model(f"{HERE}/factories.py:token_mix"))
    moves = [n.args[1:] for n in compiled.graph.graph.nodes if str(n.target) == "all_to_all_tp"]
    assert moves == [(1, 2), (2, 1)]
    rows = [r for r in compiled.ledger.rows if r.op == "all_to_all"]
    assert sorted((r.phase, r.count) for r in rows) == [("backward", 1)] * 2 + [("forward", 1)] * 2
    assert all(r.bytes == 2 * 16 * 16 * 4 // 2 for r in rows)  # what a rank holds: its shard


def test_explicit_head_count_in_view_becomes_local():
    source = load_model(f"{HERE}/factories.py:explicit_heads")
    text = "mesh tp=2\nmodules {\n    {q,k,v}: column over tp\n    out: row over tp\n}\n"
    static = compile_plan(check_text(text, "test.plan"), source, dynamic=False)
    views = [n for n in static.graph.graph.nodes if n.target is torch.ops.aten.view.default]
    assert views and all(list(v.args[1]) == [2, 16, 2, 16] for v in views)
    # captured with symbolic batch and sequence: those stay the run's sizes, the heads are local
    views = [
        n for n in compile_text(text, source).graph.graph.nodes if n.target is torch.ops.aten.view.default
    ]
    assert views and all(list(v.args[1])[2:] == [2, 16] for v in views)
    assert all(str(size.target) == "aten.sym_size.int" for v in views for size in v.args[1][:2])


# ---------------------------------------------------------------------------- errors


def errors_of(text: str, source: ModelSource) -> str:
    """The errors compiling `text` reports: a symbolic compile's are the example shape's
    (`compile_plan` compiles for it again to tell), so compiled for it alone (one capture)."""
    with pytest.raises(PlanError) as info:
        compile_plan(check_text(text, "test.plan"), source, dynamic=False)
    return str(info.value)


@pytest.fixture(scope="module")
def example_llama():
    return ModelSource("llama", llama.build(), llama.example_inputs())


def test_kv_heads_fewer_than_ranks_are_replicated(example_llama):
    """2 kv heads at tp=4: the k/v projections stay whole, each rank keeps one head."""
    compiled = compile_text(TP_RULES.format(n=4, extra=""), example_llama)
    assert compiled.kv_replicas == {
        f"layers.{i}.self_attn.{p}_proj.weight": 2 for i in range(4) for p in "kv"
    }
    assert str(compiled.param_placements["layers.0.self_attn.k_proj.weight"]["tp"]) == "Replicate()"


def test_kv_heads_that_neither_divide_nor_are_divided(example_llama):
    message = errors_of(TP_RULES.format(n=3, extra=""), example_llama)
    assert "the model has 2 key/value heads, not divisible by 3 ranks over `tp`" in message
    assert "test.plan:5:5" in message


def test_column_on_a_module_that_is_not_linear(example_llama):
    message = errors_of("mesh tp=2\nmodules {\n    layers.*.mlp: column over tp\n}\n", example_llama)
    assert "`column` needs a linear layer, but `layers.0.mlp` is a" in message
    assert "gate_proj, up_proj, down_proj" in message


def test_rule_matching_nothing_lists_what_exists(example_llama):
    message = errors_of("mesh tp=2\nmodules {\n    layers.*.mlp.w4: column over tp\n}\n", example_llama)
    assert "rule `layers.*.mlp.w4` matches no module" in message
    assert "modules under `layers.0.mlp` are: gate_proj, up_proj, down_proj" in message


def test_a_tied_weight_is_placed_through_either_owner():
    """The example GPT ties `lm_head` to `wte`: a rule on the head alone makes the embedding
    vocab-parallel too (one tensor, one placement)."""
    source = ModelSource("gpt", gpt.build(num_hidden_layers=1), gpt.example_inputs())
    compiled = compile_text("mesh tp=2\nmodules {\n    lm_head: vocab over tp\n}\n", source)
    assert compiled.param_placements["wte.weight"] == compiled.param_placements["lm_head.weight"]
    kinds = {n.meta.get("meshplan.collective", {}).get("kind") for n in compiled.graph.graph.nodes}
    assert {"vocab_embedding", "vocab_cross_entropy"} <= kinds


def test_tied_weights_placed_differently_by_two_rules():
    source = ModelSource("gpt", gpt.build(num_hidden_layers=1), gpt.example_inputs())
    message = errors_of("mesh tp=2\nmodules {\n    wte: vocab over tp\n    lm_head: replicate\n}\n", source)
    assert "test.plan:4:5: error: `lm_head.weight` is tied to `wte.weight`, which another rule" in message
    assert "test.plan:3:5: note: `wte.weight` is placed here" in message


def test_conflicting_equally_specific_rules(example_llama):
    # both have 3 literal segments and 21 literal characters
    text = "mesh tp=2\nmodules {\n    layers.0.self_attn.*_proj: column over tp\n    layers.*.self_attn.q_proj: row over tp\n}\n"
    message = errors_of(text, example_llama)
    assert "rules conflict on `layers.0.self_attn.q_proj`" in message


def test_more_specific_rule_wins(example_llama):
    text = TP_RULES.format(n=2, extra="    layers.0.self_attn.o_proj: replicate\n")
    compiled = compile_text(text, example_llama)
    assert "layers.0.self_attn.o_proj.weight" not in compiled.param_placements
    assert compiled.param_placements["layers.1.self_attn.o_proj.weight"] == {"tp": Shard(1)}
    # o_proj of layer 0 is replicated, so its sharded input is gathered first, with a warning
    assert any("not split" in w.message for w in compiled.warnings)


def test_vocab_parallel_loss_through_view_with_ignore_index():
    """nanoGPT's loss: `cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1)`, whose
    None class weight once read as a split dimension when looking for fused blocks."""
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model
    from meshplan.dsl import load_plan

    root = Path(__file__).resolve().parents[2]
    compiled = compile_plan(
        load_plan(root / "examples/gpt_tp.plan", world_size=2),
        load_model(f"{root}/tests/compiler/factories.py:nanogpt"),
    )
    kinds = {n.meta.get("meshplan.collective", {}).get("kind") for n in compiled.graph.graph.nodes}
    assert {"vocab_embedding", "vocab_cross_entropy"} <= kinds


def test_a_size_that_divides_nothing_reports_the_root_cause_once():
    """tp=3 on 8 heads: one error for the head count (counting the projections that follow from
    it), and one per rule for other sizes, not one per layer and projection."""
    text = (ROOT / "examples/llama_tp.plan").read_text().replace("tp=2", "tp=3")
    plan = check_text(text, "tp3.plan", world_size=3)
    with pytest.raises(PlanError) as info:
        compile_plan(plan, load_model(f"{HERE}/factories.py:llama_tp4"), dynamic=False)
    messages = [d.message for d in info.value.diagnostics]
    assert (
        "the model has 8 attention heads, not divisible by 3 ranks over `tp` (so 16 attention "
        in "\n".join(messages)
    )
    assert not any("self_attn" in m for m in messages)
    assert "`layers.0.mlp.gate_proj` and 7 more like it have 128 output features" in "\n".join(messages)
    assert len(messages) <= 6
