"""The overlap pass: which linears it groups on an entry collective, and what it leaves alone.

What the grouped node computes, and that its backward issues the reduction before the weight
gradients, is tests/runtime/test_linears.py; the tensor-parallel parity tests run every
program through it.
"""

from __future__ import annotations

import operator

import pytest
import torch
from plans import GPT2_TP, llama_rules, llama_sequence, plan
from torch import fx

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import ModelSource
from meshplan.compiler.meta import collective
from meshplan.compiler.passes import overlap
from meshplan.compiler.passes.checkpoint import region_modules
from meshplan.compiler.print_program import annotated_code
from meshplan.dsl import check_text
from meshplan.examples.models import llama

BF16 = "\nprecision {\n    compute = bf16\n}\n"


def compiled(extra: str = "", tail: str = ""):
    text = plan(llama_rules() + extra, extra=tail)
    source = ModelSource("llama", llama.build(), llama.example_inputs(), {})
    return compile_plan(check_text(text, path="case.plan", world_size=2), source, world_size=2)


def groups(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """(entry kind, linears) per grouped node, in program order, over the graph and its regions."""
    out = []
    for g in (gm, *(region for _, region in region_modules(gm))):
        for node in g.graph.nodes:
            if node.op == "call_module" and node.target == overlap.TARGET:
                out.append((collective(node.args[0])["kind"], len(node.meta["val"])))
                assert all(u.target is operator.getitem for u in node.users)
    return out


def ungrouped_linears_on_entries(gm: fx.GraphModule) -> list[str]:
    return [
        n.name
        for g in (gm, *(region for _, region in region_modules(gm)))
        for n in g.graph.nodes
        if n.target == torch.ops.aten.linear.default
        and (info := collective(n.args[0])) is not None
        and overlap.is_entry(info["kind"])
    ]


PER_LAYER = [3, 2]  # q, k, v; gate, up


@pytest.mark.parametrize(
    "extra, tail, kind",
    [
        ("", "", "copy_to"),
        (llama_sequence(), "", "all_gather"),
        # bf16: each weight is cast at its use, after the first linear; the casts move up
        ("", BF16, "copy_to"),
        # checkpointed layers: grouped inside each region, recomputed with it
        ("    layers.*: checkpoint\n", "", "copy_to"),
    ],
    ids=["tp", "tp-sp", "bf16", "checkpoint"],
)
def test_the_column_linears_of_each_entry_are_one_node(extra, tail, kind):
    c = compiled(extra, tail)
    layers = llama.LlamaConfig().num_hidden_layers
    want = [(kind, n) for n in PER_LAYER] * layers + [(kind, 1)]  # + the LM head
    assert sorted(groups(c.graph)) == sorted(want)
    assert ungrouped_linears_on_entries(c.graph) == []
    code = annotated_code(c)
    op = overlap.issued_reduction(kind)
    assert code.count(f"backward waits for the {op} issued below") == 2 * layers + 1
    assert f"3 linears on {kind}_tp" in code and f"backward issues its {op} of the input gradient" in code


def test_the_ledger_still_lists_each_entry_reduction_once():
    c = compiled()
    backward = [r for r in c.ledger.rows if r.kind == "copy_to" and r.phase == "backward"]
    layers = llama.LlamaConfig().num_hidden_layers
    assert len(backward) == 2 * layers + 1 and all(r.op == "all_reduce" for r in backward)


def test_an_entry_read_by_anything_but_linears_is_left_alone():
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    g = gm.graph
    x, w = g.placeholder("x"), g.placeholder("w")
    entry = g.call_function(torch.ops.aten.clone.default, (x,))
    entry.meta["meshplan.collective"] = {"kind": "copy_to", "axis": "tp"}
    a = g.call_function(torch.ops.aten.linear.default, (entry, w))
    b = g.call_function(torch.ops.aten.relu.default, (entry,))  # needs the reduced gradient too
    out = g.output((a, b))
    assert not overlap.group_linears(gm, entry)
    # a weight computed from the group's first output cannot move before it
    with g.inserting_before(out):
        w2 = g.call_function(torch.ops.aten.narrow.default, (a, 0, 0, 1))
        c = g.call_function(torch.ops.aten.linear.default, (entry, w2))
    out.args = ((a, c),)
    g.erase_node(b)
    assert not overlap.group_linears(gm, entry)
    # with the weight a plain input, the two linears are grouped
    c.args = (entry, w)
    g.erase_node(w2)
    gm.add_submodule(overlap.TARGET, torch.nn.Module())
    assert overlap.group_linears(gm, entry)


def test_gpt2_conv1d_layers_are_grouped_through_their_transpose():
    """Hugging Face GPT-2 computes its Conv1D as `addmm(bias, x, w)` with w stored (in, out): the
    group reads `t(w)`, so c_attn and c_fc overlap their reductions too (parity: verify on GPT-2)."""
    from pathlib import Path

    from meshplan.compiler.load import load_model

    factory = Path(__file__).parent / "hf_factories.py"
    source = load_model(f"{factory}:hf_gpt2")
    c = compile_plan(check_text(GPT2_TP, path="gpt2.plan", world_size=2), source, world_size=2)
    layers = source.model.config.n_layer
    assert groups(c.graph) == [("copy_to", 1)] * (2 * layers + 1)  # c_attn, c_fc per block; lm_head
    transposes = [
        n
        for n in c.graph.graph.nodes
        if n.target == torch.ops.aten.t.default and any(u.target == overlap.TARGET for u in n.users)
    ]
    assert len(transposes) == 2 * layers  # the Conv1D weights; the LM head is an nn.Linear
